//! `kvstream bench`: kvstream over the shape matrix with the timer of docs/benchmarking.md, next to
//! each shape's byte floor (a streaming read of the same bytes, same pool and timer) and the
//! card's read ceiling; results as JSON in the format of docs/benchmarking.md, a table, and plots.
//!
//! Per shape: one device arena holds the rotating pool (K, V, Q, out for every set); set 0 is
//! generated on the host and copied device-to-device to the other sets; every kvstream variant
//! is checked on set 0 against the f64 CPU reference, then timed in one CUDA graph per variant
//! holding one call per set, interleaved (A B C, C B A, ...) with the floor's graphs, which read
//! io_bytes per set from the same arena with a few grid sizes.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result as cu, CudaGraph, CudaSlice, CudaStream, DevicePtr};
use indicatif::{ProgressBar, ProgressStyle};
use kvstream::kernels::{AnyVariant, StreamReadParams, StreamReadVariant};
use kvstream::launch::{launch, LaunchConfig};
use kvstream::reference::{
    decode_reference, random_bf16, random_e4m3, relative_error, RefShape, SplitMix64,
};
use kvstream::runtime::LoadedKernel;
use kvstream::{
    DType, DecodeProblem, DecodeTensors, Decoder, Error, KvDType, KvScale, KvScaleLayout,
    PlanOptions, Runtime,
};

use crate::plot;
use crate::results::{self, BenchResults, ImplResult, Matrix, Row, Shape};
use crate::timing::{self, alloc, capture, driver, pool_sets, time_graphs};
use crate::trace;

/// Graph replays a traced decoder takes on its own (each replays every input set of the arena,
/// 2 to 256 calls; trace.rs keeps the newest records and trace.py whole calls).
const TRACE_REPLAYS: usize = 2;

/// Relative error a bf16 decode must stay under.
pub const TOLERANCE: f64 = 1e-2;
/// Bytes the read ceiling streams.
pub const CEILING_BYTES: usize = 4 << 30;
/// CTAs per SM the floor and ceiling try, each with every block size of [`BLOCKS`].
pub const CTAS_PER_SM: [u32; 4] = [1, 2, 4, 8];
/// Block sizes the floor and ceiling try.
pub const BLOCKS: [u32; 2] = [256, 512];
/// Words in the streaming read's sink (a power of two).
const SINK_WORDS: u32 = 4096;
/// Most K (and V) elements generated on the host per shape: larger batches repeat the
/// generated requests (device-to-device), so a b128 x 32K shape does not need 50 GB of host
/// memory and minutes of random numbers. At least one whole request is always generated.
const HOST_KV_ELEMS: usize = 64 << 20;

/// Arguments of `kvstream bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Shape matrix (docs/benchmarking.md); a relative path is also looked for above the
    /// current folder (the repository's `bench/`).
    #[arg(long, default_value = "bench/matrix.json", value_parser = crate::repo_file)]
    pub matrix: PathBuf,
    /// Only these matrix shapes (comma-separated ids).
    #[arg(long, value_delimiter = ',')]
    pub ids: Vec<String>,
    /// A bf16 shape `batch,hq,hkv,d,L` instead of the matrix (repeatable; with --ids, both).
    #[arg(long = "shape", value_name = "BATCH,HQ,HKV,D,L", value_parser = Shape::parse_cli)]
    pub shapes: Vec<Shape>,
    /// K and V caches in this element type for every shape (`fp8_e4m3`: e4m3 with per-cache
    /// scales; default: the shapes' own, bf16).
    #[arg(long)]
    pub kv_dtype: Option<String>,
    /// Timed rounds (each replays every implementation's graph once).
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(7..))]
    pub rounds: u32,
    /// Also time kvstream with these forced consumer-group counts (`kvstream/g1`, ...).
    #[arg(long, value_delimiter = ',')]
    pub consumer_groups: Vec<usize>,
    /// Also time kvstream with these forced ring depths (`kvstream/s2`, ...).
    #[arg(long, value_delimiter = ',')]
    pub stages: Vec<usize>,
    /// Also time kvstream with these forced split counts, kernel reduction (`kvstream/n8`, ...;
    /// with --stages also every pair, `kvstream/n8-s4`): the sweeps behind plan.rs's tables.
    #[arg(long, value_delimiter = ',')]
    pub splits: Vec<usize>,
    /// Also time kvstream with at most this many decode CTAs per SM (`kvstream/r1`, ...; with
    /// --stages also every pair, `kvstream/s2-r1`).
    #[arg(long, value_delimiter = ',')]
    pub resident_ctas: Vec<usize>,
    /// Also time the persistent engine with this many CTAs (`kvstream/c66`, ...; with
    /// --min-tiles also every pair, `kvstream/c66-t4`).
    #[arg(long, value_delimiter = ',')]
    pub ctas: Vec<usize>,
    /// Also time the persistent engine with this fewest tiles per working CTA (`kvstream/t4`).
    #[arg(long, value_delimiter = ',')]
    pub min_tiles: Vec<usize>,
    /// Also time the persistent engine with these rings, each `g<groups>s<stages>p<positions
    /// per stage>` with any part left out for its default (`kvstream/g1s6p64`, ...).
    #[arg(long, value_delimiter = ',', value_parser = parse_ring)]
    pub rings: Vec<Ring>,
    /// Also time each reduction mode forced (`kvstream/kernel`, `kvstream/cluster`), next to
    /// the automatic choice (`kvstream`).
    #[arg(long)]
    pub modes: bool,
    /// Also time cluster reduction with these forced cluster sizes (`kvstream/cluster-s8`, ...;
    /// powers of two up to 16).
    #[arg(long, value_delimiter = ',')]
    pub cluster_splits: Vec<usize>,
    /// With --modes: also time both modes with PDL off (`kvstream/kernel-nopdl`,
    /// `kvstream/cluster-nopdl`).
    #[arg(long)]
    pub no_pdl: bool,
    /// Also time the device-side planner (`kvstream/device-plan`; with `--modes` also in cluster
    /// reduction, `kvstream/device-plan-cluster`).
    #[arg(long)]
    pub device_plan: bool,
    /// Results file (docs/benchmarking.md format); rewritten after every shape.
    #[arg(long, default_value = DEFAULT_RESULTS)]
    pub json: PathBuf,
    /// Directory for the plots (`<json stem>-<group>.svg|png`).
    #[arg(long, default_value = "bench/results")]
    pub plots: PathBuf,
    /// Skip the plots.
    #[arg(long)]
    pub no_plots: bool,
}

/// A forced persistent configuration (`--rings`): consumer groups, stages, positions per stage,
/// L2 priority and L2 promotion of K and V, each optional.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ring {
    pub spec: String,
    pub groups: Option<usize>,
    pub stages: Option<usize>,
    pub tile_tokens: Option<usize>,
    pub kv_l2: Option<kvstream::kernels::L2Hint>,
    pub promotion: Option<kvstream::launch::TmaPromotion>,
    pub gather: Option<bool>,
    pub producer_warps: Option<usize>,
    pub softmax_slices: Option<usize>,
    pub pair_heads: Option<bool>,
    pub head_lanes: Option<bool>,
}

