//! `kvstream mla`: one MLA decode on the GPU (`kvstream::mla`), checked against the f64
//! reference of the absorbed form, timed by docs/benchmarking.md's method (CUDA graph over a
//! rotating pool, median of rounds) in the same rounds as the byte floor of the same bytes.
//!
//! Lengths: every request at `--len`, or with `--skew S` request 0 at `--len` and the others
//! at S (the lengths live on the device, as a server passes them). The check covers the first
//! and the last request (the reference is f64 on the CPU, one thread per head).
//! `KVSTREAM_TRACE=<dir>` runs the phase-trace build and writes its records there
//! (bench/trace.py summarises them; traced timings are not results).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaGraph, DevicePtr, DevicePtrMut};
use kvstream::mla::{MlaDecoder, MlaProblem, MlaTensors, MLA_DIM, MLA_V_DIM};
use kvstream::reference::{
    mla_reference, random_bf16, random_e4m3, random_f16, RefShape, SplitMix64,
};
use kvstream::{DType, Element, Error, KvDType, KvScale, KvScaleLayout, PlanOptions, Runtime};

use crate::bench::{BenchArgs, StreamReader};
use crate::timing::{self, alloc, driver};

/// Shape and options of `kvstream mla`.
#[derive(clap::Args, Clone, Debug)]
pub struct MlaArgs {
    /// Requests in the batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Query heads (16: DeepSeek-V3 at TP 8; 128 without tensor parallelism).
    #[arg(long, default_value_t = 16)]
    pub hq: usize,
    /// New tokens per request (1..=8).
    #[arg(long, default_value_t = 1)]
    pub q_len: usize,
    /// Cache length of every request (of request 0 with --skew).
    #[arg(long = "len", default_value_t = 32768)]
    pub len: usize,
    /// The other requests' length: one long request and many short ones.
    #[arg(long)]
    pub skew: Option<usize>,
    /// Every request's length (a ragged batch; comma-separated, one per request): the batch is
    /// their count and L their largest (--len is then unused).
    #[arg(long, value_delimiter = ',')]
    pub lens: Vec<usize>,
    /// bf16 or f16 (q and out; the cache too unless --kv-dtype says otherwise).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Cache element type: auto (the query's) or fp8_e4m3 (with a per-cache scale).
    #[arg(long, default_value = "auto")]
    pub kv_dtype: String,
    /// Paged cache with this page size; pages shuffled over the pool.
    #[arg(long)]
    pub page_size: Option<usize>,
    /// Softmax scale (DeepSeek-V3: 1/sqrt(192) x its YaRN factor).
    #[arg(long, default_value_t = DEEPSEEK_SCALE)]
    pub scale: f32,
    /// Timed rounds (at least 7; 0 = check only).
    #[arg(long, default_value_t = 15)]
    pub rounds: usize,
    /// Persistent CTAs (default and most: one per SM, as the merge needs every CTA resident):
    /// fewer cut a batch-1 request into fewer pieces (an experiment on the merge's cost).
    #[arg(long)]
    pub ctas: Option<usize>,
    /// Launch without programmatic dependent launch (the next call does not start under this
    /// one's tail).
    #[arg(long)]
    pub no_pdl: bool,
    /// Run every shape of this matrix (bench/matrix-mla.json) instead of the one above; a
    /// relative path is also looked for above the current folder.
    #[arg(long, value_parser = crate::repo_file)]
    pub matrix: Option<std::path::PathBuf>,
    /// Only the matrix shapes whose id contains one of these (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub ids: Vec<String>,
    /// Write the results (docs/benchmarking.md's format, one row per shape) to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// One timed shape, as the results file keeps it.
struct MlaRow {
    id: String,
    shape: serde_json::Value,
    io_bytes: usize,
    us: f64,
    floor_us: f64,
    rel_err: f64,
    kernel: String,
}

/// DeepSeek-V3's softmax scale: 1/sqrt(192) times its YaRN factor (about 1.0).
pub const DEEPSEEK_SCALE: f32 = 0.0722;

/// Scale of the fp8 cache (its values span e4m3's range, the dequantised ones about 1).
const FP8_SCALE: f32 = 0.25;
/// Relative error a row must stay under.
const TOLERANCE: f64 = 1e-2;

/// `kvstream demo --mla`: one MLA decode of the demo's shape; without a GPU, a clear message
/// and the f64 reference on a small problem.
pub fn demo(shape: &crate::ShapeArgs, rounds: usize) -> kvstream::Result<()> {
    let gqa_only = [
        ("splits", shape.splits.is_some()),
        ("consumer_groups", shape.consumer_groups.is_some()),
        ("reduction", shape.reduction.is_some()),
        ("device_plan", shape.device_plan),
        ("engine", shape.engine.is_some()),
        ("ring", shape.ring.is_some()),
    ];
    if let Some((name, _)) = gqa_only.iter().find(|(_, set)| *set) {
        return Err(Error::invalid(
            name,
            "set",
            "unset with --mla (a GQA engine knob; the MLA decode plans itself)",
        ));
    }
    let args = MlaArgs {
        batch: shape.batch,
        hq: shape.hq,
        q_len: shape.q_len,
        len: shape.len,
        skew: None,
        lens: Vec::new(),
        dtype: shape.dtype.clone(),
        kv_dtype: shape.kv_dtype.clone(),
        page_size: shape.page_size,
        scale: DEEPSEEK_SCALE,
        rounds,
        ctas: None,
        no_pdl: false,
        matrix: None,
        ids: Vec::new(),
        json: None,
    };
    match Runtime::new(0) {
        Ok(_) => run(&args),
        Err(e @ (Error::DriverUnavailable(_) | Error::NoSuitableDevice(_))) => {
            println!("No usable GPU: {e}.");
            println!(
                "kvstream's kernels need an NVIDIA H100/H200 (sm_90). Running the f64 CPU reference \
                 of the MLA decode instead.\n"
            );
            cpu_demo()
        }
        Err(e) => Err(e),
    }
}

/// The absorbed-MLA reference on a small problem (16 heads, 2 new tokens, 1000 positions).
fn cpu_demo() -> kvstream::Result<()> {
    let p = MlaProblem::new(1, 16, 1000, DType::Bf16, DEEPSEEK_SCALE)?.with_q_len(2)?;
    let mut rng = SplitMix64::new(7);
    let (_, q) = random_bf16(&mut rng, p.q_len * p.hq * MLA_DIM, 1.0);
    let (_, kv) = random_bf16(&mut rng, p.max_len * MLA_DIM, 1.0);
    let t = Instant::now();
    let out = mla_reference(&RefShape::from(&p), &q, &kv, &[p.max_len]);
    println!(
        "MLA reference (f64): 1 request, {} heads x {} new tokens, {} cached rows of {MLA_DIM} \
         (values: the first {MLA_V_DIM}) in {:.1} ms",
        p.hq,
        p.q_len,
        p.max_len,
        t.elapsed().as_secs_f64() * 1e3
    );
    println!(
        "  out[0][0][0..4] = {:?}, lse[0][0] = {:.4}",
        &out.out[..4],
        out.lse[0]
    );
    Ok(())
}

/// Whether a matrix file is an MLA one (`"kind": "mla"`, as bench/matrix-mla.json).
pub fn is_mla_matrix(path: &std::path::Path) -> Result<bool, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(doc["kind"].as_str() == Some("mla"))
}

