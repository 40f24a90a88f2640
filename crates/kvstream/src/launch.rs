//! Kernel launches through `cuLaunchKernelEx`, the one driver entry point that takes cluster
//! dimensions and programmatic stream serialization (PDL) as launch attributes.
//!
//! Launches are plain stream work: legal on any stream, including one being captured into a
//! CUDA graph (the attributes become the graph node's attributes).

use cudarc::driver::sys;

use crate::error::{Error, Result};
use crate::params::DecodeParams;

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

/// Launches `func(params)` on `stream`.
///
/// # Safety
/// `func` must be a live kernel taking a single `DecodeParams` by value, and every pointer in
/// `params` must be valid for what that kernel reads and writes with this configuration.
pub unsafe fn launch(
    func: sys::CUfunction,
    cfg: &LaunchConfig,
    stream: sys::CUstream,
    params: &DecodeParams,
    what: &str,
) -> Result<()> {
    let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
    if cfg.pdl {
        let mut a: sys::CUlaunchAttribute = std::mem::zeroed();
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a.value.programmaticStreamSerializationAllowed = 1;
        attrs.push(a);
    }
    if let Some([x, y, z]) = cfg.cluster {
        let mut a: sys::CUlaunchAttribute = std::mem::zeroed();
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        a.value.clusterDim.x = x;
        a.value.clusterDim.y = y;
        a.value.clusterDim.z = z;
        attrs.push(a);
    }
    let config = sys::CUlaunchConfig {
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
    };
    let mut arg = params as *const DecodeParams as *mut std::ffi::c_void;
    sys::cuLaunchKernelEx(&config, func, &mut arg, std::ptr::null_mut())
        .result()
        .map_err(|e| Error::driver(format!("launching {what}"), e))
}
