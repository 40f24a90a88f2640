//! The decode operation: a planned problem bound to a GPU, ready to launch on any stream.
//!
//! [`Decoder::new`] does everything that may be slow or allocate (plan, compile and load the
//! kernels, allocate the split workspace for the problem's maxima); [`Decoder::run`] only checks
//! pointers and enqueues one or two kernels, so it can be called while a stream is being captured
//! into a CUDA graph and replayed with new lengths.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::error::{Error, Result};
use crate::fp8::E4m3;
use crate::kernels::{AnyVariant, PlanWorkVariant, COMBINE_THREADS};
use crate::launch::{
    joined_page_map, kv_tensor_map, launch, max_active_clusters, LaunchConfig, TmaElement,
    TmaPromotion,
};
use crate::params::{DecodeParams, PersistentParams, SCHEDULE_LOG_PIECES};
use crate::plan::{choose, DecodePlan, PersistentPlan, Plan, PlanOptions, Reduction};
use crate::problem::{DType, DecodeProblem, KvDType, KvScaleLayout, KvStrides, PagedKv};
use crate::runtime::{LoadedKernel, Runtime};
use crate::schedule::Piece;

/// Device pointers of one call. Layouts (contiguous unless the problem says otherwise):
/// q `[batch, q_len, hq, d]`, k and v `[batch, max_len, hkv, d]` with the problem's strides (or,
/// paged, pools `[num_pages, page_size, hkv, d]`), out `[batch, q_len, hq, d]`,
/// lse `[batch, q_len, hq]` f32, seqlens `[batch]` i32, block_table `[batch, table_stride]` i32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeTensors {
    /// Queries.
    pub q: u64,
    /// K cache.
    pub k: u64,
    /// V cache.
    pub v: u64,
    /// Output, same dtype as q.
    pub out: u64,
    /// Optional log-sum-exp output (natural log, f32).
    pub lse: Option<u64>,
    /// Optional per-request lengths on the device (each in 0..=max_len; larger values are
    /// clamped to max_len by the kernel, never read past it).
    pub seqlens: Option<u64>,
    /// Paged caches: each request's page ids (required exactly when the problem is paged).
    pub block_table: Option<u64>,
    /// fp8 caches: K's dequantisation scales (`None`: 1).
    pub k_scale: Option<KvScale>,
    /// fp8 caches: V's dequantisation scales (`None`: 1).
    pub v_scale: Option<KvScale>,
    /// Attention sinks, f32 `[hq]` (required exactly when the problem has
    /// [`DecodeProblem::sinks`]); read at every call.
    pub sinks: Option<u64>,
    /// A contiguous cache read as a view of its first `view_len` positions (1..=max_len): the
    /// problem describes the cache's capacity, this call's requests have at most `view_len`
    /// positions (`seqlens` are clamped to it, as to max_len). One decoder then serves every
    /// view of a growing cache. `None`: max_len.
    pub view_len: Option<usize>,
}

/// The FP32 dequantisation scales of an fp8 cache on the device, read at every call (a graph
/// replay sees new values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvScale {
    /// Device address of `layout.len(batch, hkv)` f32 values.
    pub ptr: u64,
    /// How they are indexed.
    pub layout: KvScaleLayout,
}

/// Element types the safe slice API accepts.
pub trait Element: cudarc::driver::DeviceRepr + Copy {
    /// The matching kvstream dtype.
    const DTYPE: DType;
    /// The value, widened exactly.
    fn to_f64(self) -> f64;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
}

/// Element types of K and V the safe slice API accepts: the query's type, or [`E4m3`].
pub trait KvElement: cudarc::driver::DeviceRepr + Copy {
    /// The cache dtype this element makes with a query of `q`, if they pair.
    fn kv_dtype_with(q: DType) -> Option<KvDType>;
}
impl<T: Element> KvElement for T {
    fn kv_dtype_with(q: DType) -> Option<KvDType> {
        (T::DTYPE == q).then_some(KvDType::AsQuery)
    }
}
impl KvElement for E4m3 {
    fn kv_dtype_with(_: DType) -> Option<KvDType> {
        Some(KvDType::Fp8E4m3)
    }
}

/// The dequantisation scales of an fp8 cache for the safe slice API: f32 slices of 1, `hkv` or
/// `batch * hkv` elements ([`KvScaleLayout`], told apart by their length).
#[derive(Clone, Copy, Debug)]
pub struct Fp8Scales<'a> {
    /// K's scales.
    pub k: &'a CudaSlice<f32>,
    /// V's scales.
    pub v: &'a CudaSlice<f32>,
}