impl Ring {
    /// The plan options that force it.
    pub fn options(&self) -> PlanOptions {
        PlanOptions {
            persistent_groups: self.groups,
            persistent_stages: self.stages,
            persistent_tile_tokens: self.tile_tokens,
            persistent_kv_l2: self.kv_l2,
            kv_promotion: self.promotion,
            persistent_paged_gather: self.gather,
            persistent_producer_warps: self.producer_warps,
            persistent_softmax_slices: self.softmax_slices,
            persistent_pair_heads: self.pair_heads,
            persistent_head_lanes: self.head_lanes,
            ..Default::default()
        }
    }
}

/// `g2s4p64`, `s6`, `g1p128l2m2`, ...: letters g, s, p, l, m each followed by a number, at
/// most once (l: 0 evict_first, 1 evict_normal, 2 evict_last; m: 0 none, 1 64 B, 2 128 B,
/// 3 256 B; x: paged caches, 0 TMA boxes, 1 gathered pages; w: warps gathering them; r: m16
/// slices per softmax step; h: KV heads per streamed row, 1 or 2 for paired d 64 heads; k: 1 a
/// lane of CTAs per KV head, the heads of a position read at about the same time, 0 not).
pub fn parse_ring(text: &str) -> Result<Ring, String> {
    let bad = || {
        format!(
            "ring {text:?}: expected g<groups>s<stages>p<positions>l<L2 priority: 0 first, \
             1 normal, 2 last>m<L2 promotion: 0 none, 1 64 B, 2 128 B, 3 256 B>x<pages: 0 TMA \
             boxes, 1 gathered>w<gathering warps>r<m16 slices per softmax step>h<KV heads per \
             row: 1, or 2 paired>k<KV-head lanes: 0 off, 1 on>, each part optional, e.g. g1s6p64"
        )
    };
    const KEYS: &str = "gsplmxwrhk";
    let mut parts = [None::<usize>; 10];
    let mut rest = text;
    while let Some(key) = rest.chars().next() {
        let slot = KEYS.find(key).ok_or_else(bad)?;
        let digits = rest[1..].chars().take_while(|c| c.is_ascii_digit()).count();
        let value: usize = rest[1..1 + digits].parse().map_err(|_| bad())?;
        if parts[slot].replace(value).is_some() {
            return Err(bad());
        }
        rest = &rest[1 + digits..];
    }
    let [groups, stages, tile_tokens, l2, promotion, gather, producer_warps, softmax_slices, heads_per_row, head_lanes] =
        parts;
    let kv_l2 = l2
        .map(|c| kvstream::kernels::L2Hint::from_code(c).ok_or_else(bad))
        .transpose()?;
    let promotion = promotion
        .map(|c| kvstream::launch::TmaPromotion::from_code(c).ok_or_else(bad))
        .transpose()?;
    // a part that is 0 (off) or 1 (on)
    let switch = |part: Option<usize>| {
        part.map(|c| match c {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(bad()),
        })
        .transpose()
    };
    let gather = switch(gather)?;
    let pair_heads = heads_per_row
        .map(|c| match c {
            1 => Ok(false),
            2 => Ok(true),
            _ => Err(bad()),
        })
        .transpose()?;
    let head_lanes = switch(head_lanes)?;
    if text.is_empty() {
        return Err(bad());
    }
    Ok(Ring {
        spec: text.to_string(),
        groups,
        stages,
        tile_tokens,
        kv_l2,
        promotion,
        gather,
        producer_warps,
        softmax_slices,
        pair_heads,
        head_lanes,
    })
}

/// The shapes to run: `--shape`s alone, or the matrix (all, or `--ids`) plus any `--shape`s;
/// each checked to be a bf16 single-token problem kvstream accepts.
pub fn select_shapes(args: &BenchArgs) -> Result<Vec<Shape>, String> {
    let mut shapes = if !args.shapes.is_empty() && args.ids.is_empty() {
        Vec::new()
    } else {
        let m = Matrix::load(&args.matrix)?;
        if args.ids.is_empty() {
            m.shapes
        } else {
            m.select(&args.ids)?
        }
    };
    for s in &args.shapes {
        if shapes.iter().any(|x| x.id == s.id) {
            return Err(format!("shape {} given twice", s.id));
        }
        shapes.push(s.clone());
    }
    if let Some(kv) = &args.kv_dtype {
        for s in &mut shapes {
            s.kv_dtype = Some(kv.clone());
        }
    }
    for s in &shapes {
        problem_of(s).map_err(|e| format!("shape {}: {e}", s.id))?;
    }
    if shapes.is_empty() {
        return Err("no shapes to run".into());
    }
    Ok(shapes)
}

fn problem_of(s: &Shape) -> kvstream::Result<DecodeProblem> {
    if s.dtype != "bf16" {
        return Err(Error::invalid("dtype", &s.dtype, "bf16"));
    }
    let mods: Vec<&str> = [
        ("window", s.window.is_some()),
        ("softcap", s.softcap.is_some()),
        ("sinks", s.sinks),
    ]
    .iter()
    .filter_map(|&(name, on)| on.then_some(name))
    .collect();
    if !mods.is_empty() {
        return Err(Error::invalid(
            "score modifiers",
            mods.join(", "),
            "rows without any: `kvstream bench` does not time them \
             (bench/compare.py --matrix bench/matrix-models.json does)",
        ));
    }
    let kv_dtype: KvDType = s.kv_dtype.as_deref().unwrap_or("auto").parse()?;
    if s.pages_in_order && s.page_size.is_none() {
        return Err(Error::invalid(
            "pages_in_order",
            "true without page_size",
            "a paged shape (page_size given)",
        ));
    }
    if s.long_len.is_some() && s.page_size.is_none() {
        return Err(Error::invalid(
            "long_len",
            format!("{:?} without page_size", s.long_len),
            "a skewed batch on a paged cache (a contiguous one would hold batch x long_len)",
        ));
    }
    if let Some(lens) = &s.lens {
        if lens.len() != s.batch || lens.iter().any(|&l| l > s.len) {
            return Err(Error::invalid(
                "lens",
                format!("{} lengths, longest {:?}", lens.len(), lens.iter().max()),
                format!(
                    "{} lengths (one per request), each at most L = {}",
                    s.batch, s.len
                ),
            ));
        }
    }
    let p = DecodeProblem::new(s.batch, s.hq, s.hkv, s.d, s.max_len(), DType::Bf16)?
        .with_q_len(s.q_len)?
        .with_kv_dtype(kv_dtype)?;
    match s.page_size {
        Some(page) => p.with_paged(page, pool_tokens(s) / page, None),
        None => Ok(p),
    }
}

/// Cache positions one pool set holds: every request's length (rounded up to whole pages when
/// paged). The same in every set: sets only move the long request of a skewed batch.
fn pool_tokens(s: &Shape) -> usize {
    match s.page_size {
        Some(page) => s.lens(0).iter().map(|l| l.div_ceil(page) * page).sum(),
        None => s.batch * s.max_len(),
    }
}

