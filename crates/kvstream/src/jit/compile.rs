//! NVRTC: kernel source -> sm_90a CUBIN, with the ptxas resource report.
//!
//! We ask NVRTC for machine code, never PTX: a driver only JIT-compiles PTX of its own CUDA
//! version or older, and a newer NVRTC (e.g. 13.5 from pip) would emit PTX a 13.0 driver refuses.
//! A CUBIN for sm_90a loads on any driver that knows Hopper.

use std::ffi::{c_char, CString};

use cudarc::nvrtc::{result as nvrtc, sys};

use crate::error::{Error, Result};
use crate::kernels::{Variant, HEADERS};

/// Target architecture: Hopper with its architecture-specific features (wgmma, setmaxnreg).
pub const ARCH: &str = "sm_90a";

/// Register, memory and spill figures ptxas printed for one entry point.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxasReport {
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes per thread (local memory).
    pub stack_bytes: u32,
    /// Bytes spilled to local memory.
    pub spill_stores: u32,
    /// Bytes reloaded from spills.
    pub spill_loads: u32,
    /// Static shared memory (dynamic shared memory is set at launch).
    pub static_shared_bytes: u32,
}

impl PtxasReport {
    /// Extracts the figures from an NVRTC log compiled with `--ptxas-options=-v`.
    pub fn parse(log: &str) -> Self {
        let mut r = PtxasReport::default();
        for line in log.lines() {
            if let Some(n) = number_before(line, " registers") {
                r.registers = n;
            }
            if let Some(n) = number_before(line, " bytes smem") {
                r.static_shared_bytes = n;
            }
            if let Some(n) = number_before(line, " bytes stack frame") {
                r.stack_bytes = n;
            }
            if let Some(n) = number_before(line, " bytes spill stores") {
                r.spill_stores = n;
            }
            if let Some(n) = number_before(line, " bytes spill loads") {
                r.spill_loads = n;
            }
        }
        r
    }
}

impl std::fmt::Display for PtxasReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} regs, {} B stack, {} B spill stores, {} B spill loads, {} B static smem",
            self.registers,
            self.stack_bytes,
            self.spill_stores,
            self.spill_loads,
            self.static_shared_bytes
        )
    }
}

/// The integer immediately before `suffix` in `line` ("Used 96 registers" -> 96).
fn number_before(line: &str, suffix: &str) -> Option<u32> {
    let end = line.find(suffix)?;
    let head = line[..end].trim_end();
    let start = head
        .rfind(|c: char| !c.is_ascii_digit())
        .map_or(0, |i| i + 1);
    head[start..].parse().ok()
}

/// A compiled variant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compiled {
    /// sm_90a machine code.
    pub cubin: Vec<u8>,
    /// The NVRTC log (ptxas report and any warnings).
    pub log: String,
}

impl Compiled {
    /// The ptxas figures in the log.
    pub fn report(&self) -> PtxasReport {
        PtxasReport::parse(&self.log)
    }
}

/// Errors unless libnvrtc can be loaded; cudarc would panic on first use instead.
pub fn ensure_nvrtc() -> Result<()> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::NvrtcUnavailable(
            "libnvrtc.so.13 was not found on the library path; install CUDA 13 NVRTC \
             (e.g. the nvidia-cuda-nvrtc wheel) and add its lib directory to LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// NVRTC version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    ensure_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::NvrtcUnavailable(format!("nvrtcVersion failed: {e}")))?;
    Ok((major, minor))
}

/// Environment variable that turns on the decode kernel's phase trace (`KVS_TRACE`,
/// decode_gqa.cu) in every kernel compiled by this process; `kvstream bench` writes the
/// records into the directory it names. A debugging build: the stamps cost a few instructions
/// and a barrier per CTA, so traced timings are not results.
pub const TRACE_ENV: &str = "KVSTREAM_TRACE";

/// The phase-trace directory, when [`TRACE_ENV`] names one.
pub fn trace_dir() -> Option<std::path::PathBuf> {
    std::env::var_os(TRACE_ENV)
        .filter(|d| !d.is_empty())
        .map(Into::into)
}

/// The full option list for a variant (also part of the cache key).
pub fn options(variant: &dyn Variant) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={ARCH}"),
        "--std=c++17".to_string(),
        "--ptxas-options=-v".to_string(),
        "--generate-line-info".to_string(),
    ];
    opts.extend(
        variant
            .defines()
            .into_iter()
            .map(|(k, v)| format!("-D{k}={v}")),
    );
    if trace_dir().is_some() {
        opts.push("-DKVS_TRACE=1".to_string());
    }
    opts
}

/// Compiles one variant with NVRTC (no cache; see [`super::cubin`]).
pub fn compile(variant: &dyn Variant) -> Result<Compiled> {
    compile_with(variant, &[])
}

/// [`compile`] with `extra` NVRTC options after the variant's own (e.g. `-DKVS_TRACE=1`, the
/// phase-trace build, without setting [`TRACE_ENV`] for the whole process).
pub fn compile_with(variant: &dyn Variant, extra: &[String]) -> Result<Compiled> {
    ensure_nvrtc()?;
    let name = variant.name();
    let mut opts = options(variant);
    opts.extend(extra.iter().cloned());
    let fail = |log: String| Error::Compile {
        variant: name.clone(),
        options: opts.clone(),
        log,
    };
    let src = CString::new(variant.source()).map_err(|e| fail(e.to_string()))?;
    let prog_name = CString::new(format!("{name}.cu")).map_err(|e| fail(e.to_string()))?;
    let header_srcs: Vec<CString> = HEADERS
        .iter()
        .map(|(_, s)| CString::new(*s).expect("embedded header has no NUL"))
        .collect();
    let header_names: Vec<CString> = HEADERS
        .iter()
        .map(|(n, _)| CString::new(*n).expect("header name has no NUL"))
        .collect();
    let src_ptrs: Vec<*const c_char> = header_srcs.iter().map(|s| s.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();

    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer outlives the program, which is destroyed below on every path.
    unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            prog_name.as_ptr(),
            HEADERS.len() as i32,
            src_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
        .result()
        .map_err(|e| fail(format!("nvrtcCreateProgram: {e}")))?;
    }
    let result = (|| {
        // SAFETY: `prog` was created above and is not yet destroyed.
        let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
        let log = unsafe { nvrtc::get_program_log(prog) }
            .map(|raw| {
                let bytes: Vec<u8> = raw
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        if let Err(e) = compiled {
            return Err(fail(format!("{e}\n{log}")));
        }
        let mut size = 0usize;
        unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e}\n{log}")))?;
        if size == 0 {
            return Err(fail(format!(
                "NVRTC produced no CUBIN (is {ARCH} a real target?)\n{log}"
            )));
        }
        let mut cubin = vec![0u8; size];
        unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char) }
            .result()
            .map_err(|e| fail(format!("nvrtcGetCUBIN: {e}\n{log}")))?;
        Ok(Compiled { cubin, log })
    })();
    // SAFETY: created above, destroyed exactly once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_ptxas_report() {
        let log = "ptxas info    : Compiling entry function 'kvs_decode_gqa' for 'sm_90a'\n\
                   ptxas info    : Function properties for kvs_decode_gqa\n    \
                   16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 568 bytes cmem[0]\n";
        let r = PtxasReport::parse(log);
        assert_eq!(
            r,
            PtxasReport {
                registers: 168,
                stack_bytes: 16,
                spill_stores: 8,
                spill_loads: 12,
                static_shared_bytes: 1024
            }
        );
    }
}
