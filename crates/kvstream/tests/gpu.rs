//! GPU correctness suite: every test launches the real kernels on an H100/H200 and checks them
//! against the f64 CPU reference of [`kvstream::reference`].
//!
//! - `random_cases_match_reference`: a few hundred seeded random decodes (lengths 1 to 131072,
//!   groups 1 to 32, bf16 and f16, d 64 and 128, ragged and zero lengths, forced and heuristic
//!   split counts, with and without LSE, custom softmax scales). Outputs are poisoned with NaN
//!   before every run, so an element the kernels forget to write fails; K/V positions past a
//!   request's length hold NaN, so a read past the length fails; every case runs twice and must
//!   be bitwise reproducible.
//! - `graph_capture_replays_with_new_lengths`: a CUDA graph captured once replays with new
//!   `cache_seqlens` written into the same device buffer and matches eager runs bit for bit.
//! - `pdl_on_and_off_agree`: programmatic dependent launch changes timing, never results.
//! - `bad_pointers_are_rejected`: null, misaligned, host and too-short arguments are refused by
//!   name, a dtype mismatch is refused, and a refused call writes nothing.
//! - `zero_length_batch_gives_zeros_and_neg_inf`: all requests empty, with and without splits.
//! - `stale_hints_before_the_pdl_wait_are_not_used`: a kernel that lets the decode launch and
//!   then rewrites its block table and lengths; the decode uses the new ones.
//! - `fp8_cases_match_reference`: e4m3 caches with scales of every layout, contiguous and
//!   paged (every page size, both producers), ragged and zero lengths, multi-token, LSE, q in
//!   bf16 and f16, against the reference on the dequantised values; each case twice, bitwise
//!   (`KVSTREAM_GPU_CASES` below its default runs the first shapes only).
//! - `fp8_graph_replays_with_new_scales_and_lengths`: one captured graph, new scale values and
//!   lengths written between replays, equal to eager runs and to the reference.
//! - `store_kv_writes_exactly_the_slots_given`: the cache write into contiguous and paged,
//!   fp8 and 2-byte caches, every scale layout, skipped slots and saturating values, checked
//!   byte for byte (eager, then a graph replayed with other slots).
//! - `mla_*` (tests/gpu/mla.rs): the MLA decode against its f64 reference, under graphs with
//!   skewed lengths, and its input checks.
//! - `models::*` (tests/gpu/models.rs): head dims 96 and 256, sliding windows, softcap and
//!   attention sinks, alone and combined with pages, e4m3, ragged and multi-token decode
//!   (`KVSTREAM_MODEL_CASES`, default 96 or `KVSTREAM_GPU_CASES` if fewer), under graphs too.
//! - `views_of_a_growing_cache_share_one_decoder`: a decoder made for a cache's capacity reads
//!   views of its first positions (`DecodeTensors::view_len`), on both engines.
//! - `merge::*` (tests/gpu/merge.rs): the state merge against its f64 model and under a graph,
//!   and a decode cut into shards of one cache, merged, against the whole decode.
//!
//! Every test is ignored, so `cargo test` on a machine without a GPU lists them and moves on. On
//! an H100/H200 (NVRTC 13 on the library path, see `scripts/test.sh`):
//!
//! ```text
//! cargo test -p kvstream --release --test gpu -- --ignored --test-threads=1
//! ```
//!
//! Add `--nocapture` to see the summaries. Knobs of the random test: `KVSTREAM_GPU_CASES`
//! (default 300; use a handful under `compute-sanitizer`), `KVSTREAM_GPU_SEED` (decimal or
//! `0x` hex) and `KVSTREAM_GPU_SUMMARY` (a path: a JSON summary is written there).
//! `KVSTREAM_GPU_SERIALISED=1` (set under `compute-sanitizer`, which runs kernels one at a time)
//! lets the stale-hint test run without the PDL overlap it otherwise requires. A GPU that
//! cannot be opened is a test failure, never a skip.

use std::collections::BTreeMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use half::{bf16, f16};
use kvstream::plan::{
    cluster_splits, device_plan_cluster_splits, device_plan_splits, tile_tokens, CLUSTER_SPLITS,
};
use kvstream::reference::{
    decode_reference, decode_reference_with, random_bf16, random_f16, relative_error, RefOutput,
    RefScoreMods, RefShape, SplitMix64,
};
use kvstream::{
    DType, DecodeProblem, DecodeTensors, Decoder, E4m3, Element, Error, KvDType, KvScale,
    KvScaleLayout, PlanOptions, Reduction, Runtime,
};

/// Largest accepted `||out - ref|| / ||ref||` of one (request, head) row. bf16 rounding of the
/// output and of P alone gives ~2e-3.
const REL_TOL: f64 = 1e-2;
/// Largest accepted `|lse - ref|` (natural log); the kernels keep the statistics in f32.
const LSE_TOL: f64 = 1e-3;
/// Bit pattern written over outputs (and K/V positions that must never be read): a NaN in both
/// bf16 and f16.
const POISON: u16 = 0xFFFF;
/// Default seed of the random test ("kvstream" in ASCII).
const DEFAULT_SEED: u64 = 0x6B76_7374_7265_616D;
const DEFAULT_CASES: u64 = 300;
/// The random test stops early after this many failing cases (a sticky CUDA error fails every
/// later case; listing them all would only cost time).
const MAX_FAILURES: usize = 50;

// ---------------------------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------------------------

/// The two element types, as the tests need them: random data and raw bits (widening is
/// `Element::to_f64`).
trait Half: Element + ValidAsZeroBits + Copy + 'static {
    /// `n` values uniform in [-1, 1), and the same values widened for the reference.
    fn random(rng: &mut SplitMix64, n: usize) -> (Vec<Self>, Vec<f32>);
    fn from_raw(bits: u16) -> Self;
    fn raw(self) -> u16;
    /// The smallest positive normal value: below it the format keeps no relative precision.
    const MIN_NORMAL: f64;
}

macro_rules! impl_half {
    ($t:ty, $random:ident) => {
        impl Half for $t {
            fn random(rng: &mut SplitMix64, n: usize) -> (Vec<Self>, Vec<f32>) {
                $random(rng, n, 1.0)
            }
            fn from_raw(bits: u16) -> Self {
                <$t>::from_bits(bits)
            }
            fn raw(self) -> u16 {
                self.to_bits()
            }
            const MIN_NORMAL: f64 = <$t>::MIN_POSITIVE.to_f64_const();
        }
    };
}
impl_half!(bf16, random_bf16);
impl_half!(f16, random_f16);

// ---------------------------------------------------------------------------------------------
// Host data, device buffers, runs
// ---------------------------------------------------------------------------------------------

/// Opens GPU 0; any failure is a test failure (these tests only run when asked for).
fn open_gpu() -> (Arc<Runtime>, Arc<CudaStream>) {
    let rt = Runtime::new(0)
        .unwrap_or_else(|e| panic!("cannot open GPU 0 (the GPU tests need an H100/H200): {e}"));
    let stream = rt.context().default_stream();
    (rt, stream)
}

/// GPU 0 with a stream of its own and cudarc's automatic event tracking off: tracking would
/// make slice accesses record and wait on events on the legacy default stream (where
/// `Decoder::new` puts the workspace), also while the stream is being captured. The graph
/// tests order their one stream by hand instead.
fn open_gpu_own_stream() -> (Arc<Runtime>, Arc<CudaStream>) {
    let (rt, _) = open_gpu();
    let ctx = rt.context().clone();
    // SAFETY: the callers run everything on the returned stream, synchronised explicitly
    // where it matters.
    unsafe { ctx.disable_event_tracking() };
    (rt, ctx.new_stream().expect("creating a stream"))
}

/// A graph of what `enqueue` launches on `stream` (the capture ends before an error is
/// reported, so that a failure leaves the stream usable).
fn capture_graph(
    stream: &Arc<CudaStream>,
    enqueue: impl FnOnce() -> kvstream::Result<()>,
) -> Result<cudarc::driver::CudaGraph, String> {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| format!("beginning the capture: {e}"))?;
    let captured = enqueue();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    captured.map_err(|e| format!("enqueueing during the capture: {e}"))?;
    graph
        .map_err(|e| format!("ending the capture / instantiating the graph: {e}"))?
        .ok_or_else(|| "the capture recorded no work".to_string())
}

fn make_decoder(rt: &Arc<Runtime>, p: &DecodeProblem, opts: PlanOptions) -> Decoder {
    Decoder::new(rt, p.clone(), opts).unwrap_or_else(|e| panic!("Decoder::new({p:?}): {e}"))
}

fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, host: &[T]) -> CudaSlice<T> {
    stream
        .clone_htod(host)
        .unwrap_or_else(|e| panic!("uploading {} elements: {e}", host.len()))
}

fn download<T: DeviceRepr>(stream: &Arc<CudaStream>, dev: &CudaSlice<T>) -> Vec<T> {
    stream
        .clone_dtoh(dev)
        .unwrap_or_else(|e| panic!("downloading {} elements: {e}", dev.len()))
}

fn overwrite<T: DeviceRepr>(stream: &Arc<CudaStream>, host: &[T], dev: &mut CudaSlice<T>) {
    stream
        .memcpy_htod(host, dev)
        .unwrap_or_else(|e| panic!("copying {} elements to the device: {e}", host.len()));
}

fn lens_i32(lens: &[usize]) -> Vec<i32> {
    lens.iter().map(|&l| l as i32).collect()
}

/// Host copies of one problem's inputs: the bits to upload and the same values widened to f32
/// for the reference.
struct Inputs<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    q32: Vec<f32>,
    k32: Vec<f32>,
    v32: Vec<f32>,
    /// One logit per query head where the problem has sinks.
    sinks: Option<Vec<f32>>,
}

/// Random sink logits in [-3, 3): of the order of the scores, so they move the outputs.
fn random_sinks(rng: &mut SplitMix64, hq: usize) -> Vec<f32> {
    (0..hq).map(|_| rng.symmetric() * 3.0).collect()
}

/// Random Q; K and V random at positions `< lens[b]` and NaN from there to `max_len`: the
/// kernels must never read a position past a request's length, and a NaN read there would
/// reach the output (0 * NaN is NaN in the P.V product).
fn make_inputs<T: Half>(rng: &mut SplitMix64, p: &DecodeProblem, lens: &[usize]) -> Inputs<T> {
    let (q, q32) = T::random(rng, p.batch * p.q_len * p.hq * p.head_dim);
    let (k, k32) = random_cache::<T>(rng, p, lens);
    let (v, v32) = random_cache::<T>(rng, p, lens);
    let sinks = p.sinks.then(|| random_sinks(rng, p.hq));
    Inputs {
        q,
        k,
        v,
        q32,
        k32,
        v32,
        sinks,
    }
}

fn random_cache<T: Half>(
    rng: &mut SplitMix64,
    p: &DecodeProblem,
    lens: &[usize],
) -> (Vec<T>, Vec<f32>) {
    let per_token = p.hkv * p.head_dim;
    let total = p.batch * p.max_len * per_token;
    let (mut bits, mut wide) = (Vec::with_capacity(total), Vec::with_capacity(total));
    for &len in lens {
        let (b, w) = T::random(rng, len * per_token);
        bits.extend(b);
        wide.extend(w);
        let tail = (p.max_len - len) * per_token;
        bits.extend(std::iter::repeat(T::from_raw(POISON)).take(tail));
        wide.extend(std::iter::repeat(f32::NAN).take(tail));
    }
    (bits, wide)
}

fn reference<T>(p: &DecodeProblem, x: &Inputs<T>, lens: &[usize]) -> RefOutput {
    let mods = ref_mods(p, x.sinks.as_deref());
    decode_reference_with(&RefShape::from(p), &mods, &x.q32, &x.k32, &x.v32, lens)
}

/// The reference's view of the problem's score modifiers, with the sinks given.
fn ref_mods(p: &DecodeProblem, sinks: Option<&[f32]>) -> RefScoreMods {
    RefScoreMods {
        window: p.window,
        softcap: p.softcap.map(f64::from),
        sinks: sinks.map(|s| s.iter().map(|&x| f64::from(x)).collect()),
    }
}

/// A paged copy of contiguous caches: the pools and the block table.
struct Paged<T> {
    k: Vec<T>,
    v: Vec<T>,
    table: Vec<i32>,
}

/// Scatters the contiguous caches of `x` into pools of `p`'s page size, pages in a random order
/// with spare pages between them. Table entries past a request's last page point at random
/// pages of other requests (finite data the kernels must not use); positions past the length
/// inside a request's last page keep the NaN poison.
fn page_inputs<T: Half>(rng: &mut SplitMix64, p: &DecodeProblem, x: &Inputs<T>) -> Paged<T> {
    let (k, v, table) = scatter_pages(rng, p, &x.k, &x.v, T::from_raw(POISON));
    Paged { k, v, table }
}

/// Pages a paged problem needs: every request's pages plus a few spare ones.
fn pool_pages(batch: usize, max_len: usize, page_size: usize) -> usize {
    batch * max_len.div_ceil(page_size) + 3
}

/// Inputs on the device. `seqlens` is `None` when every request has `max_len` tokens; for a
/// paged problem `k` and `v` are the pools and `table` the block table.
struct DeviceInputs<T> {
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    seqlens: Option<CudaSlice<i32>>,
    table: Option<CudaSlice<i32>>,
    sinks: Option<CudaSlice<f32>>,
}

impl<T: Half> DeviceInputs<T> {
    fn upload(stream: &Arc<CudaStream>, x: &Inputs<T>, seqlens: Option<&[usize]>) -> Self {
        DeviceInputs {
            q: upload(stream, &x.q),
            k: upload(stream, &x.k),
            v: upload(stream, &x.v),
            seqlens: seqlens.map(|l| upload(stream, &lens_i32(l))),
            table: None,
            sinks: x.sinks.as_ref().map(|s| upload(stream, s)),
        }
    }

    fn upload_paged(
        stream: &Arc<CudaStream>,
        x: &Inputs<T>,
        paged: &Paged<T>,
        seqlens: Option<&[usize]>,
    ) -> Self {
        DeviceInputs {
            q: upload(stream, &x.q),
            k: upload(stream, &paged.k),
            v: upload(stream, &paged.v),
            seqlens: seqlens.map(|l| upload(stream, &lens_i32(l))),
            table: Some(upload(stream, &paged.table)),
            sinks: x.sinks.as_ref().map(|s| upload(stream, s)),
        }
    }
}

/// Output buffers on the device.
struct Outputs<T> {
    out: CudaSlice<T>,
    lse: Option<CudaSlice<f32>>,
}

/// Outputs read back to the host.
struct Output<T> {
    out: Vec<T>,
    lse: Option<Vec<f32>>,
}