/// The kvstream implementations timed per shape: the default plan first, then the forced
/// variants the arguments ask for, each under its own result key.
pub fn implementations(args: &BenchArgs) -> Vec<(String, PlanOptions)> {
    use kvstream::Reduction::{Cluster, Kernel};
    let mut out = vec![("kvstream".to_string(), PlanOptions::default())];
    let mut forced: Vec<(String, PlanOptions)> = Vec::new();
    for &g in &args.consumer_groups {
        forced.push((
            format!("kvstream/g{g}"),
            PlanOptions {
                consumer_groups: Some(g),
                ..Default::default()
            },
        ));
    }
    for &s in &args.stages {
        forced.push((
            format!("kvstream/s{s}"),
            PlanOptions {
                stages: Some(s),
                ..Default::default()
            },
        ));
    }
    // a forced variant with each forced ring depth too
    let with_stages = |opts: PlanOptions| {
        args.stages.iter().map(move |&s| {
            let both = PlanOptions {
                stages: Some(s),
                ..opts
            };
            (s, both)
        })
    };
    for &n in &args.splits {
        let split = PlanOptions {
            num_splits: Some(n),
            reduction: Some(Kernel),
            ..Default::default()
        };
        forced.push((format!("kvstream/n{n}"), split));
        forced.extend(with_stages(split).map(|(s, o)| (format!("kvstream/n{n}-s{s}"), o)));
    }
    for &r in &args.resident_ctas {
        let capped = PlanOptions {
            resident_ctas: Some(r),
            ..Default::default()
        };
        forced.push((format!("kvstream/r{r}"), capped));
        forced.extend(with_stages(capped).map(|(s, o)| (format!("kvstream/s{s}-r{r}"), o)));
    }
    for &t in &args.min_tiles {
        let o = PlanOptions {
            min_tiles_per_cta: Some(t),
            ..Default::default()
        };
        forced.push((format!("kvstream/t{t}"), o));
    }
    for r in &args.rings {
        let o = r.options();
        forced.push((format!("kvstream/{}", r.spec), o));
    }
    for &c in &args.ctas {
        let o = PlanOptions {
            persistent_ctas: Some(c),
            ..Default::default()
        };
        forced.push((format!("kvstream/c{c}"), o));
        for &t in &args.min_tiles {
            let both = PlanOptions {
                min_tiles_per_cta: Some(t),
                ..o
            };
            forced.push((format!("kvstream/c{c}-t{t}"), both));
        }
    }
    if args.modes {
        for (name, engine) in [
            ("persistent", kvstream::Engine::Persistent),
            ("split", kvstream::Engine::Split),
        ] {
            let opts = PlanOptions {
                engine: Some(engine),
                ..Default::default()
            };
            forced.push((format!("kvstream/{name}"), opts));
        }
        for (name, reduction) in [("kernel", Kernel), ("cluster", Cluster)] {
            let opts = PlanOptions {
                reduction: Some(reduction),
                ..Default::default()
            };
            forced.push((format!("kvstream/{name}"), opts));
            if args.no_pdl {
                let off = PlanOptions {
                    disable_pdl: true,
                    ..opts
                };
                forced.push((format!("kvstream/{name}-nopdl"), off));
            }
        }
    }
    for &n in &args.cluster_splits {
        forced.push((
            format!("kvstream/cluster-s{n}"),
            PlanOptions {
                reduction: Some(Cluster),
                num_splits: Some(n),
                ..Default::default()
            },
        ));
    }
    if args.device_plan {
        forced.push((
            "kvstream/device-plan".to_string(),
            PlanOptions {
                device_plan: true,
                ..Default::default()
            },
        ));
        if args.modes {
            forced.push((
                "kvstream/device-plan-cluster".to_string(),
                PlanOptions {
                    device_plan: true,
                    reduction: Some(Cluster),
                    ..Default::default()
                },
            ));
        }
    }
    for (key, opts) in forced {
        if !out.iter().any(|(k, _)| *k == key) {
            out.push((key, opts));
        }
    }
    out
}

/// The implementations of one shape: on a skewed batch the split engine is timed with its
/// device plan as `kvstream/device-plan` and its host plan as `kvstream/host-plan`, next to the
/// persistent engine (`kvstream`, nothing set but the inputs; forced ring depths plan on the
/// device there).
fn shape_implementations(
    shape: &Shape,
    impls: &[(String, PlanOptions)],
) -> Vec<(String, PlanOptions)> {
    if !shape.varies_lengths() {
        return impls.to_vec();
    }
    let mut out = vec![
        ("kvstream".to_string(), PlanOptions::default()),
        (
            "kvstream/device-plan".to_string(),
            PlanOptions {
                device_plan: true,
                ..Default::default()
            },
        ),
        (
            "kvstream/host-plan".to_string(),
            PlanOptions {
                reduction: Some(kvstream::Reduction::Kernel),
                ..Default::default()
            },
        ),
    ];
    // forced ring depths are timed on the device plan, the plan this row is about
    out.extend(
        impls
            .iter()
            .filter(|(k, _)| k != "kvstream" && k != "kvstream/device-plan")
            .map(|(k, o)| match (o.stages, o.num_splits) {
                (Some(_), None) => (
                    k.clone(),
                    PlanOptions {
                        device_plan: true,
                        ..*o
                    },
                ),
                _ => (k.clone(), *o),
            }),
    );
    out
}

/// `kvstream bench`.
/// Where `kvstream bench` writes its results unless told otherwise.
pub const DEFAULT_RESULTS: &str = "bench/results/kvstream-bench-latest.json";

pub fn run(args: &BenchArgs) -> Result<(), String> {
    if crate::mla::is_mla_matrix(&args.matrix)? {
        return crate::mla::bench_matrix(args);
    }
    let shapes = select_shapes(args)?;
    let rt = match Runtime::new(0) {
        Ok(rt) => rt,
        Err(e @ (Error::DriverUnavailable(_) | Error::NoSuitableDevice(_))) => {
            return Err(format!(
                "kvstream bench needs an NVIDIA H100/H200 (sm_90) and found none: {e}. \
                 (`kvstream plot RESULTS.json` re-plots an existing results file without a GPU.)"
            ))
        }
        Err(e) => return Err(e.to_string()),
    };
    let impls = implementations(args);
    let rounds = args.rounds as usize;
    let ctx = rt.context().clone();
    // One stream, raw pointers inside the captured graphs: no cross-stream event tracking.
    // SAFETY: everything below runs on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = driver("creating a stream", ctx.new_stream()).map_err(|e| e.to_string())?;
    let reader = StreamReader::new(&rt, &stream).map_err(|e| e.to_string())?;

    let gpu = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    eprintln!(
        "kvstream bench on {gpu}: {} shape(s), {} implementation(s), {rounds} rounds",
        shapes.len(),
        impls.len()
    );
    let t = Instant::now();
    let ceiling = reader
        .read_ceiling(&stream, rounds)
        .map_err(|e| format!("measuring the read ceiling: {e}"))?;
    eprintln!(
        "read ceiling: {:.0} GB/s ({} CTAs x {} threads over {} GiB; {:.1} s)",
        ceiling.gbps,
        ceiling.grid,
        ceiling.threads,
        CEILING_BYTES >> 30,
        t.elapsed().as_secs_f64()
    );

    let mut out = BenchResults {
        date: results::today(),
        commit: results::current_commit(),
        gpu,
        read_ceiling_gbps: Some(ceiling.gbps),
        rows: Vec::new(),
        extra: Default::default(),
    };
    out.extra.insert(
        "read_ceiling_config".into(),
        serde_json::json!({"grid": ceiling.grid, "threads": ceiling.threads, "bytes": CEILING_BYTES}),
    );
    out.extra.insert(
        "rounds".into(),
        serde_json::json!(rounds.max(timing::MIN_ROUNDS)),
    );

    let tty = std::io::stderr().is_terminal();
    let bar = if tty {
        ProgressBar::new(shapes.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40.cyan/blue} {pos}/{len} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    for (i, shape) in shapes.iter().enumerate() {
        bar.set_message(shape.id.clone());
        let t = Instant::now();
        let row = bench_shape(
            &rt,
            &stream,
            &reader,
            shape,
            &shape_implementations(shape, &impls),
            rounds,
        );
        let line = format!(
            "[{}/{}] {} ({:.1} s): {}",
            i + 1,
            shapes.len(),
            shape.id,
            t.elapsed().as_secs_f64(),
            summary(&row)
        );
        if tty {
            bar.println(line);
        } else {
            eprintln!("{line}");
        }
        out.rows.push(row);
        if let Err(e) = out.save(&args.json) {
            bar.println(format!("warning: {e}"));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();

    print_table(&out, &impls);
    out.save(&args.json)?;
    println!("results: {}", args.json.display());
    if !args.no_plots {
        let prefix = plot_prefix(&args.json);
        match plot::plot_results(&out, &args.plots, &prefix) {
            Ok(w) => println!(
                "plots: {} file(s) in {}{}",
                w.files.len(),
                args.plots.display(),
                if w.with_text {
                    ""
                } else {
                    " (no text: no font)"
                }
            ),
            Err(e) => eprintln!("warning: plotting failed: {e}"),
        }
    }
    let failed: Vec<String> = out
        .rows
        .iter()
        .flat_map(|r| {
            r.results.iter().filter_map(move |(k, v)| {
                // a variant the planner refuses for a shape is not a failure; a wrong output,
                // or the default plan failing, is
                let wrong = v.rel_err.is_some() && v.error.is_some();
                (wrong || (k == "kvstream" && v.error.is_some())).then(|| format!("{} {k}", r.id))
            })
        })
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} result(s) failed (see the JSON): {}",
            failed.len(),
            failed.join(", ")
        ))
    }
}

