//! Merging partial attention states by their log-sum-exps: the outputs of decodes over disjoint
//! parts of the keys (the shards of a context-parallel cache, each rank's local decode) into the
//! output over all keys.
//!
//! For one query row with partial outputs `o_s` and natural-log LSEs `lse_s`:
//! `out = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m)` and `lse = m + ln sum_s exp(lse_s - m)`
//! with `m = max_s lse_s`, in FP32, shards summed in index order (bitwise deterministic). A shard
//! with `lse = -inf` has no key for the row and its output is not read; a row no shard has keys
//! for gives zeros and `-inf`. Optional sinks (one logit per head, `[heads]` f32) join the
//! denominator once, after the merge: decode the shards without sinks and give them here.
//! [`crate::reference::merge_states`] is the f64 model.
//!
//! ```no_run
//! use kvstream::merge::{MergeShape, StateMerger};
//! use kvstream::{DType, Runtime};
//! # fn main() -> kvstream::Result<()> {
//! let rt = Runtime::new(0)?;
//! // 4 shards of a decode of 16 requests, 1 new token, 32 query heads of d 128
//! let merger = StateMerger::new(&rt, MergeShape::new(4, 16, 1, 32, 128, DType::Bf16)?)?;
//! // merger.run_slices(&stream, &parts, &part_lse, &mut out, Some(&mut lse), None)?;
//! # Ok(()) }
//! ```

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::decode::{check_lengths, Element};
use crate::error::{Error, Result};
use crate::kernels::{AnyVariant, MergeStatesVariant};
use crate::launch::{launch, LaunchConfig};
use crate::params::MergeStatesParams;
use crate::problem::DType;
use crate::runtime::{LoadedKernel, Runtime};

/// Most elements of one output row (MLA's 512-wide rows are the widest kvstream writes; wider
/// ones merge as well, this bounds the per-thread work).
pub const MAX_MERGE_HEAD_DIM: usize = 1024;

/// What a merge combines: `shards` partial states of `rows = batch x q_len x heads` output rows
/// of `head_dim` elements. Partial outputs are read at `shard * part_shard_stride + row *
/// part_row_stride` (elements; contiguous `[shards, rows, head_dim]` by default), partial LSEs
/// at `shard * lse_shard_stride + row` (`[shards, rows]`); the merged output is contiguous
/// `[rows, head_dim]`, its LSE `[rows]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MergeShape {
    /// Partial states per row (1 copies, with the sinks applied).
    pub shards: usize,
    /// Requests.
    pub batch: usize,
    /// New tokens per request.
    pub q_len: usize,
    /// Query heads (a sink is per head: row r is head `r % heads`).
    pub heads: usize,
    /// Elements of one output row (a multiple of 8).
    pub head_dim: usize,
    /// Element type of the partial and merged outputs.
    pub dtype: DType,
    /// Elements from one shard's outputs to the next's.
    pub part_shard_stride: usize,
    /// Elements from one row of a shard's outputs to the next.
    pub part_row_stride: usize,
    /// Elements from one shard's LSEs to the next's.
    pub lse_shard_stride: usize,
}

impl MergeShape {
    /// A merge of contiguous `[shards, batch, q_len, heads, head_dim]` partial outputs and
    /// `[shards, batch, q_len, heads]` LSEs.
    pub fn new(
        shards: usize,
        batch: usize,
        q_len: usize,
        heads: usize,
        head_dim: usize,
        dtype: DType,
    ) -> Result<Self> {
        let rows = batch * q_len * heads;
        let shape = MergeShape {
            shards,
            batch,
            q_len,
            heads,
            head_dim,
            dtype,
            part_shard_stride: rows * head_dim,
            part_row_stride: head_dim,
            lse_shard_stride: rows,
        };
        shape.validate()?;
        Ok(shape)
    }

    /// The same merge reading partial states laid out with these strides (elements).
    pub fn with_strides(
        mut self,
        part_shard_stride: usize,
        part_row_stride: usize,
        lse_shard_stride: usize,
    ) -> Result<Self> {
        self.part_shard_stride = part_shard_stride;
        self.part_row_stride = part_row_stride;
        self.lse_shard_stride = lse_shard_stride;
        self.validate()?;
        Ok(self)
    }

    /// Output rows: `batch x q_len x heads`.
    pub fn rows(&self) -> usize {
        self.batch * self.q_len * self.heads
    }

    /// Elements the partial outputs span (from the first shard's first row to the end of the
    /// last shard's last row).
    pub fn part_elements(&self) -> usize {
        match self.rows() {
            0 => 0,
            rows => {
                (self.shards - 1) * self.part_shard_stride
                    + (rows - 1) * self.part_row_stride
                    + self.head_dim
            }
        }
    }