/// A decode problem planned and loaded on one GPU.
///
/// A decoder owns one split workspace: calls on one stream (or one captured graph) are ordered,
/// but two calls of the same decoder must not be in flight on two streams at once; give each
/// concurrent stream its own decoder.
///
/// ```no_run
/// use kvstream::{DType, DecodeProblem, Decoder, PlanOptions, Runtime};
/// # fn main() -> kvstream::Result<()> {
/// let rt = Runtime::new(0)?;
/// let problem = DecodeProblem::new(1, 16, 2, 128, 4096, DType::Bf16)?;
/// let decoder = Decoder::new(&rt, problem, PlanOptions::default())?;
/// let stream = rt.context().default_stream();
/// let q = stream.alloc_zeros::<half::bf16>(16 * 128).unwrap();
/// let k = stream.alloc_zeros::<half::bf16>(4096 * 2 * 128).unwrap();
/// let v = stream.alloc_zeros::<half::bf16>(4096 * 2 * 128).unwrap();
/// let mut out = stream.alloc_zeros::<half::bf16>(16 * 128).unwrap();
/// decoder.run_slices(&stream, &q, &k, &v, &mut out, None, None)?;
/// # Ok(()) }
/// ```
pub struct Decoder {
    rt: Arc<Runtime>,
    problem: DecodeProblem,
    plan: Plan,
    engine: Engine,
}

/// What each engine holds on the GPU.
enum Engine {
    Persistent(PersistentEngine),
    Split(SplitEngine),
}

struct PersistentEngine {
    plan: PersistentPlan,
    kernel: LoadedKernel,
    /// `[o_partial | ml_partial | arrivals | warm_hints]` (PersistentPlan::workspace_offsets);
    /// the arrival counters are zeroed here once and every call leaves them zero.
    workspace: (CudaSlice<u8>, u64),
    /// Per-CTA record of the pieces (PlanOptions::record_schedule).
    schedule_log: Option<(CudaSlice<i32>, u64)>,
}

struct SplitEngine {
    plan: DecodePlan,
    decode: LoadedKernel,
    combine: Option<LoadedKernel>,
    /// The device-side work planner, for device-planned problems.
    planner: Option<LoadedKernel>,
    /// Owned split workspace and its device address (taken once, so `run` does no stream
    /// bookkeeping on it).
    workspace: Option<(CudaSlice<u8>, u64)>,
}

/// Allocates `bytes` on the default stream, zeroed, and waits for it so that calls on any
/// other stream (a capture stream, PyTorch's) can use it at once.
pub(crate) fn alloc_zeroed<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    rt: &Runtime,
    len: usize,
    what: &str,
) -> Result<(CudaSlice<T>, u64)> {
    let stream = rt.context().default_stream();
    let buf = stream
        .alloc_zeros::<T>(len.max(1))
        .map_err(|e| Error::driver(format!("allocating {what}"), e))?;
    let ptr = buf.device_ptr(&stream).0;
    stream
        .synchronize()
        .map_err(|e| Error::driver(format!("allocating {what}"), e))?;
    Ok((buf, ptr))
}

impl Decoder {
    /// Plans `problem` for this GPU, loads its kernels and allocates the split workspace.
    pub fn new(rt: &Arc<Runtime>, problem: DecodeProblem, options: PlanOptions) -> Result<Self> {
        let mut plan = choose(&problem, rt.facts(), options)?;
        let engine = match &plan {
            Plan::Persistent(pp) => {
                let kernel = rt.kernel(
                    AnyVariant::Persistent(pp.variant),
                    pp.variant.shared_bytes(),
                )?;
                // a cut unit's merge waits for all of its pieces' CTAs: the grid must be
                // resident at once
                // SAFETY: the kernel was just loaded into the runtime's context.
                let per_sm = unsafe {
                    crate::launch::max_active_ctas_per_sm(
                        kernel.func,
                        pp.variant.threads(),
                        pp.variant.shared_bytes(),
                    )?
                };
                let resident = per_sm * rt.facts().sm_count;
                if pp.grid > resident {
                    return Err(Error::invalid(
                        "persistent_ctas",
                        pp.grid,
                        format!(
                            "at most {resident} for {}: {per_sm} of its CTAs fit an SM at once \
                             (its merge waits for every CTA of the grid)",
                            crate::kernels::Variant::name(&pp.variant)
                        ),
                    ));
                }
                let (.., bytes) = pp.workspace_offsets(&problem);
                let workspace = alloc_zeroed::<u8>(rt, bytes, "the decode workspace")?;
                let schedule_log = if options.record_schedule {
                    let len = pp.grid * (SCHEDULE_LOG_PIECES + 1) * 4;
                    Some(alloc_zeroed::<i32>(rt, len, "the schedule log")?)
                } else {
                    None
                };
                Engine::Persistent(PersistentEngine {
                    plan: *pp,
                    kernel,
                    workspace,
                    schedule_log,
                })
            }
            Plan::Split(sp) => {
                let (split_plan, engine) =
                    SplitEngine::without_cluster_waves(rt, &problem, options, sp)?;
                plan = Plan::Split(split_plan);
                Engine::Split(engine)
            }
        };
        Ok(Decoder {
            rt: rt.clone(),
            problem,
            plan,
            engine,
        })
    }