/// Plot file prefix from the results path: its stem.
pub fn plot_prefix(json: &std::path::Path) -> String {
    json.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "kvstream-bench".into())
}

fn summary(row: &Row) -> String {
    let k = row.results.get("kvstream");
    match (
        k.and_then(|r| r.us),
        row.floor_us,
        k.and_then(|r| r.error.clone()),
    ) {
        (_, _, Some(e)) => format!("ERROR {e}"),
        (Some(us), Some(f), None) => format!(
            "{us:.2} us, {:.0} GB/s, floor {f:.2} us ({:.2}x)",
            row.io_bytes as f64 / us / 1e3,
            us / f
        ),
        (Some(us), None, None) => format!("{us:.2} us"),
        _ => "no result".into(),
    }
}

fn print_table(out: &BenchResults, impls: &[(String, PlanOptions)]) {
    let extra: Vec<&str> = impls.iter().skip(1).map(|(k, _)| k.as_str()).collect();
    print!(
        "{:<22} {:>10} {:>7} {:>9} {:>8} {:>10} {:>6}",
        "id", "kvstream us", "GB/s", "floor us", "lat/flr", "mode", "splits"
    );
    for k in &extra {
        print!(" {:>13}", format!("{k} us"));
    }
    println!();
    let num = |x: Option<f64>, prec: usize| {
        x.map(|v| format!("{v:.prec$}"))
            .unwrap_or_else(|| "-".into())
    };
    for r in &out.rows {
        let k = r.results.get("kvstream").cloned().unwrap_or_default();
        let bad = k.error.is_some();
        let us = if bad { None } else { k.us };
        print!(
            "{:<22} {:>11} {:>7} {:>9} {:>8} {:>10} {:>6}",
            r.id,
            if bad { "ERROR".into() } else { num(us, 2) },
            num(k.gbps.filter(|_| !bad), 0),
            num(r.floor_us, 2),
            num(us.zip(r.floor_us).map(|(a, b)| a / b), 2),
            k.mode.unwrap_or_else(|| "-".into()),
            k.splits.map_or("-".into(), |s| s.to_string()),
        );
        for key in &extra {
            let cell = match r.results.get(*key) {
                Some(v) if v.error.is_some() => "ERROR".into(),
                Some(v) => num(v.us, 2),
                None => "-".into(),
            };
            print!(" {cell:>13}");
        }
        println!();
    }
    if let Some(c) = out.read_ceiling_gbps {
        println!("read ceiling {c:.0} GB/s; lat/flr = kvstream latency / byte floor");
    }
}

/// The streaming-read kernel, ready to enqueue.
pub struct StreamReader {
    kernel: LoadedKernel,
    sink: u64,
    _sink_buf: CudaSlice<u32>,
    sm_count: u32,
}

/// Best configuration of a streaming read.
pub struct Best {
    pub us: f64,
    pub grid: u32,
    pub threads: u32,
}

struct Ceiling {
    gbps: f64,
    grid: u32,
    threads: u32,
}

impl StreamReader {
    pub fn new(rt: &Arc<Runtime>, stream: &Arc<CudaStream>) -> kvstream::Result<Self> {
        let kernel = rt.kernel(AnyVariant::StreamRead(StreamReadVariant), 0)?;
        let buf = alloc::<u32>(stream, SINK_WORDS as usize, "the stream-read sink")?;
        let sink = buf.device_ptr(stream).0;
        driver("allocating the sink", stream.synchronize())?;
        Ok(StreamReader {
            kernel,
            sink,
            _sink_buf: buf,
            sm_count: rt.facts().sm_count as u32,
        })
    }

    /// (CTAs, threads) configurations to try.
    fn configs(&self) -> Vec<(u32, u32)> {
        let mut v = Vec::new();
        for m in CTAS_PER_SM {
            for t in BLOCKS {
                v.push((self.sm_count * m, t));
            }
        }
        v
    }

    /// Enqueues a read of `bytes` (a multiple of 16) at `src`.
    ///
    /// # Safety
    /// `src..src + bytes` must be device memory of this context, 16-byte aligned.
    unsafe fn enqueue(
        &self,
        stream: &Arc<CudaStream>,
        src: u64,
        bytes: usize,
        grid: u32,
        threads: u32,
    ) -> kvstream::Result<()> {
        debug_assert!(bytes % 16 == 0 && src % 16 == 0);
        let params = StreamReadParams {
            src,
            sink: self.sink,
            n_vec: (bytes / 16) as u64,
            sink_mask: SINK_WORDS - 1,
            reserved: 0,
        };
        let cfg = LaunchConfig {
            grid: [grid, 1, 1],
            block: [threads, 1, 1],
            shared_bytes: 0,
            pdl: false,
            cluster: None,
        };
        launch(
            self.kernel.func,
            &cfg,
            stream.cu_stream(),
            &params,
            "the stream-read kernel",
        )
    }

