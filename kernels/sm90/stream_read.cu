// Streaming read: the byte floor and read ceiling of `kvstream bench` (bench/METHOD.md).
//
// Reads n_vec 16-byte vectors once, grid-stride, KVS_UNROLL independent loads in flight per
// thread, folds them into one register with xor/adds and stores one word per CTA into a small
// sink, so the loads cannot be optimised away and the writes are negligible. Any grid and any
// block size up to KVS_MAX_THREADS (a multiple of 32) is valid; n_vec may be 0.
//
// Parameters mirrored by `StreamReadParams` in crates/kvstream/src/kernels.rs; both sides
// assert the size.
//
// Compile-time configuration: KVS_MAX_THREADS, KVS_UNROLL.

namespace kvs {
constexpr int MAX_THREADS = KVS_MAX_THREADS;
constexpr int UNROLL = KVS_UNROLL;
static_assert(MAX_THREADS % 32 == 0 && MAX_THREADS <= 1024, "whole warps, at most 1024");

struct StreamReadParams {
    const uint4* src;           // n_vec 16-byte vectors, 16-byte aligned
    unsigned* sink;             // sink_mask + 1 words
    unsigned long long n_vec;   // vectors to read
    unsigned sink_mask;         // sink words - 1 (a power of two minus one)
    unsigned reserved;
};
static_assert(sizeof(StreamReadParams) == 32, "StreamReadParams must match kernels.rs");

// Read-only, no L1 allocation: every byte is read exactly once.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned fold(unsigned acc, uint4 v) {
    return (acc ^ v.x) + (v.y ^ v.z) + v.w;
}
}  // namespace kvs

using namespace kvs;

// Two CTAs per SM: caps ptxas at 64 registers, enough to keep all UNROLL loads in flight (at the
// default occupancy target it squeezes to ~32 registers and consumes each load right after the
// next is issued: two in flight instead of eight).
extern "C" __global__ void __launch_bounds__(MAX_THREADS, 2)
kvs_stream_read(const __grid_constant__ StreamReadParams p) {
    __shared__ unsigned warp_acc[MAX_THREADS / 32];
    const unsigned long long n = p.n_vec;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    // One accumulator per load slot: no dependency chain between the UNROLL loads of a round,
    // so all of them are issued before the first is used.
    unsigned accs[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) accs[u] = 0;
    for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = load_stream(p.src + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) accs[u] = fold(accs[u], v[u]);
    }
    for (; i < n; i += stride) accs[0] = fold(accs[0], load_stream(p.src + i));
    unsigned acc = 0;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc += accs[u];

#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc ^= __shfl_xor_sync(0xffffffffu, acc, off);
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (threadIdx.x % 32 == 0) warp_acc[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned r = 0;
        for (int w = 0; w < warps; ++w) r += warp_acc[w];
        p.sink[blockIdx.x & p.sink_mask] = r;
    }
}
