//! Kernel launches through `cuLaunchKernelEx`, the one driver entry point that takes cluster
//! dimensions and programmatic stream serialization (PDL) as launch attributes.
//!
//! Launches are plain stream work: legal on any stream, including one being captured into a
//! CUDA graph (the attributes become the graph node's attributes).

use cudarc::driver::sys;

use crate::error::{Error, Result};
use crate::problem::{DType, KvDType, KvStrides};

/// Geometry and attributes of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Grid in CTAs.
    pub grid: [u32; 3],
    /// Threads per CTA.
    pub block: [u32; 3],
    /// Dynamic shared memory per CTA.
    pub shared_bytes: u32,
    /// Programmatic dependent launch: may start before the previous kernel in the stream ends;
    /// the kernel itself calls `griddepcontrol.wait` before touching its inputs.
    pub pdl: bool,
    /// Thread-block cluster shape, if any.
    pub cluster: Option<[u32; 3]>,
}

/// Launches `func(params)` on `stream`; `P` is the kernel's one by-value parameter struct
/// ([`crate::params::DecodeParams`] for decode and combine, [`crate::kernels::StreamReadParams`] for the
/// streaming read).
///
/// # Safety
/// `func` must be a live kernel taking a single `P` (with the same `#[repr(C)]` layout) by
/// value, and every pointer in `params` must be valid for what that kernel reads and writes with
/// this configuration.
pub unsafe fn launch<P: Copy>(
    func: sys::CUfunction,
    cfg: &LaunchConfig,
    stream: sys::CUstream,
    params: &P,
    what: &str,
) -> Result<()> {
    let mut attrs = attributes(cfg);
    let config = driver_config(cfg, stream, &mut attrs);
    let mut arg = params as *const P as *mut std::ffi::c_void;
    sys::cuLaunchKernelEx(&config, func, &mut arg, std::ptr::null_mut())
        .result()
        .map_err(|e| Error::driver(format!("launching {what}"), e))
}

/// How many clusters of `cfg` can be resident at once (0: the cluster does not fit the GPU with
/// this kernel's shared memory and threads).
///
/// # Safety
/// `func` must be a live kernel of the current context.
pub unsafe fn max_active_clusters(func: sys::CUfunction, cfg: &LaunchConfig) -> Result<usize> {
    let mut attrs = attributes(cfg);
    let config = driver_config(cfg, std::ptr::null_mut(), &mut attrs);
    let mut n = 0i32;
    sys::cuOccupancyMaxActiveClusters(&mut n, func, &config)
        .result()
        .map_err(|e| Error::driver("querying cluster occupancy", e))?;
    Ok(n.max(0) as usize)
}

/// How many CTAs of `func` with `threads` threads and `shared_bytes` of dynamic shared memory
/// one SM holds at once.
///
/// # Safety
/// `func` must be a live kernel of the current context.
pub unsafe fn max_active_ctas_per_sm(
    func: sys::CUfunction,
    threads: u32,
    shared_bytes: usize,
) -> Result<usize> {
    let mut n = 0i32;
    sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, func, threads as i32, shared_bytes)
        .result()
        .map_err(|e| Error::driver("querying CTA occupancy", e))?;
    Ok(n.max(0) as usize)
}

fn attributes(cfg: &LaunchConfig) -> Vec<sys::CUlaunchAttribute> {
    let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
    // SAFETY (both blocks): CUlaunchAttribute is plain data; zero is a valid empty value.
    if cfg.pdl {
        let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a.value.programmaticStreamSerializationAllowed = 1;
        attrs.push(a);
    }
    if let Some([x, y, z]) = cfg.cluster {
        let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        a.value.clusterDim.x = x;
        a.value.clusterDim.y = y;
        a.value.clusterDim.z = z;
        attrs.push(a);
    }
    attrs
}

fn driver_config(
    cfg: &LaunchConfig,
    stream: sys::CUstream,
    attrs: &mut [sys::CUlaunchAttribute],
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: cfg.grid[0],
        gridDimY: cfg.grid[1],
        gridDimZ: cfg.grid[2],
        blockDimX: cfg.block[0],
        blockDimY: cfg.block[1],
        blockDimZ: cfg.block[2],
        sharedMemBytes: cfg.shared_bytes,
        hStream: stream,
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
    }
}

/// How far the L2 extends a TMA load's DRAM fetch past the bytes the box asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TmaPromotion {
    /// No promotion.
    None,
    /// To 64 bytes.
    B64,
    /// To 128 bytes: a box row's line; the default of both engines (256 bytes fetched the next
    /// head's row with it: docs/tuning.md, "L2 promotion").
    #[default]
    B128,
    /// To 256 bytes.
    B256,
}

impl TmaPromotion {
    /// From 0 (none), 1 (64 B), 2 (128 B), 3 (256 B).
    pub fn from_code(code: usize) -> Option<Self> {
        [Self::None, Self::B64, Self::B128, Self::B256]
            .get(code)
            .copied()
    }
    fn raw(self) -> sys::CUtensorMapL2promotion {
        use sys::CUtensorMapL2promotion as P;
        match self {
            Self::None => P::CU_TENSOR_MAP_L2_PROMOTION_NONE,
            Self::B64 => P::CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
            Self::B128 => P::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            Self::B256 => P::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        }
    }
}