    /// The problem this decoder serves.
    pub fn problem(&self) -> &DecodeProblem {
        &self.problem
    }

    /// The plan it executes.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// What the device planner decided at the last call (per request: split count, first FP32
    /// partial slot), read back from the workspace after synchronising `stream`, the stream that
    /// call ran on. `None` unless the split engine runs with a device plan. For reports and
    /// tests: compare it with [`crate::plan::device_plan_splits`].
    pub fn last_device_plan(
        &self,
        stream: &Arc<CudaStream>,
    ) -> Result<Option<Vec<(usize, usize)>>> {
        let Engine::Split(e) = &self.engine else {
            return Ok(None);
        };
        let (Some(_), Some((buf, _))) = (e.plan.device_plan, &e.workspace) else {
            return Ok(None);
        };
        let offset = e.plan.workspace.offsets().request_plan;
        let bytes = 2 * 4 * self.problem.batch;
        let raw = stream
            .clone_dtoh(&buf.slice(offset..offset + bytes))
            .map_err(|e| Error::driver("reading the device plan back", e))?;
        stream
            .synchronize()
            .map_err(|e| Error::driver("reading the device plan back", e))?;
        let word =
            |i: usize| i32::from_le_bytes(raw[4 * i..4 * i + 4].try_into().unwrap()) as usize;
        Ok(Some(
            (0..self.problem.batch)
                .map(|b| (word(2 * b), word(2 * b + 1)))
                .collect(),
        ))
    }

    /// The pieces each CTA of the persistent engine streamed at the last call (index: CTA;
    /// CTAs without work have none), read back after synchronising `stream`. `None` unless the
    /// decoder was built with [`PlanOptions::record_schedule`]. For tests: compare with
    /// [`crate::schedule::pieces_in_window`] (`tiles`, `start` and `origin` are not
    /// recorded and read 0).
    pub fn last_schedule(&self, stream: &Arc<CudaStream>) -> Result<Option<Vec<Vec<Piece>>>> {
        let Engine::Persistent(PersistentEngine {
            schedule_log: Some((log, _)),
            ..
        }) = &self.engine
        else {
            return Ok(None);
        };
        read_schedule_log(log, stream).map(Some)
    }

    /// Registers of the decode kernel (from ptxas), for reports.
    pub fn decode_registers(&self) -> u32 {
        match &self.engine {
            Engine::Persistent(e) => e.kernel.report.registers,
            Engine::Split(e) => e.decode.report.registers,
        }
    }

    /// Enqueues one decode on `stream` (a raw `CUstream`, e.g. PyTorch's current stream).
    ///
    /// # Safety
    /// The pointers must reference device memory of this runtime's GPU with at least the sizes
    /// the layouts in [`DecodeTensors`] imply for this problem, and stay valid until the work
    /// completes. `stream` must belong to this runtime's context.
    pub unsafe fn run(&self, t: &DecodeTensors, stream: sys::CUstream) -> Result<()> {
        let rt = &self.rt;
        rt.check_pointer("q", t.q, 16)?;
        rt.check_pointer("k_cache", t.k, 16)?;
        rt.check_pointer("v_cache", t.v, 16)?;
        rt.check_pointer("out", t.out, 16)?;
        if let Some(lse) = t.lse {
            rt.check_pointer("lse", lse, 4)?;
        }
        if let Some(s) = t.seqlens {
            rt.check_pointer("cache_seqlens", s, 4)?;
        }
        match (self.problem.paged, t.block_table) {
            (Some(_), Some(bt)) => rt.check_pointer("block_table", bt, 4)?,
            (Some(_), None) => {
                return Err(Error::invalid(
                    "block_table",
                    "none",
                    "a device pointer: the problem has a paged cache",
                ))
            }
            (None, Some(_)) => {
                return Err(Error::invalid(
                    "block_table",
                    "a pointer",
                    "none: the problem has a contiguous cache (use DecodeProblem::with_paged)",
                ))
            }
            (None, None) => {}
        }
        for (arg, scale) in [("k_scale", t.k_scale), ("v_scale", t.v_scale)] {
            self.problem.check_scale_given(arg, scale.is_some())?;
            if let Some(scale) = scale {
                rt.check_pointer(arg, scale.ptr, 4)?;
            }
        }
        match (self.problem.sinks, t.sinks) {
            (true, Some(s)) => rt.check_pointer("sinks", s, 4)?,
            (true, None) => {
                return Err(Error::invalid(
                    "sinks",
                    "none",
                    "a device pointer to hq f32 logits: the problem has sinks",
                ))
            }
            (false, Some(_)) => {
                return Err(Error::invalid(
                    "sinks",
                    "a pointer",
                    "none: the problem has no sinks (use DecodeProblem::with_sinks)",
                ))
            }
            (false, None) => {}
        }
        if let Some(n) = t.view_len {
            if self.problem.paged.is_some() {
                return Err(Error::invalid(
                    "view_len",
                    n,
                    "none for a paged cache (its lengths bound what is read)",
                ));
            }
            if n == 0 || n > self.problem.max_len {
                return Err(Error::invalid(
                    "view_len",
                    n,
                    format!("1..={} (the problem's max_len)", self.problem.max_len),
                ));
            }
        }
        rt.bind()?;
        match &self.engine {
            Engine::Persistent(e) => e.run(&self.problem, t, stream),
            Engine::Split(e) => e.run(&self.problem, t, stream),
        }
    }

