//! One GPU as kvstream sees it: the CUDA context, device facts for the planner, and the kernels
//! loaded so far (compiled on first use, cached on disk by [`crate::jit`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as cu, sys, CudaContext};

use crate::error::{Error, Result};
use crate::jit::{self, PtxasReport};
use crate::kernels::AnyVariant;
use crate::plan::DeviceFacts;

/// A kernel resident on the device.
#[derive(Clone, Copy, Debug)]
pub struct LoadedKernel {
    /// Entry point.
    pub func: sys::CUfunction,
    /// ptxas figures of its CUBIN.
    pub report: ResourceFigures,
}

/// The ptxas figures that matter at run time (copyable).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResourceFigures {
    /// Registers per thread.
    pub registers: u32,
    /// Spilled bytes (stores).
    pub spill_stores: u32,
}

impl From<&PtxasReport> for ResourceFigures {
    fn from(r: &PtxasReport) -> Self {
        ResourceFigures {
            registers: r.registers,
            spill_stores: r.spill_stores,
        }
    }
}

struct Module(sys::CUmodule);
// SAFETY: a CUmodule handle may be used from any thread of the process.
unsafe impl Send for Module {}
// SAFETY: as above; the function handle is immutable once obtained.
unsafe impl Send for LoadedKernel {}
unsafe impl Sync for LoadedKernel {}

/// A GPU ready to run kvstream kernels.
pub struct Runtime {
    ctx: Arc<CudaContext>,
    facts: DeviceFacts,
    /// Loaded kernels, with the dynamic shared memory each is allowed to launch with.
    loaded: Mutex<HashMap<AnyVariant, (Module, LoadedKernel, usize)>>,
}

/// Errors unless the CUDA driver library can be loaded (cudarc would panic on first use).
pub fn ensure_driver() -> Result<()> {
    // SAFETY: only tries to dlopen libcuda by its usual names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::DriverUnavailable(
            "libcuda.so was not found: this machine has no NVIDIA driver".into(),
        ))
    }
}

impl Runtime {
    /// Opens GPU `ordinal` through its primary context (the one PyTorch and the CUDA runtime
    /// use, so pointers and streams from them work here). Requires an sm_90 GPU.
    pub fn new(ordinal: usize) -> Result<Arc<Self>> {
        ensure_driver()?;
        cu::init().map_err(|e| Error::driver("initialising the CUDA driver", e))?;
        let count =
            CudaContext::device_count().map_err(|e| Error::driver("counting devices", e))?;
        if count <= 0 {
            return Err(Error::NoSuitableDevice("the driver reports no GPU".into()));
        }
        if ordinal >= count as usize {
            return Err(Error::invalid(
                "device",
                ordinal,
                format!("0..{count} (GPUs on this machine)"),
            ));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| Error::driver(format!("opening GPU {ordinal}"), e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| Error::driver("reading the compute capability", e))?;
        if (major, minor) != (9, 0) {
            let name = ctx.name().unwrap_or_default();
            return Err(Error::NoSuitableDevice(format!(
                "GPU {ordinal} ({name}) is sm_{major}{minor}; kvstream's kernels are built for sm_90a (H100/H200)"
            )));
        }
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| Error::driver("reading the SM count", e))? as usize;
        Ok(Arc::new(Runtime {
            ctx,
            facts: DeviceFacts { sm_count },
            loaded: Mutex::new(HashMap::new()),
        }))
    }

    /// The CUDA context (primary context of the device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Facts the planner uses.
    pub fn facts(&self) -> DeviceFacts {
        self.facts
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes this runtime's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::driver("making the context current", e))
    }

