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

/// `f` over every item on `threads` threads (at least one), results in item order: each NVRTC
/// compile is single-threaded and NVRTC is thread-safe, so compiling many variants scales with
/// the cores (`kvstream kernels --jobs`, the every-variant tests); the f64 reference's rows
/// alike. A panic in any call is
/// resumed in the caller.
///
/// ```
/// let squares = kvstream::jit::par_map(&[1, 2, 3], 2, |x| x * x);
/// assert_eq!(squares, [1, 4, 9]);
/// ```
pub fn par_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let threads = threads.clamp(1, items.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<(usize, R)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        mine.push((i, f(item)));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, r)| r).collect()
}