impl<T: Half> Outputs<T> {
    fn new(stream: &Arc<CudaStream>, p: &DecodeProblem, with_lse: bool) -> Self {
        let rows = p.batch * p.q_len * p.hq;
        let alloc = "allocating outputs";
        Outputs {
            out: stream.alloc_zeros::<T>(rows * p.head_dim).expect(alloc),
            lse: with_lse.then(|| stream.alloc_zeros::<f32>(rows).expect(alloc)),
        }
    }

    /// NaN everywhere, so that whatever the next run does not write is caught.
    fn poison(&mut self, stream: &Arc<CudaStream>) {
        overwrite(
            stream,
            &vec![T::from_raw(POISON); self.out.len()],
            &mut self.out,
        );
        if let Some(lse) = &mut self.lse {
            overwrite(stream, &vec![f32::NAN; lse.len()], lse);
        }
    }

    fn read(&self, stream: &Arc<CudaStream>) -> Output<T> {
        Output {
            out: download(stream, &self.out),
            lse: self.lse.as_ref().map(|l| download(stream, l)),
        }
    }
}

/// Raw pointers of the buffers, for the unsafe `Decoder::run`.
fn raw_tensors<T: Half>(
    stream: &Arc<CudaStream>,
    x: &DeviceInputs<T>,
    o: &mut Outputs<T>,
) -> DecodeTensors {
    let (q, _) = x.q.device_ptr(stream);
    let (k, _) = x.k.device_ptr(stream);
    let (v, _) = x.v.device_ptr(stream);
    let (out, _) = o.out.device_ptr_mut(stream);
    DecodeTensors {
        q,
        k,
        v,
        out,
        lse: o.lse.as_mut().map(|l| l.device_ptr_mut(stream).0),
        seqlens: x.seqlens.as_ref().map(|s| s.device_ptr(stream).0),
        block_table: x.table.as_ref().map(|t| t.device_ptr(stream).0),
        k_scale: None,
        v_scale: None,
        sinks: x.sinks.as_ref().map(|s| s.device_ptr(stream).0),
        view_len: None,
    }
}

/// Poisons the outputs, runs one decode through the safe API, waits and reads back.
fn run_poisoned<T: Half>(
    stream: &Arc<CudaStream>,
    dec: &Decoder,
    x: &DeviceInputs<T>,
    o: &mut Outputs<T>,
) -> Result<Output<T>, String> {
    o.poison(stream);
    match (&x.table, &x.sinks) {
        (table, Some(sinks)) => dec.run_slices_with_sinks(
            stream,
            &x.q,
            &x.k,
            &x.v,
            &mut o.out,
            o.lse.as_mut(),
            x.seqlens.as_ref(),
            table.as_ref(),
            None,
            sinks,
        ),
        (None, None) => dec.run_slices(
            stream,
            &x.q,
            &x.k,
            &x.v,
            &mut o.out,
            o.lse.as_mut(),
            x.seqlens.as_ref(),
        ),
        (Some(table), None) => dec.run_paged_slices(
            stream,
            &x.q,
            &x.k,
            &x.v,
            &mut o.out,
            o.lse.as_mut(),
            x.seqlens.as_ref(),
            table,
        ),
    }
    .map_err(|e| format!("run_slices refused a valid call: {e}"))?;
    // Kernel faults surface here, with a message that says so.
    stream
        .synchronize()
        .map_err(|e| format!("the decode failed on the GPU: {e}"))?;
    Ok(o.read(stream))
}

// ---------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------

/// Largest errors of one checked output.
#[derive(Clone, Copy, Debug, Default)]
struct Errors {
    rel: f64,
    lse: f64,
}

/// `relative_error` of a row whose reference may lie below the output format's normal range
/// (a row whose sink takes nearly all of the weight): errors are measured against at least
/// `min_normal` per element, the format's resolution there.
fn relative_error_above(got: &[f64], want: &[f64], min_normal: f64) -> f64 {
    let norm = want.iter().map(|x| x * x).sum::<f64>().sqrt();
    let floor = min_normal * (want.len() as f64).sqrt();
    if norm >= floor {
        return relative_error(got, want);
    }
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt();
    if diff.is_nan() {
        f64::INFINITY
    } else {
        diff / floor
    }
}

/// Checks `got` against the reference row by row: every element written (no poison left), each
/// non-empty row within [`REL_TOL`], empty rows exactly 0 with LSE -inf, LSE within [`LSE_TOL`].
fn check_output<T: Half>(
    p: &DecodeProblem,
    got: &Output<T>,
    want: &RefOutput,
) -> Result<Errors, String> {
    let d = p.head_dim;
    let at = |row: usize| {
        format!(
            "request {} token {} head {}",
            row / p.hq / p.q_len,
            row / p.hq % p.q_len,
            row % p.hq
        )
    };
    if let Some(i) = got.out.iter().position(|x| x.to_f64().is_nan()) {
        return Err(format!(
            "out of {} element {} is NaN (bits {:#06x}): never written, or a NaN computed",
            at(i / d),
            i % d,
            got.out[i].raw()
        ));
    }
    let mut errors = Errors::default();
    for row in 0..p.batch * p.q_len * p.hq {
        let out: Vec<f64> = got.out[row * d..(row + 1) * d]
            .iter()
            .map(|x| x.to_f64())
            .collect();
        let want_lse = want.lse[row];
        if want_lse == f64::NEG_INFINITY {
            if let Some(x) = out.iter().find(|&&x| x != 0.0) {
                return Err(format!(
                    "{} has length 0, yet out holds {x} (must be exactly 0)",
                    at(row)
                ));
            }
        } else {
            let rel = relative_error_above(&out, &want.out[row * d..(row + 1) * d], T::MIN_NORMAL);
            errors.rel = errors.rel.max(rel);
            if rel.is_nan() || rel > REL_TOL {
                return Err(format!(
                    "{}: relative error {rel:.3e} > {REL_TOL:e}",
                    at(row)
                ));
            }
        }
        if let Some(lse) = &got.lse {
            let g = f64::from(lse[row]);
            if want_lse == f64::NEG_INFINITY {
                if g != f64::NEG_INFINITY {
                    return Err(format!("{}: lse {g}, want -inf (length 0)", at(row)));
                }
            } else {
                let err = (g - want_lse).abs();
                errors.lse = errors.lse.max(err);
                if err.is_nan() || err > LSE_TOL {
                    return Err(format!(
                        "{}: lse {g}, reference {want_lse} (error {err:.3e} > {LSE_TOL:e})",
                        at(row)
                    ));
                }
            }
        }
    }
    Ok(errors)
}

/// `Ok` when both outputs hold the same bits (out and LSE).
fn same_bits<T: Half>(a: &Output<T>, b: &Output<T>, what: &str) -> Result<(), String> {
    if let Some(i) = a
        .out
        .iter()
        .zip(&b.out)
        .position(|(x, y)| x.raw() != y.raw())
    {
        return Err(format!(
            "{what}: out[{i}] differs ({:#06x} vs {:#06x})",
            a.out[i].raw(),
            b.out[i].raw()
        ));
    }
    if let (Some(la), Some(lb)) = (&a.lse, &b.lse) {
        if let Some(i) = la
            .iter()
            .zip(lb)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            return Err(format!("{what}: lse[{i}] differs ({} vs {})", la[i], lb[i]));
        }
    }
    Ok(())
}

/// The argument a refused call names; panics if the call was accepted or failed otherwise.
fn rejected_arg(r: kvstream::Result<()>, call: &str) -> &'static str {
    match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        Err(other) => panic!("{call}: expected InvalidArgument, got {other}"),
        Ok(()) => panic!("{call}: accepted, must be refused"),
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Random cases
// ---------------------------------------------------------------------------------------------

const LENS: [usize; 7] = [1, 7, 63, 64, 65, 1000, 4097];
const LONG_LEN: usize = 131_072;
const GROUPS: [usize; 9] = [1, 2, 4, 5, 7, 8, 12, 16, 32];

/// One drawn case; everything needed to rerun it.
#[derive(Clone, Debug)]
struct Case {
    index: usize,
    data_seed: u64,
    dtype: DType,
    batch: usize,
    hq: usize,
    hkv: usize,
    head_dim: usize,
    max_len: usize,
    /// `None`: no `cache_seqlens`, every request has `max_len` tokens.
    lens: Option<Vec<usize>>,
    splits: Option<usize>,
    lse: bool,
    scale: Option<f32>,
    /// New tokens per request (multi-token decode when > 1).
    q_len: usize,
    /// `Some(page size)`: the cache is paged (shuffled pages).
    page_size: Option<usize>,
}

impl Case {
    fn draw(index: usize, rng: &mut SplitMix64) -> Case {
        // 131072 about once in 12 cases, with one request and at most 16 query heads: the f64
        // reference costs ~1 s for it already.
        let long = rng.below(12) == 0;
        let max_len = if long {
            LONG_LEN
        } else {
            LENS[rng.below(LENS.len())]
        };
        let (group, hkv) = loop {
            let g = GROUPS[rng.below(GROUPS.len())];
            let hkv = 1 + rng.below(4);
            if !long || g * hkv <= 16 {
                break (g, hkv);
            }
        };
        let batch = match max_len {
            LONG_LEN => 1,
            l if l >= 4096 => 1 + rng.below(2),
            _ => 1 + rng.below(4),
        };
        let dtype = if rng.below(2) == 0 {
            DType::Bf16
        } else {
            DType::F16
        };
        let head_dim = if rng.below(2) == 0 { 64 } else { 128 };
        let lens = (rng.below(2) == 0).then(|| {
            if rng.below(16) == 0 {
                vec![0; batch] // the all-empty family
            } else {
                (0..batch)
                    .map(|_| match rng.below(8) {
                        0 => 0,
                        1 => max_len,
                        _ => rng.below(max_len + 1),
                    })
                    .collect()
            }
        });
        let splits = (rng.below(4) != 0).then(|| 1 + rng.below(64));
        let lse = rng.below(4) != 0;
        let scale = (rng.below(5) == 0).then(|| (0.01 + 0.99 * rng.uniform()) as f32);
        let q_len = if rng.below(3) == 0 {
            2 + rng.below(7)
        } else {
            1
        };
        let page_size =
            (rng.below(3) == 0).then(|| kvstream::problem::SUPPORTED_PAGE_SIZES[rng.below(10)]);
        Case {
            index,
            data_seed: rng.next_u64(),
            dtype,
            batch,
            hq: group * hkv,
            hkv,
            head_dim,
            max_len,
            lens,
            splits,
            lse,
            scale,
            q_len,
            page_size,
        }
    }

    fn problem(&self) -> Result<DecodeProblem, String> {
        let p = DecodeProblem::new(
            self.batch,
            self.hq,
            self.hkv,
            self.head_dim,
            self.max_len,
            self.dtype,
        );
        let p = match self.scale {
            Some(s) => p.and_then(|p| p.with_softmax_scale(s)),
            None => p,
        };
        let p = p.and_then(|p| p.with_q_len(self.q_len));
        let p = match self.page_size {
            Some(ps) => {
                p.and_then(|p| p.with_paged(ps, pool_pages(self.batch, self.max_len, ps), None))
            }
            None => p,
        };
        p.map_err(|e| format!("DecodeProblem refused a valid shape: {e}"))
    }

    fn lens(&self) -> Vec<usize> {
        self.lens
            .clone()
            .unwrap_or_else(|| vec![self.max_len; self.batch])
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "case {} ({}, batch {}, q_len {}, pages {}, hq {}, hkv {}, d {}, L {}, lens {}, splits {}, lse {}, scale {})",
            self.index,
            self.dtype.name(),
            self.batch,
            self.q_len,
            match self.page_size {
                Some(s) => s.to_string(),
                None => "contiguous".into(),
            },
            self.hq,
            self.hkv,
            self.head_dim,
            self.max_len,
            match &self.lens {
                Some(l) => format!("{l:?}"),
                None => "none (all L)".into(),
            },
            match self.splits {
                Some(s) => s.to_string(),
                None => "heuristic".into(),
            },
            if self.lse { "on" } else { "off" },
            match self.scale {
                Some(s) => s.to_string(),
                None => "default".into(),
            },
        )
    }
}

/// What one passing case contributes to the summary.
struct CaseResult {
    errors: Errors,
    splits: usize,
}

/// For a persistent decoder built with `record_schedule`: the pieces each CTA streamed at the
/// last call are the ones the Rust model of schedule.cuh gives for these lengths.
fn check_schedule(
    stream: &Arc<CudaStream>,
    dec: &Decoder,
    p: &DecodeProblem,
    lens: &[usize],
) -> Result<(), String> {
    let Some(kvstream::plan::Plan::Persistent(pp)) = Some(dec.plan()) else {
        return Ok(());
    };
    let Some(got) = dec.last_schedule(stream).map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let clamped: Vec<usize> = lens.iter().map(|&l| l.min(p.max_len)).collect();
    let window = kvstream::schedule::TileWindow {
        q_len: p.q_len,
        left: p.window.left,
        granularity: kvstream::schedule::tile_granularity(
            p.paged.map(|pg| pg.page_size),
            pp.variant.tile_tokens,
        ),
    };
    let (_, want) = kvstream::schedule::pieces_in_lanes(
        &clamped,
        window,
        // units of the kernel's view (paired heads: one per pair)
        pp.kernel_problem(p).hkv * pp.col_blocks,
        pp.lanes,
        pp.variant.tile_tokens,
        pp.grid,
        pp.min_tiles_per_cta,
    );
    same_schedule(&got, &want, lens)
}

/// The pieces a kernel recorded per CTA (`got`, every CTA of the grid) are the model's (`want`,
/// the working CTAs; the others record none), up to the log's capacity.
fn same_schedule(
    got: &[Vec<kvstream::schedule::Piece>],
    want: &[Vec<kvstream::schedule::Piece>],
    lens: &[usize],
) -> Result<(), String> {
    let logged = |c: usize| -> Vec<(usize, usize, usize, usize)> {
        let none = Vec::new();
        want.get(c)
            .unwrap_or(&none)
            .iter()
            .take(kvstream::params::SCHEDULE_LOG_PIECES)
            .map(|x| (x.batch, x.unit, x.first, x.end))
            .collect()
    };
    for (c, pieces) in got.iter().enumerate() {
        let g: Vec<_> = pieces
            .iter()
            .map(|x| (x.batch, x.unit, x.first, x.end))
            .collect();
        if g != logged(c) {
            return Err(format!(
                "schedule of CTA {c}: kernel {g:?}, model {:?} (lengths {lens:?})",
                logged(c)
            ));
        }
    }
    Ok(())
}

