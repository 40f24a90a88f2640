//! MLA decode (DeepSeek-V2/V3/R1, Kimi-K2 class) in the absorbed form: every query head
//! attends to one shared latent cache whose rows are `[c_kv (512) | k_pe (64)]`. Scores use all
//! [`MLA_DIM`] columns, the values are the first [`MLA_V_DIM`] of the same rows (read once).
//!
//! Layouts: q `[batch, q_len, hq, 576]`, cache `[batch, max_len, 576]` (contiguous) or a page
//! pool `[num_pages, page_size, 576]` (FlashMLA's `[num_blocks, page_size, 1, 576]` is the same
//! memory) with an int32 block table `[batch, table_stride]`, out `[batch, q_len, hq, 512]` in
//! q's dtype, LSE `[batch, q_len, hq]` f32 (natural log). The cache is q's dtype or float8 e4m3
//! with an FP32 scale on the device (one per cache or one per request), applied to the scores
//! and to the output.
//!
//! The kernel (`decode_mla.cu`) runs on the persistent engine's device schedule: one CTA per SM,
//! each working out its share of the call's KV tiles from the lengths at every call, so a CUDA
//! graph captured once stays balanced whatever lengths it is replayed with; no host plan, no
//! memset.
//!
//! ```no_run
//! use kvstream::mla::{MlaDecoder, MlaProblem};
//! use kvstream::{DType, PlanOptions, Runtime};
//! # fn main() -> kvstream::Result<()> {
//! let rt = Runtime::new(0)?;
//! // 16 heads (DeepSeek-V3 at TP 8), one new token, caches of up to 128K positions
//! let scale = 1.0 / (192f32).sqrt();
//! let problem = MlaProblem::new(4, 16, 131072, DType::Bf16, scale)?;
//! let decoder = MlaDecoder::new(&rt, problem, PlanOptions::default())?;
//! // unsafe { decoder.run(&tensors, stream) }?;  // raw pointers, any CUstream, graph-capturable
//! # Ok(()) }
//! ```

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::decode::{check_slice_lengths, Element, KvElement, KvScale};
use crate::error::{Error, Result};
use crate::kernels::AnyVariant;
use crate::launch::{kv_tensor_map, launch, LaunchConfig, TmaElement};
use crate::params::{PersistentParams, SCHEDULE_LOG_PIECES};
use crate::plan::{plan_mla, MlaPlan, PlanOptions};
use crate::problem::{DType, KvDType, KvScaleLayout, KvStrides, PagedKv, MAX_Q_LEN};
use crate::runtime::{LoadedKernel, Runtime};
use crate::schedule::Piece;

/// Width of a cached row and of a query row: the latent (512) and the rope part (64).
pub const MLA_DIM: usize = 576;
/// Width of the values and of an output row: the latent part of a cached row.
pub const MLA_V_DIM: usize = 512;
/// Most query heads (DeepSeek-V3 without tensor parallelism: 128).
pub const MLA_MAX_HEADS: usize = 128;

/// One MLA decode call.
///
/// ```
/// use kvstream::mla::MlaProblem;
/// use kvstream::DType;
/// let p = MlaProblem::new(2, 16, 4096, DType::Bf16, 0.0722).unwrap().with_q_len(2).unwrap();
/// assert_eq!(p.columns(), 32);
/// assert!(MlaProblem::new(2, 16, 4096, DType::Bf16, 0.0).is_err()); // the scale is required
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct MlaProblem {
    /// Requests in the batch.
    pub batch: usize,
    /// Query heads (1..=[`MLA_MAX_HEADS`]).
    pub hq: usize,
    /// New tokens per request (1..=[`MAX_Q_LEN`]); token i of request b sees cache positions
    /// `[0, len_b - q_len + i]`.
    pub q_len: usize,
    /// Cache capacity per request; per-request lengths, when given, are at most this.
    pub max_len: usize,
    /// Element type of q and out (and of the cache unless `kv_dtype` says otherwise).
    pub dtype: DType,
    /// Element type of the cache.
    pub kv_dtype: KvDType,
    /// Softmax scale (DeepSeek-V3: 1/sqrt(192) times its YaRN factor, not 1/sqrt(576)).
    pub softmax_scale: f32,
    /// A page pool instead of a contiguous `[batch, max_len, 576]` cache (`hkv`-free: one
    /// latent head).
    pub paged: Option<PagedKv>,
}