    /// The kernel for `variant`, compiling and loading it on first use. `shared_bytes` is the
    /// dynamic shared memory it will be launched with (the opt-in limit is raised to it, also
    /// for a kernel already loaded by a plan that needed less).
    pub fn kernel(&self, variant: AnyVariant, shared_bytes: usize) -> Result<LoadedKernel> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, k, allowed)) = loaded.get_mut(&variant) {
            if shared_bytes > *allowed {
                self.bind()?;
                allow_shared_bytes(k.func, shared_bytes, &variant.as_variant().name())?;
                *allowed = shared_bytes;
            }
            return Ok(*k);
        }
        self.bind()?;
        let v = variant.as_variant();
        let (compiled, _) = jit::cubin(v)?;
        let name = v.name();
        // SAFETY: the CUBIN was produced by NVRTC for this architecture; the image is copied by
        // the driver before load_data returns.
        let module = unsafe { cu::module::load_data(compiled.cubin.as_ptr() as *const _) }
            .map_err(|e| Error::driver(format!("loading {name}"), e))?;
        let entry = std::ffi::CString::new(v.entry()).expect("entry names have no NUL");
        // SAFETY: module is live.
        let func = unsafe { cu::module::get_function(module, entry) }
            .map_err(|e| Error::driver(format!("finding {} in {name}", v.entry()), e))?;
        allow_shared_bytes(func, shared_bytes, &name)?;
        // Cluster reductions of 16 CTAs exceed the portable cluster size (8); the decoder checks
        // with the occupancy API that such a cluster fits before it plans one.
        // SAFETY: func is live; the attribute only widens the cluster sizes a launch may ask for.
        unsafe {
            cu::function::set_function_attribute(
                func,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                1,
            )
        }
        .map_err(|e| Error::driver(format!("allowing non-portable clusters for {name}"), e))?;
        let kernel = LoadedKernel {
            func,
            report: ResourceFigures::from(&compiled.report()),
        };
        loaded.insert(variant, (Module(module), kernel, shared_bytes));
        Ok(kernel)
    }

    /// Every loaded module's global `name` (an `extern "C"` `__device__` variable), as
    /// (variant name, device address, bytes); modules without it are skipped. For debug
    /// readers such as the phase trace (decode_gqa.cu, `KVS_TRACE`).
    pub fn module_globals(&self, name: &str) -> Result<Vec<(String, u64, usize)>> {
        let symbol = std::ffi::CString::new(name)
            .map_err(|_| Error::invalid("name", name, "a symbol name without NUL bytes"))?;
        self.bind()?;
        let loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        let mut found = Vec::new();
        for (variant, (module, _, _)) in loaded.iter() {
            // SAFETY: the module is live while `loaded` holds it.
            match unsafe { cu::module::get_global(module.0, symbol.clone()) } {
                Ok((ptr, bytes)) => found.push((variant.as_variant().name(), ptr, bytes)),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_FOUND => {}
                Err(e) => {
                    let v = variant.as_variant().name();
                    return Err(Error::driver(format!("looking up {name} in {v}"), e));
                }
            }
        }
        found.sort();
        Ok(found)
    }

    /// The device a pointer belongs to, or an error naming `arg` if it is not device memory.
    pub fn check_pointer(&self, arg: &'static str, ptr: u64, align: u64) -> Result<()> {
        if ptr == 0 {
            return Err(Error::invalid(arg, "a null pointer", "a device pointer"));
        }
        if ptr % align != 0 {
            return Err(Error::invalid(
                arg,
                format!("address {ptr:#x}"),
                format!("{align}-byte aligned device memory"),
            ));
        }
        let mut ordinal: i32 = -1;
        // SAFETY: out-parameter of the documented size for this attribute.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                &mut ordinal as *mut i32 as *mut std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS || ordinal < 0 {
            return Err(Error::invalid(
                arg,
                format!("address {ptr:#x}, not known to the CUDA driver"),
                format!("memory on GPU {}", self.ordinal()),
            ));
        }
        if ordinal as usize != self.ordinal() {
            return Err(Error::invalid(
                arg,
                format!("memory on GPU {ordinal}"),
                format!("memory on GPU {} (the runtime's device)", self.ordinal()),
            ));
        }
        Ok(())
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let loaded = self.loaded.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, (module, _, _)) in loaded.drain() {
            // SAFETY: each module is unloaded once; failures are ignored (never panic in drop).
            let _ = unsafe { cu::module::unload(module.0) };
        }
    }
}

/// Raises `func`'s dynamic shared memory opt-in limit to `bytes`.
fn allow_shared_bytes(func: sys::CUfunction, bytes: usize, name: &str) -> Result<()> {
    // SAFETY: func is live; the attribute only raises the shared-memory opt-in limit.
    unsafe {
        cu::function::set_function_attribute(
            func,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
    }
    .map_err(|e| Error::driver(format!("allowing {bytes} B of shared memory for {name}"), e))
}