    /// Safe form of [`Decoder::run`] on cudarc slices: checks dtype and lengths, then enqueues
    /// on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_slices<T: Element, K: KvElement>(
        &self,
        stream: &Arc<CudaStream>,
        q: &CudaSlice<T>,
        k: &CudaSlice<K>,
        v: &CudaSlice<K>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
        seqlens: Option<&CudaSlice<i32>>,
    ) -> Result<()> {
        self.run_slices_with_table(stream, q, k, v, out, lse, seqlens, None, None, None)
    }

    /// [`Decoder::run_slices`] / [`Decoder::run_paged_slices`] (`block_table` given) on an fp8
    /// cache with its scales (`None`: 1).
    #[allow(clippy::too_many_arguments)]
    pub fn run_fp8_slices<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        q: &CudaSlice<T>,
        k: &CudaSlice<E4m3>,
        v: &CudaSlice<E4m3>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
        seqlens: Option<&CudaSlice<i32>>,
        block_table: Option<&CudaSlice<i32>>,
        scales: Option<Fp8Scales<'_>>,
    ) -> Result<()> {
        self.run_slices_with_table(
            stream,
            q,
            k,
            v,
            out,
            lse,
            seqlens,
            block_table,
            scales,
            None,
        )
    }

    /// [`Decoder::run_slices`] for a paged problem: `k_pages` and `v_pages` are the pools
    /// `[num_pages, page_size, hkv, d]`, `block_table` the int32 `[batch, table_stride]` page ids.
    #[allow(clippy::too_many_arguments)]
    pub fn run_paged_slices<T: Element, K: KvElement>(
        &self,
        stream: &Arc<CudaStream>,
        q: &CudaSlice<T>,
        k_pages: &CudaSlice<K>,
        v_pages: &CudaSlice<K>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
        seqlens: Option<&CudaSlice<i32>>,
        block_table: &CudaSlice<i32>,
    ) -> Result<()> {
        self.run_slices_with_table(
            stream,
            q,
            k_pages,
            v_pages,
            out,
            lse,
            seqlens,
            Some(block_table),
            None,
            None,
        )
    }

    /// The general form of the slice API, for a problem with attention sinks
    /// ([`DecodeProblem::with_sinks`]): `sinks` holds one f32 logit per query head (`[hq]`);
    /// `block_table` as in [`Decoder::run_paged_slices`], `scales` as in
    /// [`Decoder::run_fp8_slices`].
    #[allow(clippy::too_many_arguments)]
    pub fn run_slices_with_sinks<T: Element, K: KvElement>(
        &self,
        stream: &Arc<CudaStream>,
        q: &CudaSlice<T>,
        k: &CudaSlice<K>,
        v: &CudaSlice<K>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
        seqlens: Option<&CudaSlice<i32>>,
        block_table: Option<&CudaSlice<i32>>,
        scales: Option<Fp8Scales<'_>>,
        sinks: &CudaSlice<f32>,
    ) -> Result<()> {
        self.run_slices_with_table(
            stream,
            q,
            k,
            v,
            out,
            lse,
            seqlens,
            block_table,
            scales,
            Some(sinks),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn run_slices_with_table<T: Element, K: KvElement>(
        &self,
        stream: &Arc<CudaStream>,
        q: &CudaSlice<T>,
        k: &CudaSlice<K>,
        v: &CudaSlice<K>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
        seqlens: Option<&CudaSlice<i32>>,
        block_table: Option<&CudaSlice<i32>>,
        scales: Option<Fp8Scales<'_>>,
        sinks: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        let p = &self.problem;
        if T::DTYPE != p.dtype {
            return Err(Error::invalid(
                "q, out",
                T::DTYPE.name(),
                format!("{} (the problem's dtype)", p.dtype.name()),
            ));
        }
        if K::kv_dtype_with(T::DTYPE) != Some(p.kv_dtype) {
            return Err(Error::invalid(
                "k_cache, v_cache",
                std::any::type_name::<K>(),
                format!(
                    "elements of the problem's kv_dtype ({}, with q {})",
                    p.kv_dtype.name(),
                    p.dtype.name()
                ),
            ));
        }
        let scale_of = |arg: &'static str, s: &CudaSlice<f32>| -> Result<KvScale> {
            Ok(KvScale {
                ptr: s.device_ptr(stream).0,
                layout: KvScaleLayout::of_tensor(arg, s.len(), p.batch, p.hkv)?,
            })
        };
        let (k_scale, v_scale) = match scales {
            Some(sc) => (
                Some(scale_of("k_scale", sc.k)?),
                Some(scale_of("v_scale", sc.v)?),
            ),
            None => (None, None),
        };
        let rows = p.batch * p.q_len * p.hq;
        let need_q = rows * p.head_dim;
        let kv_need = |s: KvStrides| match p.paged {
            Some(pg) => (pg.num_pages * pg.page_size * p.hkv * p.head_dim) as i64,
            None => {
                (p.batch as i64 - 1) * s.batch
                    + (p.max_len as i64 - 1) * s.token
                    + (p.hkv as i64 - 1) * s.head
                    + p.head_dim as i64
            }
        };
        if let Some(sk) = sinks {
            check_lengths(&[("sinks", sk.len(), p.hq, " (one per query head)")])?;
        }
        check_slice_lengths(
            &[
                ("q", q.len(), need_q, ""),
                ("k_cache", k.len(), kv_need(p.k_strides) as usize, ""),
                ("v_cache", v.len(), kv_need(p.v_strides) as usize, ""),
                ("out", out.len(), need_q, ""),
            ],
            rows,
            p.batch,
            lse.as_ref().map(|l| l.len()),
            seqlens,
            block_table,
            p.paged,
        )?;
        let (qp, _g1) = q.device_ptr(stream);
        let (kp, _g2) = k.device_ptr(stream);
        let (vp, _g3) = v.device_ptr(stream);
        let (op, _g4) = out.device_ptr_mut(stream);
        let mut lse = lse;
        let lse_ptr = lse.as_mut().map(|l| l.device_ptr_mut(stream));
        let seq_ptr = seqlens.map(|s| s.device_ptr(stream));
        let table_ptr = block_table.map(|s| s.device_ptr(stream));
        let sinks_ptr = sinks.map(|s| s.device_ptr(stream));
        let tensors = DecodeTensors {
            q: qp,
            k: kp,
            v: vp,
            out: op,
            lse: lse_ptr.as_ref().map(|(p, _)| *p),
            seqlens: seq_ptr.as_ref().map(|(p, _)| *p),
            block_table: table_ptr.as_ref().map(|(p, _)| *p),
            k_scale,
            v_scale,
            sinks: sinks_ptr.as_ref().map(|(p, _)| *p),
            view_len: None,
        };
        // SAFETY: lengths checked above; the slices outlive the enqueue and cudarc's guards
        // record the stream use.
        unsafe { self.run(&tensors, stream.cu_stream()) }
    }
}