impl MlaProblem {
    /// A problem with one new token per request and a contiguous cache of q's dtype.
    pub fn new(
        batch: usize,
        hq: usize,
        max_len: usize,
        dtype: DType,
        softmax_scale: f32,
    ) -> Result<Self> {
        let p = MlaProblem {
            batch,
            hq,
            q_len: 1,
            max_len,
            dtype,
            kv_dtype: KvDType::AsQuery,
            softmax_scale,
            paged: None,
        };
        p.validate()?;
        Ok(p)
    }

    /// With `q_len` new tokens per request (multi-token prediction, speculative verification).
    pub fn with_q_len(mut self, q_len: usize) -> Result<Self> {
        self.q_len = q_len;
        self.validate()?;
        Ok(self)
    }

    /// With a cache of `kv_dtype` (float8 e4m3 takes a scale at every call).
    pub fn with_kv_dtype(mut self, kv_dtype: KvDType) -> Result<Self> {
        self.kv_dtype = kv_dtype;
        self.validate()?;
        Ok(self)
    }

    /// With a paged cache: a pool of `num_pages` pages of `page_size` positions and a block
    /// table of `table_stride` entries per request (default `ceil(max_len / page_size)`).
    pub fn with_paged(
        mut self,
        page_size: usize,
        num_pages: usize,
        table_stride: Option<usize>,
    ) -> Result<Self> {
        let table_stride = table_stride.unwrap_or_else(|| self.max_len.div_ceil(page_size.max(1)));
        self.paged = Some(PagedKv {
            page_size,
            num_pages,
            table_stride,
        });
        self.validate()?;
        Ok(self)
    }

    /// Query rows per request: `q_len * hq`, the MMA N dimension.
    pub fn columns(&self) -> usize {
        self.q_len * self.hq
    }

    /// Bytes of one cache element.
    pub fn kv_elem_bytes(&self) -> usize {
        self.kv_dtype.size(self.dtype)
    }

    /// Bytes one call must move at least when the requests hold `total_tokens` positions: q,
    /// each cached row once, and out.
    pub fn io_bytes(&self, total_tokens: usize) -> usize {
        let e = self.dtype.size();
        let rows = self.batch * self.q_len * self.hq;
        rows * (MLA_DIM + MLA_V_DIM) * e + total_tokens * MLA_DIM * self.kv_elem_bytes()
    }

    /// Elements the cache tensor must hold.
    pub fn cache_elements(&self) -> usize {
        match self.paged {
            Some(pg) => pg.num_pages * pg.page_size * MLA_DIM,
            None => self.batch * self.max_len * MLA_DIM,
        }
    }

    /// Checks every field; called by the constructors.
    pub fn validate(&self) -> Result<()> {
        if self.batch == 0 || self.batch > 65_535 {
            return Err(Error::invalid("batch", self.batch, "1..=65535"));
        }
        if !(1..=MLA_MAX_HEADS).contains(&self.hq) {
            return Err(Error::invalid(
                "hq",
                self.hq,
                format!("1..={MLA_MAX_HEADS} query heads"),
            ));
        }
        if !(1..=MAX_Q_LEN).contains(&self.q_len) {
            return Err(Error::invalid(
                "q_len",
                self.q_len,
                format!("1..={MAX_Q_LEN}"),
            ));
        }
        if self.max_len == 0 || self.max_len > i32::MAX as usize {
            return Err(Error::invalid("max_len", self.max_len, "1..=2^31-1"));
        }
        if !self.softmax_scale.is_finite() || self.softmax_scale <= 0.0 {
            return Err(Error::invalid(
                "softmax_scale",
                self.softmax_scale,
                "a finite positive number (MLA has no default: DeepSeek-V3 uses 1/sqrt(192) \
                 times its YaRN factor)",
            ));
        }
        if let Some(pg) = self.paged {
            pg.validate(self.max_len)?;
        }
        Ok(())
    }

    /// The scale layouts an e4m3 cache accepts: one per cache or one per request.
    pub fn check_scale(&self, arg: &'static str, len: usize) -> Result<KvScaleLayout> {
        KvScaleLayout::from_len(len, self.batch, 1)
            .filter(|l| *l != KvScaleLayout::PerKvHead || self.batch == 1)
            .ok_or_else(|| {
                Error::invalid(
                    arg,
                    format!("{len} elements"),
                    format!(
                        "1 (per cache) or batch = {} (per request) FP32 values",
                        self.batch
                    ),
                )
            })
    }
}

