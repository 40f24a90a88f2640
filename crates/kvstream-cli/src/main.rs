//! `kvstream`: run and check a decode on the GPU, benchmark it, inspect kernels and plans.

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use kvstream::jit;
use kvstream::kernels::all_variants;
use kvstream::plan::{choose, PlanOptions};
use kvstream::{DType, DecodeProblem, DeviceFacts, Window};

mod bench;
mod demo;
mod mla;
mod plot;
mod results;
mod timing;
mod trace;

#[derive(Parser)]
#[command(
    name = "kvstream",
    version,
    about = "Decode attention for LLM inference on NVIDIA Hopper"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Shape of a decode problem on the command line.
#[derive(clap::Args, Clone, Debug)]
pub struct ShapeArgs {
    /// Requests in the batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 16)]
    pub hq: usize,
    /// KV heads.
    #[arg(long, default_value_t = 2)]
    pub hkv: usize,
    /// Head dimension (64, 96, 128 or 256).
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Cache length per request.
    #[arg(long = "len", default_value_t = 4096)]
    pub len: usize,
    /// bf16 or f16 (q and out; the caches too unless --kv-dtype says otherwise).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Element type of the K and V caches: auto (the query's) or fp8_e4m3 (with per-tensor
    /// scales).
    #[arg(long, default_value = "auto")]
    pub kv_dtype: String,
    /// Force the number of KV splits.
    #[arg(long)]
    pub splits: Option<usize>,
    /// Force 1 or 2 groups of consumer warps per CTA (tuning knob).
    #[arg(long)]
    pub consumer_groups: Option<usize>,
    /// Force the reduction mode of the splits: kernel or cluster (default: chosen by the plan).
    #[arg(long)]
    pub reduction: Option<String>,
    /// New query tokens per request (1..=8): multi-token decode.
    #[arg(long, default_value_t = 1)]
    pub q_len: usize,
    /// Paged KV cache with this page size (1, 2, 4, ..., 512); the pools hold every request's
    /// pages plus a few spare ones.
    #[arg(long)]
    pub page_size: Option<usize>,
    /// Plan the split partition on the device at each call (either reduction; no --splits).
    #[arg(long)]
    pub device_plan: bool,
    /// Force the engine: persistent or split (default: chosen by the plan).
    #[arg(long)]
    pub engine: Option<String>,
    /// Force the persistent engine's ring, in `bench --rings` syntax (e.g. g2s4p64).
    #[arg(long)]
    pub ring: Option<String>,
    /// Sliding window as FlashAttention's window_size: LEFT or LEFT,RIGHT (-1: unbounded;
    /// RIGHT defaults to 0, causal). `--window 128`: each query sees its own position and the
    /// 128 before it.
    #[arg(long, allow_hyphen_values = true)]
    pub window: Option<String>,
    /// Logit softcap c: scaled scores s become c tanh(s / c) (Gemma 2: 50).
    #[arg(long)]
    pub softcap: Option<f32>,
    /// Attention sinks: one random f32 logit per query head joins each softmax (gpt-oss).
    #[arg(long)]
    pub sinks: bool,
    /// Persistent engine: one lane of CTAs per column block where a KV head has several (more
    /// than 32 query rows): true or false (default: on where there are several blocks).
    #[arg(long)]
    pub column_lanes: Option<bool>,
    /// Persistent engine: one lane of CTAs per (KV head, column block): the heads of a position
    /// read at about the same time.
    #[arg(long)]
    pub head_lanes: bool,
    /// Persistent engine: column blocks of 64 query rows on the warpgroup MMA: true or false
    /// (default: on where it serves: more than 32 query rows a KV head, d 64 or 128).
    #[arg(long)]
    pub wide_columns: Option<bool>,
    /// Persistent engine: query rows of a wide column block, 64 or 128 (128: 2-byte caches
    /// with more than 64 rows a KV head, both warpgroups on every tile; default 64).
    #[arg(long)]
    pub wide_rows: Option<usize>,
    /// Persistent engine: launch this many CTAs (default one per SM; up to two per SM where
    /// the kernel allows it).
    #[arg(long)]
    pub ctas: Option<usize>,
}