    /// Floats the partial LSEs span.
    pub fn lse_elements(&self) -> usize {
        match self.rows() {
            0 => 0,
            rows => (self.shards - 1) * self.lse_shard_stride + rows,
        }
    }

    /// Checks every field against what the merge kernel takes.
    pub fn validate(&self) -> Result<()> {
        let chunk = MergeStatesVariant::CHUNK;
        if self.shards == 0 || self.shards > i32::MAX as usize {
            return Err(Error::invalid("shards", self.shards, "1 ..= 2^31 - 1"));
        }
        for (arg, v) in [
            ("batch", self.batch),
            ("q_len", self.q_len),
            ("heads", self.heads),
        ] {
            if v == 0 {
                return Err(Error::invalid(arg, v, "at least 1"));
            }
        }
        if self.head_dim == 0 || self.head_dim % chunk != 0 || self.head_dim > MAX_MERGE_HEAD_DIM {
            return Err(Error::invalid(
                "head_dim",
                self.head_dim,
                format!("a multiple of {chunk} up to {MAX_MERGE_HEAD_DIM} (16-byte rows)"),
            ));
        }
        let rows = self.rows();
        // (rows < 2^31 and head_dim <= 1024 keep the grid, rows x head_dim / 8 / 256 CTAs,
        // below 2^32)
        if rows > i32::MAX as usize {
            return Err(Error::invalid(
                "batch x q_len x heads",
                rows,
                "fewer than 2^31 rows",
            ));
        }
        for (arg, stride) in [
            ("part_shard_stride", self.part_shard_stride),
            ("part_row_stride", self.part_row_stride),
        ] {
            if stride % chunk != 0 {
                return Err(Error::invalid(
                    arg,
                    stride,
                    format!("a multiple of {chunk} elements (16-byte aligned rows)"),
                ));
            }
        }
        if self.part_row_stride < self.head_dim {
            return Err(Error::invalid(
                "part_row_stride",
                self.part_row_stride,
                format!(
                    "at least head_dim = {} (rows may not overlap)",
                    self.head_dim
                ),
            ));
        }
        if self.shards > 1 && self.lse_shard_stride < rows {
            return Err(Error::invalid(
                "lse_shard_stride",
                self.lse_shard_stride,
                format!("at least the rows, {rows} (shards may not overlap)"),
            ));
        }
        Ok(())
    }
}

/// Device pointers of one merge (see [`MergeShape`] for their layouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MergeTensors {
    /// Partial outputs, the shape's dtype, 16-byte aligned.
    pub parts: u64,
    /// Partial LSEs, f32 (natural log; `-inf`: the shard has no key for the row).
    pub part_lse: u64,
    /// Merged output `[rows, head_dim]`, the shape's dtype, 16-byte aligned.
    pub out: u64,
    /// Merged LSE `[rows]` f32, if wanted.
    pub lse: Option<u64>,
    /// Sinks `[heads]` f32, if the attention has them.
    pub sinks: Option<u64>,
}

/// Merges partial attention states on the GPU (one small kernel, graph-capturable, no
/// workspace).
pub struct StateMerger {
    rt: Arc<Runtime>,
    shape: MergeShape,
    kernel: LoadedKernel,
}

impl StateMerger {
    /// Loads the merge kernel for `shape` (compiling it on a cold cache).
    pub fn new(rt: &Arc<Runtime>, shape: MergeShape) -> Result<Self> {
        shape.validate()?;
        let kernel = rt.kernel(
            AnyVariant::MergeStates(MergeStatesVariant { dtype: shape.dtype }),
            0,
        )?;
        Ok(StateMerger {
            rt: rt.clone(),
            shape,
            kernel,
        })
    }

    /// The merge it runs.
    pub fn shape(&self) -> &MergeShape {
        &self.shape
    }

    /// The launch parameters of a merge (pure host work).
    pub(crate) fn params(&self, t: &MergeTensors) -> MergeStatesParams {
        let s = &self.shape;
        MergeStatesParams {
            parts: t.parts,
            part_lse: t.part_lse,
            sinks: t.sinks.unwrap_or(0),
            out: t.out,
            lse: t.lse.unwrap_or(0),
            part_shard_stride: s.part_shard_stride as i64,
            part_row_stride: s.part_row_stride as i64,
            lse_shard_stride: s.lse_shard_stride as i64,
            shards: s.shards as i32,
            rows: s.rows() as i32,
            head_dim: s.head_dim as i32,
            heads: s.heads as i32,
        }
    }