    /// One graph per configuration reading `sets` consecutive chunks of `bytes` from `base`.
    ///
    /// # Safety
    /// `base..base + sets * bytes` must be device memory of this context, 16-byte aligned.
    pub unsafe fn graphs(
        &self,
        stream: &Arc<CudaStream>,
        base: u64,
        bytes: usize,
        sets: usize,
    ) -> kvstream::Result<Vec<((u32, u32), CudaGraph)>> {
        let mut out = Vec::new();
        for (grid, threads) in self.configs() {
            let g = capture(stream, sets, &mut |s| {
                self.enqueue(stream, base + (s * bytes) as u64, bytes, grid, threads)
            })?;
            out.push(((grid, threads), g));
        }
        Ok(out)
    }

    /// The best median over the configurations whose timings are given in `configs` order.
    pub fn best(configs: &[(u32, u32)], timings: &[timing::Timing]) -> Best {
        let (i, t) = timings
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.median_us.total_cmp(&b.1.median_us))
            .expect("at least one configuration");
        Best {
            us: t.median_us,
            grid: configs[i].0,
            threads: configs[i].1,
        }
    }

    /// Streaming read over [`CEILING_BYTES`] (filled with a non-zero pattern), best grid.
    fn read_ceiling(&self, stream: &Arc<CudaStream>, rounds: usize) -> kvstream::Result<Ceiling> {
        let buf = alloc::<u8>(stream, CEILING_BYTES, "the read-ceiling buffer")?;
        let base = buf.device_ptr(stream).0;
        // SAFETY: the buffer holds CEILING_BYTES bytes.
        driver("filling the read-ceiling buffer", unsafe {
            cu::memset_d8_async(base, 0xA5, CEILING_BYTES, stream.cu_stream())
        })?;
        // SAFETY: one set of CEILING_BYTES from the buffer's start.
        let graphs = unsafe { self.graphs(stream, base, CEILING_BYTES, 1)? };
        let list: Vec<(&CudaGraph, usize)> = graphs.iter().map(|(_, g)| (g, 1)).collect();
        let timings = time_graphs(stream, &list, rounds)?;
        let configs: Vec<(u32, u32)> = graphs.iter().map(|(c, _)| *c).collect();
        let best = Self::best(&configs, &timings);
        drop(graphs);
        driver("after the read ceiling", stream.synchronize())?;
        drop(buf);
        Ok(Ceiling {
            gbps: CEILING_BYTES as f64 / best.us / 1e3,
            grid: best.grid,
            threads: best.threads,
        })
    }
}

fn align256(bytes: usize) -> usize {
    bytes.div_ceil(256) * 256
}

/// Device layout of one shape's pool: `[K sets][V sets][Q sets][out sets]`, each region
/// 256-byte aligned; set s of a region starts at `region + s * per_set`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arena {
    /// Input sets.
    pub sets: usize,
    /// Bytes of one set of K (V is the same).
    pub kv_set: usize,
    /// Bytes of one set of Q (out is the same).
    pub q_set: usize,
}

impl Arena {
    /// The pool of `problem` with `tokens` cache positions per set (sets from K + V bytes per
    /// set, docs/benchmarking.md).
    pub fn of(problem: &DecodeProblem, tokens: usize) -> Self {
        let e = problem.dtype.size();
        let kv_set = tokens * problem.hkv * problem.head_dim * problem.kv_elem_bytes();
        let q_set = problem.batch * problem.q_len * problem.hq * problem.head_dim * e;
        Arena {
            sets: pool_sets(2 * kv_set),
            kv_set,
            q_set,
        }
    }
    /// Byte offsets of the K, V, Q and out regions.
    pub fn offsets(&self) -> [usize; 4] {
        let kv = align256(self.sets * self.kv_set);
        let q = align256(self.sets * self.q_set);
        [0, kv, 2 * kv, 2 * kv + q]
    }
    /// Total bytes.
    pub fn bytes(&self) -> usize {
        self.offsets()[3] + align256(self.sets * self.q_set)
    }
}

/// Cache positions whose K/V are generated on the host; the pool repeats them (position f of a
/// set holds generated position f % generated).
pub fn generated_tokens(pool_tokens: usize, token_elems: usize) -> usize {
    (HOST_KV_ELEMS / token_elems.max(1)).clamp(1, pool_tokens.max(1))
}

/// The block table of pool set `set` (empty for a contiguous cache): the set's pages shuffled
/// (or in pool order with `pages_in_order`), handed out to the requests in order of their
/// lengths in that set; unused entries point at page 0.
fn block_table(shape: &Shape, p: &DecodeProblem, set: usize, rng: &mut SplitMix64) -> Vec<i32> {
    let Some(pg) = p.paged else {
        return Vec::new();
    };
    let mut order: Vec<i32> = (0..pg.num_pages as i32).collect();
    if !shape.pages_in_order {
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
    }
    let mut table = vec![0i32; p.batch * pg.table_stride];
    let mut next = order.into_iter();
    for (b, len) in shape.lens(set).into_iter().enumerate() {
        for j in 0..len.div_ceil(pg.page_size) {
            table[b * pg.table_stride + j] = next.next().expect("the pool holds every page");
        }
    }
    table
}

/// Copies `[0, filled)` of the region at `base` over `[filled, total)` by doubling.
///
/// # Safety
/// `base..base + total` must be device memory of this context.
unsafe fn replicate(
    stream: &Arc<CudaStream>,
    base: u64,
    mut filled: usize,
    total: usize,
) -> kvstream::Result<()> {
    while filled < total {
        let n = filled.min(total - filled);
        driver(
            "replicating inputs",
            cu::memcpy_dtod_async(base + filled as u64, base, n, stream.cu_stream()),
        )?;
        filled += n;
    }
    Ok(())
}

/// Dequantisation scales of the fp8 caches (per cache): the cache holds values / these.
const FP8_SCALES: (f32, f32) = (0.25, 0.125);

/// Host copy of set 0: Q for every request, K and V for the generated positions (the cache's
/// bytes, and the values the kernels attend to: dequantised for an fp8 cache).
struct HostSet {
    q: (Vec<half::bf16>, Vec<f32>),
    k: (Vec<u8>, Vec<f32>),
    v: (Vec<u8>, Vec<f32>),
    /// Generated positions; the pool repeats them.
    gen_tokens: usize,
}

fn bench_shape(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    reader: &StreamReader,
    shape: &Shape,
    impls: &[(String, PlanOptions)],
    rounds: usize,
) -> Row {
    let problem = match problem_of(shape) {
        Ok(p) => p,
        Err(e) => {
            let mut row = Row::for_shape(shape, 0);
            row.results
                .insert("kvstream".into(), ImplResult::failed(e.to_string()));
            return row;
        }
    };
    let io = problem.io_bytes(shape.lens(0).iter().sum());
    let mut row = Row::for_shape(shape, io as u64);
    if let Err(e) = measure_shape(rt, stream, reader, shape, &problem, impls, rounds, &mut row) {
        for (key, _) in impls {
            row.results
                .entry(key.clone())
                .or_insert_with(|| ImplResult::failed(e.to_string()));
        }
    }
    // leave the stream usable for the next shape whatever happened
    let _ = stream.synchronize();
    row
}