fn run_case(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    case: &Case,
) -> Result<CaseResult, String> {
    match case.dtype {
        DType::Bf16 => run_case_as::<bf16>(rt, stream, case),
        DType::F16 => run_case_as::<f16>(rt, stream, case),
    }
}

fn run_case_as<T: Half>(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    case: &Case,
) -> Result<CaseResult, String> {
    let p = case.problem()?;
    // Alternate the consumer-warp layouts, ring depths and reduction modes over the cases; a
    // cluster holds a power of two of splits, at most MAX_CLUSTER_SPLITS.
    // One case in six is planned on the device instead (one in twelve with cluster reduction).
    // Even cases run the persistent engine (default options), recording its schedule.
    let persistent = case.index % 2 == 0;
    let cluster = case.index % 4 == 3;
    let device_plan = case.index % 6 == 5;
    let opts = if persistent {
        PlanOptions {
            engine: Some(kvstream::Engine::Persistent),
            record_schedule: true,
            ..Default::default()
        }
    } else {
        PlanOptions {
            num_splits: if device_plan {
                None
            } else if cluster {
                case.splits.map(cluster_splits)
            } else {
                case.splits
            },
            consumer_groups: (p.columns() <= 16).then_some(1 + case.index % 2),
            stages: (case.index % 3 == 0).then_some(2),
            reduction: cluster.then_some(Reduction::Cluster),
            device_plan,
            ..Default::default()
        }
    };
    let dec = Decoder::new(rt, p.clone(), opts).map_err(|e| format!("Decoder::new: {e}"))?;
    let lens = case.lens();
    let mut rng = SplitMix64::new(case.data_seed);
    let x = make_inputs::<T>(&mut rng, &p, &lens);
    let dev = match p.paged {
        None => DeviceInputs::upload(stream, &x, case.lens.as_deref()),
        Some(_) => DeviceInputs::upload_paged(
            stream,
            &x,
            &page_inputs(&mut rng, &p, &x),
            case.lens.as_deref(),
        ),
    };
    let mut outs = Outputs::new(stream, &p, case.lse);

    let first = run_poisoned(stream, &dec, &dev, &mut outs)?;
    let errors = check_output(&p, &first, &reference(&p, &x, &lens))?;
    // Same inputs, same plan: the fixed-order reductions must give the same bits.
    let second = run_poisoned(stream, &dec, &dev, &mut outs)?;
    same_bits(&first, &second, "second run vs first")?;
    check_schedule(stream, &dec, &p, &lens)?;
    Ok(CaseResult {
        errors,
        splits: dec.plan().split().map_or(0, |s| s.num_splits),
    })
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(s) if !s.trim().is_empty() => {
            let s = s.trim();
            let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16),
                None => s.replace('_', "").parse(),
            };
            parsed.unwrap_or_else(|_| panic!("{name}={s:?} is not a number"))
        }
        _ => default,
    }
}

/// Running totals of the random test.
#[derive(Default)]
struct Summary {
    cases: usize,
    max_rel: f64,
    max_lse: f64,
    dtype: BTreeMap<&'static str, usize>,
    head_dim: BTreeMap<usize, usize>,
    group: BTreeMap<usize, usize>,
    max_len: BTreeMap<usize, usize>,
    splits: BTreeMap<usize, usize>,
    ragged: usize,
    all_empty: usize,
    heuristic_splits: usize,
    with_lse: usize,
    custom_scale: usize,
}

impl Summary {
    fn add(&mut self, case: &Case, r: &CaseResult) {
        self.cases += 1;
        self.max_rel = self.max_rel.max(r.errors.rel);
        self.max_lse = self.max_lse.max(r.errors.lse);
        *self.dtype.entry(case.dtype.name()).or_default() += 1;
        *self.head_dim.entry(case.head_dim).or_default() += 1;
        *self.group.entry(case.hq / case.hkv).or_default() += 1;
        *self.max_len.entry(case.max_len).or_default() += 1;
        *self.splits.entry(r.splits).or_default() += 1;
        self.ragged += usize::from(case.lens.is_some());
        self.all_empty += usize::from(
            case.lens
                .as_ref()
                .is_some_and(|l| l.iter().all(|&x| x == 0)),
        );
        self.heuristic_splits += usize::from(case.splits.is_none());
        self.with_lse += usize::from(case.lse);
        self.custom_scale += usize::from(case.scale.is_some());
    }

    fn line(&self, seed: u64, failures: usize, secs: f64) -> String {
        format!(
            "random_cases_match_reference: {} cases passed, {failures} failed (seed {seed:#x}, \
             {secs:.1} s); max rel err {:.3e}, max lse err {:.3e}; dtype {:?}, d {:?}, \
             groups {:?}, L {:?}, {} distinct split counts ({} heuristic), ragged {} \
             (all-empty {}), lse {}, custom scale {}",
            self.cases,
            self.max_rel,
            self.max_lse,
            self.dtype,
            self.head_dim,
            self.group,
            self.max_len,
            self.splits.len(),
            self.heuristic_splits,
            self.ragged,
            self.all_empty,
            self.with_lse,
            self.custom_scale,
        )
    }