    /// Enqueues the merge on `stream`. Launched with programmatic dependent launch: it waits
    /// for the kernel before it (the decode that wrote the last shard) inside the GPU.
    ///
    /// # Safety
    /// The pointers must reference device memory of this runtime's GPU with the sizes the
    /// shape implies, valid until the work completes; `stream` must belong to this runtime's
    /// context.
    pub unsafe fn run(&self, t: &MergeTensors, stream: sys::CUstream) -> Result<()> {
        let rt = &self.rt;
        for (arg, ptr, align) in [
            ("parts", t.parts, 16),
            ("part_lse", t.part_lse, 4),
            ("out", t.out, 16),
        ] {
            rt.check_pointer(arg, ptr, align)?;
        }
        for (arg, ptr) in [("lse", t.lse), ("sinks", t.sinks)] {
            if let Some(ptr) = ptr {
                rt.check_pointer(arg, ptr, 4)?;
            }
        }
        let params = self.params(t);
        rt.bind()?;
        let threads =
            (self.shape.rows() * (self.shape.head_dim / MergeStatesVariant::CHUNK)) as u64;
        let blocks = threads.div_ceil(MergeStatesVariant::THREADS as u64);
        let cfg = LaunchConfig {
            grid: [blocks as u32, 1, 1],
            block: [MergeStatesVariant::THREADS, 1, 1],
            shared_bytes: 0,
            pdl: true,
            cluster: None,
        };
        launch(self.kernel.func, &cfg, stream, &params, "the state merge")
    }

    /// Safe form of [`StateMerger::run`] on cudarc slices: checks dtypes and lengths, then
    /// enqueues on `stream`.
    pub fn run_slices<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        parts: &CudaSlice<T>,
        part_lse: &CudaSlice<f32>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
        sinks: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        let s = &self.shape;
        if T::DTYPE != s.dtype {
            return Err(Error::invalid(
                "parts, out",
                T::DTYPE.name(),
                format!("{} (the shape's dtype)", s.dtype.name()),
            ));
        }
        let rows = s.rows();
        check_lengths(&[
            ("parts", parts.len(), s.part_elements(), ""),
            ("part_lse", part_lse.len(), s.lse_elements(), ""),
            ("out", out.len(), rows * s.head_dim, ""),
        ])?;
        if let Some(l) = &lse {
            check_lengths(&[("lse", l.len(), rows, " (one per row)")])?;
        }
        if let Some(sk) = sinks {
            check_lengths(&[("sinks", sk.len(), s.heads, " (one per head)")])?;
        }
        let (pp, _g1) = parts.device_ptr(stream);
        let (lp, _g2) = part_lse.device_ptr(stream);
        let (op, _g3) = out.device_ptr_mut(stream);
        let mut lse = lse;
        let lse_ptr = lse.as_mut().map(|l| l.device_ptr_mut(stream));
        let sinks_ptr = sinks.map(|s| s.device_ptr(stream));
        let t = MergeTensors {
            parts: pp,
            part_lse: lp,
            out: op,
            lse: lse_ptr.as_ref().map(|(p, _)| *p),
            sinks: sinks_ptr.as_ref().map(|(p, _)| *p),
        };
        // SAFETY: lengths checked above; the slices outlive the enqueue and cudarc's guards
        // record the stream use.
        unsafe { self.run(&t, stream.cu_stream()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked_by_name() {
        let err = |r: Result<MergeShape>| r.unwrap_err().to_string();
        assert!(err(MergeShape::new(0, 1, 1, 8, 128, DType::Bf16)).contains("shards"));
        assert!(err(MergeShape::new(2, 0, 1, 8, 128, DType::Bf16)).contains("batch"));
        let e = err(MergeShape::new(2, 1, 1, 8, 100, DType::Bf16));
        assert!(
            e.contains("head_dim") && e.contains("100") && e.contains("multiple of 8"),
            "{e}"
        );
        let ok = MergeShape::new(2, 3, 2, 8, 512, DType::F16).unwrap();
        assert_eq!(ok.rows(), 48);
        assert_eq!(ok.part_elements(), 2 * 48 * 512);
        assert_eq!(ok.lse_elements(), 96);
        let e = err(ok.with_strides(48 * 512, 500, 48));
        assert!(e.contains("part_row_stride"), "{e}");
        let e = err(ok.with_strides(48 * 512, 512, 40));
        assert!(e.contains("lse_shard_stride"), "{e}");
        // an all-gathered [shards, batch, heads, d] view of per-rank outputs with padding rows
        let padded = ok.with_strides(50 * 512, 512, 50).unwrap();
        assert_eq!(padded.part_elements(), 50 * 512 + 47 * 512 + 512);
    }
}