#[allow(clippy::too_many_arguments)]
fn measure_shape(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    reader: &StreamReader,
    shape: &Shape,
    p: &DecodeProblem,
    impls: &[(String, PlanOptions)],
    rounds: usize,
    row: &mut Row,
) -> kvstream::Result<()> {
    let arena = Arena::of(p, pool_tokens(shape));
    let io = row.io_bytes as usize;
    let floor_sets = pool_sets(io);
    // the floor reads its pool from the arena's start: it fits because io >= K + V per set
    // (so floor_sets <= sets) and the arena holds sets * io bytes
    assert!(
        floor_sets * io <= arena.bytes(),
        "floor pool exceeds the arena"
    );
    let buf = alloc::<u8>(stream, arena.bytes(), "the input pool")?;
    let base = buf.device_ptr(stream).0;
    let [k_off, v_off, q_off, o_off] = arena.offsets().map(|o| base + o as u64);
    let set_at = |region: u64, per_set: usize, s: usize| region + (s * per_set) as u64;

    // ---- set 0 on the host, then the whole pool by device copies ----
    let token_elems = p.hkv * p.head_dim;
    let gen_tokens = generated_tokens(pool_tokens(shape), token_elems);
    let mut rng = SplitMix64::new(0x6b76_7374 ^ row.io_bytes);
    let fp8 = p.kv_dtype == KvDType::Fp8E4m3;
    let q = random_bf16(&mut rng, p.batch * p.q_len * p.hq * p.head_dim, 1.0);
    let mut cache = |scale: f32| -> (Vec<u8>, Vec<f32>) {
        let n = gen_tokens * token_elems;
        if fp8 {
            // over e4m3's range, dequantised to about 1
            let (codes, values) = random_e4m3(&mut rng, n, 4.0);
            (
                codes.iter().map(|c| c.0).collect(),
                values.iter().map(|x| x * scale).collect(),
            )
        } else {
            let (bits, values) = random_bf16(&mut rng, n, 1.0);
            (bits.iter().flat_map(|x| x.to_le_bytes()).collect(), values)
        }
    };
    let (k, v) = (cache(FP8_SCALES.0), cache(FP8_SCALES.1));
    let scales = if fp8 {
        Some(driver(
            "uploading the scales",
            stream.clone_htod(&[FP8_SCALES.0, FP8_SCALES.1]),
        )?)
    } else {
        None
    };
    let scale_at = |i: u64| {
        scales.as_ref().map(|sc| KvScale {
            ptr: sc.device_ptr(stream).0 + 4 * i,
            layout: KvScaleLayout::PerTensor,
        })
    };
    let host = HostSet {
        q,
        k,
        v,
        gen_tokens,
    };
    // ---- per set: lengths (skewed batches) and block tables (paged caches) ----
    let tables: Vec<Vec<i32>> = (0..arena.sets)
        .map(|s| block_table(shape, p, s, &mut rng))
        .collect();
    let lens_host: Vec<i32> = (0..arena.sets)
        .flat_map(|s| shape.lens(s).into_iter().map(|l| l as i32))
        .collect();
    let table_host: Vec<i32> = tables.concat();
    let lens_dev = match shape.varies_lengths() {
        true => Some(driver("uploading lengths", stream.clone_htod(&lens_host))?),
        false => None,
    };
    let table_dev = match p.paged {
        Some(_) => Some(driver(
            "uploading block tables",
            stream.clone_htod(&table_host),
        )?),
        None => None,
    };
    let lens_at = lens_dev.as_ref().map(|d| d.device_ptr(stream).0);
    let table_at = table_dev.as_ref().map(|d| d.device_ptr(stream).0);
    let table_set = p.paged.map_or(0, |pg| p.batch * pg.table_stride * 4);
    // SAFETY: every copy stays inside its region of the arena; the host vectors outlive the
    // synchronisation below.
    unsafe {
        driver(
            "uploading q",
            cu::memcpy_htod_async(q_off, &host.q.0, stream.cu_stream()),
        )?;
        driver(
            "uploading k",
            cu::memcpy_htod_async(k_off, &host.k.0, stream.cu_stream()),
        )?;
        driver(
            "uploading v",
            cu::memcpy_htod_async(v_off, &host.v.0, stream.cu_stream()),
        )?;
        let generated = host.k.0.len();
        replicate(stream, k_off, generated, arena.kv_set)?;
        replicate(stream, v_off, generated, arena.kv_set)?;
        let total = arena.sets;
        replicate(stream, k_off, arena.kv_set, total * arena.kv_set)?;
        replicate(stream, v_off, arena.kv_set, total * arena.kv_set)?;
        replicate(stream, q_off, arena.q_set, total * arena.q_set)?;
    }
    driver("uploading the inputs", stream.synchronize())?;
    let tensors = |s: usize| DecodeTensors {
        q: set_at(q_off, arena.q_set, s),
        k: set_at(k_off, arena.kv_set, s),
        v: set_at(v_off, arena.kv_set, s),
        out: set_at(o_off, arena.q_set, s),
        lse: None,
        seqlens: lens_at.map(|a| set_at(a, p.batch * 4, s)),
        block_table: table_at.map(|a| set_at(a, table_set, s)),
        k_scale: scale_at(0),
        v_scale: scale_at(1),
        sinks: None,
        view_len: None,
    };

    // ---- check every implementation on set 0, capture the ones that pass ----
    let mut reference: Option<(Vec<usize>, Vec<f64>)> = None;
    let mut timed: Vec<(String, Decoder, CudaGraph, f64)> = Vec::new();
    for (key, opts) in impls {
        let decoder = match Decoder::new(rt, p.clone(), *opts) {
            Ok(d) => d,
            Err(e) => {
                row.results
                    .insert(key.clone(), ImplResult::failed(e.to_string()));
                continue;
            }
        };
        // SAFETY: set 0's pointers cover the problem's sizes.
        let checked = unsafe { decoder.run(&tensors(0), stream.cu_stream()) }.and_then(|()| {
            let refs = reference.get_or_insert_with(|| reference_rows(shape, p, &host, &tables[0]));
            let got = download_rows(stream, o_off, p, &refs.0)?;
            Ok(relative_error(&got, &refs.1))
        });
        let err = match checked {
            Ok(err) => err,
            Err(e) => {
                row.results
                    .insert(key.clone(), ImplResult::failed(e.to_string()));
                continue;
            }
        };
        if err.is_nan() || err > TOLERANCE {
            row.results.insert(
                key.clone(),
                ImplResult {
                    rel_err: Some(err),
                    error: Some(format!(
                        "output check failed: rel err {err:.3e} > {TOLERANCE:.0e}"
                    )),
                    ..Default::default()
                },
            );
            continue;
        }
        let graph = capture(stream, arena.sets, &mut |s| {
            // SAFETY: every set's pointers lie in the arena.
            unsafe { decoder.run(&tensors(s), stream.cu_stream()) }
        });
        match graph {
            Ok(g) => timed.push((key.clone(), decoder, g, err)),
            Err(e) => {
                row.results
                    .insert(key.clone(), ImplResult::failed(e.to_string()));
            }
        }
    }

    // ---- the byte floor's graphs over the same arena ----
    // SAFETY: floor_sets * io bytes from the arena's start lie in the arena (asserted above).
    let floor = unsafe { reader.graphs(stream, base, io, floor_sets)? };

    // ---- one interleaved timing of everything ----
    let mut list: Vec<(&CudaGraph, usize)> = timed.iter().map(|t| (&t.2, arena.sets)).collect();
    list.extend(floor.iter().map(|(_, g)| (g, floor_sets)));
    let timings = time_graphs(stream, &list, rounds)?;
    // traced builds: each timed decoder's records apart, `<shape>.<key>` (the interleaved
    // timing above writes every decoder's calls into the same records); a few replays of its
    // graph give trace.py its calls (its timings are not results)
    if let Some(dir) = kvstream::jit::compile::trace_dir() {
        for (key, _, graph, _) in &timed {
            trace::reset(rt, stream)?;
            for _ in 0..TRACE_REPLAYS {
                driver("a traced replay", graph.launch())?;
            }
            driver("after the traced replays", stream.synchronize())?;
            trace::dump(
                rt,
                stream,
                &dir,
                &format!("{}.{}", shape.id, key.replace('/', "-")),
            )?;
        }
    }
    for (i, (key, decoder, _, err)) in timed.iter().enumerate() {
        let t = timings[i];
        let plan = decoder.plan();
        let mode = plan.mode();
        row.results.insert(
            key.clone(),
            ImplResult {
                us: Some(t.median_us),
                gbps: Some(io as f64 / t.median_us / 1e3),
                rel_err: Some(*err),
                mode: Some(mode),
                splits: plan.split().map(|p| p.num_splits),
                min_us: Some(t.min_us),
                ..Default::default()
            },
        );
    }
    let configs: Vec<(u32, u32)> = floor.iter().map(|(c, _)| *c).collect();
    let best = StreamReader::best(&configs, &timings[timed.len()..]);
    row.floor_us = Some(best.us);
    row.extra.insert(
        "floor_config".into(),
        serde_json::json!({"grid": best.grid, "threads": best.threads, "sets": floor_sets}),
    );
    row.extra
        .insert("pool_sets".into(), serde_json::json!(arena.sets));
    if host.gen_tokens < pool_tokens(shape) {
        row.extra.insert(
            "distinct_kv_positions".into(),
            serde_json::json!(host.gen_tokens),
        );
    }
    drop(floor);
    drop(timed);
    driver("finishing the shape", stream.synchronize())?;
    drop(buf);
    Ok(())
}