/// `kvstream bench --matrix bench/matrix-mla.json`: `kvstream mla --matrix` with the bench's
/// --ids, --rounds and --json (default: bench/results/kvstream-mla-latest.json); the GQA
/// engines' sweep options are refused.
pub fn bench_matrix(args: &BenchArgs) -> Result<(), String> {
    let sweeps = [
        ("shape", !args.shapes.is_empty()),
        ("kv_dtype", args.kv_dtype.is_some()),
        ("consumer_groups", !args.consumer_groups.is_empty()),
        ("stages", !args.stages.is_empty()),
        ("splits", !args.splits.is_empty()),
        ("resident_ctas", !args.resident_ctas.is_empty()),
        ("ctas", !args.ctas.is_empty()),
        ("min_tiles", !args.min_tiles.is_empty()),
        ("rings", !args.rings.is_empty()),
        ("modes", args.modes),
        ("cluster_splits", !args.cluster_splits.is_empty()),
        ("no_pdl", args.no_pdl),
        ("device_plan", args.device_plan),
    ];
    if let Some((name, _)) = sweeps.iter().find(|(_, set)| *set) {
        return Err(format!(
            "--{}: not with an MLA matrix ({}): a GQA engine option; the MLA rows take --ids, \
             --rounds and --json",
            name.replace('_', "-"),
            args.matrix.display()
        ));
    }
    if let Err(e @ (Error::DriverUnavailable(_) | Error::NoSuitableDevice(_))) = Runtime::new(0) {
        return Err(format!(
            "kvstream bench needs an NVIDIA H100/H200 (sm_90) and found none: {e}. \
             (`kvstream demo --mla` runs the MLA reference on the CPU.)"
        ));
    }
    let json = if args.json == std::path::Path::new(crate::bench::DEFAULT_RESULTS) {
        std::path::PathBuf::from("bench/results/kvstream-mla-latest.json")
    } else {
        args.json.clone()
    };
    let mla = MlaArgs {
        batch: 1,
        hq: 16,
        q_len: 1,
        len: 32768,
        skew: None,
        lens: Vec::new(),
        dtype: "bf16".into(),
        kv_dtype: "auto".into(),
        page_size: None,
        scale: DEEPSEEK_SCALE,
        rounds: args.rounds as usize,
        ctas: None,
        no_pdl: false,
        matrix: Some(args.matrix.clone()),
        ids: args.ids.clone(),
        json: Some(json),
    };
    run(&mla).map_err(|e| e.to_string())
}

