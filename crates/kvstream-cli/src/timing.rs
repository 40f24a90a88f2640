//! The timer of docs/benchmarking.md, shared by `kvstream demo` and `kvstream bench`: a rotating
//! pool of input sets, one CUDA graph per implementation holding one call per set, two warm-up
//! replays, then rounds that replay every graph once in alternating order; per-call latency =
//! replay time / calls in the graph, median and minimum over the rounds.

use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph, CudaSlice, CudaStream};
use kvstream::Error;

/// Bytes the timing pool cycles through, so the cache cannot hold it (L2 is 60 MB).
pub const POOL_BYTES: usize = 512 << 20;
/// Fewest and most input sets in a pool.
pub const POOL_SETS: (usize, usize) = (2, 256);
/// Warm-up replays of every graph before the timed rounds.
pub const WARMUP_REPLAYS: usize = 2;
/// Fewest timed rounds.
pub const MIN_ROUNDS: usize = 7;

/// Input sets of a rotating pool: `clamp(ceil(512 MiB / bytes_per_set), 2, 256)`.
pub fn pool_sets(bytes_per_set: usize) -> usize {
    POOL_BYTES
        .div_ceil(bytes_per_set.max(1))
        .clamp(POOL_SETS.0, POOL_SETS.1)
}

/// A driver error as a kvstream error naming what was being done.
pub fn driver<T>(what: &str, r: Result<T, cudarc::driver::DriverError>) -> kvstream::Result<T> {
    r.map_err(|e| Error::Driver {
        context: what.to_string(),
        code: format!("{e:?}"),
    })
}

/// `n` uninitialised elements on `stream`.
pub fn alloc<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    n: usize,
    what: &str,
) -> kvstream::Result<CudaSlice<T>> {
    // SAFETY: callers write every buffer (upload, copy or kernel) before reading it.
    unsafe { stream.alloc::<T>(n) }.map_err(|e| Error::Driver {
        context: format!("allocating {n} elements for {what}"),
        code: format!("{e:?}"),
    })
}

/// Captures `calls` invocations of `enqueue(i)`, i = 0..calls, on `stream` into one graph.
/// The capture is always ended, also when `enqueue` fails.
pub fn capture(
    stream: &Arc<CudaStream>,
    calls: usize,
    enqueue: &mut dyn FnMut(usize) -> kvstream::Result<()>,
) -> kvstream::Result<CudaGraph> {
    driver(
        "beginning capture",
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
    )?;
    let enqueued = (0..calls).try_for_each(&mut *enqueue);
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    enqueued?;
    driver("instantiating the graph", graph)?.ok_or_else(|| Error::Driver {
        context: "capturing the timed calls".into(),
        code: "empty graph".into(),
    })
}

/// Latency of one implementation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Median over the rounds, microseconds per call.
    pub median_us: f64,
    /// Minimum over the rounds, microseconds per call.
    pub min_us: f64,
    /// Rounds timed.
    pub rounds: usize,
}

impl Timing {
    /// From per-call latencies of the rounds (any order; at least one).
    pub fn from_samples(mut us: Vec<f64>) -> Self {
        assert!(!us.is_empty(), "no timed rounds");
        us.sort_by(|a, b| a.total_cmp(b));
        Timing {
            median_us: us[us.len() / 2],
            min_us: us[0],
            rounds: us.len(),
        }
    }
}

/// The implementation order of round `round` over `n` graphs: 0..n, then n-1..0, alternating.
pub fn round_order(round: usize, n: usize) -> Vec<usize> {
    if round % 2 == 0 {
        (0..n).collect()
    } else {
        (0..n).rev().collect()
    }
}

/// Times `graphs` (each with the number of calls it holds, all captured on `stream`):
/// warm-up, then `rounds` (at least [`MIN_ROUNDS`]) rounds in alternating order, each opened by
/// one untimed replay.
pub fn time_graphs(
    stream: &Arc<CudaStream>,
    graphs: &[(&CudaGraph, usize)],
    rounds: usize,
) -> kvstream::Result<Vec<Timing>> {
    let ctx = stream.context();
    let event = || {
        driver(
            "creating an event",
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)),
        )
    };
    let mut events = Vec::with_capacity(graphs.len());
    for _ in graphs {
        events.push((event()?, event()?));
    }
    for _ in 0..WARMUP_REPLAYS {
        for (g, _) in graphs {
            driver("warm-up replay", g.launch())?;
        }
    }
    driver("waiting for the warm-up", stream.synchronize())?;
    let rounds = rounds.max(MIN_ROUNDS);
    let mut samples = vec![Vec::with_capacity(rounds); graphs.len()];
    for round in 0..rounds {
        let order = round_order(round, graphs.len());
        // An untimed lead-in replay, so the first timed graph of a round does not start on a GPU
        // idled by the previous round's synchronisation (without it the two graphs at the ends
        // of the order paid that start-up in every other round: 1-5% on 10-40 us shapes).
        driver("lead-in replay", graphs[order[0]].0.launch())?;
        for &i in &order {
            let (start, stop) = &events[i];
            driver("recording", start.record(stream))?;
            driver("replaying", graphs[i].0.launch())?;
            driver("recording", stop.record(stream))?;
        }
        driver("waiting for the round", stream.synchronize())?;
        for &i in &order {
            let (start, stop) = &events[i];
            let ms = driver("timing", start.elapsed_ms(stop))?;
            samples[i].push(ms as f64 * 1e3 / graphs[i].1.max(1) as f64);
        }
    }
    Ok(samples.into_iter().map(Timing::from_samples).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_sets_follow_the_method() {
        const MIB: usize = 1 << 20;
        assert_eq!(pool_sets(1), 256);
        assert_eq!(pool_sets(MIB), 256);
        assert_eq!(pool_sets(2 * MIB), 256);
        assert_eq!(pool_sets(3 * MIB), 171); // ceil(512 / 3)
        assert_eq!(pool_sets(4 * MIB), 128);
        assert_eq!(pool_sets(100 * MIB), 6);
        assert_eq!(pool_sets(256 * MIB), 2);
        assert_eq!(pool_sets(300 * MIB), 2);
        assert_eq!(pool_sets(512 * MIB), 2);
        assert_eq!(pool_sets(16 << 30), 2);
        assert_eq!(pool_sets(0), 256);
        for b in [1usize, 7, 4096, 3 * MIB + 1, 77 * MIB, 600 * MIB] {
            let s = pool_sets(b);
            assert!((2..=256).contains(&s));
            // the pool covers 512 MiB unless capped at 256 sets
            assert!(s == 256 || s * b >= POOL_BYTES, "{b}: {s}");
        }
    }

    #[test]
    fn rounds_alternate_and_median_is_the_middle() {
        assert_eq!(round_order(0, 3), vec![0, 1, 2]);
        assert_eq!(round_order(1, 3), vec![2, 1, 0]);
        assert_eq!(round_order(2, 3), vec![0, 1, 2]);
        let t = Timing::from_samples(vec![5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 7.0]);
        assert_eq!((t.median_us, t.min_us, t.rounds), (4.0, 1.0, 7));
    }
}
