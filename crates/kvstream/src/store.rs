//! The cache write: new tokens' K and V rows into the cache a [`crate::Decoder`] reads, at
//! given slots, quantised to e4m3 for an fp8 cache.
//!
//! Slots follow vLLM's `slot_mapping`: in a paged cache slot `page * page_size + offset`, in a
//! contiguous `[batch, max_len, hkv, d]` cache slot `request * max_len + position`; -1 (or any
//! slot outside the cache) skips the token. [`KvWriter::run`] enqueues one kernel, reads the
//! slots and scales on the device and never synchronises, so it can be captured in a graph.

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::decode::{Element, Fp8Scales, KvElement, KvScale};
use crate::error::{Error, Result};
use crate::kernels::{AnyVariant, StoreKvVariant};
use crate::launch::{launch, LaunchConfig};
use crate::params::StoreKvParams;
use crate::problem::{DecodeProblem, KvScaleLayout};
use crate::runtime::{LoadedKernel, Runtime};

/// Device pointers of one write: `k_new` and `v_new` `[tokens, hkv, d]` contiguous in the
/// problem's dtype, `slots` int64 `[tokens]`, the caches as the problem describes them (for
/// [`crate::Decoder::run`]), and for an fp8 cache the scales the values are divided by (`None`:
/// 1) — the same scales the decoder then multiplies by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreTensors {
    /// New tokens (the leading dimension of `k_new`, `v_new` and `slots`).
    pub tokens: usize,
    /// New K rows.
    pub k_new: u64,
    /// New V rows.
    pub v_new: u64,
    /// Slot of each token, int64.
    pub slots: u64,
    /// K cache (contiguous cache or page pool).
    pub k_cache: u64,
    /// V cache.
    pub v_cache: u64,
    /// fp8: K's scales.
    pub k_scale: Option<KvScale>,
    /// fp8: V's scales.
    pub v_scale: Option<KvScale>,
}

/// Writes new tokens into the caches of one decode problem.
///
/// ```no_run
/// use kvstream::{DType, DecodeProblem, KvDType, Runtime};
/// use kvstream::store::KvWriter;
/// # fn main() -> kvstream::Result<()> {
/// let rt = Runtime::new(0)?;
/// let problem = DecodeProblem::new(8, 32, 8, 128, 4096, DType::Bf16)?
///     .with_paged(16, 2048, None)?
///     .with_kv_dtype(KvDType::Fp8E4m3)?;
/// let writer = KvWriter::new(&rt, &problem)?;
/// // unsafe { writer.run(&tensors, stream) }?;   // then the decoder reads what it wrote
/// # Ok(()) }
/// ```
pub struct KvWriter {
    rt: Arc<Runtime>,
    problem: DecodeProblem,
    kernel: LoadedKernel,
}

impl KvWriter {
    /// Loads the write kernel for `problem`'s caches (compiling it on a cold cache). A
    /// contiguous cache must have the same strides for K and V.
    pub fn new(rt: &Arc<Runtime>, problem: &DecodeProblem) -> Result<Self> {
        problem.validate()?;
        if problem.paged.is_none() && problem.k_strides != problem.v_strides {
            return Err(Error::invalid(
                "v strides",
                format!("{:?}", problem.v_strides),
                format!(
                    "K's strides {:?} (the cache write takes one layout for both)",
                    problem.k_strides
                ),
            ));
        }
        let variant = StoreKvVariant {
            dtype: problem.dtype,
            kv_dtype: problem.kv_dtype,
            head_dim: problem.head_dim,
        };
        let kernel = rt.kernel(AnyVariant::StoreKv(variant), 0)?;
        Ok(KvWriter {
            rt: rt.clone(),
            problem: problem.clone(),
            kernel,
        })
    }

    /// The problem whose caches it writes.
    pub fn problem(&self) -> &DecodeProblem {
        &self.problem
    }

