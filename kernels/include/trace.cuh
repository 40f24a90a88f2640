// Phase trace of the persistent decode (debug builds, KVS_TRACE=1; `KVSTREAM_TRACE=<dir>
// kvstream bench` compiles it and writes the records): per CTA, the global timer and the SM clock
// at each trace point, parked in shared memory by the one thread that sees the point and
// written out as one record per CTA at its end. The record layout is the one
// crates/kvstream-cli/src/trace.rs reads (24 slots, 320 bytes, a ring of TRACE_RECORDS).
#pragma once

#include "ptx.cuh"

#ifndef KVS_TRACE
#define KVS_TRACE 0
#endif

namespace kvs {

constexpr bool TRACE = KVS_TRACE;
constexpr int TRACE_SLOTS = 24;
struct TraceRecord {
    u64 ns[TRACE_SLOTS];      // global timer, 0 where a point was not reached
    u32 cycles[TRACE_SLOTS];  // SM clock at the same points
    u32 block[3], sm, tiles, splits, len, flags;  // splits: a persistent CTA's pieces
};
static_assert(sizeof(TraceRecord) == 320, "records are 320 bytes (trace.rs reads them so)");
constexpr int TRACE_RECORDS = 1 << 15;
#if KVS_TRACE
extern "C" {  // unmangled, for cuModuleGetGlobal
__device__ TraceRecord kvs_trace[TRACE_RECORDS];
__device__ unsigned int kvs_trace_count;
}
__shared__ u64 trace_ns[TRACE_SLOTS];
__shared__ u32 trace_cycles[TRACE_SLOTS];
#endif

// Thread 0 at entry: points a CTA never reaches read 0.
__device__ __forceinline__ void trace_clear() {
#if KVS_TRACE
    for (int i = 0; i < TRACE_SLOTS; ++i) trace_ns[i] = 0;
#endif
}

__device__ __forceinline__ void trace_stamp(int point) {
#if KVS_TRACE
    trace_ns[point] = global_timer_ns();
    trace_cycles[point] = sm_clock();
#endif
}

// Whether `point` has been stamped in this CTA (false in untraced builds).
__device__ __forceinline__ bool trace_stamped(int point) {
#if KVS_TRACE
    return trace_ns[point] != 0;
#else
    return false;
#endif
}

// Thread 0, after the consumers' last barrier.
__device__ __forceinline__ void trace_write(int tiles, int splits, int len, u32 flags) {
#if KVS_TRACE
    TraceRecord& r = kvs_trace[atomicAdd(&kvs_trace_count, 1u) % TRACE_RECORDS];
    for (int i = 0; i < TRACE_SLOTS; ++i) {
        r.ns[i] = trace_ns[i];
        r.cycles[i] = trace_cycles[i];
    }
    r.block[0] = blockIdx.x;
    r.block[1] = blockIdx.y;
    r.block[2] = blockIdx.z;
    r.sm = sm_id();
    r.tiles = tiles;
    r.splits = splits;
    r.len = len;
    r.flags = flags;
#endif
}

}  // namespace kvs