pub fn run(args: &MlaArgs) -> kvstream::Result<()> {
    let Some(path) = &args.matrix else {
        let row = run_one(args)?;
        return match (&args.json, row) {
            (Some(out), Some(row)) => write_results(out, &[row_json(&row)], &gpu_name()?),
            _ => Ok(()),
        };
    };
    // no GPU: say so once, write nothing
    let gpu = gpu_name()?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::invalid("matrix", path.display(), format!("a readable file ({e})")))?;
    let doc: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::invalid("matrix", path.display(), format!("JSON ({e})")))?;
    let shapes = doc["shapes"].as_array().cloned().unwrap_or_default();
    let mut rows = Vec::new();
    for shape in shapes {
        let id = shape["id"].as_str().unwrap_or_default().to_string();
        if !args.ids.is_empty() && !args.ids.iter().any(|w| id.contains(w.as_str())) {
            continue;
        }
        let field = |k: &str| shape[k].as_u64().map(|v| v as usize);
        let one = MlaArgs {
            batch: field("batch").unwrap_or(1),
            hq: field("hq").unwrap_or(16),
            q_len: field("q_len").unwrap_or(1),
            len: field("L").unwrap_or(32768),
            skew: field("skew"),
            lens: shape["lens"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_u64().map(|v| v as usize))
                        .collect()
                })
                .unwrap_or_default(),
            kv_dtype: shape["kv_dtype"].as_str().unwrap_or("auto").to_string(),
            page_size: field("page"),
            matrix: None,
            ids: Vec::new(),
            json: None,
            ..args.clone()
        };
        println!("== {id}");
        match run_one(&one) {
            Ok(Some(mut row)) => {
                row.id = id;
                row.shape = shape;
                rows.push(row_json(&row));
            }
            Ok(None) => {}
            Err(e) => {
                println!("  error: {e}");
                // the row stays, with the error in place of numbers (docs/benchmarking.md)
                let mut v = shape;
                v["id"] = id.into();
                v["results"] = serde_json::json!({ "kvstream": { "error": e.to_string() } });
                rows.push(v);
            }
        }
    }
    match &args.json {
        Some(out) => write_results(out, &rows, &gpu),
        None => Ok(()),
    }
}

/// The name of GPU 0 (an error without one).
fn gpu_name() -> kvstream::Result<String> {
    Ok(Runtime::new(0)?
        .context()
        .name()
        .unwrap_or_else(|_| "unknown GPU".into()))
}

