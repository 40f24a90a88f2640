// Merge of attention states: n partial outputs of the same query rows, each over a disjoint part
// of the keys (one shard of a context-parallel cache, say), with their log-sum-exps, into the
// exact output over all keys:
//   m = max_s lse_s,  w_s = exp(lse_s - m),  out = sum_s w_s o_s / sum_s w_s,  lse = m + log(sum_s w_s)
// in FP32, the shards summed in index order (bitwise deterministic). A shard whose LSE is -inf
// holds no key for the row: its output is not read (it may hold anything, NaN included). A row
// that no shard has keys for gives zeros and -inf. An optional sink (a learned per-head logit)
// joins the denominator once: lse' = logaddexp(lse, sink), out' = out * exp(lse - lse'), so
// shards decoded without sinks merge into the decode with them.
//
// One thread per 8 elements (16 bytes) of an output row; the threads of a row each recompute
// its weights from the n LSEs (a few floats, served by L1).
//
// Parameters mirrored by `MergeStatesParams` in crates/kvstream/src/params.rs.
//
// Compile-time configuration: KVS_IS_F16 (the element type of the partial and merged outputs).
#include "ptx.cuh"

namespace kvs {

constexpr bool IS_F16 = KVS_IS_F16;
constexpr int THREADS = 256;
constexpr int CHUNK = 8;  // elements per thread

struct alignas(128) MergeStatesParams {
    const void* parts;        // shard s, row r, element e at s * part_shard_stride + r * row_stride + e
    const float* part_lse;    // shard s, row r at s * lse_shard_stride + r
    const float* sinks;       // [heads] (row r is head r % heads), or null
    void* out;                // [rows, head_dim], contiguous
    float* lse;               // [rows], or null
    long long part_shard_stride, part_row_stride;  // elements
    long long lse_shard_stride;
    int shards, rows, head_dim, heads;
};
static_assert(sizeof(MergeStatesParams) == 128, "MergeStatesParams must match params.rs");

}  // namespace kvs

using namespace kvs;

extern "C" __global__ void __launch_bounds__(THREADS) kvs_merge_states(const __grid_constant__ MergeStatesParams p) {
    const int chunks = p.head_dim / CHUNK;
    const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    // The partial states are the previous kernels' outputs.
    pdl_wait_for_producer();
    pdl_release_dependents();
    if (i >= (long long)p.rows * chunks) return;
    const int row = (int)(i / chunks);
    const int c = (int)(i % chunks);

    float m = neg_inf();
    for (int s = 0; s < p.shards; ++s) m = fmaxf(m, p.part_lse[s * p.lse_shard_stride + row]);
    float acc[CHUNK];
#pragma unroll
    for (int e = 0; e < CHUNK; ++e) acc[e] = 0.f;
    float lse = neg_inf();
    if (m != neg_inf()) {
        float total = 0.f;
        for (int s = 0; s < p.shards; ++s) {
            const float lse_s = p.part_lse[s * p.lse_shard_stride + row];
            if (lse_s == neg_inf()) continue;
            const float w = expf(lse_s - m);
            total += w;
            const uint4 x = *reinterpret_cast<const uint4*>(
                reinterpret_cast<const u16*>(p.parts) + s * p.part_shard_stride + row * p.part_row_stride + c * CHUNK);
            const u32 words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float lo, hi;
                unpack_half2<IS_F16>(words[k], lo, hi);
                acc[2 * k] += w * lo;
                acc[2 * k + 1] += w * hi;
            }
        }
        const float inv = 1.f / total;
#pragma unroll
        for (int e = 0; e < CHUNK; ++e) acc[e] *= inv;
        lse = m + logf(total);
    }
    if (p.sinks) {
        const float sink = p.sinks[row % p.heads];
        if (lse == neg_inf()) {
            lse = sink;
        } else {
            const float top = fmaxf(lse, sink);
            const float joined = top + logf(expf(lse - top) + expf(sink - top));
            const float keep = expf(lse - joined);
#pragma unroll
            for (int e = 0; e < CHUNK; ++e) acc[e] *= keep;
            lse = joined;
        }
    }
    uint4 y;
    y.x = pack_half2<IS_F16>(acc[0], acc[1]);
    y.y = pack_half2<IS_F16>(acc[2], acc[3]);
    y.z = pack_half2<IS_F16>(acc[4], acc[5]);
    y.w = pack_half2<IS_F16>(acc[6], acc[7]);
    *reinterpret_cast<uint4*>(reinterpret_cast<u16*>(p.out) + (long long)row * p.head_dim + c * CHUNK) = y;
    if (c == 0 && p.lse) p.lse[row] = lse;
}
