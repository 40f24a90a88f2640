//! Run-time compilation of the kernels: NVRTC ([`compile`]) behind a disk cache ([`cache`]).

pub mod cache;
pub mod compile;

pub use compile::{Compiled, PtxasReport, ARCH};

use crate::error::Result;
use crate::kernels::{Variant, HEADERS};

/// Where a CUBIN came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Loaded from the disk cache.
    Cache,
    /// Compiled now (and stored, if the cache is writable).
    Compiled,
}

/// The CUBIN of `variant`: from the disk cache when an intact entry exists, else compiled by
/// NVRTC and stored. A cache that cannot be written is not an error (the CUBIN is still
/// returned); one that cannot be read is treated as empty.
pub fn cubin(variant: &dyn Variant) -> Result<(Compiled, Origin)> {
    let (major, minor) = compile::nvrtc_version()?;
    let opts = compile::options(variant);
    let version = format!("nvrtc {major}.{minor} {ARCH}");
    let mut parts: Vec<&[u8]> = vec![variant.source().as_bytes(), version.as_bytes()];
    for (name, src) in HEADERS.iter() {
        parts.push(name.as_bytes());
        parts.push(src.as_bytes());
    }
    parts.extend(opts.iter().map(|o| o.as_bytes()));
    let key = cache::key(&parts);
    let dir = cache::cache_dir();
    let name = variant.name();
    if let Some(hit) = cache::load(&dir, &name, &key) {
        return Ok((hit, Origin::Cache));
    }
    let compiled = compile::compile(variant)?;
    let _ = cache::store(&dir, &name, &key, &compiled);
    Ok((compiled, Origin::Compiled))
}