/// Device pointers of one MLA call (layouts in the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MlaTensors {
    /// Queries `[batch, q_len, hq, 576]`.
    pub q: u64,
    /// The latent cache (or page pool).
    pub kv: u64,
    /// Output `[batch, q_len, hq, 512]`, q's dtype.
    pub out: u64,
    /// Optional log-sum-exp output (natural log, f32).
    pub lse: Option<u64>,
    /// Optional per-request lengths (int32, each clamped to 0..=max_len by the kernel).
    pub seqlens: Option<u64>,
    /// Paged caches: each request's page ids.
    pub block_table: Option<u64>,
    /// e4m3 caches: the dequantisation scale (required; per cache or per request).
    pub kv_scale: Option<KvScale>,
}

/// An MLA problem planned and loaded on one GPU. Like [`crate::Decoder`], it owns one
/// workspace: calls of one decoder must not be in flight on two streams at once.
pub struct MlaDecoder {
    rt: Arc<Runtime>,
    problem: MlaProblem,
    plan: MlaPlan,
    kernel: LoadedKernel,
    /// `[o_partial | ml_partial | counters]` ([`MlaPlan::workspace_offsets`]); the counters are
    /// zeroed here once and every call leaves them zero.
    workspace: (CudaSlice<u8>, u64),
    schedule_log: Option<(CudaSlice<i32>, u64)>,
}

impl MlaDecoder {
    /// Plans `problem` for this GPU, loads its kernel and allocates the workspace.
    pub fn new(rt: &Arc<Runtime>, problem: MlaProblem, options: PlanOptions) -> Result<Self> {
        let plan = plan_mla(&problem, rt.facts(), options)?;
        let kernel = rt.kernel(AnyVariant::Mla(plan.variant), plan.variant.shared_bytes())?;
        let (.., bytes) = plan.workspace_offsets(problem.batch);
        let workspace = crate::decode::alloc_zeroed::<u8>(rt, bytes, "the MLA workspace")?;
        let schedule_log = if options.record_schedule {
            let len = plan.grid * (SCHEDULE_LOG_PIECES + 1) * 4;
            Some(crate::decode::alloc_zeroed::<i32>(
                rt,
                len,
                "the schedule log",
            )?)
        } else {
            None
        };
        Ok(MlaDecoder {
            rt: rt.clone(),
            problem,
            plan,
            kernel,
            workspace,
            schedule_log,
        })
    }

    /// The problem this decoder serves.
    pub fn problem(&self) -> &MlaProblem {
        &self.problem
    }

    /// The plan it executes.
    pub fn plan(&self) -> &MlaPlan {
        &self.plan
    }

    /// Registers of the kernel (from ptxas), for reports.
    pub fn registers(&self) -> u32 {
        self.kernel.report.registers
    }

    /// The pieces each CTA streamed at the last call, read back after synchronising `stream`
    /// (`None` unless built with [`PlanOptions::record_schedule`]); compare with
    /// [`crate::schedule::pieces`] over one KV head.
    pub fn last_schedule(&self, stream: &Arc<CudaStream>) -> Result<Option<Vec<Vec<Piece>>>> {
        match &self.schedule_log {
            Some((log, _)) => crate::decode::read_schedule_log(log, stream).map(Some),
            None => Ok(None),
        }
    }

