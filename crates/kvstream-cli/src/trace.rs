//! The decode kernels' phase trace (`KVSTREAM_TRACE=<dir>`, `KVS_TRACE` in decode_gqa.cu,
//! decode.cu and decode_mla.cu): after a shape's timing, each timed decoder (`bench`'s keys:
//! `kvstream`, `kvstream/<ring>`, ...) replays its graph alone and every loaded decode module's
//! records are written to `<dir>/<shape id>.<key>.<variant>.csv` (`/` in a key as `-`), one line
//! per CTA, each column named after its kernel's trace point, for `bench/trace.py`.
//!
//! A debugging aid only: the traced kernels carry the stamps, so their timings are not results.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{result as cu, CudaStream};
use kvstream::{Error, Runtime};

use crate::timing::driver;

/// Trace points of decode_gqa.cu's `TracePoint` (the split engine), in order.
const SPLIT_POINTS: [&str; 16] = [
    "entry",
    "waited",
    "producer_waited",
    "released",
    "planned",
    "ids_ready",
    "producer_ready",
    "first_issue",
    "q_issued",
    "q_staged",
    "first_tile",
    "second_tile",
    "last_tile",
    "loop_done",
    "merged",
    "exit",
];
/// Trace points of decode.cu's `TracePoint` (the persistent engine), in order.
const PERSISTENT_POINTS: [&str; 12] = [
    "entry",
    "waited",
    "scheduled",
    "first_issue",
    "last_issue",
    "q_staged",
    "first_tile",
    "first_loop",
    "last_loop",
    "parked",
    "merged",
    "exit",
];
/// The steps of a persistent CTA's first merge (its cut unit's pieces all parked, the merge
/// started, its own part done, every thread's part done): decode_mla.cu's `TracePoint` after the
/// persistent engine's, and decode.cu's after its start points.
const MERGE_POINTS: [&str; 4] = ["all_parked", "merge_start", "merge_done", "merge_synced"];
/// decode.cu's `TracePoint`: after the persistent engine's, the start's steps (the scheduler's
/// first round of lengths in registers, its result written; the contiguous producer's walk
/// built, the first piece's query rows issued), then the merge's, then its first cut piece
/// counted in.
const GQA_START_POINTS: [&str; 4] = ["lengths", "start_written", "producer_ready", "q_issued"];
const GQA_PARK_POINTS: [&str; 1] = ["first_counted"];
/// Record ring size, trace slots per record and record bytes of decode_gqa.cu
/// (`TRACE_RECORDS`, `TRACE_SLOTS`, `TraceRecord`).
const RECORDS: usize = 1 << 15;
const SLOTS: usize = 24;
const RECORD_BYTES: usize = 320;

/// Forgets every record so far (before a timing).
pub fn reset(rt: &Arc<Runtime>, stream: &Arc<CudaStream>) -> kvstream::Result<()> {
    for (_, count_at, _) in rt.module_globals("kvs_trace_count")? {
        let zero = [0u32];
        // SAFETY: the global is 4 bytes of a live module; synchronised before `zero` drops.
        driver("clearing the trace count", unsafe {
            cu::memcpy_htod_async(count_at, &zero, stream.cu_stream())
        })?;
    }
    driver("clearing the trace count", stream.synchronize())
}

/// Writes the records of every traced module to `dir`, named after `shape_id`.
pub fn dump(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    dir: &Path,
    shape_id: &str,
) -> kvstream::Result<()> {
    let io = |e: std::io::Error| Error::Driver {
        context: format!("writing the trace to {}", dir.display()),
        code: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let records = rt.module_globals("kvs_trace")?;
    for (variant, count_at, _) in rt.module_globals("kvs_trace_count")? {
        let Some((_, records_at, bytes)) = records.iter().find(|r| r.0 == variant) else {
            continue;
        };
        assert_eq!(
            *bytes,
            RECORDS * RECORD_BYTES,
            "decode_gqa.cu's trace ring changed"
        );
        let mut count = [0u32];
        let mut raw = vec![0u8; RECORDS * RECORD_BYTES];
        // SAFETY: both globals belong to a live module and have exactly these sizes;
        // synchronised before the buffers are read.
        unsafe {
            driver(
                "reading the trace count",
                cu::memcpy_dtoh_async(&mut count, count_at, stream.cu_stream()),
            )?;
            driver(
                "reading the trace",
                cu::memcpy_dtoh_async(&mut raw, *records_at, stream.cu_stream()),
            )?;
        }
        driver("reading the trace", stream.synchronize())?;
        let n = count[0] as usize;
        if n == 0 {
            continue;
        }
        let points: Vec<&str> = if variant.starts_with("decode_gqa.") {
            SPLIT_POINTS.to_vec()
        } else if variant.starts_with("decode_mla.") {
            [PERSISTENT_POINTS.as_slice(), MERGE_POINTS.as_slice()].concat()
        } else {
            [
                PERSISTENT_POINTS.as_slice(),
                GQA_START_POINTS.as_slice(),
                MERGE_POINTS.as_slice(),
                GQA_PARK_POINTS.as_slice(),
            ]
            .concat()
        };
        // the persistent kernel's `splits` field counts its pieces
        let tail = if variant.starts_with("decode_gqa.") {
            "tiles,splits,len,flags"
        } else {
            "tiles,pieces,range_tiles,flags"
        };
        let mut csv = String::new();
        let _ = write!(csv, "seq");
        for p in &points {
            let _ = write!(csv, ",{p}_ns");
        }
        for p in &points {
            let _ = write!(csv, ",{p}_cycles");
        }
        let _ = writeln!(csv, ",block_x,block_y,block_z,sm,{tail}");
        // oldest kept record first
        for seq in n.saturating_sub(RECORDS)..n {
            let r = &raw[(seq % RECORDS) * RECORD_BYTES..][..RECORD_BYTES];
            let u64_at = |i: usize| u64::from_le_bytes(r[8 * i..8 * i + 8].try_into().unwrap());
            let u32_at = |i: usize| {
                let at = 8 * SLOTS + 4 * i;
                u32::from_le_bytes(r[at..at + 4].try_into().unwrap())
            };
            let _ = write!(csv, "{seq}");
            for i in 0..points.len() {
                let _ = write!(csv, ",{}", u64_at(i));
            }
            for i in 0..points.len() {
                let _ = write!(csv, ",{}", u32_at(i));
            }
            for i in SLOTS..SLOTS + 8 {
                let _ = write!(csv, ",{}", u32_at(i));
            }
            csv.push('\n');
        }
        let path = dir.join(format!("{shape_id}.{variant}.csv"));
        std::fs::write(&path, csv).map_err(io)?;
        eprintln!("trace: {n} records -> {}", path.display());
    }
    reset(rt, stream)
}