/// `--window LEFT[,RIGHT]` as a [`Window`].
fn parse_window(text: &str) -> kvstream::Result<Window> {
    let bad = || {
        kvstream::Error::invalid(
            "--window",
            text,
            "LEFT or LEFT,RIGHT: integers, -1 for unbounded (e.g. 128 or 4095,0)",
        )
    };
    let mut parts = text
        .split(',')
        .map(|x| x.trim().parse::<i64>().map_err(|_| bad()));
    let left = parts.next().ok_or_else(bad)??;
    let right = parts.next().transpose()?.unwrap_or(0);
    if parts.next().is_some() {
        return Err(bad());
    }
    Window::from_window_size(left, right)
}

/// A file named relative to the repository (`bench/matrix.json`) wherever the CLI runs from: as
/// given, else under the nearest folder above the current one that has it, else above the
/// binary's (a build inside the repository). For clap's `value_parser`.
pub fn repo_file(arg: &str) -> Result<std::path::PathBuf, String> {
    let path = std::path::PathBuf::from(arg);
    if path.is_file() || path.is_absolute() {
        return Ok(path);
    }
    let cwd = std::env::current_dir().ok();
    let exe = std::env::current_exe().ok();
    let roots = cwd.iter().chain(exe.iter()).flat_map(|d| d.ancestors());
    for root in roots {
        let candidate = root.join(&path);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(format!(
        "no file {arg} in the current folder, the folders above it or above the kvstream binary"
    ))
}

/// A library error about one of the shape flags, naming the flag the user typed (`--len`, not
/// the library's `max_len`); any other error as it is.
pub fn as_flag_error(e: kvstream::Error) -> kvstream::Error {
    match e {
        kvstream::Error::InvalidArgument {
            arg,
            value,
            allowed,
        } => {
            let flag = match arg {
                "batch" => "--batch",
                "hq" => "--hq",
                "hkv" => "--hkv",
                "hq / hkv" => "--hq / --hkv",
                "head_dim" => "--head-dim",
                "max_len" => "--len",
                "q_len" => "--q-len",
                "dtype" => "--dtype",
                "kv_dtype" => "--kv-dtype",
                "page_size" => "--page-size",
                "num_splits" => "--splits",
                "consumer_groups" => "--consumer-groups",
                "reduction" => "--reduction",
                "engine" => "--engine",
                "ring" => "--ring",
                "softcap" => "--softcap",
                "window_size[0] (left)" | "window_size[1] (right)" => "--window",
                other => other,
            };
            kvstream::Error::invalid(flag, value, allowed)
        }
        e => e,
    }
}

impl ShapeArgs {
    /// The validated problem and plan options; errors name the flags.
    pub fn problem(&self) -> kvstream::Result<(DecodeProblem, PlanOptions)> {
        self.problem_unflagged().map_err(as_flag_error)
    }

    fn problem_unflagged(&self) -> kvstream::Result<(DecodeProblem, PlanOptions)> {
        let dtype: DType = self.dtype.parse()?;
        let mut p = DecodeProblem::new(
            self.batch,
            self.hq,
            self.hkv,
            self.head_dim,
            self.len,
            dtype,
        )?
        .with_q_len(self.q_len)?
        .with_kv_dtype(self.kv_dtype.parse()?)?;
        if let Some(page) = self.page_size {
            let pages = self.batch * self.len.div_ceil(page.max(1)) + 3;
            p = p.with_paged(page, pages, None)?;
        }
        if let Some(w) = &self.window {
            p = p.with_window(parse_window(w)?)?;
        }
        p = p.with_softcap(self.softcap)?.with_sinks(self.sinks)?;
        let ring = match &self.ring {
            Some(r) => bench::parse_ring(r)
                .map_err(|e| kvstream::Error::invalid("ring", r, e))?
                .options(),
            None => PlanOptions::default(),
        };
        let opts = PlanOptions {
            num_splits: self.splits,
            consumer_groups: self.consumer_groups,
            reduction: self.reduction.as_deref().map(str::parse).transpose()?,
            device_plan: self.device_plan,
            engine: self.engine.as_deref().map(str::parse).transpose()?,
            persistent_column_lanes: self.column_lanes,
            persistent_head_lanes: self.head_lanes.then_some(true),
            persistent_wide_columns: self.wide_columns,
            persistent_wide_rows: self.wide_rows,
            persistent_ctas: self.ctas,
            ..ring
        };
        Ok((p, opts))
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run one decode on the GPU, check it against the f64 reference, print time and bandwidth.
    /// Without a GPU: say so and run the CPU reference on a small problem.
    Demo {
        #[command(flatten)]
        shape: ShapeArgs,
        /// Timed rounds (each replays one CUDA graph over the whole input pool); at least 7, 0 = check only.
        #[arg(long, default_value_t = 15)]
        rounds: usize,
        /// An MLA decode instead (DeepSeek-V3 class, one latent head of 576; `kvstream mla`
        /// with --batch, --hq, --q-len, --len, --dtype, --kv-dtype and --page-size; --hkv and
        /// --head-dim do not apply).
        #[arg(long)]
        mla: bool,
    },
    /// Compile every kernel variant with NVRTC (or take it from the cache) and print its ptxas
    /// report. Needs NVRTC, not a GPU.
    Kernels {
        /// Also write each raw CUBIN to this directory (for cuobjdump / nvdisasm).
        #[arg(long)]
        dump: Option<std::path::PathBuf>,
        /// Only the variants whose name contains this text (e.g. `d128.n1.t64.s4.g2.paged`).
        #[arg(long)]
        only: Option<String>,
        /// Also every persistent variant with these forced rings (`bench --rings` syntax, e.g.
        /// g1s6p64): compiles what a ring sweep will load.
        #[arg(long, value_delimiter = ',', value_parser = bench::parse_ring)]
        rings: Vec<bench::Ring>,
        /// Variants compiled at once (NVRTC is thread-safe); default: the machine's cores.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
        jobs: Option<u32>,
    },
    /// Run one MLA decode (DeepSeek-V3 class: latent 512 + rope 64) on the GPU, check it
    /// against the f64 reference, time it next to the byte floor of the same bytes.
    Mla(mla::MlaArgs),
    /// Print the plan the library would choose for a shape: engine, kernel variant, grid, splits,
    /// workspace (for GPU 0's SM count; without a GPU, an H200's 132).
    Plan {
        #[command(flatten)]
        shape: ShapeArgs,
    },
    /// Benchmark kvstream over the shape matrix (docs/benchmarking.md): latency, GB/s, byte floor
    /// and read ceiling; writes the results JSON, a table and plots. Needs an H100/H200.
    Bench(bench::BenchArgs),
    /// Re-plot a results file (one SVG + PNG per shape group). No GPU needed.
    Plot {
        /// Results file in docs/benchmarking.md's format.
        results: std::path::PathBuf,
        /// Output directory (default: the results file's directory).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let lib = |r: kvstream::Result<()>| r.map_err(|e| e.to_string());
    let result = match cli.command {
        Command::Demo { shape, rounds, mla } if mla => lib(mla::demo(&shape, rounds)),
        Command::Demo { shape, rounds, .. } => lib(demo::run(&shape, rounds)),
        Command::Kernels {
            dump,
            only,
            rings,
            jobs,
        } => {
            let jobs = jobs.map_or_else(
                || std::thread::available_parallelism().map_or(1, |n| n.get()),
                |j| j as usize,
            );
            lib(kernels(dump.as_deref(), only.as_deref(), &rings, jobs))
        }
        Command::Mla(args) => lib(mla::run(&args)),
        Command::Plan { shape } => lib(print_plan(&shape)),
        Command::Bench(args) => bench::run(&args),
        Command::Plot { results, out } => replot(&results, out.as_deref()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn kernels(
    dump: Option<&std::path::Path>,
    only: Option<&str>,
    rings: &[bench::Ring],
    jobs: usize,
) -> kvstream::Result<()> {
    let mut variants = all_variants();
    for v in all_variants() {
        if let kvstream::kernels::AnyVariant::Persistent(pv) = v {
            for r in rings {
                // a ring that does not fit this variant is skipped: it cannot be planned either
                if let Ok(f) = kvstream::plan::persistent_variant_forced(pv, &r.options()) {
                    let f = kvstream::kernels::AnyVariant::Persistent(f);
                    if !variants.contains(&f) {
                        variants.push(f);
                    }
                }
            }
        }
    }
    if let Some(text) = only {
        variants.retain(|v| v.as_variant().name().contains(text));
        if variants.is_empty() {
            return Err(kvstream::Error::invalid(
                "--only",
                text,
                "text found in a variant's name (e.g. `decode_mla`, `d128.n1`; `kvstream kernels` lists them all)",
            ));
        }
    }
    let (major, minor) = jit::compile::nvrtc_version()?;
    println!(
        "NVRTC {major}.{minor}, target {}, cache {}",
        jit::ARCH,
        jit::cache::cache_dir().display()
    );
    println!(
        "{:<36} {:>6} {:>6} {:>7} {:>7} {:>9}  source",
        "variant", "regs", "stack", "spill_st", "spill_ld", "smem_dyn"
    );
    // compiled `jobs` at a time, reported in the list's order
    let done = jit::par_map(&variants, jobs, |v| {
        let t = Instant::now();
        (jit::cubin(v.as_variant()), t.elapsed())
    });
    let mut failures = 0;
    for (&v, (result, took)) in variants.iter().zip(done) {
        let var = v.as_variant();
        match result {
            Ok((c, origin)) => {
                let r = c.report();
                if let Some(dir) = dump {
                    let path = dir.join(format!("{}.cubin", var.name()));
                    std::fs::create_dir_all(dir)
                        .and_then(|_| std::fs::write(&path, &c.cubin))
                        .map_err(|e| {
                            kvstream::Error::Cache(format!("cannot write {}: {e}", path.display()))
                        })?;
                }
                let dyn_smem = match v {
                    kvstream::kernels::AnyVariant::Persistent(d) => d.shared_bytes(),
                    kvstream::kernels::AnyVariant::Decode(d) => d.shared_bytes(),
                    kvstream::kernels::AnyVariant::Mla(d) => d.shared_bytes(),
                    kvstream::kernels::AnyVariant::Combine(_)
                    | kvstream::kernels::AnyVariant::StreamRead(_)
                    | kvstream::kernels::AnyVariant::PlanWork(_)
                    | kvstream::kernels::AnyVariant::StoreKv(_)
                    | kvstream::kernels::AnyVariant::MergeStates(_) => 0,
                };
                println!(
                    "{:<36} {:>6} {:>6} {:>8} {:>8} {:>9}  {:?} {:.1}s",
                    var.name(),
                    r.registers,
                    r.stack_bytes,
                    r.spill_stores,
                    r.spill_loads,
                    dyn_smem,
                    origin,
                    took.as_secs_f64()
                );
            }
            Err(e) => {
                failures += 1;
                println!("{:<36} FAILED: {e}", var.name());
            }
        }
    }
    if failures > 0 {
        return Err(kvstream::Error::Compile {
            variant: format!("{failures} variant(s)"),
            options: vec![],
            log: "see above".into(),
        });
    }
    Ok(())
}

fn replot(path: &std::path::Path, out: Option<&std::path::Path>) -> Result<(), String> {
    let r = results::BenchResults::load(path)?;
    let dir = out
        .map(std::path::Path::to_path_buf)
        .or_else(|| path.parent().map(std::path::Path::to_path_buf))
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or_else(|| ".".into());
    let w = plot::plot_results(&r, &dir, &bench::plot_prefix(path))?;
    for f in &w.files {
        println!("{}", f.display());
    }
    Ok(())
}

/// The device facts to plan for: GPU 0's when there is one, else an H200's (and which).
fn planning_device() -> (DeviceFacts, String) {
    match kvstream::Runtime::new(0) {
        Ok(rt) => (rt.facts(), format!("GPU 0 ({} SMs)", rt.facts().sm_count)),
        Err(_) => (
            DeviceFacts::H200,
            format!(
                "no usable GPU here: an H200's {} SMs",
                DeviceFacts::H200.sm_count
            ),
        ),
    }
}

fn print_plan(shape: &ShapeArgs) -> kvstream::Result<()> {
    use kvstream::kernels::Variant;
    use kvstream::plan::Plan;
    let (p, opts) = shape.problem()?;
    let (facts, device) = planning_device();
    let pl = choose(&p, facts, opts)?;
    let cache = match p.kv_dtype {
        kvstream::KvDType::AsQuery => p.dtype.name().to_string(),
        kvstream::KvDType::Fp8E4m3 => "fp8 e4m3".to_string(),
    };
    let paging = p.paged.as_ref().map_or("contiguous".to_string(), |g| {
        format!("pages of {} ({} pages)", g.page_size, g.num_pages)
    });
    println!(
        "problem: batch {}, {}/{} heads, head dim {}, L {}, q_len {}, q {}, cache {cache}, {paging}",
        p.batch, p.hq, p.hkv, p.head_dim, p.max_len, p.q_len, p.dtype.name()
    );
    println!("planned for: {device}");
    match &pl {
        Plan::Persistent(pp) => {
            let (.., workspace) = pp.workspace_offsets(&p);
            println!("engine: persistent (work split among the CTAs on the GPU from the lengths, at every call)");
            println!(
                "kernel: {} (kvstream kernels --only {})",
                pp.variant.name(),
                pp.variant.name()
            );
            println!(
                "grid: {} CTAs, {} column block(s) per KV head, at least {} tiles a working CTA, PDL {}",
                pp.grid,
                pp.col_blocks,
                pp.min_tiles_per_cta,
                if pp.pdl { "on" } else { "off" }
            );
            println!("shared memory: {} bytes a CTA", pp.variant.shared_bytes());
            println!("workspace: {workspace} bytes");
        }
        Plan::Split(dp) => {
            println!("engine: split ({})", pl.mode());
            println!(
                "kernel: {} (kvstream kernels --only {})",
                dp.decode.name(),
                dp.decode.name()
            );
            if let Some(c) = &dp.combine {
                println!("merge: {}", c.name());
            }
            match &dp.device_plan {
                Some(d) => println!(
                    "splits: planned on the GPU at every call from the lengths (aiming at {} CTAs; grid {}, {} partial slots)",
                    d.target, d.grid, d.slots
                ),
                None => println!("splits: {} a request (from L; merged by {})", dp.num_splits, dp.reduction.name()),
            }
            if kvstream::plan::cluster_merge_checked(dp, &opts) {
                println!(
                    "  (a decoder merges by kernel instead where the GPU cannot hold all {} clusters at once: docs/tuning.md, \"Cluster waves\")",
                    dp.clusters()
                );
            }
            println!("grid: {} x {} x {}", dp.grid[0], dp.grid[1], dp.grid[2]);
            println!("shared memory: {} bytes a CTA", dp.decode_shared_bytes);
            println!("workspace: {} bytes", dp.workspace.bytes());
        }
    }
    Ok(())
}