impl SplitEngine {
    fn new(rt: &Arc<Runtime>, plan: DecodePlan) -> Result<Self> {
        let decode = rt.kernel(AnyVariant::Decode(plan.decode), plan.decode_shared_bytes)?;
        let combine = match plan.combine {
            Some(c) => Some(rt.kernel(AnyVariant::Combine(c), 0)?),
            None => None,
        };
        let planner = match plan.device_plan {
            Some(_) => Some(rt.kernel(AnyVariant::PlanWork(PlanWorkVariant), 0)?),
            None => None,
        };
        // the workspace is write-before-read in every call (see combine.cu)
        let workspace = match plan.workspace.bytes() {
            0 => None,
            bytes => Some(alloc_zeroed::<u8>(rt, bytes, "the split workspace")?),
        };
        let engine = SplitEngine {
            plan,
            decode,
            combine,
            planner,
            workspace,
        };
        if engine.cluster() {
            // SAFETY: the decode kernel was loaded into this runtime's context just above.
            let fits = unsafe { max_active_clusters(engine.decode.func, &engine.decode_config())? };
            if fits == 0 {
                return Err(Error::invalid(
                    "num_splits",
                    engine.plan.num_splits,
                    format!(
                        "a cluster size this GPU can co-schedule with {} B of shared memory per \
                         CTA (cluster reduction); use fewer splits or kernel reduction",
                        engine.plan.decode_shared_bytes
                    ),
                ));
            }
        }
        Ok(engine)
    }

    /// The engine of `plan`, or where the heuristic chose a cluster merge whose clusters the GPU
    /// cannot hold at once (a GPC holds fewer clusters of 8 large CTAs than its SMs suggest, and
    /// the grid would run in waves: plan::clusters_fit_one_wave), of the same problem merged by
    /// kernel; with the plan it runs.
    fn without_cluster_waves(
        rt: &Arc<Runtime>,
        problem: &DecodeProblem,
        options: PlanOptions,
        plan: &DecodePlan,
    ) -> Result<(DecodePlan, Self)> {
        let engine = SplitEngine::new(rt, plan.clone())?;
        if !crate::plan::cluster_merge_checked(plan, &options) {
            return Ok((plan.clone(), engine));
        }
        // SAFETY: the decode kernel was loaded into this runtime's context by new().
        let resident = unsafe { max_active_clusters(engine.decode.func, &engine.decode_config())? };
        if crate::plan::clusters_fit_one_wave(plan, resident) {
            return Ok((plan.clone(), engine));
        }
        let kernel_merge = PlanOptions {
            reduction: Some(Reduction::Kernel),
            ..options
        };
        let Plan::Split(merged) = choose(problem, rt.facts(), kernel_merge)? else {
            unreachable!("the reduction is a knob of the split engine")
        };
        Ok((merged.clone(), SplitEngine::new(rt, merged)?))
    }

