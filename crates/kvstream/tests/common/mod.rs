//! Helpers shared by the compile-only test binaries.

pub mod sass;

/// `f` over every item on as many threads as the machine has cores, results in item order
/// ([`kvstream::jit::par_map`]). A panic in any call fails the caller, with its message.
pub fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    kvstream::jit::par_map(items, cores, f)
}