/// How the TMA unit sees a cache element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaElement {
    data_type: sys::CUtensorMapDataType,
    bytes: u64,
}

impl TmaElement {
    /// The cache elements of a query of `dtype` and caches of `kv_dtype`.
    pub fn of(dtype: DType, kv_dtype: KvDType) -> Self {
        use sys::CUtensorMapDataType as T;
        let data_type = match (kv_dtype, dtype) {
            (KvDType::Fp8E4m3, _) => T::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            (KvDType::AsQuery, DType::Bf16) => T::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            (KvDType::AsQuery, DType::F16) => T::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        };
        TmaElement {
            data_type,
            bytes: kv_dtype.size(dtype) as u64,
        }
    }
}

/// Encodes the TMA tensor map of one KV cache tensor for the decode kernel: a 4-D tensor
/// `{d, hkv, max_len, batch}` (innermost first) with the given element strides, read in boxes of
/// one row of head dims ([`crate::kernels::kv_box_row_bytes`]) x `box_tokens` positions of one
/// head, swizzled in shared memory at the row's width (kv_format.cuh). Positions past `max_len`
/// and head dims past `d` (the padded last row of a d 96 head) read as zeros. Pure host work: no device call, legal during capture.
#[allow(clippy::too_many_arguments)]
pub fn kv_tensor_map(
    arg: &'static str,
    ptr: u64,
    elem: TmaElement,
    head_dim: usize,
    hkv: usize,
    max_len: usize,
    batch: usize,
    strides: KvStrides,
    box_tokens: usize,
    promotion: TmaPromotion,
) -> Result<sys::CUtensorMap> {
    let row_bytes = crate::kernels::kv_box_row_bytes(head_dim, elem.bytes as usize) as u64;
    let swizzle = if row_bytes == 128 {
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
    } else {
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B
    };
    let box_dims = [(row_bytes / elem.bytes) as u32, 1, box_tokens as u32, 1];
    encode_tiled(
        arg,
        ptr,
        (elem, swizzle),
        promotion,
        [head_dim as u64, hkv as u64, max_len as u64, batch as u64],
        // byte strides of dims 1.. (dim 0 is contiguous)
        &[
            strides.head as u64 * elem.bytes,
            strides.token as u64 * elem.bytes,
            strides.batch as u64 * elem.bytes,
        ],
        box_dims,
    )
}

/// Encodes the tensor map of a page pool `[num_pages, page_size, hkv, 128]` whose boxes hold both
/// 64-dim halves of one page run: the 5-D tensor `{64 dims, page_size positions, 2 halves, hkv,
/// num_pages}` (the halves' stride, 128 bytes, is smaller than the positions'), boxes `{64,
/// page_size, 2, 1, 1}`, so the box lands in shared memory as `[half][position][128 bytes]`. For
/// pages of 8-32 positions at d128 (`DecodeVariant::joins_halves`): half the boxes per tile.
pub fn joined_page_map(
    arg: &'static str,
    ptr: u64,
    dtype: DType,
    hkv: usize,
    page_size: usize,
    num_pages: usize,
    promotion: TmaPromotion,
) -> Result<sys::CUtensorMap> {
    let tma = TmaElement::of(dtype, KvDType::AsQuery);
    let elem = tma.bytes;
    let position = hkv as u64 * 128 * elem;
    encode_tiled(
        arg,
        ptr,
        (tma, sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B),
        promotion,
        [64, page_size as u64, 2, hkv as u64, num_pages as u64],
        &[position, 64 * elem, 128 * elem, page_size as u64 * position],
        [64, page_size as u32, 2, 1, 1],
    )
}

/// cuTensorMapEncodeTiled with the decode kernel's settings: the element and swizzle given, the
/// given L2 promotion, zeros outside the tensor.
fn encode_tiled<const RANK: usize>(
    arg: &'static str,
    ptr: u64,
    (elem, swizzle): (TmaElement, sys::CUtensorMapSwizzle),
    promotion: TmaPromotion,
    dims: [u64; RANK],
    byte_strides: &[u64],
    box_dims: [u32; RANK],
) -> Result<sys::CUtensorMap> {
    // (the driver reads RANK - 1 of them: checked in release builds too, it guards the FFI call)
    assert_eq!(byte_strides.len() + 1, RANK, "tensor map strides");
    let element_strides = [1u32; RANK];
    // SAFETY: all-zero bytes are a valid (if meaningless) tensor map; it is fully written below.
    let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
    // SAFETY: dims, box_dims and element_strides have RANK entries and byte_strides RANK - 1
    // (asserted above); the pointer is only recorded, not dereferenced.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            elem.data_type,
            RANK as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            byte_strides.as_ptr(),
            box_dims.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            promotion.raw(),
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result().map_err(|_| {
        Error::invalid(
            arg,
            format!("address {ptr:#x}, dims {dims:?}, byte strides {byte_strides:?}"),
            "a 16-byte aligned tensor with 16-byte multiple strides below 2^40 bytes (TMA limits)",
        )
    })?;
    Ok(map)
}