/// A timed row as the results file keeps it.
fn row_json(r: &MlaRow) -> serde_json::Value {
    let mut v = r.shape.clone();
    v["id"] = r.id.clone().into();
    v["io_bytes"] = r.io_bytes.into();
    v["floor_us"] = r.floor_us.into();
    v["results"] = serde_json::json!({ "kvstream": {
        "us": r.us, "GBps": r.io_bytes as f64 / r.us / 1e3, "rel_err": r.rel_err,
        "mode": r.kernel } });
    v
}

/// The results file: docs/benchmarking.md's keys, a row per shape with its byte floor and the
/// `kvstream` result (peers are added by bench/mla_peers.py --merge).
fn write_results(
    path: &std::path::Path,
    rows: &[serde_json::Value],
    gpu: &str,
) -> kvstream::Result<()> {
    let doc = serde_json::json!({
        "date": crate::results::today(),
        "commit": crate::results::current_commit(),
        "gpu": gpu,
        "rows": rows,
    });
    let text = serde_json::to_string_pretty(&doc).expect("plain JSON values");
    std::fs::write(path, text + "\n")
        .map_err(|e| Error::invalid("json", path.display(), format!("a writable path ({e})")))
}

/// Every request's cache length: `--lens` as given, or request 0 at `--len` and the others at
/// `--skew`, or all at `--len`. Returns (batch, L, lengths); on the host only, so that a check
/// of the arguments needs no GPU.
fn request_lens(args: &MlaArgs) -> kvstream::Result<(usize, usize, Vec<usize>)> {
    if args.lens.is_empty() {
        let lens = (0..args.batch)
            .map(|b| match args.skew {
                Some(s) if b > 0 => s.min(args.len),
                _ => args.len,
            })
            .collect();
        return Ok((args.batch, args.len, lens));
    }
    let shown = || format!("{:?}", args.lens);
    if args.skew.is_some() {
        return Err(Error::invalid(
            "--lens",
            shown(),
            "unset with --skew (one or the other)",
        ));
    }
    if args.batch != 1 && args.batch != args.lens.len() {
        return Err(Error::invalid(
            "--lens",
            shown(),
            format!("one length per request (--batch {})", args.batch),
        ));
    }
    let longest = *args.lens.iter().max().unwrap_or(&0);
    if longest == 0 {
        return Err(Error::invalid(
            "--lens",
            shown(),
            "at least one length above 0",
        ));
    }
    Ok((args.lens.len(), longest, args.lens.clone()))
}

fn run_one(args: &MlaArgs) -> kvstream::Result<Option<MlaRow>> {
    let dtype: DType = args.dtype.parse()?;
    let (batch, max_len, lens) = request_lens(args)?;
    let mut p = MlaProblem::new(batch, args.hq, max_len, dtype, args.scale)?
        .with_q_len(args.q_len)?
        .with_kv_dtype(args.kv_dtype.parse()?)?;
    if let Some(page) = args.page_size {
        // the pool holds the pages of the real lengths and a few spare ones
        let pages = lens.iter().map(|l| l.div_ceil(page.max(1))).sum::<usize>() + 3;
        p = p.with_paged(page, pages, None)?;
    }
    let rt = Runtime::new(0)?;
    match (p.dtype, p.kv_dtype) {
        (DType::Bf16, KvDType::AsQuery) => gpu_mla(&rt, p, args, random_bf16, random_bf16),
        (DType::F16, KvDType::AsQuery) => gpu_mla(&rt, p, args, random_f16, random_f16),
        (DType::Bf16, KvDType::Fp8E4m3) => gpu_mla(&rt, p, args, random_bf16, random_e4m3),
        (DType::F16, KvDType::Fp8E4m3) => gpu_mla(&rt, p, args, random_f16, random_e4m3),
    }
}

type RandomFn<T> = fn(&mut SplitMix64, usize, f32) -> (Vec<T>, Vec<f32>);