    /// Whether the splits merge inside a thread-block cluster (no combine launch).
    fn cluster(&self) -> bool {
        self.plan.reduction == Reduction::Cluster && self.plan.num_splits > 1
    }

    /// Launch configuration of the decode kernel.
    fn decode_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: self.plan.grid,
            block: [self.plan.decode.threads(), 1, 1],
            shared_bytes: self.plan.decode_shared_bytes as u32,
            pdl: self.plan.pdl,
            cluster: self
                .cluster()
                .then_some([self.plan.num_splits as u32, 1, 1]),
        }
    }

    /// # Safety
    /// As [`Decoder::run`], pointers checked.
    unsafe fn run(
        &self,
        p: &DecodeProblem,
        t: &DecodeTensors,
        stream: sys::CUstream,
    ) -> Result<()> {
        let (ws, off) = match &self.workspace {
            Some((_, ptr)) => (*ptr, self.plan.workspace.offsets()),
            None => (0, Default::default()),
        };
        let at = |off: usize| if ws == 0 { 0 } else { ws + off as u64 };
        let tile = self.plan.decode.box_tokens();
        let map = |arg, ptr, strides| match p.paged {
            // pages of 8 positions up to a tile at d128: one box per page run, both halves
            Some(pg) if self.plan.decode.joined_halves => joined_page_map(
                arg,
                ptr,
                p.dtype,
                p.hkv,
                pg.page_size,
                pg.num_pages,
                self.plan.kv_promotion,
            ),
            _ => cache_map(p, arg, ptr, strides, tile, self.plan.kv_promotion),
        };
        let rows = row_strides(p);
        // the caches' addresses for the decode's L2 warm-up (params.cuh): none where a position
        // or head stride needs more than 32 bits; a page pool's "batch" stride is its page stride
        let (k_warm, v_warm) = match p.paged {
            Some(pg) => {
                let pool = KvStrides::contiguous(pg.page_size, p.hkv, p.head_dim);
                (pool, pool)
            }
            None => (p.k_strides, p.v_strides),
        };
        let fits =
            |st: KvStrides| i32::try_from(st.token).is_ok() && i32::try_from(st.head).is_ok();
        let warm = fits(k_warm) && fits(v_warm);
        let params = DecodeParams {
            k_map: map("k_cache", t.k, p.k_strides)?,
            v_map: map("v_cache", t.v, p.v_strides)?,
            q: t.q,
            out: t.out,
            lse: t.lse.unwrap_or(0),
            seqlens: t.seqlens.unwrap_or(0),
            o_partial: at(off.o_partial),
            m_partial: at(off.m_partial),
            l_partial: at(off.l_partial),
            block_table: t.block_table.unwrap_or(0),
            q_batch_stride: rows.batch,
            q_token_stride: rows.token,
            q_head_stride: rows.head,
            o_batch_stride: rows.batch,
            o_token_stride: rows.token,
            o_head_stride: rows.head,
            batch: p.batch as i32,
            hq: p.hq as i32,
            hkv: p.hkv as i32,
            group: p.group() as i32,
            max_len: t.view_len.unwrap_or(p.max_len) as i32,
            num_splits: self.plan.num_splits as i32,
            scale_log2: p.scale() * std::f32::consts::LOG2_E,
            cluster_splits: if self.cluster() {
                self.plan.num_splits as i32
            } else {
                0
            },
            q_len: p.q_len as i32,
            cols: p.columns() as i32,
            col_blocks: self.plan.decode.column_blocks(p) as i32,
            page_size: p.paged.map_or(0, |pg| pg.page_size as i32),
            table_stride: p.paged.map_or(0, |pg| pg.table_stride as i32),
            work: self.plan.device_plan.map_or(0, |_| at(off.work)),
            request_plan: self.plan.device_plan.map_or(0, |_| at(off.request_plan)),
            plan_grid: self.plan.device_plan.map_or(0, |d| d.grid as i32),
            plan_target: self.plan.device_plan.map_or(0, |d| d.target as i32),
            plan_tile: self.plan.decode.tile_tokens as i32,
            block_cols: (self.plan.decode.n_tiles * 8) as i32,
            plan_slots: self.plan.device_plan.map_or(0, |d| d.slots as i32),
            num_pages: p.paged.map_or(0, |pg| pg.num_pages as i32),
            k_cache: if warm { t.k } else { 0 },
            v_cache: if warm { t.v } else { 0 },
            k_batch_stride: k_warm.batch,
            v_batch_stride: v_warm.batch,
            k_token_stride: k_warm.token as i32,
            k_head_stride: k_warm.head as i32,
            v_token_stride: v_warm.token as i32,
            v_head_stride: v_warm.head as i32,
            k_scale: t.k_scale.map_or(0, |s| s.ptr),
            v_scale: t.v_scale.map_or(0, |s| s.ptr),
            k_scale_batch_stride: scale_strides(t.k_scale, p.hkv).0,
            k_scale_head_stride: scale_strides(t.k_scale, p.hkv).1,
            v_scale_batch_stride: scale_strides(t.v_scale, p.hkv).0,
            v_scale_head_stride: scale_strides(t.v_scale, p.hkv).1,
        };
        if let Some(planner) = &self.planner {
            let cfg = LaunchConfig {
                grid: [1, 1, 1],
                block: [PlanWorkVariant::THREADS, 1, 1],
                shared_bytes: 0,
                pdl: self.plan.pdl,
                cluster: None,
            };
            launch(planner.func, &cfg, stream, &params, "the work planner")?;
        }
        launch(
            self.decode.func,
            &self.decode_config(),
            stream,
            &params,
            "the decode kernel",
        )?;
        if let Some(combine) = &self.combine {
            let rows = (p.batch * p.q_len * p.hq) as u32;
            let cfg = LaunchConfig {
                grid: [rows, 1, 1],
                block: [COMBINE_THREADS, 1, 1],
                shared_bytes: 0,
                pdl: self.plan.pdl,
                cluster: None,
            };
            launch(combine.func, &cfg, stream, &params, "the combine kernel")?;
        }
        Ok(())
    }
}