    fn json(&self, seed: u64, failures: usize) -> String {
        fn num(x: f64) -> String {
            if x.is_finite() {
                format!("{x:e}")
            } else {
                "null".into()
            }
        }
        fn map<K: fmt::Display>(m: &BTreeMap<K, usize>) -> String {
            let items: Vec<String> = m.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            format!("{{{}}}", items.join(","))
        }
        format!(
            "{{\"test\":\"random_cases_match_reference\",\"cases\":{},\"max_rel_err\":{},\
             \"max_lse_err\":{},\"seed\":{seed},\"seed_hex\":\"{seed:#x}\",\"failures\":{failures},\"by_dtype\":{},\
             \"by_head_dim\":{},\"by_group\":{},\"by_max_len\":{},\"splits_used\":{},\
             \"ragged\":{},\"all_empty\":{},\"heuristic_splits\":{},\"with_lse\":{},\
             \"custom_scale\":{}}}\n",
            self.cases,
            num(self.max_rel),
            num(self.max_lse),
            map(&self.dtype),
            map(&self.head_dim),
            map(&self.group),
            map(&self.max_len),
            map(&self.splits),
            self.ragged,
            self.all_empty,
            self.heuristic_splits,
            self.with_lse,
            self.custom_scale,
        )
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic with a non-string payload".into())
}

/// Expected run time on an H200: about 1 minute for 300 cases, most of it in the f64 reference
/// of the L = 131072 cases (the first run compiles the kernels with NVRTC: add ~1 minute once).
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn random_cases_match_reference() {
    let seed = env_u64("KVSTREAM_GPU_SEED", DEFAULT_SEED);
    let count = env_u64("KVSTREAM_GPU_CASES", DEFAULT_CASES) as usize;
    let (rt, stream) = open_gpu();
    let start = Instant::now();
    // Shapes come from one stream of draws, so case i is the same for any case count.
    let mut rng = SplitMix64::new(seed);
    let mut summary = Summary::default();
    let mut failures: Vec<String> = Vec::new();
    for index in 0..count {
        let case = Case::draw(index, &mut rng);
        // A panic inside a case (a driver call failing) is that case's failure, not the end
        // of the run.
        let outcome = catch_unwind(AssertUnwindSafe(|| run_case(&rt, &stream, &case)))
            .unwrap_or_else(|p| Err(format!("panicked: {}", panic_message(p))));
        match outcome {
            Ok(r) => summary.add(&case, &r),
            Err(e) => {
                eprintln!("FAILED {case}: {e}");
                failures.push(format!("{case}: {e}"));
                if failures.len() >= MAX_FAILURES {
                    failures.push(format!("stopped after {MAX_FAILURES} failing cases"));
                    break;
                }
            }
        }
        if (index + 1) % 50 == 0 {
            println!(
                "  {} / {count} cases, {:.1} s",
                index + 1,
                start.elapsed().as_secs_f64()
            );
        }
    }
    let n_failed = failures.len().min(MAX_FAILURES);
    println!(
        "{}",
        summary.line(seed, n_failed, start.elapsed().as_secs_f64())
    );
    if let Ok(path) = std::env::var("KVSTREAM_GPU_SUMMARY") {
        if !path.is_empty() {
            std::fs::write(&path, summary.json(seed, n_failed))
                .unwrap_or_else(|e| panic!("writing the summary to {path}: {e}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{n_failed} of {count} random cases failed (seed {seed:#x}; rerun one with \
         KVSTREAM_GPU_SEED={seed:#x} KVSTREAM_GPU_CASES=<index + 1>). First {}:\n{}",
        failures.len().min(10),
        failures[..failures.len().min(10)].join("\n")
    );
    assert!(count == 0 || summary.cases > 0);
}

// ---------------------------------------------------------------------------------------------
// 2. CUDA graph capture
// ---------------------------------------------------------------------------------------------

/// The shape of the graph and PDL tests: a Llama-style 32/8 head layout, split 8 ways.
fn mid_problem() -> DecodeProblem {
    DecodeProblem::new(4, 32, 8, 128, 4096, DType::Bf16).expect("a valid problem")
}

/// Expected run time: a few seconds (three 4 x 4096 references per problem): contiguous, and
/// paged (page 16) with three new tokens per request, in kernel and cluster reduction, host- and
/// device-planned.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn graph_capture_replays_with_new_lengths() {
    let p = mid_problem();
    let paged = p
        .clone()
        .with_q_len(3)
        .and_then(|p| p.with_paged(16, pool_pages(4, 4096, 16), None))
        .expect("a valid problem");
    let split = |reduction| PlanOptions {
        num_splits: Some(8),
        reduction: Some(reduction),
        ..Default::default()
    };
    let device_plan = |reduction| PlanOptions {
        device_plan: true,
        reduction: Some(reduction),
        ..Default::default()
    };
    let length_sets = [[0, 4096, 1, 2049], [4096; 4], [17, 0, 4095, 64]];
    let persistent = PlanOptions {
        engine: Some(kvstream::Engine::Persistent),
        record_schedule: true,
        ..Default::default()
    };
    for (p, opts) in [
        (p.clone(), persistent),
        (paged.clone(), persistent),
        (p.clone(), split(Reduction::Kernel)),
        (paged.clone(), split(Reduction::Kernel)),
        (paged.clone(), split(Reduction::Cluster)),
        (p.clone(), device_plan(Reduction::Kernel)),
        (paged.clone(), device_plan(Reduction::Kernel)),
        (p, device_plan(Reduction::Cluster)),
        (paged, device_plan(Reduction::Cluster)),
    ] {
        graph_replay_case(&p, opts, &length_sets.map(|l| l.to_vec()));
    }
}

/// The device plan under one captured graph replayed with very different lengths: one long
/// request and many short ones (the long one moving between replays), all empty, all full; in
/// kernel reduction and in cluster reduction (long requests as whole clusters, short ones
/// packed unsplit into clusters that never synchronise). Every replay also checks the planner's
/// per-request decisions against the host mirror. Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn device_plan_balances_skewed_batches() {
    let (batch, long) = (16, 32_768);
    let p = DecodeProblem::new(batch, 32, 8, 128, long, DType::Bf16).expect("a valid problem");
    let skew = |at: usize| -> Vec<usize> {
        (0..batch)
            .map(|b| if b == at { long } else { 2048 + 17 * b })
            .collect()
    };
    let sets = vec![
        skew(0),
        vec![0; batch],
        skew(11),
        (0..batch).map(|b| b * 7 % 300).collect(),
        skew(15),
        // every unit longer than the fair share: splitting would need a second wave
        vec![long; batch],
    ];
    let persistent = PlanOptions {
        engine: Some(kvstream::Engine::Persistent),
        record_schedule: true,
        ..Default::default()
    };
    graph_replay_case(&p, persistent, &sets);
    for reduction in [Reduction::Kernel, Reduction::Cluster] {
        let opts = PlanOptions {
            device_plan: true,
            reduction: Some(reduction),
            ..Default::default()
        };
        graph_replay_case(&p, opts, &sets);
    }
}

fn graph_replay_case(p: &DecodeProblem, opts: PlanOptions, length_sets: &[Vec<usize>]) {
    let (rt, stream) = open_gpu_own_stream();
    let ctx = rt.context().clone();
    let p = p.clone();
    let dec = make_decoder(&rt, &p, opts);
    let reduction = dec.plan().split().map(|s| s.reduction);
    let planned = if !opts.wants_split_engine() {
        "persistent"
    } else if opts.device_plan {
        "device-planned"
    } else {
        "host-planned"
    };
    // Decoder::new allocated its workspace on the legacy default stream, which our non-blocking
    // stream does not wait for.
    ctx.synchronize().expect("synchronising after Decoder::new");

    // Every position holds real data: the lengths change between replays.
    let full = vec![p.max_len; p.batch];
    let mut rng = SplitMix64::new(0x6AF);
    let x = make_inputs::<bf16>(&mut rng, &p, &full);
    let mut dev = match p.paged {
        None => DeviceInputs::upload(&stream, &x, Some(&full)),
        Some(_) => {
            DeviceInputs::upload_paged(&stream, &x, &page_inputs(&mut rng, &p, &x), Some(&full))
        }
    };
    let mut graph_out = Outputs::<bf16>::new(&stream, &p, true);
    stream.synchronize().expect("uploads");

    let tensors = raw_tensors(&stream, &dev, &mut graph_out);
    // SAFETY: every pointer is a live allocation of the sizes the problem implies.
    let graph = capture_graph(&stream, || unsafe { dec.run(&tensors, stream.cu_stream()) })
        .unwrap_or_else(|e| panic!("{e}"));

    for lens in length_sets {
        let lens = lens.as_slice();
        let what = format!(
            "q_len {}, {}, {planned}, {reduction:?} reduction, lengths {lens:?}",
            p.q_len,
            if p.paged.is_some() {
                "paged"
            } else {
                "contiguous"
            }
        );
        // New lengths into the buffer the graph reads.
        overwrite(&stream, &lens_i32(lens), dev.seqlens.as_mut().unwrap());
        graph_out.poison(&stream);
        graph.launch().expect("launching the graph");
        stream
            .synchronize()
            .expect("graph replay failed on the GPU");
        let replayed = graph_out.read(&stream);

        let mut fresh = Outputs::<bf16>::new(&stream, &p, true);
        fresh.poison(&stream);
        let t = raw_tensors(&stream, &dev, &mut fresh);
        // SAFETY: as for the capture.
        unsafe { dec.run(&t, stream.cu_stream()) }
            .unwrap_or_else(|e| panic!("{what}: eager run: {e}"));
        stream.synchronize().expect("eager run failed on the GPU");
        let eager = fresh.read(&stream);
        if let Some(dp) = dec.plan().split().and_then(|s| s.device_plan) {
            // the planner kernel decided what its host mirror decides for these lengths
            let units = p.hkv * dec.plan().split().unwrap().decode.column_blocks(&p);
            let clamped: Vec<usize> = lens.iter().map(|&l| l.min(p.max_len)).collect();
            let tile = tile_tokens(p.head_dim);
            let want = match reduction.expect("a split plan") {
                Reduction::Kernel => device_plan_splits(&clamped, units, tile, dp.target, dp.slots),
                Reduction::Cluster => device_plan_cluster_splits(
                    &clamped,
                    units,
                    tile,
                    dp.target,
                    dec.plan().split().unwrap().num_splits,
                ),
            };
            let got = dec
                .last_device_plan(&stream)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
                .expect("a device-planned decoder has a device plan");
            assert_eq!(
                got, want,
                "{what}: device plan (splits, first slot) per request"
            );
        }

        check_schedule(&stream, &dec, &p, lens).unwrap_or_else(|e| panic!("{what}: {e}"));
        same_bits(
            &replayed,
            &eager,
            &format!("{what}: graph replay vs eager run"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let errors = check_output(&p, &replayed, &reference(&p, &x, lens))
            .unwrap_or_else(|e| panic!("{what}: graph replay: {e}"));
        println!(
            "graph replay, {what}: max rel err {:.3e}, max lse err {:.3e}",
            errors.rel, errors.lse
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 3. PDL on and off
// ---------------------------------------------------------------------------------------------

/// Expected run time: about a second.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn pdl_on_and_off_agree() {
    let (rt, stream) = open_gpu();
    let p = mid_problem();
    let lens = [4096, 1, 0, 3000];
    let x = make_inputs::<bf16>(&mut SplitMix64::new(0x9D1), &p, &lens);
    let dev = DeviceInputs::upload(&stream, &x, Some(&lens));
    let want = reference(&p, &x, &lens);
    for splits in [Some(8), None] {
        let opts = |disable_pdl| PlanOptions {
            num_splits: splits,
            disable_pdl,
            ..Default::default()
        };
        let off = make_decoder(&rt, &p, opts(true));
        let on = make_decoder(&rt, &p, opts(false));
        assert!(!off.plan().pdl() && on.plan().pdl());
        let what = on.plan().mode();

        let mut o = Outputs::<bf16>::new(&stream, &p, true);
        let serial = run_poisoned(&stream, &off, &dev, &mut o).unwrap_or_else(|e| panic!("{e}"));
        check_output(&p, &serial, &want).unwrap_or_else(|e| panic!("{what}, PDL off: {e}"));

        // Four calls back to back with no synchronisation in between, so that with PDL each
        // decode really starts while the previous combine drains (they share the workspace).
        let mut outs: Vec<Outputs<bf16>> =
            (0..4).map(|_| Outputs::new(&stream, &p, true)).collect();
        for o in &mut outs {
            o.poison(&stream);
        }
        for o in &mut outs {
            on.run_slices(
                &stream,
                &dev.q,
                &dev.k,
                &dev.v,
                &mut o.out,
                o.lse.as_mut(),
                dev.seqlens.as_ref(),
            )
            .unwrap_or_else(|e| panic!("{what}, PDL on: {e}"));
        }
        stream.synchronize().expect("PDL runs failed on the GPU");
        for (i, o) in outs.iter().enumerate() {
            same_bits(
                &o.read(&stream),
                &serial,
                &format!("{what}: PDL on (call {i}) vs off"),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// Capping the CTAs per SM (shared memory padded) changes where CTAs run, never what they
/// compute: a full-wave batch (the plan's own cap) and the same variant capped at 2 and 3 CTAs
/// per SM give bitwise the same output, also when a smaller padding loads the kernel first and
/// a larger one must raise its shared-memory limit afterwards. Expected run time: a second.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn resident_cta_cap_changes_nothing_but_placement() {
    let (rt, stream) = open_gpu();
    let p = DecodeProblem::new(16, 32, 8, 128, 2048, DType::Bf16).expect("a valid problem");
    let lens: Vec<usize> = (0..16).map(|b| 2048 - 61 * b).collect();
    let x = make_inputs::<bf16>(&mut SplitMix64::new(0x5E5), &p, &lens);
    let dev = DeviceInputs::upload(&stream, &x, Some(&lens));
    let want = reference(&p, &x, &lens);
    let capped = |n| PlanOptions {
        stages: Some(kvstream::plan::FULL_WAVE_STAGES),
        resident_ctas: Some(n),
        ..Default::default()
    };
    // smallest padding first, so each later decoder raises the loaded kernel's limit
    let decoders = [
        make_decoder(&rt, &p, capped(3)),
        make_decoder(&rt, &p, capped(2)),
        // the split engine's own plan for a full wave (1 split, FULL_WAVE_STAGES, one CTA per SM)
        make_decoder(
            &rt,
            &p,
            PlanOptions {
                reduction: Some(Reduction::Kernel),
                ..Default::default()
            },
        ),
    ];
    let full = decoders[2].plan().split().unwrap();
    assert_eq!(full.decode.stages, kvstream::plan::FULL_WAVE_STAGES);
    assert!(full.decode_shared_bytes > decoders[1].plan().split().unwrap().decode_shared_bytes);
    let mut first = None;
    for d in &decoders {
        let what = format!(
            "{} B of shared memory",
            d.plan().split().unwrap().decode_shared_bytes
        );
        let mut o = Outputs::<bf16>::new(&stream, &p, true);
        let got = run_poisoned(&stream, d, &dev, &mut o).unwrap_or_else(|e| panic!("{what}: {e}"));
        check_output(&p, &got, &want).unwrap_or_else(|e| panic!("{what}: {e}"));
        match &first {
            None => first = Some(got),
            Some(f) => same_bits(&got, f, &what).unwrap_or_else(|e| panic!("{e}")),
        }
    }
}

/// Two persistent CTAs per SM (a forced grid of twice the SMs, units cut up to 264 times, each
/// merged in slices by all of its pieces' CTAs): equal to the reference with ragged lengths (a
/// zero, a long request cut by most CTAs), bitwise the same twice, for d 128 and d 64 (two
/// consumer groups), contiguous and paged. A kernel of which two CTAs do not fit an SM (the wide
/// consumer: 288 threads of 168 registers) refuses such a grid by name, as its merge waits for
/// every CTA. Expected run time: a second.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn two_ctas_per_sm_match_reference() {
    let (rt, stream) = open_gpu();
    for (head_dim, page) in [(128, None), (64, None), (128, Some(16))] {
        let mut p =
            DecodeProblem::new(6, 32, 8, head_dim, 20000, DType::Bf16).expect("a valid problem");
        if let Some(page) = page {
            p = p
                .with_paged(page, pool_pages(6, 20000, page), None)
                .unwrap();
        }
        let lens = vec![20000, 0, 3, 777, 12345, 64];
        let mut rng = SplitMix64::new(0x2C7A);
        let x = make_inputs::<bf16>(&mut rng, &p, &lens);
        let dev = match p.paged {
            None => DeviceInputs::upload(&stream, &x, Some(&lens)),
            Some(_) => {
                DeviceInputs::upload_paged(&stream, &x, &page_inputs(&mut rng, &p, &x), Some(&lens))
            }
        };
        let want = reference(&p, &x, &lens);
        let grid = kvstream::plan::PERSISTENT_MAX_FORCED_GRID;
        let opts = PlanOptions {
            engine: Some(kvstream::Engine::Persistent),
            persistent_ctas: Some(grid),
            ..Default::default()
        };
        let dec = make_decoder(&rt, &p, opts);
        let what = format!("d {head_dim}, pages {page:?}, {grid} CTAs");
        let mut o = Outputs::<bf16>::new(&stream, &p, true);
        let first =
            run_poisoned(&stream, &dec, &dev, &mut o).unwrap_or_else(|e| panic!("{what}: {e}"));
        check_output(&p, &first, &want).unwrap_or_else(|e| panic!("{what}: {e}"));
        let second =
            run_poisoned(&stream, &dec, &dev, &mut o).unwrap_or_else(|e| panic!("{what}: {e}"));
        same_bits(&first, &second, &what).unwrap_or_else(|e| panic!("{e}"));
    }
    let wide = DecodeProblem::new(2, 32, 2, 128, 4096, DType::Bf16)
        .and_then(|p| p.with_q_len(8))
        .unwrap();
    let opts = PlanOptions {
        engine: Some(kvstream::Engine::Persistent),
        persistent_ctas: Some(kvstream::plan::PERSISTENT_MAX_FORCED_GRID),
        ..Default::default()
    };
    match Decoder::new(&rt, wide, opts) {
        Ok(_) => panic!("a wide grid of two CTAs an SM was accepted"),
        Err(e) => assert!(e.to_string().contains("persistent_ctas"), "{e}"),
    }
}

/// Cluster reduction (splits merged through distributed shared memory, one launch) against the
/// kernel reduction and the reference: ragged lengths with zeros, every cluster size (2 to 16),
/// several group sizes and both head dims; cluster results are bitwise reproducible.
/// Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn cluster_reduction_matches_kernel_reduction() {
    let (rt, stream) = open_gpu();
    let shapes = [
        (3, 16, 2, 128, 4097),
        (2, 12, 1, 64, 1000),
        (4, 32, 8, 128, 333),
        (1, 7, 1, 128, 65),
        (2, 32, 1, 64, 2048),
    ];
    for (i, &(batch, hq, hkv, d, len)) in shapes.iter().enumerate() {
        let p = DecodeProblem::new(batch, hq, hkv, d, len, DType::Bf16).expect("a valid problem");
        let mut rng = SplitMix64::new(0xC1u64 + i as u64);
        let mut lens: Vec<usize> = (0..batch).map(|_| rng.below(len + 1)).collect();
        lens[0] = len;
        if batch > 1 {
            lens[batch - 1] = 0;
        }
        let x = make_inputs::<bf16>(&mut rng, &p, &lens);
        let dev = DeviceInputs::upload(&stream, &x, Some(&lens));
        let want = reference(&p, &x, &lens);
        for splits in CLUSTER_SPLITS.into_iter().filter(|&s| s > 1) {
            let what = format!("{p:?} lens {lens:?}, {splits} splits");
            let opts = |reduction| PlanOptions {
                num_splits: Some(splits),
                reduction: Some(reduction),
                ..Default::default()
            };
            let kernel = make_decoder(&rt, &p, opts(Reduction::Kernel));
            let cluster = make_decoder(&rt, &p, opts(Reduction::Cluster));
            assert!(
                cluster.plan().split().unwrap().combine.is_none()
                    && cluster.plan().split().unwrap().workspace.bytes() == 0
            );
            let mut o = Outputs::<bf16>::new(&stream, &p, true);
            let k_out = run_poisoned(&stream, &kernel, &dev, &mut o)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let c_out = run_poisoned(&stream, &cluster, &dev, &mut o)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            check_output(&p, &c_out, &want).unwrap_or_else(|e| panic!("{what}, cluster: {e}"));
            check_output(&p, &k_out, &want).unwrap_or_else(|e| panic!("{what}, kernel: {e}"));
            let again = run_poisoned(&stream, &cluster, &dev, &mut o)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            same_bits(&again, &c_out, &format!("{what}: cluster run 2 vs 1"))
                .unwrap_or_else(|e| panic!("{e}"));
            // Same FP32 math in another association: equal up to the output rounding.
            let widen = |o: &Output<bf16>| o.out.iter().map(|&x| x.to_f64()).collect::<Vec<f64>>();
            let (a, b) = (widen(&c_out), widen(&k_out));
            let diff = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            let scale = b.iter().map(|y| y.abs()).fold(0.0, f64::max).max(1e-30);
            assert!(
                diff <= 1e-2 * scale,
                "{what}: cluster vs kernel differ by {diff} (scale {scale})"
            );
        }
    }
}

/// A cluster merge the heuristic chooses runs only where the GPU holds all of its clusters at
/// once: e4m3 16/16 heads at L 1024 want 8 splits, 16 clusters of 8 CTAs of ~137 KB, which a
/// 132-SM H100 / H200 runs in two waves (twice the time of kernel reduction: docs/tuning.md,
/// "Cluster waves"), so the decoder merges those by kernel; every case matches the reference,
/// as 2-byte caches whose clusters fit keep the cluster merge.
/// Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn automatic_cluster_merges_fit_one_wave() {
    let (rt, stream) = open_gpu();
    let mut rng = SplitMix64::new(0xC3);
    // (head dim, cache, len, the merge a 132-SM GPU runs)
    let cases = [
        (64, KvDType::Fp8E4m3, 1024, Reduction::Kernel),
        (128, KvDType::Fp8E4m3, 1024, Reduction::Kernel),
        (64, KvDType::Fp8E4m3, 2048, Reduction::Kernel),
        (64, KvDType::AsQuery, 1024, Reduction::Cluster),
    ];
    for (d, kv, len, on_132_sms) in cases {
        let p = DecodeProblem::new(1, 16, 16, d, len, DType::Bf16)
            .and_then(|p| p.with_kv_dtype(kv))
            .expect("a valid problem");
        let what = format!("{p:?}");
        let heuristic =
            kvstream::plan::choose(&p, rt.facts(), PlanOptions::default()).expect("a plan");
        let dec = make_decoder(&rt, &p, PlanOptions::default());
        let (chosen, ran) = (
            heuristic.split().expect("split engine"),
            dec.plan().split().expect("split engine"),
        );
        if rt.facts().sm_count == 132 {
            assert_eq!(
                ran.reduction, on_132_sms,
                "{what}: the merge run (the heuristic chose {:?})",
                chosen.reduction
            );
        }
        if chosen.reduction == Reduction::Cluster && ran.reduction == Reduction::Kernel {
            assert!(
                ran.combine.is_some() && ran.workspace.bytes() > 0,
                "{what}: a kernel merge with its combine"
            );
        }
        let lens = vec![len];
        let errors = if kv == KvDType::Fp8E4m3 {
            fp8_case::<bf16>(
                &rt,
                &stream,
                &mut rng,
                &p,
                &lens,
                KvScaleLayout::PerKvHead,
                PlanOptions::default(),
            )
        } else {
            let x = make_inputs::<bf16>(&mut rng, &p, &lens);
            let dev = DeviceInputs::upload(&stream, &x, Some(&lens));
            let mut o = Outputs::<bf16>::new(&stream, &p, true);
            run_poisoned(&stream, &dec, &dev, &mut o)
                .and_then(|out| check_output(&p, &out, &reference(&p, &x, &lens)))
        };
        errors.unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// 3c. Paged caches and multi-token decode
// ---------------------------------------------------------------------------------------------

/// A paged cache (shuffled pages, spare pages, table entries past the length pointing at other
/// requests' pages) gives the same bits as the contiguous cache it was scattered from, for every
/// page size, in both reduction modes and with several split counts, and on the persistent
/// engine with either producer (gathered pages, TMA boxes); all match the reference.
/// Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn paged_cache_equals_contiguous() {
    let (rt, stream) = open_gpu();
    let shapes = [
        (3, 16, 2, 128, 1000, 1),
        (2, 32, 4, 64, 3000, 2),
        (2, 8, 1, 128, 300, 5),
    ];
    for (i, &(batch, hq, hkv, d, len, q_len)) in shapes.iter().enumerate() {
        let base = DecodeProblem::new(batch, hq, hkv, d, len, DType::Bf16)
            .and_then(|p| p.with_q_len(q_len))
            .expect("a valid problem");
        let mut rng = SplitMix64::new(0x9A6E + i as u64);
        let mut lens: Vec<usize> = (0..batch).map(|_| rng.below(len + 1)).collect();
        lens[0] = len;
        lens[batch - 1] = lens[batch - 1].min(3); // a zero or very short request
        let x = make_inputs::<bf16>(&mut rng, &base, &lens);
        let want = reference(&base, &x, &lens);
        let contiguous_dev = DeviceInputs::upload(&stream, &x, Some(&lens));
        for page_size in kvstream::problem::SUPPORTED_PAGE_SIZES {
            let paged = base
                .clone()
                .with_paged(page_size, pool_pages(batch, len, page_size), None)
                .expect("a valid paged problem");
            let pages = page_inputs(&mut rng, &paged, &x);
            let paged_dev = DeviceInputs::upload_paged(&stream, &x, &pages, Some(&lens));
            let persistent = PlanOptions {
                engine: Some(kvstream::Engine::Persistent),
                ..Default::default()
            };
            let split = |n, reduction| PlanOptions {
                num_splits: Some(n),
                reduction: Some(reduction),
                ..Default::default()
            };
            for opts in [
                PlanOptions::default(),
                persistent,
                // both producers of the persistent engine at every page size, the gathering one
                // with its default warps and with one
                PlanOptions {
                    persistent_paged_gather: Some(true),
                    ..persistent
                },
                PlanOptions {
                    persistent_paged_gather: Some(true),
                    persistent_producer_warps: Some(1),
                    ..persistent
                },
                PlanOptions {
                    persistent_paged_gather: Some(false),
                    ..persistent
                },
                // three CTAs: pieces of tens of tiles, so the producer's chunks of page ids are
                // refilled many times over a piece (with pages of 1 a chunk is one tile)
                PlanOptions {
                    persistent_paged_gather: Some(true),
                    persistent_ctas: Some(3),
                    ..persistent
                },
                // the paired softmax step (a tuning knob), on 128-position tiles
                PlanOptions {
                    persistent_softmax_slices: Some(2),
                    persistent_tile_tokens: Some(128),
                    ..persistent
                },
                split(3, Reduction::Kernel),
                split(4, Reduction::Cluster),
            ] {
                let what = format!("{base:?} lens {lens:?}, page {page_size}, {opts:?}");
                let pd = make_decoder(&rt, &paged, opts);
                // the heuristic may split a paged cache differently: compare like with like
                // (the persistent engine's schedule does not depend on the layout)
                let same_plan = match pd.plan().split() {
                    Some(sp) => PlanOptions {
                        num_splits: Some(sp.num_splits),
                        reduction: Some(sp.reduction),
                        consumer_groups: Some(sp.decode.consumer_groups),
                        ..opts
                    },
                    // the paged problem may take the persistent engine where the contiguous
                    // one would not (small pages)
                    None => PlanOptions {
                        engine: Some(kvstream::Engine::Persistent),
                        ..opts
                    },
                };
                let c = make_decoder(&rt, &base, same_plan);
                let mut o = Outputs::<bf16>::new(&stream, &base, true);
                let want_bits = run_poisoned(&stream, &c, &contiguous_dev, &mut o)
                    .unwrap_or_else(|e| panic!("{what}, contiguous: {e}"));
                let got = run_poisoned(&stream, &pd, &paged_dev, &mut o)
                    .unwrap_or_else(|e| panic!("{what}, paged: {e}"));
                check_output(&base, &got, &want).unwrap_or_else(|e| panic!("{what}, paged: {e}"));
                same_bits(&got, &want_bits, &format!("{what}: paged vs contiguous"))
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

/// Paired heads (`plan::can_pair_heads`: two adjacent KV heads streamed as one row of twice the
/// head dim) match the f64 reference: d 64 wherever the plan pairs (`plan::pairs_heads`), d 96
/// pairs asked for (d 192 rows): MHA and groups up to 4, an odd group (its pair's columns are
/// not a power of two), multi-token groups over two and three column tiles (d 64), ragged
/// lengths with an empty request, a long batch-1 cache whose units are cut and merged, every
/// persistent KV source a pair can take, bf16 and e4m3 caches with each scale layout (the two
/// heads of a pair have their own scales); bitwise equal run to run, and unpaired agrees too.
/// Expected run time: under a minute.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn paired_heads_match_reference() {
    let (rt, stream) = open_gpu();
    let layouts = [
        KvScaleLayout::PerTensor,
        KvScaleLayout::PerKvHead,
        KvScaleLayout::PerRequestHead,
    ];
    let mut rng = SplitMix64::new(0x9A12ED);
    // (batch, hq, hkv, max_len, q_len): 1, 4, 3, 4 (two tokens) and 12 query rows per KV head
    let shapes = [
        (3, 16, 16, 1500, 1),
        (2, 32, 8, 2100, 1),
        (2, 24, 8, 900, 1),
        (2, 8, 4, 700, 2),
        (2, 12, 4, 500, 4),
        (1, 16, 16, 40_000, 1),
    ];
    let keep = (env_u64("KVSTREAM_GPU_CASES", DEFAULT_CASES) as usize * shapes.len())
        .div_ceil(DEFAULT_CASES as usize)
        .clamp(1, shapes.len());
    let persistent = PlanOptions {
        engine: Some(kvstream::Engine::Persistent),
        record_schedule: true,
        ..Default::default()
    };
    let mut cases = 0;
    let mut worst = Errors::default();
    let runs = [64, 96]
        .into_iter()
        .flat_map(|d| shapes.iter().take(keep).map(move |&s| (d, s)));
    for (head_dim, (batch, hq, hkv, len, q_len)) in runs {
        let base = DecodeProblem::new(batch, hq, hkv, head_dim, len, DType::Bf16)
            .and_then(|p| p.with_q_len(q_len))
            .expect("a valid problem");
        if head_dim == 64 {
            assert!(kvstream::plan::pairs_heads(&base), "{base:?} should pair");
        } else if !kvstream::plan::can_pair_heads(&base) {
            continue; // 12 query rows a KV head: a d 192 pair's block holds 8
        }
        let persistent = PlanOptions {
            persistent_pair_heads: (head_dim == 96).then_some(true),
            ..persistent
        };
        let mut lens: Vec<usize> = (0..batch).map(|_| rng.below(len + 1)).collect();
        lens[0] = len;
        if batch > 2 {
            lens[batch - 1] = 0;
        }
        let mut problems = vec![base.clone()];
        for page in [1, 16, 64] {
            problems.push(
                base.clone()
                    .with_paged(page, pool_pages(batch, len, page), None)
                    .expect("a valid paged problem"),
            );
        }
        for p in problems {
            // both producers of a pool (a 128-dim row fills a box at any page size; d 192 rows
            // go by boxes only)
            let gathers: &[Option<bool>] = match p.paged {
                Some(_) if head_dim == 64 => &[Some(true), Some(false)],
                _ => &[None],
            };
            for &gather in gathers {
                let opts = PlanOptions {
                    persistent_paged_gather: gather,
                    ..persistent
                };
                let dec = make_decoder(&rt, &p, opts);
                let Some(kvstream::plan::Plan::Persistent(pp)) = Some(dec.plan()) else {
                    panic!("{p:?}: not the persistent engine");
                };
                assert_eq!(pp.variant.heads_per_row, 2, "{p:?}: not paired");
                let what = format!("{p:?}, lens {lens:?}, {opts:?}");
                // bf16 caches: the reference, twice-run bits, the schedule, and unpaired
                let x = make_inputs::<bf16>(&mut rng, &p, &lens);
                let dev = match p.paged {
                    None => DeviceInputs::upload(&stream, &x, Some(&lens)),
                    Some(_) => DeviceInputs::upload_paged(
                        &stream,
                        &x,
                        &page_inputs(&mut rng, &p, &x),
                        Some(&lens),
                    ),
                };
                let want = reference(&p, &x, &lens);
                let mut o = Outputs::<bf16>::new(&stream, &p, true);
                let first = run_poisoned(&stream, &dec, &dev, &mut o)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let e = check_output(&p, &first, &want).unwrap_or_else(|e| panic!("{what}: {e}"));
                worst.rel = worst.rel.max(e.rel);
                worst.lse = worst.lse.max(e.lse);
                let second = run_poisoned(&stream, &dec, &dev, &mut o)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                same_bits(&first, &second, &format!("{what}: second run"))
                    .unwrap_or_else(|e| panic!("{e}"));
                check_schedule(&stream, &dec, &p, &lens).unwrap_or_else(|e| panic!("{what}: {e}"));
                let single = make_decoder(
                    &rt,
                    &p,
                    PlanOptions {
                        persistent_pair_heads: Some(false),
                        ..opts
                    },
                );
                let got = run_poisoned(&stream, &single, &dev, &mut o)
                    .unwrap_or_else(|e| panic!("{what}, unpaired: {e}"));
                check_output(&p, &got, &want).unwrap_or_else(|e| panic!("{what}, unpaired: {e}"));
                // e4m3 caches with each scale layout
                let p8 = p
                    .clone()
                    .with_kv_dtype(KvDType::Fp8E4m3)
                    .expect("fp8 problem");
                // (e4m3 d 96 pairs have no producer on pages of 1: plan's tests; unpaired there)
                let opts8 = PlanOptions {
                    persistent_pair_heads: opts
                        .persistent_pair_heads
                        .map(|_| kvstream::plan::can_pair_heads(&p8)),
                    ..opts
                };
                let e = fp8_case::<bf16>(
                    &rt,
                    &stream,
                    &mut rng,
                    &p8,
                    &lens,
                    layouts[cases % 3],
                    opts8,
                )
                .unwrap_or_else(|e| panic!("{what}, fp8 {:?} scales: {e}", layouts[cases % 3]));
                worst.rel = worst.rel.max(e.rel);
                worst.lse = worst.lse.max(e.lse);
                cases += 1;
            }
        }
    }
    println!(
        "paired heads (d 64 and d 96): {cases} cases pass (bf16, unpaired and fp8 each); max rel \
         err {:.3e}, max lse err {:.3e}",
        worst.rel, worst.lse
    );
}

/// Multi-token decode: token i of a request sees the cache up to `len - q_len + i`; rows that
/// see nothing (a request shorter than q_len) give 0 and LSE -inf. Every q_len 1..=8, with the
/// query rows of one KV head spread over several CTAs when q_len x group > 32.
/// Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn multi_token_decode_is_causal() {
    let (rt, stream) = open_gpu();
    for q_len in 1..=kvstream::problem::MAX_Q_LEN {
        for &(batch, hq, hkv, d, len) in &[
            (3, 32, 8, 128, 777),
            (2, 16, 2, 64, 300),
            (1, 32, 1, 128, 2048),
        ] {
            let p = DecodeProblem::new(batch, hq, hkv, d, len, DType::Bf16)
                .and_then(|p| p.with_q_len(q_len))
                .expect("a valid problem");
            let lens: Vec<usize> = [len, 0, 5, q_len.saturating_sub(1)][..batch].to_vec();
            let mut rng = SplitMix64::new(0x3700 + q_len as u64);
            let x = make_inputs::<bf16>(&mut rng, &p, &lens);
            let dev = DeviceInputs::upload(&stream, &x, Some(&lens));
            let want = reference(&p, &x, &lens);
            // None: the persistent engine
            for reduction in [None, Some(Reduction::Kernel), Some(Reduction::Cluster)] {
                let what = format!("{p:?} lens {lens:?}, {reduction:?}");
                let dec = make_decoder(
                    &rt,
                    &p,
                    PlanOptions {
                        num_splits: reduction.map(|_| 4),
                        reduction,
                        engine: reduction.map_or(Some(kvstream::Engine::Persistent), |_| None),
                        ..Default::default()
                    },
                );
                let mut o = Outputs::<bf16>::new(&stream, &p, true);
                let got = run_poisoned(&stream, &dec, &dev, &mut o)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                check_output(&p, &got, &want).unwrap_or_else(|e| panic!("{what}: {e}"));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Argument checks
// ---------------------------------------------------------------------------------------------

/// Host memory aligned like a device allocation, so only "not device memory" can reject it.
#[derive(Clone, Copy)]
#[repr(C, align(256))]
struct HostBlock([u8; 256]);

/// Expected run time: under a second.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn bad_pointers_are_rejected() {
    let (rt, stream) = open_gpu();
    let p = DecodeProblem::new(2, 16, 2, 128, 256, DType::Bf16).expect("a valid problem");
    let dec = make_decoder(
        &rt,
        &p,
        PlanOptions {
            num_splits: Some(4),
            disable_pdl: false,
            ..Default::default()
        },
    );
    let lens = [256, 100];
    let x = make_inputs::<bf16>(&mut SplitMix64::new(0xBAD), &p, &lens);
    let dev = DeviceInputs::upload(&stream, &x, Some(&lens));
    let mut o = Outputs::<bf16>::new(&stream, &p, true);
    o.poison(&stream);
    let good = raw_tensors(&stream, &dev, &mut o);
    let host = vec![HostBlock([0; 256]); p.batch * p.max_len * p.hkv * p.head_dim * 2 / 256];

    let bad_raw = [
        ("q", DecodeTensors { q: 0, ..good }, "null q"),
        (
            "k_cache",
            DecodeTensors {
                k: good.k + 2,
                ..good
            },
            "k + 2 bytes",
        ),
        (
            "v_cache",
            DecodeTensors {
                v: host.as_ptr() as u64,
                ..good
            },
            "host v",
        ),
    ];
    for (arg, t, call) in bad_raw {
        // SAFETY: the library must refuse these before launching anything.
        let r = unsafe { dec.run(&t, stream.cu_stream()) };
        assert_eq!(rejected_arg(r, call), arg, "{call}");
    }

    let kv_len = x.k.len();
    let short_k = stream.alloc_zeros::<bf16>(kv_len - 1).expect("alloc");
    let r = dec.run_slices(&stream, &dev.q, &short_k, &dev.v, &mut o.out, None, None);
    assert_eq!(rejected_arg(r, "short k slice"), "k_cache");

    let short_seqlens = upload(&stream, &[7i32]);
    let r = dec.run_slices(
        &stream,
        &dev.q,
        &dev.k,
        &dev.v,
        &mut o.out,
        None,
        Some(&short_seqlens),
    );
    assert_eq!(rejected_arg(r, "short seqlens slice"), "cache_seqlens");

    let mut short_lse = stream
        .alloc_zeros::<f32>(p.batch * p.hq - 1)
        .expect("alloc");
    let r = dec.run_slices(
        &stream,
        &dev.q,
        &dev.k,
        &dev.v,
        &mut o.out,
        Some(&mut short_lse),
        None,
    );
    assert_eq!(rejected_arg(r, "short lse slice"), "lse");

    // f16 slices of the right sizes for a bf16 problem.
    let q16 = stream.alloc_zeros::<f16>(x.q.len()).expect("alloc");
    let k16 = stream.alloc_zeros::<f16>(kv_len).expect("alloc");
    let v16 = stream.alloc_zeros::<f16>(kv_len).expect("alloc");
    let mut out16 = stream.alloc_zeros::<f16>(x.q.len()).expect("alloc");
    let r = dec.run_slices(&stream, &q16, &k16, &v16, &mut out16, None, None);
    let msg = r
        .as_ref()
        .map_err(|e| e.to_string())
        .err()
        .unwrap_or_default();
    rejected_arg(r, "f16 slices for a bf16 problem");
    assert!(
        msg.contains("bf16"),
        "dtype error should name the problem's dtype: {msg}"
    );

    // Nothing refused may have been launched: the outputs still hold the poison.
    stream.synchronize().expect("synchronising");
    let untouched = o.read(&stream);
    assert!(
        untouched.out.iter().all(|x| x.raw() == POISON),
        "a refused call wrote out"
    );
    assert!(
        untouched.lse.iter().flatten().all(|x| x.is_nan()),
        "a refused call wrote lse"
    );

    // And the runtime is still healthy: a valid call right after gives the right answer.
    let got = run_poisoned(&stream, &dec, &dev, &mut o).unwrap_or_else(|e| panic!("{e}"));
    check_output(&p, &got, &reference(&p, &x, &lens))
        .unwrap_or_else(|e| panic!("valid call after the refused ones: {e}"));
}

// ---------------------------------------------------------------------------------------------
// 5. All requests empty
// ---------------------------------------------------------------------------------------------

/// `splits`: the split engine with that many splits; `None`: the persistent engine.
fn zero_length_case<T: Half>(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    d: usize,
    splits: Option<usize>,
) {
    let p = DecodeProblem::new(3, 16, 2, d, 1000, T::DTYPE).expect("a valid problem");
    let what = format!("{} d {d}, {splits:?} splits", T::DTYPE.name());
    let dec = make_decoder(
        rt,
        &p,
        PlanOptions {
            num_splits: splits,
            engine: splits.map_or(Some(kvstream::Engine::Persistent), |_| None),
            disable_pdl: false,
            ..Default::default()
        },
    );
    assert_eq!(dec.plan().split().map(|s| s.num_splits), splits, "{what}");
    let lens = [0; 3];
    // K and V are all NaN: with every length 0 nothing may be read from them.
    let x = make_inputs::<T>(&mut SplitMix64::new(0x0), &p, &lens);
    let dev = DeviceInputs::upload(stream, &x, Some(&lens));
    let mut o = Outputs::<T>::new(stream, &p, true);
    let got = run_poisoned(stream, &dec, &dev, &mut o).unwrap_or_else(|e| panic!("{what}: {e}"));
    if let Some(i) = got.out.iter().position(|x| x.to_f64() != 0.0) {
        panic!(
            "{what}: out[{i}] is {:#06x}, must be exactly 0",
            got.out[i].raw()
        );
    }
    let lse = got.lse.expect("lse was requested");
    if let Some(i) = lse.iter().position(|&x| x != f32::NEG_INFINITY) {
        panic!("{what}: lse[{i}] is {}, must be -inf", lse[i]);
    }
}

/// Expected run time: under a second.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn zero_length_batch_gives_zeros_and_neg_inf() {
    let (rt, stream) = open_gpu();
    for splits in [None, Some(1), Some(16)] {
        zero_length_case::<bf16>(&rt, &stream, 128, splits);
        zero_length_case::<f16>(&rt, &stream, 64, splits);
    }
}

// ---------------------------------------------------------------------------------------------
// Hints read before the PDL wait
// ---------------------------------------------------------------------------------------------

/// Test kernels for the PDL overlap: `late_writer` lets the next kernel launch at once, pauses,
/// copies `count` words and stamps its finish time; `launched_at` stamps its start time before
/// its PDL wait (launched after `late_writer`, it shows that the overlap really happens).
const LATE_WRITER_SRC: &str = r#"
struct LateWriterParams {
    int* dst;
    const int* src;
    int count;
    int pad;
    unsigned long long pause_ns;
    unsigned long long* stamps;  // [0]: late_writer's finish, [1]: launched_at's start
};
__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
extern "C" __global__ void late_writer(const __grid_constant__ LateWriterParams p) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const unsigned long long start = now_ns();
    while (now_ns() - start < p.pause_ns) {}
    for (int i = threadIdx.x; i < p.count; i += blockDim.x) p.dst[i] = p.src[i];
    __syncthreads();
    if (threadIdx.x == 0) p.stamps[0] = now_ns();
}
extern "C" __global__ void launched_at(const __grid_constant__ LateWriterParams p) {
    if (threadIdx.x == 0) p.stamps[1] = now_ns();
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
"#;

#[repr(C)]
#[derive(Clone, Copy)]
struct LateWriterParams {
    dst: u64,
    src: u64,
    count: i32,
    pad: i32,
    pause_ns: u64,
    stamps: u64,
}

struct LateWriterKernel(&'static str);

impl kvstream::kernels::Variant for LateWriterKernel {
    fn name(&self) -> String {
        format!("test.{}", self.0)
    }
    fn source(&self) -> &'static str {
        LATE_WRITER_SRC
    }
    fn entry(&self) -> &'static str {
        self.0
    }
    fn defines(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

fn load_test_kernel(rt: &Arc<Runtime>, entry: &'static str) -> sys::CUfunction {
    rt.bind().expect("binding the context");
    let compiled = kvstream::jit::compile::compile(&LateWriterKernel(entry))
        .unwrap_or_else(|e| panic!("compiling {entry}: {e}"));
    // SAFETY: an sm_90a CUBIN from NVRTC; the driver copies the image before returning. The
    // module stays loaded for the rest of the process.
    unsafe {
        let module = cudarc::driver::result::module::load_data(compiled.cubin.as_ptr() as *const _)
            .unwrap_or_else(|e| panic!("loading {entry}: {e}"));
        let name = std::ffi::CString::new(entry).unwrap();
        cudarc::driver::result::module::get_function(module, name)
            .unwrap_or_else(|e| panic!("finding {entry}: {e}"))
    }
}

/// One CTA of 128 threads, PDL as asked.
fn launch_test_kernel(
    func: sys::CUfunction,
    stream: &Arc<CudaStream>,
    params: &LateWriterParams,
    pdl: bool,
) {
    let cfg = kvstream::launch::LaunchConfig {
        grid: [1, 1, 1],
        block: [128, 1, 1],
        shared_bytes: 0,
        pdl,
        cluster: None,
    };
    // SAFETY: the kernels take one LateWriterParams; every pointer in it is live device memory
    // of at least the sizes the kernels touch.
    unsafe { kvstream::launch::launch(func, &cfg, stream.cu_stream(), params, "a test kernel") }
        .unwrap_or_else(|e| panic!("launching a test kernel: {e}"));
}

/// Joined-halves pages of split requests read page ids before the PDL wait, as hints for their
/// L2 warm-up (decode_gqa.cu, "L2 warm-up before the PDL wait"); nothing read there may decide
/// what the decode computes. Here the kernel in front of the decode lets it launch at once and
/// only then, after a pause, rewrites the block table (another page order) and the lengths (one
/// longer, one shorter): the decode must use the new ones, equal to the reference and bitwise to
/// a decode run after a synchronise. A probe launched the same way shows that the overlap
/// happens, so the decode really starts while the old words are in place.
/// Expected run time: about a second.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn stale_hints_before_the_pdl_wait_are_not_used() {
    let (rt, _) = open_gpu();
    let stream = rt.context().new_stream().expect("creating a stream");
    let writer = load_test_kernel(&rt, "late_writer");
    let probe = load_test_kernel(&rt, "launched_at");
    let mut stamps = stream.alloc_zeros::<u64>(2).expect("allocating stamps");
    let scratch = upload(&stream, &[0i32]);
    let stamp_params = LateWriterParams {
        dst: scratch.device_ptr(&stream).0,
        src: scratch.device_ptr(&stream).0,
        count: 0,
        pad: 0,
        pause_ns: 50_000,
        stamps: stamps.device_ptr_mut(&stream).0,
    };
    launch_test_kernel(writer, &stream, &stamp_params, false);
    launch_test_kernel(probe, &stream, &stamp_params, true);
    stream.synchronize().expect("the probe kernels failed");
    let t = download(&stream, &stamps);
    // compute-sanitizer serialises kernels: there the rewrite lands before the decode starts,
    // and the test still checks the decode, only not with stale words
    let serialised = std::env::var_os("KVSTREAM_GPU_SERIALISED").is_some();
    assert!(
        t[1] < t[0] || serialised,
        "the kernel after late_writer started at {} ns, after it finished ({} ns): no PDL overlap, \
         so this test would not exercise stale hints (set KVSTREAM_GPU_SERIALISED=1 where kernels \
         are serialised on purpose, e.g. under compute-sanitizer)",
        t[1],
        t[0]
    );

    let (batch, max_len) = (2, 4096);
    let new_lens = [2500, max_len];
    let old_lens = [max_len, 1000];
    for page_size in [16, 32] {
        let base = DecodeProblem::new(batch, 32, 8, 128, max_len, DType::Bf16).expect("a problem");
        let paged = base
            .clone()
            .with_paged(page_size, pool_pages(batch, max_len, page_size), None)
            .expect("a paged problem");
        let pg = paged.paged.unwrap();
        let mut rng = SplitMix64::new(0x57A1E + page_size as u64);
        let x = make_inputs::<bf16>(&mut rng, &base, &new_lens);
        let want = reference(&base, &x, &new_lens);
        let pages = page_inputs(&mut rng, &paged, &x);
        // old words: a table that points at the wrong pages, and the old lengths
        let mut old_words: Vec<i32> = pages.table.iter().rev().copied().collect();
        old_words.extend(lens_i32(&old_lens));
        let mut new_words = pages.table.clone();
        new_words.extend(lens_i32(&new_lens));
        let opts = PlanOptions {
            num_splits: Some(8),
            reduction: Some(Reduction::Kernel),
            ..Default::default()
        };
        let dec = make_decoder(&rt, &paged, opts);
        let plan = dec.plan().split().unwrap();
        assert!(
            plan.decode.joined_halves
                && plan.decode.stages == 4
                && plan.pdl
                && plan.num_splits == 8
                && plan.device_plan.is_none(),
            "page {page_size}: the plan must be a static, PDL-chained split of joined-halves pages \
             to read hints: {plan:?}"
        );
        let mut live = upload(&stream, &old_words);
        let staged = upload(&stream, &new_words);
        let q = upload(&stream, &x.q);
        let k = upload(&stream, &pages.k);
        let v = upload(&stream, &pages.v);
        let mut o = Outputs::<bf16>::new(&stream, &base, true);
        let table_words = batch * pg.table_stride;
        let mut run = |o: &mut Outputs<bf16>, live: &mut CudaSlice<i32>, late_write: bool| {
            o.poison(&stream);
            let live_ptr = live.device_ptr_mut(&stream).0;
            if late_write {
                let params = LateWriterParams {
                    dst: live_ptr,
                    src: staged.device_ptr(&stream).0,
                    count: new_words.len() as i32,
                    pad: 0,
                    pause_ns: 50_000,
                    stamps: stamps.device_ptr_mut(&stream).0,
                };
                launch_test_kernel(writer, &stream, &params, false);
            }
            let tensors = DecodeTensors {
                q: q.device_ptr(&stream).0,
                k: k.device_ptr(&stream).0,
                v: v.device_ptr(&stream).0,
                out: o.out.device_ptr_mut(&stream).0,
                lse: o.lse.as_mut().map(|l| l.device_ptr_mut(&stream).0),
                seqlens: Some(live_ptr + 4 * table_words as u64),
                block_table: Some(live_ptr),
                k_scale: None,
                v_scale: None,
                sinks: None,
                view_len: None,
            };
            // SAFETY: every pointer is live device memory of the sizes the problem implies.
            unsafe { dec.run(&tensors, stream.cu_stream()) }
                .unwrap_or_else(|e| panic!("page {page_size}: decode refused: {e}"));
            stream
                .synchronize()
                .unwrap_or_else(|e| panic!("page {page_size}: the decode failed on the GPU: {e}"));
            o.read(&stream)
        };
        let stale = run(&mut o, &mut live, true);
        assert_eq!(
            download(&stream, &live),
            new_words,
            "late_writer did not write"
        );
        check_output(&base, &stale, &want)
            .unwrap_or_else(|e| panic!("page {page_size}, table and lengths rewritten late: {e}"));
        let settled = run(&mut o, &mut live, false);
        same_bits(
            &stale,
            &settled,
            &format!("page {page_size}: late rewrite vs settled"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The test kernels above compile without a GPU (NVRTC only), so a mistake in them shows in CI
/// rather than on the GPU machine.
#[test]
fn late_writer_kernels_compile() {
    for entry in ["late_writer", "launched_at"] {
        let compiled = kvstream::jit::compile::compile(&LateWriterKernel(entry))
            .unwrap_or_else(|e| panic!("compiling {entry}: {e}"));
        assert!(!compiled.cubin.is_empty(), "{entry}: empty CUBIN");
    }
}

// ---------------------------------------------------------------------------------------------
// fp8 caches
// ---------------------------------------------------------------------------------------------

/// Bytes of an e4m3 NaN, written past each request's length.
const E4M3_POISON: E4m3 = E4m3(0x7f);

/// One fp8 problem's host data: q, the e4m3 caches (NaN past each length), their scales, and
/// the dequantised values the reference sees.
struct Fp8Inputs<T> {
    q: Vec<T>,
    k: Vec<E4m3>,
    v: Vec<E4m3>,
    k_scale: Vec<f32>,
    v_scale: Vec<f32>,
    q32: Vec<f32>,
    k32: Vec<f32>,
    v32: Vec<f32>,
    sinks: Option<Vec<f32>>,
}

/// The caches over e4m3's whole range (values up to 448, subnormals too) and scales in
/// [1/32, 1/4): the dequantised K and V are of order 1.
fn fp8_inputs<T: Half>(
    rng: &mut SplitMix64,
    p: &DecodeProblem,
    lens: &[usize],
    layout: KvScaleLayout,
) -> Fp8Inputs<T> {
    let (q, q32) = T::random(rng, p.batch * p.q_len * p.hq * p.head_dim);
    let cache = |rng: &mut SplitMix64| {
        let per_token = p.hkv * p.head_dim;
        let mut bits = Vec::with_capacity(p.batch * p.max_len * per_token);
        for &len in lens {
            for _ in 0..len * per_token {
                // log-uniform magnitudes reach the subnormals and 448
                let mag = 2f32.powf(rng.symmetric() * 9.0 - 0.5).min(448.0);
                bits.push(E4m3::from_f32(if rng.below(2) == 0 { mag } else { -mag }));
            }
            bits.extend(std::iter::repeat(E4M3_POISON).take((p.max_len - len) * per_token));
        }
        bits
    };
    let (k, v) = (cache(rng), cache(rng));
    let n = layout.len(p.batch, p.hkv);
    let scales = |rng: &mut SplitMix64| -> Vec<f32> {
        (0..n)
            .map(|_| (1.0 + rng.symmetric().abs() * 7.0) / 32.0)
            .collect()
    };
    let (k_scale, v_scale) = (scales(rng), scales(rng));
    let (k32, v32) = (
        dequantise(p, layout, &k, &k_scale),
        dequantise(p, layout, &v, &v_scale),
    );
    let sinks = p.sinks.then(|| random_sinks(rng, p.hq));
    Fp8Inputs {
        sinks,
        q,
        k,
        v,
        k_scale,
        v_scale,
        q32,
        k32,
        v32,
    }
}

/// The values a contiguous `[batch, max_len, hkv, d]` e4m3 cache holds with its scales.
fn dequantise(p: &DecodeProblem, layout: KvScaleLayout, bits: &[E4m3], scale: &[f32]) -> Vec<f32> {
    let (sb, sh) = layout.strides(p.hkv);
    bits.iter()
        .enumerate()
        .map(|(i, e)| {
            let h = i / p.head_dim % p.hkv;
            let b = i / (p.head_dim * p.hkv * p.max_len);
            e.to_f32() * scale[b * sb + h * sh]
        })
        .collect()
}

/// Contiguous `[batch, max_len, hkv, d]` caches scattered into shuffled pools of `p`'s pages,
/// any element type (see `page_inputs`).
fn scatter_pages<K: Copy>(
    rng: &mut SplitMix64,
    p: &DecodeProblem,
    k: &[K],
    v: &[K],
    poison: K,
) -> (Vec<K>, Vec<K>, Vec<i32>) {
    let pg = p.paged.expect("a paged problem");
    let per_token = p.hkv * p.head_dim;
    let per_page = pg.page_size * per_token;
    let pages_per_request = p.max_len.div_ceil(pg.page_size);
    let mut order: Vec<usize> = (0..pg.num_pages).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut kp = vec![poison; pg.num_pages * per_page];
    let mut vp = kp.clone();
    let mut table = vec![0i32; p.batch * pg.table_stride];
    for b in 0..p.batch {
        for j in 0..pg.table_stride {
            let slot = b * pg.table_stride + j;
            if j < pages_per_request {
                let page = order[b * pages_per_request + j];
                table[slot] = page as i32;
                let first = j * pg.page_size;
                let rows = pg.page_size.min(p.max_len - first);
                let src = (b * p.max_len + first) * per_token;
                let n = rows * per_token;
                kp[page * per_page..page * per_page + n].copy_from_slice(&k[src..src + n]);
                vp[page * per_page..page * per_page + n].copy_from_slice(&v[src..src + n]);
            } else {
                table[slot] = order[rng.below(p.batch * pages_per_request)] as i32;
            }
        }
    }
    (kp, vp, table)
}

/// One fp8 problem's device buffers.
struct Fp8Device<T> {
    q: CudaSlice<T>,
    k: CudaSlice<E4m3>,
    v: CudaSlice<E4m3>,
    k_scale: CudaSlice<f32>,
    v_scale: CudaSlice<f32>,
    seqlens: CudaSlice<i32>,
    table: Option<CudaSlice<i32>>,
    layout: KvScaleLayout,
    sinks: Option<CudaSlice<f32>>,
}

impl<T: Half> Fp8Device<T> {
    fn upload(
        stream: &Arc<CudaStream>,
        rng: &mut SplitMix64,
        p: &DecodeProblem,
        x: &Fp8Inputs<T>,
        lens: &[usize],
        layout: KvScaleLayout,
    ) -> Self {
        let (k, v, table) = match p.paged {
            Some(_) => {
                let (k, v, t) = scatter_pages(rng, p, &x.k, &x.v, E4M3_POISON);
                (
                    upload(stream, &k),
                    upload(stream, &v),
                    Some(upload(stream, &t)),
                )
            }
            None => (upload(stream, &x.k), upload(stream, &x.v), None),
        };
        Fp8Device {
            q: upload(stream, &x.q),
            k,
            v,
            k_scale: upload(stream, &x.k_scale),
            v_scale: upload(stream, &x.v_scale),
            seqlens: upload(stream, &lens_i32(lens)),
            table,
            layout,
            sinks: x.sinks.as_ref().map(|s| upload(stream, s)),
        }
    }

    fn tensors(&self, stream: &Arc<CudaStream>, o: &mut Outputs<T>) -> DecodeTensors {
        let scale = |s: &CudaSlice<f32>| KvScale {
            ptr: s.device_ptr(stream).0,
            layout: self.layout,
        };
        DecodeTensors {
            q: self.q.device_ptr(stream).0,
            k: self.k.device_ptr(stream).0,
            v: self.v.device_ptr(stream).0,
            out: o.out.device_ptr_mut(stream).0,
            lse: o.lse.as_mut().map(|l| l.device_ptr_mut(stream).0),
            seqlens: Some(self.seqlens.device_ptr(stream).0),
            block_table: self.table.as_ref().map(|t| t.device_ptr(stream).0),
            k_scale: Some(scale(&self.k_scale)),
            v_scale: Some(scale(&self.v_scale)),
            sinks: self.sinks.as_ref().map(|s| s.device_ptr(stream).0),
            view_len: None,
        }
    }
}

/// Poisons, runs through the raw API, waits, reads back.
fn run_fp8<T: Half>(
    stream: &Arc<CudaStream>,
    dec: &Decoder,
    x: &Fp8Device<T>,
    o: &mut Outputs<T>,
) -> Result<Output<T>, String> {
    o.poison(stream);
    let t = x.tensors(stream, o);
    // SAFETY: every pointer is a live allocation of the sizes the problem implies.
    unsafe { dec.run(&t, stream.cu_stream()) }.map_err(|e| format!("run refused: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("the decode failed on the GPU: {e}"))?;
    Ok(o.read(stream))
}

fn fp8_case<T: Half>(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    rng: &mut SplitMix64,
    p: &DecodeProblem,
    lens: &[usize],
    layout: KvScaleLayout,
    opts: PlanOptions,
) -> Result<Errors, String> {
    let x = fp8_inputs::<T>(rng, p, lens, layout);
    let mods = ref_mods(p, x.sinks.as_deref());
    let want = decode_reference_with(&RefShape::from(p), &mods, &x.q32, &x.k32, &x.v32, lens);
    let dev = Fp8Device::upload(stream, rng, p, &x, lens, layout);
    let dec = Decoder::new(rt, p.clone(), opts).map_err(|e| format!("Decoder::new: {e}"))?;
    let mut o = Outputs::<T>::new(stream, p, true);
    let first = run_fp8(stream, &dec, &dev, &mut o)?;
    let errors = check_output(p, &first, &want)?;
    let second = run_fp8(stream, &dec, &dev, &mut o)?;
    same_bits(&first, &second, "two runs")?;
    Ok(errors)
}

/// Expected run time: about a minute.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn fp8_cases_match_reference() {
    let (rt, stream) = open_gpu();
    let layouts = [
        KvScaleLayout::PerTensor,
        KvScaleLayout::PerKvHead,
        KvScaleLayout::PerRequestHead,
    ];
    let mut rng = SplitMix64::new(0xF8);
    let mut worst = Errors::default();
    let mut cases = 0;
    // (batch, hq, hkv, d, max_len, q_len): every column-tile count, both head dims
    let shapes = [
        (3, 16, 2, 128, 1500, 1),
        (2, 32, 4, 64, 2100, 1),
        (4, 8, 8, 128, 700, 1),
        (2, 64, 2, 128, 900, 1),
        (3, 32, 8, 64, 1200, 4),
        (2, 32, 2, 128, 513, 3),
        (1, 128, 8, 64, 4096, 2),
        (16, 32, 8, 128, 300, 1),
    ];
    // KVSTREAM_GPU_CASES below the default (the sanitizer runs) takes the first shapes only
    let keep = (env_u64("KVSTREAM_GPU_CASES", DEFAULT_CASES) as usize * shapes.len())
        .div_ceil(DEFAULT_CASES as usize)
        .clamp(1, shapes.len());
    for (i, &(batch, hq, hkv, d, len, q_len)) in shapes.iter().enumerate().take(keep) {
        let base = DecodeProblem::new(batch, hq, hkv, d, len, DType::Bf16)
            .and_then(|p| p.with_q_len(q_len))
            .and_then(|p| p.with_kv_dtype(KvDType::Fp8E4m3))
            .expect("a valid problem");
        let mut lens: Vec<usize> = (0..batch).map(|_| rng.below(len + 1)).collect();
        lens[0] = len;
        if batch > 1 {
            lens[batch - 1] = 0;
        }
        let layout = layouts[i % 3];
        let paired = PlanOptions {
            persistent_softmax_slices: Some(2),
            persistent_tile_tokens: Some(128),
            ..Default::default()
        };
        // the default (split engine below a GPU-filling batch), both engines forced, both
        // reductions of the split engine, its device plan
        let mut problems = vec![
            (base.clone(), PlanOptions::default()),
            (base.clone(), paired),
            (
                base.clone(),
                PlanOptions {
                    engine: Some(kvstream::Engine::Persistent),
                    ..Default::default()
                },
            ),
            (
                base.clone(),
                PlanOptions {
                    num_splits: Some(3),
                    reduction: Some(Reduction::Kernel),
                    ..Default::default()
                },
            ),
            (
                base.clone(),
                PlanOptions {
                    num_splits: Some(4),
                    reduction: Some(Reduction::Cluster),
                    ..Default::default()
                },
            ),
            (
                base.clone(),
                PlanOptions {
                    device_plan: true,
                    ..Default::default()
                },
            ),
        ];
        for page in [1, 16, 64] {
            let paged = base
                .clone()
                .with_paged(page, pool_pages(batch, len, page), None)
                .expect("a valid paged problem");
            if page >= 16 {
                // pages of 16 and more on the split engine too (pages of 1 take the persistent
                // engine at any batch)
                problems.push((
                    paged.clone(),
                    PlanOptions {
                        engine: Some(kvstream::Engine::Split),
                        ..Default::default()
                    },
                ));
            }
            for gather in [None, Some(true), Some(false)] {
                let opts = PlanOptions {
                    persistent_paged_gather: gather,
                    ..Default::default()
                };
                problems.push((paged.clone(), opts));
            }
        }
        for (p, opts) in problems {
            for q_dtype in [DType::Bf16, DType::F16] {
                let p = DecodeProblem {
                    dtype: q_dtype,
                    ..p.clone()
                };
                let what = format!("{p:?}, lens {lens:?}, {layout:?} scales, {opts:?}");
                let run_bytes = p.paged.map_or(128, |pg| pg.page_size * p.head_dim);
                if opts.persistent_paged_gather == Some(false) && run_bytes < 128 {
                    // boxes need 128-byte page runs: the plan refuses, naming the knob
                    let e = Decoder::new(&rt, p.clone(), opts)
                        .err()
                        .map(|e| e.to_string());
                    assert!(
                        e.as_deref()
                            .is_some_and(|m| m.contains("persistent_paged_gather")),
                        "{what}: {e:?}"
                    );
                    continue;
                }
                let r = match q_dtype {
                    DType::Bf16 => {
                        fp8_case::<bf16>(&rt, &stream, &mut rng, &p, &lens, layout, opts)
                    }
                    DType::F16 => fp8_case::<f16>(&rt, &stream, &mut rng, &p, &lens, layout, opts),
                };
                let e = r.unwrap_or_else(|e| panic!("{what}: {e}"));
                worst.rel = worst.rel.max(e.rel);
                worst.lse = worst.lse.max(e.lse);
                cases += 1;
            }
        }
    }
    println!(
        "fp8: {cases} cases pass; max rel err {:.3e}, max lse err {:.3e}",
        worst.rel, worst.lse
    );
}

/// Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn fp8_graph_replays_with_new_scales_and_lengths() {
    let (rt, stream) = open_gpu_own_stream();
    let ctx = rt.context().clone();
    let layout = KvScaleLayout::PerRequestHead;
    for page in [None, Some(16)] {
        let mut p = DecodeProblem::new(16, 32, 8, 128, 4096, DType::Bf16)
            .and_then(|p| p.with_kv_dtype(KvDType::Fp8E4m3))
            .expect("a valid problem");
        if let Some(page) = page {
            p = p
                .with_paged(page, pool_pages(16, 4096, page), None)
                .expect("a valid paged problem");
        }
        let dec = make_decoder(&rt, &p, PlanOptions::default());
        ctx.synchronize().expect("synchronising after Decoder::new");
        let full = vec![p.max_len; p.batch];
        let mut rng = SplitMix64::new(0xF8A);
        let mut x = fp8_inputs::<bf16>(&mut rng, &p, &full, layout);
        let mut dev = Fp8Device::upload(&stream, &mut rng, &p, &x, &full, layout);
        let mut graph_out = Outputs::<bf16>::new(&stream, &p, true);
        stream.synchronize().expect("uploads");
        let tensors = dev.tensors(&stream, &mut graph_out);
        // SAFETY: every pointer is a live allocation of the sizes the problem implies.
        let graph = capture_graph(&stream, || unsafe { dec.run(&tensors, stream.cu_stream()) })
            .unwrap_or_else(|e| panic!("{e}"));
        let mut skew = vec![40; p.batch];
        skew[3] = 4096;
        let ragged: Vec<usize> = (0..p.batch).map(|_| rng.below(4097)).collect();
        for (round, lens) in [full.clone(), skew, ragged, vec![0; p.batch]]
            .iter()
            .enumerate()
        {
            // new scales (and so new dequantised values) and lengths in the graph's buffers
            for s in x.k_scale.iter_mut().chain(x.v_scale.iter_mut()) {
                *s *= 1.0 + 0.25 * (round as f32 + 1.0);
            }
            x.k32 = dequantise(&p, layout, &x.k, &x.k_scale);
            x.v32 = dequantise(&p, layout, &x.v, &x.v_scale);
            overwrite(&stream, &x.k_scale, &mut dev.k_scale);
            overwrite(&stream, &x.v_scale, &mut dev.v_scale);
            overwrite(&stream, &lens_i32(lens), &mut dev.seqlens);
            graph_out.poison(&stream);
            graph.launch().expect("launching the graph");
            stream
                .synchronize()
                .expect("graph replay failed on the GPU");
            let replayed = graph_out.read(&stream);
            let mut fresh = Outputs::<bf16>::new(&stream, &p, true);
            let eager = run_fp8(&stream, &dec, &dev, &mut fresh).unwrap_or_else(|e| panic!("{e}"));
            let what = format!("fp8 graph, page {page:?}, round {round}");
            same_bits(&replayed, &eager, &what).unwrap_or_else(|e| panic!("{e}"));
            let want = decode_reference(&RefShape::from(&p), &x.q32, &x.k32, &x.v32, lens);
            let e = check_output(&p, &replayed, &want).unwrap_or_else(|e| panic!("{what}: {e}"));
            println!(
                "{what}: max rel err {:.3e}, max lse err {:.3e}",
                e.rel, e.lse
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The cache write
// ---------------------------------------------------------------------------------------------

/// Byte written over the caches before a write: whatever the write must not touch keeps it.
const CACHE_POISON: u8 = 0x5A;

/// One write checked byte for byte: every written slot holds exactly the copied bits (2-byte
/// cache) or `E4m3::from_f32(value / scale)` (fp8), every other byte its poison.
#[allow(clippy::too_many_arguments)]
fn check_written<T: Half>(
    p: &DecodeProblem,
    layout: Option<KvScaleLayout>,
    new: &[T],
    slots: &[i64],
    scale: &[f32],
    cache: &[u8],
    what: &str,
) -> Result<usize, String> {
    let (row, d) = (p.hkv * p.head_dim, p.head_dim);
    let eb = p.kv_elem_bytes();
    let (block_slots, block_stride, slot_stride, head_stride) = match p.paged {
        Some(pg) => (pg.page_size, pg.page_size * row, row, d),
        None => (
            p.max_len,
            p.k_strides.batch as usize,
            p.k_strides.token as usize,
            p.k_strides.head as usize,
        ),
    };
    let mut want = vec![CACHE_POISON; cache.len()];
    for (t, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let slot = slot as usize;
        let block = slot / block_slots;
        for h in 0..p.hkv {
            let base = block * block_stride + (slot % block_slots) * slot_stride + h * head_stride;
            let s = layout.map_or(1.0, |l| {
                let (sb, sh) = l.strides(p.hkv);
                scale[block * sb + h * sh]
            });
            for i in 0..d {
                let x = new[t * row + h * d + i];
                match p.kv_dtype {
                    KvDType::Fp8E4m3 => {
                        want[base + i] = E4m3::from_f32(x.to_f64() as f32 / s).0;
                    }
                    KvDType::AsQuery => {
                        want[(base + i) * eb..(base + i + 1) * eb]
                            .copy_from_slice(&x.raw().to_le_bytes());
                    }
                }
            }
        }
    }
    match want.iter().zip(cache).position(|(w, g)| w != g) {
        None => Ok(slots.iter().filter(|&&s| s >= 0).count()),
        Some(i) => Err(format!(
            "{what}: cache byte {i} is {:#04x}, want {:#04x}",
            cache[i], want[i]
        )),
    }
}

fn store_case<T: Half>(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    rng: &mut SplitMix64,
    p: &DecodeProblem,
    layout: Option<KvScaleLayout>,
) -> Result<usize, String> {
    let what = format!("{p:?}, scales {layout:?}");
    let writer = kvstream::KvWriter::new(rt, p).map_err(|e| format!("{what}: {e}"))?;
    let slots_total = match p.paged {
        Some(pg) => pg.num_pages * pg.page_size,
        None => p.batch * p.max_len,
    };
    let cache_elems = match p.paged {
        Some(pg) => pg.num_pages * pg.page_size * p.hkv * p.head_dim,
        None => p.batch * p.max_len * p.hkv * p.head_dim,
    };
    let bytes = cache_elems * p.kv_elem_bytes();
    let tokens = 37;
    // distinct slots, a few skipped
    let mut order: Vec<usize> = (0..slots_total).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut slots: Vec<i64> = order[..tokens].iter().map(|&s| s as i64).collect();
    for t in [3, 17, 36] {
        slots[t] = -1;
    }
    // values well past e4m3's range once divided by the scales: saturation is checked too
    let (mut k_new, _) = T::random(rng, tokens * p.hkv * p.head_dim);
    let (v_new, _) = T::random(rng, tokens * p.hkv * p.head_dim);
    k_new[5] = T::from_raw(
        if std::any::TypeId::of::<T>() == std::any::TypeId::of::<bf16>() {
            bf16::from_f32(3.0e4).to_bits()
        } else {
            f16::from_f32(3.0e4).to_bits()
        },
    );
    let n_scales = layout.map_or(1, |l| l.len(p.batch, p.hkv));
    let k_scale: Vec<f32> = (0..n_scales)
        .map(|i| 1.0 / 64.0 + i as f32 / 512.0)
        .collect();
    let v_scale: Vec<f32> = (0..n_scales)
        .map(|i| 1.0 / 128.0 + i as f32 / 1024.0)
        .collect();
    let dk = upload(stream, &k_new);
    let dv = upload(stream, &v_new);
    let mut dslots = upload(stream, &slots);
    let dks = upload(stream, &k_scale);
    let dvs = upload(stream, &v_scale);
    let mut kc = upload(stream, &vec![CACHE_POISON; bytes]);
    let mut vc = upload(stream, &vec![CACHE_POISON; bytes]);
    let scale = |s: &CudaSlice<f32>| {
        layout.map(|l| KvScale {
            ptr: s.device_ptr(stream).0,
            layout: l,
        })
    };
    let t = kvstream::StoreTensors {
        tokens,
        k_new: dk.device_ptr(stream).0,
        v_new: dv.device_ptr(stream).0,
        slots: dslots.device_ptr(stream).0,
        k_cache: kc.device_ptr_mut(stream).0,
        v_cache: vc.device_ptr_mut(stream).0,
        k_scale: scale(&dks),
        v_scale: scale(&dvs),
    };
    // SAFETY: every pointer is a live allocation of the sizes the problem implies.
    unsafe { writer.run(&t, stream.cu_stream()) }.map_err(|e| format!("{what}: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("{what}: the write failed on the GPU: {e}"))?;
    let mut written = check_written(
        p,
        layout,
        &k_new,
        &slots,
        &k_scale,
        &download(stream, &kc),
        &format!("{what}, K"),
    )?;
    written += check_written(
        p,
        layout,
        &v_new,
        &slots,
        &v_scale,
        &download(stream, &vc),
        &format!("{what}, V"),
    )?;

    // the safe slice API writes the same bytes (fp8 caches as E4m3 slices)
    if p.kv_dtype == KvDType::Fp8E4m3 {
        let mut k8 = upload(stream, &vec![E4m3(CACHE_POISON); bytes]);
        let mut v8 = upload(stream, &vec![E4m3(CACHE_POISON); bytes]);
        let scales = layout.map(|_| kvstream::Fp8Scales { k: &dks, v: &dvs });
        writer
            .run_slices(stream, &dk, &dv, &dslots, &mut k8, &mut v8, scales)
            .map_err(|e| format!("{what}: run_slices: {e}"))?;
        let bytes_of =
            |c: &CudaSlice<E4m3>| -> Vec<u8> { download(stream, c).iter().map(|e| e.0).collect() };
        if bytes_of(&k8) != download(stream, &kc) || bytes_of(&v8) != download(stream, &vc) {
            return Err(format!("{what}: run_slices wrote other bytes than run"));
        }
        let short = stream.alloc_zeros::<i64>(tokens - 1).expect("allocating");
        let e = writer.run_slices(stream, &dk, &dv, &short, &mut k8, &mut v8, scales);
        if !e
            .as_ref()
            .is_err_and(|e| e.to_string().contains("slot_mapping"))
        {
            return Err(format!(
                "{what}: a short slot_mapping was not refused: {e:?}"
            ));
        }
    }

    // captured once, replayed with other slots written into the same buffer
    overwrite(stream, &vec![CACHE_POISON; bytes], &mut kc);
    overwrite(stream, &vec![CACHE_POISON; bytes], &mut vc);
    stream.synchronize().expect("poisoning the caches");
    // SAFETY: as above.
    let graph = capture_graph(stream, || unsafe { writer.run(&t, stream.cu_stream()) })
        .map_err(|e| format!("{what}: {e}"))?;
    let replay_slots: Vec<i64> = order[tokens..2 * tokens]
        .iter()
        .map(|&s| s as i64)
        .collect();
    overwrite(stream, &replay_slots, &mut dslots);
    graph
        .launch()
        .map_err(|e| format!("{what}: launching the graph: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("{what}: the replay failed on the GPU: {e}"))?;
    check_written(
        p,
        layout,
        &k_new,
        &replay_slots,
        &k_scale,
        &download(stream, &kc),
        &format!("{what}, K replay"),
    )?;
    Ok(written)
}

/// Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn store_kv_writes_exactly_the_slots_given() {
    let (rt, stream) = open_gpu_own_stream();
    let mut rng = SplitMix64::new(0x5707E);
    let mut cases = 0;
    for d in [64, 128] {
        for kv in [KvDType::Fp8E4m3, KvDType::AsQuery] {
            let base = DecodeProblem::new(3, 16, 4, d, 96, DType::Bf16)
                .and_then(|p| p.with_kv_dtype(kv))
                .expect("a valid problem");
            let paged = base
                .clone()
                .with_paged(16, 40, None)
                .expect("a valid paged problem");
            let layouts: &[Option<KvScaleLayout>] = match kv {
                KvDType::Fp8E4m3 => &[
                    None,
                    Some(KvScaleLayout::PerTensor),
                    Some(KvScaleLayout::PerKvHead),
                    Some(KvScaleLayout::PerRequestHead),
                ],
                KvDType::AsQuery => &[None],
            };
            for p in [base, paged] {
                for &layout in layouts {
                    if p.paged.is_some() && layout == Some(KvScaleLayout::PerRequestHead) {
                        continue;
                    }
                    for dtype in [DType::Bf16, DType::F16] {
                        let p = DecodeProblem { dtype, ..p.clone() };
                        let r = match dtype {
                            DType::Bf16 => store_case::<bf16>(&rt, &stream, &mut rng, &p, layout),
                            DType::F16 => store_case::<f16>(&rt, &stream, &mut rng, &p, layout),
                        };
                        r.unwrap_or_else(|e| panic!("{e}"));
                        cases += 1;
                    }
                }
            }
        }
    }
    println!("store_kv: {cases} cases written byte-exact, eager and replayed");
}

// ---------------------------------------------------------------------------------------------
// Views of a growing cache
// ---------------------------------------------------------------------------------------------

/// One decoder made for a cache's capacity serves views of its first n positions
/// (`DecodeTensors::view_len`): with and without lengths (none: every request n long), on both
/// engines, equal to the reference of the view; positions past the view hold NaN (never read).
/// Bad view lengths are refused by name.
#[test]
#[ignore = "needs an H100/H200"]
fn views_of_a_growing_cache_share_one_decoder() {
    let (rt, stream) = open_gpu();
    let mut rng = SplitMix64::new(31);
    let capacity = 4096;
    for (batch, hq, hkv, d, engine) in [
        (2, 32, 8, 128, kvstream::Engine::Split),
        (16, 32, 8, 128, kvstream::Engine::Persistent),
        (3, 8, 1, 64, kvstream::Engine::Persistent),
    ] {
        let p = DecodeProblem::new(batch, hq, hkv, d, capacity, DType::Bf16).unwrap();
        let opts = PlanOptions {
            engine: Some(engine),
            ..Default::default()
        };
        let dec = make_decoder(&rt, &p, opts);
        for (view, with_lens) in [
            (1, false),
            (300, true),
            (300, false),
            (2049, true),
            (4096, false),
        ] {
            // the cache's positions past the view hold NaN: a read past it reaches the output
            let lens: Vec<usize> = (0..batch)
                .map(|b| {
                    if with_lens {
                        rng.below(view + 1).max(b % 2)
                    } else {
                        view
                    }
                })
                .collect();
            let x: Inputs<bf16> = make_inputs(&mut rng, &p, &vec![view; batch]);
            let want = reference(&p, &x, &lens);
            let dev = DeviceInputs::upload(&stream, &x, with_lens.then_some(&lens[..]));
            let mut o = Outputs::new(&stream, &p, true);
            o.poison(&stream);
            let t = DecodeTensors {
                view_len: Some(view),
                ..raw_tensors(&stream, &dev, &mut o)
            };
            // SAFETY: the buffers hold the problem's sizes and outlive the sync below.
            unsafe { dec.run(&t, stream.cu_stream()) }.unwrap();
            stream.synchronize().unwrap();
            let label =
                format!("{batch}x{hq}/{hkv} d{d} {engine:?}, view {view}, lens {with_lens}");
            check_output(&p, &o.read(&stream), &want).unwrap_or_else(|e| panic!("{label}: {e}"));
        }
        let x: Inputs<bf16> = make_inputs(&mut rng, &p, &vec![capacity; batch]);
        let dev = DeviceInputs::upload(&stream, &x, None);
        let mut o = Outputs::new(&stream, &p, false);
        for bad in [0, capacity + 1] {
            let t = DecodeTensors {
                view_len: Some(bad),
                ..raw_tensors(&stream, &dev, &mut o)
            };
            // SAFETY: refused before any launch.
            let r = unsafe { dec.run(&t, stream.cu_stream()) };
            assert_eq!(rejected_arg(r, "view_len"), "view_len");
        }
    }
    println!("views: one decoder per capacity matches the reference of every view");
}

// ---------------------------------------------------------------------------------------------
// MLA decode
// ---------------------------------------------------------------------------------------------

#[path = "gpu/mla.rs"]
mod mla;

// ---------------------------------------------------------------------------------------------
// Model coverage: head dims 96 and 256, windows, softcap, sinks
// ---------------------------------------------------------------------------------------------

#[path = "gpu/models.rs"]
mod models;

// ---------------------------------------------------------------------------------------------
// Merging partial states (context parallelism)
// ---------------------------------------------------------------------------------------------

#[path = "gpu/merge.rs"]
mod merge;