fn gpu_mla<T: Element + Copy + Default + Sync, K: cudarc::driver::DeviceRepr + Copy + Default>(
    rt: &Arc<Runtime>,
    p: MlaProblem,
    args: &MlaArgs,
    random: RandomFn<T>,
    random_kv: RandomFn<K>,
) -> kvstream::Result<Option<MlaRow>> {
    let ctx = rt.context();
    // SAFETY: everything below runs on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = driver("creating a stream", ctx.new_stream())?;
    let t = Instant::now();
    let options = PlanOptions {
        persistent_ctas: args.ctas,
        disable_pdl: args.no_pdl,
        ..PlanOptions::default()
    };
    let decoder = MlaDecoder::new(rt, p.clone(), options)?;
    let setup = t.elapsed();
    let (_, _, lens) = request_lens(args)?;
    let rows = p.batch * p.q_len * p.hq;
    let fp8 = p.kv_dtype == KvDType::Fp8E4m3;
    let mut rng = SplitMix64::new(576);
    let (q_h, q_f) = random(&mut rng, rows * MLA_DIM, 1.0);
    // each request's rows (only its length: a skewed batch of 1M + short ones stays small on
    // the host); the values the reference sees only for the checked requests
    let mut checked = vec![0];
    if p.batch > 1 {
        checked.push(p.batch - 1);
    }
    let mut cache_h = Vec::with_capacity(p.batch);
    let mut cache_f = vec![Vec::new(); p.batch];
    for (b, &len) in lens.iter().enumerate() {
        let (bits, mut wide) = random_kv(&mut rng, len * MLA_DIM, if fp8 { 4.0 } else { 1.0 });
        if checked.contains(&b) {
            if fp8 {
                wide.iter_mut().for_each(|x| *x *= FP8_SCALE);
            }
            cache_f[b] = wide;
        }
        cache_h.push(bits);
    }
    let kv_bytes = p.kv_elem_bytes();
    let row_bytes = MLA_DIM * kv_bytes;
    // where request b's position t lives, in bytes from the start of a set
    let (place, table_h): (Box<dyn Fn(usize, usize) -> usize>, _) = match p.paged {
        Some(pg) => {
            let mut order: Vec<usize> = (0..pg.num_pages).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
            let mut table = vec![0i32; p.batch * pg.table_stride];
            let mut next = 0;
            for (b, &len) in lens.iter().enumerate() {
                for j in 0..len.div_ceil(pg.page_size) {
                    table[b * pg.table_stride + j] = order[next] as i32;
                    next += 1;
                }
            }
            let (stride, page) = (pg.table_stride, pg.page_size);
            let t = table.clone();
            (
                Box::new(move |b, pos| {
                    (t[b * stride + pos / page] as usize * page + pos % page) * row_bytes
                }),
                Some(table),
            )
        }
        None => {
            let max_len = p.max_len;
            (
                Box::new(move |b, pos| (b * max_len + pos) * row_bytes),
                None,
            )
        }
    };
    let cache_bytes = p.cache_elements() * kv_bytes;
    let elem = p.dtype.size();
    let io = p.io_bytes(lens.iter().sum());
    // every set's cache sits `stride` bytes apart, so the floor reads io bytes per set inside
    // the same arena
    let stride = cache_bytes.max(io).div_ceil(256) * 256;
    let sets = timing::pool_sets(io);
    let mut arena = alloc::<u8>(&stream, sets * stride, "the cache pool")?;
    let run_rows = p.paged.map_or(p.max_len, |pg| pg.page_size);
    for (b, bits) in cache_h.iter().enumerate() {
        // SAFETY: K is a plain element type (bf16, f16 or e4m3 bytes).
        let raw = unsafe {
            std::slice::from_raw_parts(bits.as_ptr() as *const u8, bits.len() * kv_bytes)
        };
        // one copy per page (or per request when contiguous)
        for first in (0..lens[b]).step_by(run_rows.max(1)) {
            let n = run_rows.min(lens[b] - first) * row_bytes;
            let src = &raw[first * row_bytes..first * row_bytes + n];
            for s in 0..sets {
                let at = s * stride + place(b, first);
                driver(
                    "uploading the cache",
                    stream.memcpy_htod(src, &mut arena.slice_mut(at..at + n)),
                )?;
            }
        }
    }
    let mut q = alloc::<T>(&stream, sets * rows * MLA_DIM, "q")?;
    for s in 0..sets {
        driver(
            "uploading q",
            stream.memcpy_htod(
                &q_h,
                &mut q.slice_mut(s * rows * MLA_DIM..(s + 1) * rows * MLA_DIM),
            ),
        )?;
    }
    let mut out = alloc::<T>(&stream, sets * rows * MLA_V_DIM, "out")?;
    let mut lse = alloc::<f32>(&stream, rows, "lse")?;
    let lens_h: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let seqlens = driver("uploading the lengths", stream.clone_htod(&lens_h))?;
    let table = match &table_h {
        Some(t) => Some(driver("uploading the block table", stream.clone_htod(t))?),
        None => None,
    };
    let scale = driver("uploading the scale", stream.clone_htod(&[FP8_SCALE]))?;
    let base = arena.device_ptr_mut(&stream).0;
    let (qb, ob) = (q.device_ptr(&stream).0, out.device_ptr_mut(&stream).0);
    let lse_ptr = lse.device_ptr_mut(&stream).0;
    let seq_ptr = seqlens.device_ptr(&stream).0;
    let table_ptr = table.as_ref().map(|t| t.device_ptr(&stream).0);
    let scale_ptr = scale.device_ptr(&stream).0;
    let tensors = |s: usize, with_lse: bool| MlaTensors {
        q: qb + (s * rows * MLA_DIM * elem) as u64,
        kv: base + (s * stride) as u64,
        out: ob + (s * rows * MLA_V_DIM * elem) as u64,
        lse: with_lse.then_some(lse_ptr),
        seqlens: Some(seq_ptr),
        block_table: table_ptr,
        kv_scale: fp8.then_some(KvScale {
            ptr: scale_ptr,
            layout: KvScaleLayout::PerTensor,
        }),
    };

    // ---- check the first and the last request of set 0 ----
    // SAFETY: the pointers cover the sizes the problem implies (allocated above).
    unsafe { decoder.run(&tensors(0, true), stream.cu_stream())? };
    let got: Vec<T> = driver(
        "downloading out",
        stream.clone_dtoh(&out.slice(0..rows * MLA_V_DIM)),
    )?;
    let got_lse: Vec<f32> = driver("downloading lse", stream.clone_dtoh(&lse))?;
    let (mut err, mut lse_err) = (0.0f64, 0.0f64);
    for &b in &checked {
        let (e, l) = check_request(&p, b, lens[b], &q_f, &cache_f[b], &got, &got_lse);
        err = err.max(e);
        lse_err = lse_err.max(l);
    }

    // ---- time, next to the byte floor of the same bytes ----
    let timing = if args.rounds == 0 {
        None
    } else {
        let graph = timing::capture(&stream, sets, &mut |s| {
            // SAFETY: the pointers cover every pool set.
            unsafe { decoder.run(&tensors(s, false), stream.cu_stream()) }
        })?;
        if kvstream::jit::compile::trace_dir().is_some() {
            crate::trace::reset(rt, &stream)?;
        }
        let reader = StreamReader::new(rt, &stream)?;
        let floor_bytes = io.div_ceil(16) * 16;
        // SAFETY: sets * stride >= sets * io bytes from the arena's start.
        let floor = unsafe { reader.graphs(&stream, base, floor_bytes.min(stride), sets)? };
        let mut list: Vec<(&CudaGraph, usize)> = vec![(&graph, sets)];
        list.extend(floor.iter().map(|(_, g)| (g, sets)));
        let t = timing::time_graphs(&stream, &list, args.rounds)?;
        let configs: Vec<(u32, u32)> = floor.iter().map(|(c, _)| *c).collect();
        let best = StreamReader::best(&configs, &t[1..]);
        if let Some(dir) = kvstream::jit::compile::trace_dir() {
            let id = format!("mla-h{}-q{}-b{}-L{}", p.hq, p.q_len, p.batch, p.max_len);
            crate::trace::dump(rt, &stream, &dir, &id)?;
        }
        Some((t[0], best.us))
    };

    let plan = decoder.plan();
    println!(
        "kvstream MLA decode on {}: batch {}, q_len {}, {} heads, L {}{}, q {}, cache {}{}",
        ctx.name().unwrap_or_default(),
        p.batch,
        p.q_len,
        p.hq,
        p.max_len,
        if args.lens.is_empty() {
            args.skew
                .map_or(String::new(), |s| format!(" (others {s})"))
        } else {
            format!(" (ragged: {lens:?})")
        },
        p.dtype.name(),
        p.kv_dtype.name(),
        p.paged.map_or(String::new(), |pg| format!(
            ", pages of {} (shuffled)",
            pg.page_size
        ))
    );
    println!(
        "  plan: {} CTAs scheduled on the device, {} column block(s), kernel {} ({} regs){}; setup {:.0} ms",
        plan.grid,
        plan.col_blocks,
        kvstream::kernels::Variant::name(&plan.variant),
        decoder.registers(),
        if plan.pdl { "" } else { ", no PDL" },
        setup.as_secs_f64() * 1e3
    );
    println!("  check vs f64 reference (requests {checked:?}): rel err {err:.2e} (limit {TOLERANCE:.0e}), max |lse err| {lse_err:.2e}");
    if let Some((t, floor_us)) = timing {
        let io = io as f64;
        println!(
            "  time: {:.2} us median ({:.2} min) over {} rounds of {sets} calls; {:.0} GB/s ({:.1} MB per call); byte floor {floor_us:.2} us ({:.3}x)",
            t.median_us,
            t.min_us,
            t.rounds,
            io / t.median_us / 1e3,
            io / 1e6,
            t.median_us / floor_us
        );
        println!(
            "RESULT id=mla-h{}-q{}-b{}-L{}{}{}{} us={:.3} floor_us={floor_us:.3} GBps={:.1} rel_err={err:.3e}",
            p.hq,
            p.q_len,
            p.batch,
            p.max_len,
            match (args.skew, args.lens.is_empty()) {
                (Some(s), _) => format!("-skew{s}"),
                (None, false) => "-ragged".to_string(),
                (None, true) => String::new(),
            },
            p.paged.map_or(String::new(), |pg| format!("-p{}", pg.page_size)),
            if fp8 { "-fp8" } else { "" },
            t.median_us,
            io / t.median_us / 1e3
        );
    }
    if !(err <= TOLERANCE && lse_err <= 1e-3) {
        return Err(Error::invalid(
            "MLA decode result",
            format!("rel err {err:.3e}, lse err {lse_err:.3e}"),
            format!("rel err <= {TOLERANCE:e} and lse err <= 1e-3"),
        ));
    }
    Ok(timing.map(|(t, floor_us)| MlaRow {
        id: String::new(),
        shape: serde_json::json!({
            "batch": p.batch, "hq": p.hq, "q_len": p.q_len, "L": p.max_len, "skew": args.skew,
            "lens": if args.lens.is_empty() { serde_json::Value::Null } else { lens.clone().into() },
            "page": p.paged.map(|pg| pg.page_size), "kv_dtype": p.kv_dtype.name(),
            "dtype": p.dtype.name() }),
        io_bytes: io,
        us: t.median_us,
        floor_us,
        rel_err: err,
        kernel: kvstream::kernels::Variant::name(&plan.variant),
    }))
}