/// The element counts of a call on slices: each (argument, elements given, elements needed,
/// what sets the need) must have at least what it needs.
pub(crate) fn check_lengths(checks: &[(&'static str, usize, usize, &str)]) -> Result<()> {
    for &(arg, have, need, why) in checks {
        if have < need {
            return Err(Error::invalid(
                arg,
                format!("{have} elements"),
                format!("at least {need}{why}"),
            ));
        }
    }
    Ok(())
}

/// Checks a decode call on slices: the `required` (argument, have, need, why) element counts,
/// then the optional arguments every such call takes: LSE (one per output row), the lengths (one
/// per request), the block table (batch x its `table_stride`, paged caches only).
pub(crate) fn check_slice_lengths(
    required: &[(&'static str, usize, usize, &'static str)],
    rows: usize,
    batch: usize,
    lse: Option<usize>,
    seqlens: Option<&CudaSlice<i32>>,
    block_table: Option<&CudaSlice<i32>>,
    paged: Option<PagedKv>,
) -> Result<()> {
    let mut checks = required.to_vec();
    if let Some(have) = lse {
        checks.push(("lse", have, rows, ""));
    }
    if let Some(s) = seqlens {
        checks.push(("cache_seqlens", s.len(), batch, " (one per request)"));
    }
    if let Some((bt, pg)) = block_table.zip(paged) {
        checks.push((
            "block_table",
            bt.len(),
            batch * pg.table_stride,
            " (batch x table_stride)",
        ));
    }
    check_lengths(&checks)
}

/// The pieces per CTA a persistent kernel recorded in its schedule log (`schedule_log` in
/// decode_params.cuh), read back after synchronising `stream`.
pub(crate) fn read_schedule_log(
    log: &CudaSlice<i32>,
    stream: &Arc<CudaStream>,
) -> Result<Vec<Vec<Piece>>> {
    let raw = stream
        .clone_dtoh(log)
        .map_err(|e| Error::driver("reading the schedule log back", e))?;
    stream
        .synchronize()
        .map_err(|e| Error::driver("reading the schedule log back", e))?;
    let per_cta = (SCHEDULE_LOG_PIECES + 1) * 4;
    let mut out = Vec::new();
    for cta in raw.chunks(per_cta) {
        let count = (cta[0].max(0) as usize).min(SCHEDULE_LOG_PIECES);
        out.push(
            (0..count)
                .map(|i| {
                    let e = &cta[4 * (i + 1)..4 * (i + 2)];
                    Piece {
                        batch: e[0] as usize,
                        unit: e[1] as usize,
                        first: e[2] as usize,
                        end: e[3] as usize,
                        tiles: 0,
                        start: 0,
                        origin: 0,
                    }
                })
                .collect(),
        );
    }
    Ok(out)
}

/// (request, KV head) strides of a scale tensor's index.
fn scale_strides(scale: Option<KvScale>, hkv: usize) -> (i32, i32) {
    let (b, h) = scale.map_or((0, 0), |s| s.layout.strides(hkv));
    (b as i32, h as i32)
}

/// Element strides of q and out, both `[batch, q_len, hq, d]` contiguous.
fn row_strides(p: &DecodeProblem) -> KvStrides {
    let token = (p.hq * p.head_dim) as i64;
    KvStrides {
        batch: p.q_len as i64 * token,
        token,
        head: p.head_dim as i64,
    }
}

/// The tensor map of a K or V cache (or page pool) with boxes of `tile` positions (whole pages
/// where pages are smaller).
fn cache_map(
    p: &DecodeProblem,
    arg: &'static str,
    ptr: u64,
    strides: KvStrides,
    tile: usize,
    promotion: TmaPromotion,
) -> Result<sys::CUtensorMap> {
    match p.paged {
        // the pool as {d, hkv, page_size, num_pages}
        Some(pg) => kv_tensor_map(
            arg,
            ptr,
            TmaElement::of(p.dtype, p.kv_dtype),
            p.head_dim,
            p.hkv,
            pg.page_size,
            pg.num_pages,
            KvStrides::contiguous(pg.page_size, p.hkv, p.head_dim),
            pg.page_size.min(tile),
            promotion,
        ),
        None => kv_tensor_map(
            arg,
            ptr,
            TmaElement::of(p.dtype, p.kv_dtype),
            p.head_dim,
            p.hkv,
            p.max_len,
            p.batch,
            strides,
            tile,
            promotion,
        ),
    }
}

impl PersistentEngine {
    /// # Safety
    /// As [`Decoder::run`], pointers checked.
    unsafe fn run(
        &self,
        p: &DecodeProblem,
        t: &DecodeTensors,
        stream: sys::CUstream,
    ) -> Result<()> {
        let pp = &self.plan;
        let ws = self.workspace.1;
        let (o_off, ml_off, arrivals_off, hints_off, _) = pp.workspace_offsets(p);
        let tile = pp.variant.tile_tokens;
        let rows = row_strides(p);
        // the caches as the kernel streams them (paired heads: half the heads, 128-dim rows)
        let kp = &pp.kernel_problem(p);
        let params = PersistentParams {
            k_map: cache_map(kp, "k_cache", t.k, kp.k_strides, tile, pp.kv_promotion)?,
            v_map: cache_map(kp, "v_cache", t.v, kp.v_strides, tile, pp.kv_promotion)?,
            q: t.q,
            out: t.out,
            lse: t.lse.unwrap_or(0),
            seqlens: t.seqlens.unwrap_or(0),
            block_table: t.block_table.unwrap_or(0),
            k_cache: t.k,
            v_cache: t.v,
            o_partial: ws + o_off as u64,
            ml_partial: ws + ml_off as u64,
            arrivals: ws + arrivals_off as u64,
            schedule_log: self.schedule_log.as_ref().map_or(0, |l| l.1),
            q_batch_stride: rows.batch,
            q_token_stride: rows.token,
            q_head_stride: rows.head,
            o_batch_stride: rows.batch,
            o_token_stride: rows.token,
            o_head_stride: rows.head,
            batch: p.batch as i32,
            hq: p.hq as i32,
            hkv: kp.hkv as i32,
            group: kp.group() as i32,
            q_len: p.q_len as i32,
            cols: kp.columns() as i32,
            col_blocks: pp.col_blocks as i32,
            max_len: t.view_len.unwrap_or(p.max_len) as i32,
            scale_log2: p.scale() * std::f32::consts::LOG2_E,
            page_size: p.paged.map_or(0, |pg| pg.page_size as i32),
            table_stride: p.paged.map_or(0, |pg| pg.table_stride as i32),
            num_pages: p.paged.map_or(0, |pg| pg.num_pages as i32),
            min_tiles_per_cta: pp.min_tiles_per_cta as i32,
            lanes: pp.lanes as i32,
            k_scale: t.k_scale.map_or(0, |s| s.ptr),
            v_scale: t.v_scale.map_or(0, |s| s.ptr),
            k_scale_batch_stride: scale_strides(t.k_scale, p.hkv).0,
            k_scale_head_stride: scale_strides(t.k_scale, p.hkv).1,
            v_scale_batch_stride: scale_strides(t.v_scale, p.hkv).0,
            v_scale_head_stride: scale_strides(t.v_scale, p.hkv).1,
            sinks: t.sinks.unwrap_or(0),
            window_left: p.window.to_window_size().0 as i32,
            window_right: p.window.to_window_size().1 as i32,
            softcap_scale: p.softcap.map_or(0.0, |c| 2.0 / c),
            softcap_log2: p.softcap.map_or(0.0, |c| c * std::f32::consts::LOG2_E),
            warm_hints: ws + hints_off as u64,
        };
        let cfg = LaunchConfig {
            grid: [pp.grid as u32, 1, 1],
            block: [pp.variant.threads(), 1, 1],
            shared_bytes: pp.variant.shared_bytes() as u32,
            pdl: pp.pdl,
            cluster: None,
        };
        launch(self.kernel.func, &cfg, stream, &params, "the decode kernel")
    }
}