    /// Enqueues the write of `t.tokens` tokens on `stream` (nothing for 0 tokens).
    ///
    /// # Safety
    /// The pointers must reference device memory of this runtime's GPU with the sizes
    /// [`StoreTensors`] and the problem imply, valid until the work completes; `stream` must
    /// belong to this runtime's context.
    pub unsafe fn run(&self, t: &StoreTensors, stream: sys::CUstream) -> Result<()> {
        let rt = &self.rt;
        let params = store_params(&self.problem, t)?;
        if t.tokens == 0 {
            return Ok(());
        }
        for (arg, ptr, align) in [
            ("k_new", t.k_new, 16),
            ("v_new", t.v_new, 16),
            ("slot_mapping", t.slots, 8),
            ("k_cache", t.k_cache, 16),
            ("v_cache", t.v_cache, 16),
        ] {
            rt.check_pointer(arg, ptr, align)?;
        }
        for (arg, s) in [("k_scale", t.k_scale), ("v_scale", t.v_scale)] {
            if let Some(s) = s {
                rt.check_pointer(arg, s.ptr, 4)?;
            }
        }
        rt.bind()?;
        let threads = t.tokens as u64
            * self.problem.hkv as u64
            * (self.problem.head_dim / StoreKvVariant::CHUNK) as u64;
        let blocks = threads.div_ceil(StoreKvVariant::THREADS as u64);
        let grid_x = u32::try_from(blocks).map_err(|_| {
            Error::invalid(
                "tokens",
                t.tokens,
                "fewer than 2^31 x 256 / (hkv x d / 8) (one CTA per 256 chunks of 8 head dims)",
            )
        })?;
        let cfg = LaunchConfig {
            grid: [grid_x, 2, 1],
            block: [StoreKvVariant::THREADS, 1, 1],
            shared_bytes: 0,
            pdl: false,
            cluster: None,
        };
        launch(self.kernel.func, &cfg, stream, &params, "the cache write")
    }

    /// Safe form of [`KvWriter::run`] on cudarc slices: `k_new` / `v_new` hold `tokens` rows
    /// `[hkv, d]` (their length decides `tokens`), `slots` one int64 per token, the caches the
    /// problem's layout ([`crate::Decoder::run_slices`]'s), `scales` an fp8 cache's (told apart
    /// by their lengths, as there). Checks dtypes and lengths, then enqueues on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub fn run_slices<T: Element, K: KvElement>(
        &self,
        stream: &Arc<CudaStream>,
        k_new: &CudaSlice<T>,
        v_new: &CudaSlice<T>,
        slots: &CudaSlice<i64>,
        k_cache: &mut CudaSlice<K>,
        v_cache: &mut CudaSlice<K>,
        scales: Option<Fp8Scales<'_>>,
    ) -> Result<()> {
        let p = &self.problem;
        if T::DTYPE != p.dtype {
            return Err(Error::invalid(
                "k_new, v_new",
                T::DTYPE.name(),
                format!("{} (the problem's dtype)", p.dtype.name()),
            ));
        }
        if K::kv_dtype_with(T::DTYPE) != Some(p.kv_dtype) {
            return Err(Error::invalid(
                "k_cache, v_cache",
                std::any::type_name::<K>(),
                format!("elements of the problem's kv_dtype ({})", p.kv_dtype.name()),
            ));
        }
        let row = p.hkv * p.head_dim;
        let tokens = k_new.len() / row;
        let cache = match p.paged {
            Some(pg) => pg.num_pages * pg.page_size * row,
            None => {
                let s = p.k_strides;
                (p.batch as i64 - 1) as usize * s.batch as usize
                    + (p.max_len - 1) * s.token as usize
                    + (p.hkv - 1) * s.head as usize
                    + p.head_dim
            }
        };
        if k_new.len() % row != 0 || v_new.len() != k_new.len() {
            return Err(Error::invalid(
                "k_new, v_new",
                format!("{} and {} elements", k_new.len(), v_new.len()),
                format!("the same whole number of rows of hkv x d = {row}"),
            ));
        }
        // at least: a larger slot buffer or cache is fine
        crate::decode::check_lengths(&[
            ("slot_mapping", slots.len(), tokens, ""),
            ("k_cache", k_cache.len(), cache, ""),
            ("v_cache", v_cache.len(), cache, ""),
        ])?;
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
        let (kn, _g1) = k_new.device_ptr(stream);
        let (vn, _g2) = v_new.device_ptr(stream);
        let (sl, _g3) = slots.device_ptr(stream);
        let (kc, _g4) = k_cache.device_ptr_mut(stream);
        let (vc, _g5) = v_cache.device_ptr_mut(stream);
        let t = StoreTensors {
            tokens,
            k_new: kn,
            v_new: vn,
            slots: sl,
            k_cache: kc,
            v_cache: vc,
            k_scale,
            v_scale,
        };
        // SAFETY: lengths checked above; the slices outlive the enqueue and cudarc's guards
        // record the stream use.
        unsafe { self.run(&t, stream.cu_stream()) }
    }
}