/// Requests checked against the reference: the first and the last, except a skewed batch's
/// long request (its f64 reference alone would take minutes; the GPU tests cover it).
fn checked_requests(shape: &Shape) -> Vec<usize> {
    if shape.lens.is_some() {
        // a ragged batch: its two shortest requests of set 0 (the longest can be 1M positions)
        let lens = shape.lens(0);
        let mut order: Vec<usize> = (0..shape.batch).collect();
        order.sort_by_key(|&b| (lens[b], b));
        order.truncate(2);
        order.sort_unstable();
        return order;
    }
    let long = shape.long_len.map(|_| 0); // the long request of set 0
    let mut reqs = vec![0, shape.batch - 1, 1.min(shape.batch - 1)];
    reqs.retain(|&b| Some(b) != long);
    reqs.sort_unstable();
    reqs.dedup();
    reqs.truncate(2);
    reqs
}

/// The f64 reference output rows `[q_len, hq, d]` of the checked requests of set 0,
/// concatenated: each request's K/V gathered from the pool as the kernels see it.
fn reference_rows(
    shape: &Shape,
    p: &DecodeProblem,
    host: &HostSet,
    table: &[i32],
) -> (Vec<usize>, Vec<f64>) {
    let reqs = checked_requests(shape);
    let lens = shape.lens(0);
    let q_req = p.q_len * p.hq * p.head_dim;
    let te = p.hkv * p.head_dim;
    let mut out = Vec::with_capacity(reqs.len() * q_req);
    for &b in &reqs {
        let len = lens[b];
        // pool position of request b's position t, then the generated position it repeats
        let source = |t: usize| -> usize {
            let flat = match p.paged {
                Some(pg) => {
                    table[b * pg.table_stride + t / pg.page_size] as usize * pg.page_size
                        + t % pg.page_size
                }
                None => b * p.max_len + t,
            };
            flat % host.gen_tokens
        };
        let gather = |src: &[f32]| -> Vec<f32> {
            (0..len)
                .flat_map(|t| src[source(t) * te..(source(t) + 1) * te].iter().copied())
                .collect()
        };
        let shape = RefShape {
            batch: 1,
            max_len: len,
            ..RefShape::from(p)
        };
        let r = decode_reference(
            &shape,
            &host.q.1[b * q_req..(b + 1) * q_req],
            &gather(&host.k.1),
            &gather(&host.v.1),
            &[len],
        );
        out.extend(r.out);
    }
    (reqs, out)
}