/// The largest row error and LSE error of request `b` (all its tokens and heads) against the
/// reference on its `cache` rows, computed one head per thread.
fn check_request<T: Element + Sync>(
    p: &MlaProblem,
    b: usize,
    len: usize,
    q: &[f32],
    cache: &[f32],
    got: &[T],
    got_lse: &[f32],
) -> (f64, f64) {
    let kv = &cache[..len * MLA_DIM];
    let per_head: Vec<(f64, f64)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..p.hq)
            .map(|h| {
                s.spawn(move || {
                    let q_h: Vec<f32> = (0..p.q_len)
                        .flat_map(|i| {
                            let r = (b * p.q_len + i) * p.hq + h;
                            q[r * MLA_DIM..(r + 1) * MLA_DIM].iter().copied()
                        })
                        .collect();
                    let shape = RefShape {
                        batch: 1,
                        hq: 1,
                        max_len: len,
                        ..RefShape::from(p)
                    };
                    let want = mla_reference(&shape, &q_h, kv, &[len]);
                    let (mut e, mut l) = (0.0f64, 0.0f64);
                    for i in 0..p.q_len {
                        let r = (b * p.q_len + i) * p.hq + h;
                        let row: Vec<f64> = got[r * MLA_V_DIM..(r + 1) * MLA_V_DIM]
                            .iter()
                            .map(|x| x.to_f64())
                            .collect();
                        let w = &want.out[i * MLA_V_DIM..(i + 1) * MLA_V_DIM];
                        e = e.max(kvstream::reference::relative_error(&row, w));
                        let (a, b) = (f64::from(got_lse[r]), want.lse[i]);
                        l = l.max(if a == b { 0.0 } else { (a - b).abs() });
                    }
                    (e, if l.is_nan() { f64::INFINITY } else { l })
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a reference thread"))
            .collect()
    });
    per_head
        .into_iter()
        .fold((0.0, 0.0), |(e, l), (a, b)| (e.max(a), l.max(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lens_uniform_skewed_and_ragged() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            mla: MlaArgs,
        }
        let lens = |argv: &[&str]| {
            let cli = Cli::try_parse_from([&["kvstream"], argv].concat()).unwrap();
            request_lens(&cli.mla).map_err(|e| e.to_string())
        };
        assert_eq!(
            lens(&["--batch", "3", "--len", "100"]),
            Ok((3, 100, vec![100; 3]))
        );
        assert_eq!(
            lens(&["--batch", "3", "--len", "100", "--skew", "7"]),
            Ok((3, 100, vec![100, 7, 7]))
        );
        assert_eq!(
            lens(&["--lens", "5,64000,1024"]),
            Ok((3, 64000, vec![5, 64000, 1024]))
        );
        assert_eq!(
            lens(&["--batch", "3", "--lens", "5,6,7"]),
            Ok((3, 7, vec![5, 6, 7]))
        );
        let err = lens(&["--batch", "2", "--lens", "5,6,7"]).unwrap_err();
        assert!(err.contains("--lens") && err.contains("--batch 2"), "{err}");
        let err = lens(&["--lens", "5,6", "--skew", "3"]).unwrap_err();
        assert!(err.contains("unset with --skew"), "{err}");
        let err = lens(&["--lens", "0,0"]).unwrap_err();
        assert!(err.contains("above 0"), "{err}");
    }

    /// `kvstream bench --matrix` runs the MLA matrix as `kvstream mla --matrix` and refuses the
    /// GQA sweep options with it.
    #[test]
    fn bench_dispatches_the_mla_matrix_and_refuses_gqa_sweeps() {
        use clap::Parser;
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        let mla = std::path::PathBuf::from(format!("{root}/bench/matrix-mla.json"));
        assert!(is_mla_matrix(&mla).unwrap());
        assert!(!is_mla_matrix(&std::path::PathBuf::from(format!(
            "{root}/bench/matrix.json"
        )))
        .unwrap());
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            bench: BenchArgs,
        }
        let args =
            Cli::parse_from(["bench", "--matrix", mla.to_str().unwrap(), "--stages", "2"]).bench;
        let e = bench_matrix(&args).unwrap_err();
        assert!(e.contains("--stages") && e.contains("MLA matrix"), "{e}");
    }

    #[test]
    fn the_repository_mla_matrix_has_valid_unique_shapes() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/matrix-mla.json");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let shapes = doc["shapes"].as_array().unwrap();
        let mut ids: Vec<&str> = shapes.iter().map(|s| s["id"].as_str().unwrap()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), shapes.len(), "ids must be unique");
        for s in shapes {
            let n = |k: &str| s[k].as_u64().unwrap() as usize;
            let mut p = MlaProblem::new(n("batch"), n("hq"), n("L"), DType::Bf16, 0.07)
                .and_then(|p| p.with_q_len(n("q_len")))
                .and_then(|p| p.with_kv_dtype(s["kv_dtype"].as_str().unwrap().parse()?))
                .unwrap_or_else(|e| panic!("{s}: {e}"));
            if let Some(page) = s["page"].as_u64() {
                p = p.with_paged(page as usize, 8, None).unwrap();
            }
            kvstream::plan::plan_mla(&p, kvstream::DeviceFacts::H200, PlanOptions::default())
                .unwrap_or_else(|e| panic!("{s}: {e}"));
        }
    }
}
