//! The one error type of the crate.
//!
//! Every invalid input is reported as [`Error::InvalidArgument`] naming the argument, the value
//! it had and what is allowed, so a caller (or the Python binding, which maps it to
//! `ValueError`) can show it unchanged. The library never panics on user input.

use std::fmt;

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in kvstream.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// An argument is outside what the kernels accept.
    InvalidArgument {
        /// Name of the argument as the caller wrote it (`"k_cache"`, `"cache_seqlens"`, ...).
        arg: &'static str,
        /// The offending value, formatted.
        value: String,
        /// What would have been accepted.
        allowed: String,
    },
    /// The CUDA driver library (libcuda) could not be loaded: no NVIDIA driver on this machine.
    DriverUnavailable(String),
    /// NVRTC (libnvrtc.so.13) could not be loaded.
    NvrtcUnavailable(String),
    /// No usable GPU: none present, or not an sm_90 device.
    NoSuitableDevice(String),
    /// NVRTC rejected a kernel; keeps the variant, the options and the full compiler log.
    Compile {
        /// Kernel variant name.
        variant: String,
        /// Options passed to NVRTC.
        options: Vec<String>,
        /// NVRTC program log.
        log: String,
    },
    /// A CUDA driver call failed.
    Driver {
        /// What we were doing.
        context: String,
        /// `cuGetErrorName` of the result.
        code: String,
    },
    /// The kernel cache directory could not be used.
    Cache(String),
}

impl Error {
    /// An [`Error::InvalidArgument`] for `arg`, which had `value`; `allowed` says what is accepted.
    pub fn invalid(
        arg: &'static str,
        value: impl fmt::Display,
        allowed: impl fmt::Display,
    ) -> Self {
        Error::InvalidArgument {
            arg,
            value: value.to_string(),
            allowed: allowed.to_string(),
        }
    }

    pub(crate) fn driver(context: impl Into<String>, err: cudarc::driver::DriverError) -> Self {
        let code = err
            .error_name()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", err.0));
        Error::Driver {
            context: context.into(),
            code,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidArgument {
                arg,
                value,
                allowed,
            } => write!(f, "invalid {arg}: got {value}, allowed: {allowed}"),
            Error::DriverUnavailable(why) => write!(f, "CUDA driver not available: {why}"),
            Error::NvrtcUnavailable(why) => write!(f, "NVRTC not available: {why}"),
            Error::NoSuitableDevice(why) => write!(f, "no suitable GPU: {why}"),
            Error::Compile {
                variant,
                options,
                log,
            } => write!(
                f,
                "NVRTC failed to compile {variant} (options: {}):\n{log}",
                options.join(" ")
            ),
            Error::Driver { context, code } => {
                write!(f, "CUDA driver error {code} while {context}")
            }
            Error::Cache(why) => write!(f, "kernel cache: {why}"),
        }
    }
}

impl std::error::Error for Error {}