/// The output rows of requests `reqs` of set 0, as f64.
fn download_rows(
    stream: &Arc<CudaStream>,
    out: u64,
    p: &DecodeProblem,
    reqs: &[usize],
) -> kvstream::Result<Vec<f64>> {
    let q_req = p.q_len * p.hq * p.head_dim;
    let mut got = Vec::with_capacity(reqs.len() * q_req);
    for &b in reqs {
        let mut host = vec![half::bf16::ZERO; q_req];
        // SAFETY: request b's output row lies in set 0 of the out region; synchronised below
        // before `host` is read or dropped.
        driver("downloading out", unsafe {
            cu::memcpy_dtoh_async(&mut host, out + (b * q_req * 2) as u64, stream.cu_stream())
        })?;
        driver("downloading out", stream.synchronize())?;
        got.extend(host.iter().map(|x| x.to_f64()));
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn parse(argv: &[&str]) -> Result<BenchArgs, clap::Error> {
        let mut v = vec!["bench"];
        v.extend_from_slice(argv);
        Wrap::try_parse_from(v).map(|w| w.args)
    }

    fn matrix_path() -> String {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/matrix.json").into()
    }

    #[test]
    fn rows_with_score_modifiers_are_refused_not_timed_without_them() {
        let models = matrix_path().replace("matrix.json", "matrix-models.json");
        let plain = parse(&["--matrix", &models, "--ids", "phi3-d96-b1-L4096"]).unwrap();
        assert_eq!(select_shapes(&plain).unwrap().len(), 1);
        for (id, named) in [
            ("gptoss-sinks-w128-b1-L4096", "window, sinks"),
            ("gemma2-softcap-b1-L4096", "softcap"),
        ] {
            let a = parse(&["--matrix", &models, "--ids", id]).unwrap();
            let e = select_shapes(&a).unwrap_err();
            assert!(
                e.contains("score modifiers") && e.contains(named),
                "{id}: {e}"
            );
        }
    }

    #[test]
    fn rings_parse_each_part_once() {
        let r = parse_ring("g1s6p128").unwrap();
        assert_eq!(
            (r.groups, r.stages, r.tile_tokens),
            (Some(1), Some(6), Some(128))
        );
        let r = parse_ring("s2").unwrap();
        assert_eq!((r.groups, r.stages, r.tile_tokens), (None, Some(2), None));
        assert_eq!(
            parse_ring("s2l2").unwrap().kv_l2,
            Some(kvstream::kernels::L2Hint::EvictLast)
        );
        assert_eq!(parse_ring("x1").unwrap().gather, Some(true));
        assert_eq!(parse_ring("g1x0").unwrap().gather, Some(false));
        assert_eq!(parse_ring("x1w2").unwrap().producer_warps, Some(2));
        assert_eq!(parse_ring("h2").unwrap().pair_heads, Some(true));
        assert_eq!(parse_ring("g1h1").unwrap().pair_heads, Some(false));
        assert_eq!(parse_ring("k1").unwrap().head_lanes, Some(true));
        assert_eq!(parse_ring("s2k0").unwrap().head_lanes, Some(false));
        for bad in ["", "g", "x2", "g1g2", "s2p", "g1 s2", "l3", "h3", "k2"] {
            assert!(parse_ring(bad).is_err(), "{bad:?}");
        }
        let a = parse(&["--matrix", &matrix_path(), "--rings", "g1s2,g2s4"]).unwrap();
        assert_eq!(a.rings.len(), 2);
    }

    #[test]
    fn arguments_and_shape_selection() {
        let a = parse(&["--matrix", &matrix_path()]).unwrap();
        assert_eq!(a.rounds, 9);
        assert_eq!(
            a.json,
            PathBuf::from("bench/results/kvstream-bench-latest.json")
        );
        assert_eq!(select_shapes(&a).unwrap().len(), 60);
        assert!(parse(&["--rounds", "5"]).is_err(), "at least 7 rounds");
        let a = parse(&[
            "--matrix",
            &matrix_path(),
            "--ids",
            "gqa-d128-L4096,mqa-d64-L1024",
            "--shape",
            "2,16,2,128,1000",
            "--consumer-groups",
            "1,2",
            "--stages",
            "2",
            "--splits",
            "8",
            "--resident-ctas",
            "1",
            "--modes",
            "--no-pdl",
            "--cluster-splits",
            "4,16",
        ])
        .unwrap();
        let s = select_shapes(&a).unwrap();
        let ids: Vec<&str> = s.iter().map(|x| x.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "mqa-d64-L1024",
                "gqa-d128-L4096",
                "custom-b2-h16-2-d128-L1000"
            ]
        );
        let keys: Vec<String> = implementations(&a).into_iter().map(|(k, _)| k).collect();
        assert_eq!(
            keys,
            [
                "kvstream",
                "kvstream/g1",
                "kvstream/g2",
                "kvstream/s2",
                "kvstream/n8",
                "kvstream/n8-s2",
                "kvstream/r1",
                "kvstream/s2-r1",
                "kvstream/persistent",
                "kvstream/split",
                "kvstream/kernel",
                "kvstream/kernel-nopdl",
                "kvstream/cluster",
                "kvstream/cluster-nopdl",
                "kvstream/cluster-s4",
                "kvstream/cluster-s16"
            ]
        );
        // --shape alone does not need the matrix
        let a = parse(&["--matrix", "/nonexistent", "--shape", "1,16,2,128,4096"]).unwrap();
        assert_eq!(select_shapes(&a).unwrap().len(), 1);
        let a = parse(&["--shape", "1,16,3,128,4096"]).unwrap(); // 16 % 3 != 0
        assert!(select_shapes(&a).is_err());
        assert!(parse(&["--shape", "1,16,2"]).is_err());
        assert_eq!(plot_prefix(&a.json), "kvstream-bench-latest");
    }

    #[test]
    fn kv_dtype_applies_to_every_shape() {
        let a = parse(&[
            "--matrix",
            &matrix_path(),
            "--ids",
            "gqa-d128-L4096",
            "--kv-dtype",
            "fp8_e4m3",
        ])
        .unwrap();
        let shapes = select_shapes(&a).unwrap();
        assert_eq!(shapes[0].kv_dtype.as_deref(), Some("fp8_e4m3"));
        let p = problem_of(&shapes[0]).unwrap();
        assert_eq!(p.kv_dtype, KvDType::Fp8E4m3);
        // half the K and V bytes of the bf16 shape, the same Q and out
        let bf16 = problem_of(&Shape {
            kv_dtype: None,
            ..shapes[0].clone()
        })
        .unwrap();
        let qo = 2 * p.batch * p.q_len * p.hq * p.head_dim * 2;
        assert_eq!(2 * (p.io_bytes(4096) - qo), bf16.io_bytes(4096) - qo);
        let bad = parse(&["--matrix", &matrix_path(), "--kv-dtype", "e5m2"]).unwrap();
        assert!(select_shapes(&bad).is_err());
    }

    #[test]
    fn arena_holds_the_pool_and_the_floor() {
        let serving = matrix_path().replace("matrix.json", "serving.json");
        for path in [matrix_path(), serving] {
            let m = Matrix::load(std::path::Path::new(&path)).unwrap();
            for s in &m.shapes {
                let p = problem_of(s).unwrap_or_else(|e| panic!("{}: {e}", s.id));
                let tokens = pool_tokens(s);
                let a = Arena::of(&p, tokens);
                let io = p.io_bytes(s.lens(0).iter().sum());
                assert_eq!(a.sets, pool_sets(2 * a.kv_set), "{}", s.id);
                assert!(pool_sets(io) * io <= a.bytes(), "{}", s.id);
                assert_eq!(io % 16, 0);
                let [k, v, q, o] = a.offsets();
                assert!(k < v && v < q && q < o && o < a.bytes());
                assert!([k, v, q, o].iter().all(|x| x % 256 == 0));
                assert_eq!((a.kv_set % 16, a.q_set % 16), (0, 0));
                let te = p.hkv * p.head_dim;
                let g = generated_tokens(tokens, te);
                assert!(g >= 1 && g <= tokens);
                assert!(g * te <= HOST_KV_ELEMS.max(te));
                let reqs = checked_requests(s);
                assert!(!reqs.is_empty() && reqs.len() <= 2);
                if s.lens.is_some() {
                    // every set: the same total and page count, other lengths per request
                    let l0 = s.lens(0);
                    let mut sorted = l0.clone();
                    sorted.sort_unstable();
                    assert!(
                        reqs.iter().all(|&b| l0[b] <= sorted[1]),
                        "{}: the two shortest are checked",
                        s.id
                    );
                    assert_ne!(l0, s.lens(1), "{}: the lengths move between sets", s.id);
                    for set in 0..a.sets {
                        let l = s.lens(set);
                        assert_eq!(l.iter().sum::<usize>(), l0.iter().sum::<usize>());
                        assert!(l.iter().all(|&x| x <= s.len));
                    }
                    let keys: Vec<String> = shape_implementations(s, &[])
                        .into_iter()
                        .map(|(k, _)| k)
                        .collect();
                    assert_eq!(
                        keys,
                        ["kvstream", "kvstream/device-plan", "kvstream/host-plan"]
                    );
                }
                if let (true, Some(pg)) = (s.varies_lengths(), p.paged) {
                    assert!(
                        s.long_len.is_none() || !reqs.contains(&0),
                        "{}: the long request is not checked",
                        s.id
                    );
                    for set in 0..a.sets {
                        let t = block_table(s, &p, set, &mut SplitMix64::new(set as u64));
                        let mut used: Vec<i32> = s
                            .lens(set)
                            .iter()
                            .enumerate()
                            .flat_map(|(b, l)| {
                                t[b * pg.table_stride
                                    ..b * pg.table_stride + l.div_ceil(pg.page_size)]
                                    .to_vec()
                            })
                            .collect();
                        used.sort_unstable();
                        assert_eq!(
                            used,
                            (0..pg.num_pages as i32).collect::<Vec<_>>(),
                            "{}",
                            s.id
                        );
                    }
                }
            }
        }
    }
}