    /// Enqueues one MLA decode on `stream` (a raw `CUstream`, e.g. PyTorch's current stream).
    ///
    /// # Safety
    /// The pointers must reference device memory of this runtime's GPU with at least the sizes
    /// the layouts in the module docs imply for this problem, and stay valid until the work
    /// completes. `stream` must belong to this runtime's context.
    pub unsafe fn run(&self, t: &MlaTensors, stream: sys::CUstream) -> Result<()> {
        let rt = &self.rt;
        let p = &self.problem;
        rt.check_pointer("q", t.q, 16)?;
        rt.check_pointer("kv_cache", t.kv, 16)?;
        rt.check_pointer("out", t.out, 16)?;
        if let Some(lse) = t.lse {
            rt.check_pointer("lse", lse, 4)?;
        }
        if let Some(s) = t.seqlens {
            rt.check_pointer("cache_seqlens", s, 4)?;
        }
        match (p.paged, t.block_table) {
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
                    "none: the problem has a contiguous cache (use MlaProblem::with_paged)",
                ))
            }
            (None, None) => {}
        }
        match (p.kv_dtype, t.kv_scale) {
            (KvDType::Fp8E4m3, Some(s)) => {
                if s.layout == KvScaleLayout::PerKvHead && p.batch != 1 {
                    return Err(Error::invalid(
                        "kv_scale",
                        "per KV head",
                        "per cache or per request",
                    ));
                }
                rt.check_pointer("kv_scale", s.ptr, 4)?
            }
            (KvDType::Fp8E4m3, None) => {
                return Err(Error::invalid(
                    "kv_scale",
                    "none",
                    "the FP32 dequantisation scale of the e4m3 cache",
                ))
            }
            (KvDType::AsQuery, Some(_)) => {
                return Err(Error::invalid(
                    "kv_scale",
                    "a scale",
                    format!(
                        "none: the cache is {} (scales are for e4m3 caches)",
                        p.dtype.name()
                    ),
                ))
            }
            (KvDType::AsQuery, None) => {}
        }
        rt.bind()?;
        let plan = &self.plan;
        let ws = self.workspace.1;
        let (o_off, ml_off, counters_off, _) = plan.workspace_offsets(p.batch);
        let tile = plan.variant.tile_tokens;
        let elem = TmaElement::of(p.dtype, p.kv_dtype);
        let kv_map = match p.paged {
            Some(pg) => kv_tensor_map(
                "kv_cache",
                t.kv,
                elem,
                MLA_DIM,
                1,
                pg.page_size,
                pg.num_pages,
                KvStrides::contiguous(pg.page_size, 1, MLA_DIM),
                pg.page_size.min(tile),
                plan.kv_promotion,
            )?,
            None => kv_tensor_map(
                "kv_cache",
                t.kv,
                elem,
                MLA_DIM,
                1,
                p.max_len,
                p.batch,
                KvStrides::contiguous(p.max_len, 1, MLA_DIM),
                tile,
                plan.kv_promotion,
            )?,
        };
        let (scale, scale_stride) = match t.kv_scale {
            Some(s) => (s.ptr, s.layout.strides(1).0 as i32),
            None => (0, 0),
        };
        let q_token = (p.hq * MLA_DIM) as i64;
        let o_token = (p.hq * MLA_V_DIM) as i64;
        let params = PersistentParams {
            k_map: kv_map,
            v_map: kv_map,
            q: t.q,
            out: t.out,
            lse: t.lse.unwrap_or(0),
            seqlens: t.seqlens.unwrap_or(0),
            block_table: t.block_table.unwrap_or(0),
            k_cache: t.kv,
            v_cache: t.kv,
            o_partial: ws + o_off as u64,
            ml_partial: ws + ml_off as u64,
            arrivals: ws + counters_off as u64,
            schedule_log: self.schedule_log.as_ref().map_or(0, |l| l.1),
            q_batch_stride: p.q_len as i64 * q_token,
            q_token_stride: q_token,
            q_head_stride: MLA_DIM as i64,
            o_batch_stride: p.q_len as i64 * o_token,
            o_token_stride: o_token,
            o_head_stride: MLA_V_DIM as i64,
            batch: p.batch as i32,
            hq: p.hq as i32,
            hkv: 1,
            group: p.hq as i32,
            q_len: p.q_len as i32,
            cols: p.columns() as i32,
            col_blocks: plan.col_blocks as i32,
            max_len: p.max_len as i32,
            scale_log2: p.softmax_scale * std::f32::consts::LOG2_E,
            page_size: p.paged.map_or(0, |pg| pg.page_size as i32),
            table_stride: p.paged.map_or(0, |pg| pg.table_stride as i32),
            num_pages: p.paged.map_or(0, |pg| pg.num_pages as i32),
            min_tiles_per_cta: plan.min_tiles_per_cta as i32,
            lanes: plan.lanes as i32,
            k_scale: scale,
            v_scale: scale,
            k_scale_batch_stride: scale_stride,
            k_scale_head_stride: 0,
            v_scale_batch_stride: scale_stride,
            v_scale_head_stride: 0,
            // plain softmax over every position
            sinks: 0,
            window_left: -1,
            window_right: -1,
            softcap_scale: 0.0,
            softcap_log2: 0.0,
            warm_hints: 0,
        };
        let cfg = LaunchConfig {
            grid: [plan.grid as u32, 1, 1],
            block: [plan.variant.threads(), 1, 1],
            shared_bytes: plan.variant.shared_bytes() as u32,
            pdl: plan.pdl,
            cluster: None,
        };
        launch(
            self.kernel.func,
            &cfg,
            stream,
            &params,
            "the MLA decode kernel",
        )
    }

    /// Safe form of [`MlaDecoder::run`] on cudarc slices: checks dtypes and lengths, then
    /// enqueues on `stream`. `kv` is the cache (`[batch, max_len, 576]`) or, with
    /// `block_table`, the page pool; `kv_scale` the e4m3 cache's scale (1 or `batch` values).
    #[allow(clippy::too_many_arguments)]
    pub fn run_slices<T: Element, K: KvElement>(
        &self,
        stream: &Arc<CudaStream>,
        q: &CudaSlice<T>,
        kv: &CudaSlice<K>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
        seqlens: Option<&CudaSlice<i32>>,
        block_table: Option<&CudaSlice<i32>>,
        kv_scale: Option<&CudaSlice<f32>>,
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
                "kv_cache",
                std::any::type_name::<K>(),
                format!(
                    "elements of the problem's kv_dtype ({}, with q {})",
                    p.kv_dtype.name(),
                    p.dtype.name()
                ),
            ));
        }
        let rows = p.batch * p.q_len * p.hq;
        check_slice_lengths(
            &[
                ("q", q.len(), rows * MLA_DIM, ""),
                ("kv_cache", kv.len(), p.cache_elements(), ""),
                ("out", out.len(), rows * MLA_V_DIM, ""),
            ],
            rows,
            p.batch,
            lse.as_ref().map(|l| l.len()),
            seqlens,
            block_table,
            p.paged,
        )?;
        let kv_scale = match kv_scale {
            Some(s) => Some(KvScale {
                ptr: s.device_ptr(stream).0,
                layout: p.check_scale("kv_scale", s.len())?,
            }),
            None => None,
        };
        let (qp, _g1) = q.device_ptr(stream);
        let (kp, _g2) = kv.device_ptr(stream);
        let (op, _g3) = out.device_ptr_mut(stream);
        let mut lse = lse;
        let lse_ptr = lse.as_mut().map(|l| l.device_ptr_mut(stream));
        let seq_ptr = seqlens.map(|s| s.device_ptr(stream));
        let table_ptr = block_table.map(|s| s.device_ptr(stream));
        let tensors = MlaTensors {
            q: qp,
            kv: kp,
            out: op,
            lse: lse_ptr.as_ref().map(|(p, _)| *p),
            seqlens: seq_ptr.as_ref().map(|(p, _)| *p),
            block_table: table_ptr.as_ref().map(|(p, _)| *p),
            kv_scale,
        };
        // SAFETY: lengths checked above; the slices outlive the enqueue and cudarc's guards
        // record the stream use.
        unsafe { self.run(&tensors, stream.cu_stream()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::DeviceFacts;

    #[test]
    fn problems_are_validated_with_errors_that_name_the_argument() {
        let err = |r: Result<MlaProblem>| r.unwrap_err().to_string();
        assert!(err(MlaProblem::new(0, 16, 4096, DType::Bf16, 0.07)).contains("batch"));
        assert!(err(MlaProblem::new(1, 129, 4096, DType::Bf16, 0.07)).contains("hq"));
        assert!(err(MlaProblem::new(1, 16, 0, DType::Bf16, 0.07)).contains("max_len"));
        assert!(err(MlaProblem::new(1, 16, 64, DType::Bf16, f32::NAN)).contains("softmax_scale"));
        let p = MlaProblem::new(1, 16, 4096, DType::Bf16, 0.07).unwrap();
        assert!(err(p.clone().with_q_len(9)).contains("q_len"));
        assert!(err(p.clone().with_paged(48, 100, None)).contains("page_size"));
        assert!(err(p.clone().with_paged(64, 100, Some(10))).contains("block_table stride"));
        let pg = p.with_paged(64, 100, None).unwrap();
        assert_eq!(pg.paged.unwrap().table_stride, 64);
        assert_eq!(pg.cache_elements(), 100 * 64 * MLA_DIM);
    }

    #[test]
    fn scale_layouts_are_per_cache_or_per_request() {
        let p = MlaProblem::new(4, 16, 64, DType::Bf16, 0.07)
            .unwrap()
            .with_kv_dtype(KvDType::Fp8E4m3)
            .unwrap();
        assert_eq!(
            p.check_scale("kv_scale", 1).unwrap(),
            KvScaleLayout::PerTensor
        );
        assert_eq!(
            p.check_scale("kv_scale", 4).unwrap(),
            KvScaleLayout::PerRequestHead
        );
        assert!(p
            .check_scale("kv_scale", 3)
            .unwrap_err()
            .to_string()
            .contains("per request"));
    }

    #[test]
    fn the_plan_picks_column_blocks_and_the_ring_from_the_problem() {
        let plan = |hq, q_len, kv| {
            let p = MlaProblem::new(2, hq, 8192, DType::Bf16, 0.07)
                .unwrap()
                .with_q_len(q_len)
                .unwrap()
                .with_kv_dtype(kv)
                .unwrap();
            plan_mla(&p, DeviceFacts::H200, PlanOptions::default()).unwrap()
        };
        let p = plan(16, 1, KvDType::AsQuery);
        assert_eq!(
            (p.variant.n_tiles, p.col_blocks, p.variant.stages),
            (2, 1, 2)
        );
        // e4m3 on narrow blocks: two stages of 128 positions (72 KB each, as 2-byte ones)
        let p = plan(12, 1, KvDType::Fp8E4m3);
        assert_eq!(
            (
                p.variant.n_tiles,
                p.col_blocks,
                p.variant.stages,
                p.variant.tile_tokens
            ),
            (2, 1, 2, 128)
        );
        assert!(p.variant.shared_bytes() <= 227 * 1024);
        // more than 32 rows: wide blocks of 64 for a 2-byte cache, in lanes
        let p = plan(16, 8, KvDType::AsQuery);
        assert_eq!((p.variant.n_tiles, p.col_blocks, p.lanes), (8, 2, 2));
        assert!(p.variant.is_wide());
        let p = plan(128, 1, KvDType::AsQuery);
        assert_eq!((p.variant.n_tiles, p.col_blocks, p.lanes), (8, 2, 2));
        assert!(p.variant.shared_bytes() <= 227 * 1024);
        let p = plan(12, 4, KvDType::AsQuery);
        assert_eq!((p.variant.n_tiles, p.col_blocks, p.lanes), (8, 1, 1));
        // e4m3 too, on two stages next to the staging tile
        let p = plan(16, 8, KvDType::Fp8E4m3);
        assert_eq!((p.variant.n_tiles, p.col_blocks, p.lanes), (8, 2, 2));
        assert_eq!(p.variant.stages, 2);
        assert!(p.variant.shared_bytes() <= 227 * 1024);
        // knobs of the GQA engines are refused by name
        let problem = MlaProblem::new(1, 16, 64, DType::Bf16, 0.07).unwrap();
        let e = plan_mla(
            &problem,
            DeviceFacts::H200,
            PlanOptions {
                num_splits: Some(4),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("num_splits"), "{e}");
        // an e4m3 page of one row is not a whole TMA box row; 2-byte pages of one row are
        let paged = |kv, page| {
            let p = MlaProblem::new(1, 16, 64, DType::Bf16, 0.07)
                .unwrap()
                .with_kv_dtype(kv)
                .unwrap()
                .with_paged(page, 64, None)
                .unwrap();
            plan_mla(&p, DeviceFacts::H200, PlanOptions::default())
        };
        assert!(paged(KvDType::Fp8E4m3, 1)
            .unwrap_err()
            .to_string()
            .contains("page_size"));
        assert!(paged(KvDType::Fp8E4m3, 2).is_ok());
        assert!(paged(KvDType::AsQuery, 1).is_ok());
    }

    #[test]
    fn every_mla_variant_fits_the_shared_memory_of_one_sm() {
        for v in crate::kernels::all_variants() {
            if let AnyVariant::Mla(m) = v {
                assert!(m.shared_bytes() <= 227 * 1024, "{m:?}");
            }
        }
    }
}