/// The launch parameters of a write of `t` into `p`'s caches (pure host work).
fn store_params(p: &DecodeProblem, t: &StoreTensors) -> Result<StoreKvParams> {
    let (blocks, block_slots, block_stride, slot_stride, head_stride) = match p.paged {
        Some(pg) => {
            let row = (p.hkv * p.head_dim) as i64;
            (
                pg.num_pages,
                pg.page_size,
                pg.page_size as i64 * row,
                row,
                p.head_dim as i64,
            )
        }
        None => (
            p.batch,
            p.max_len,
            p.k_strides.batch,
            p.k_strides.token,
            p.k_strides.head,
        ),
    };
    let scale = |arg: &'static str, s: Option<KvScale>| -> Result<(u64, i32, i32)> {
        p.check_scale_given(arg, s.is_some())?;
        let Some(s) = s else { return Ok((0, 0, 0)) };
        if p.paged.is_some() && s.layout == KvScaleLayout::PerRequestHead {
            return Err(Error::invalid(
                arg,
                "per request and KV head",
                "per cache or per KV head for a paged cache (a slot names a page, not a \
                 request)",
            ));
        }
        let (b, h) = s.layout.strides(p.hkv);
        Ok((s.ptr, b as i32, h as i32))
    };
    let (k_scale, kb, kh) = scale("k_scale", t.k_scale)?;
    let (v_scale, vb, vh) = scale("v_scale", t.v_scale)?;
    let tokens = i32::try_from(t.tokens)
        .map_err(|_| Error::invalid("tokens", t.tokens, "at most 2^31-1"))?;
    // the kernel indexes chunks and slots in 32 bits
    let chunks = t.tokens as u64 * (p.hkv * (p.head_dim / StoreKvVariant::CHUNK)) as u64;
    if chunks > u64::from(u32::MAX) {
        return Err(Error::invalid(
            "tokens",
            t.tokens,
            format!(
                "at most {} a call (2^32 - 1 chunks of 8 head dims over the KV heads)",
                u64::from(u32::MAX) / (p.hkv * (p.head_dim / StoreKvVariant::CHUNK)) as u64
            ),
        ));
    }
    let num_slots = (blocks * block_slots) as u64;
    if num_slots > u64::from(u32::MAX) {
        return Err(Error::invalid(
            "the cache's slots (pages x page size, or batch x capacity)",
            num_slots,
            "at most 2^32 - 1",
        ));
    }
    Ok(StoreKvParams {
        k_new: t.k_new,
        v_new: t.v_new,
        slots: t.slots,
        k_cache: t.k_cache,
        v_cache: t.v_cache,
        k_scale,
        v_scale,
        new_token_stride: (p.hkv * p.head_dim) as i64,
        new_head_stride: p.head_dim as i64,
        block_stride,
        slot_stride,
        head_stride,
        num_slots: (blocks * block_slots) as i64,
        tokens,
        hkv: p.hkv as i32,
        block_slots: block_slots as i32,
        k_scale_block_stride: kb,
        k_scale_head_stride: kh,
        v_scale_block_stride: vb,
        v_scale_head_stride: vh,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::DType;

    fn tensors(tokens: usize) -> StoreTensors {
        StoreTensors {
            tokens,
            k_new: 0,
            v_new: 0,
            slots: 0,
            k_cache: 0,
            v_cache: 0,
            k_scale: None,
            v_scale: None,
        }
    }

    #[test]
    fn writes_past_32_bit_chunk_and_slot_indices_are_refused_by_name() {
        // 8 KV heads of 128 dims: 128 chunks of 8 dims a token, 2^25 tokens a call at most
        let p = DecodeProblem::new(2, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let most = (u32::MAX / 128) as usize;
        assert!(store_params(&p, &tensors(most)).is_ok());
        let msg = store_params(&p, &tensors(most + 1))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("tokens") && msg.contains(&most.to_string()),
            "{msg}"
        );
        // a pool of 2^33 slots
        let pool = DecodeProblem::new(1, 32, 8, 128, 4096, DType::Bf16)
            .and_then(|p| p.with_paged(256, 1 << 25, None))
            .unwrap();
        let msg = store_params(&pool, &tensors(1)).unwrap_err().to_string();
        assert!(msg.contains("slots"), "{msg}");
    }
}
