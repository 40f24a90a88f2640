// Split-KV combine: merges the FP32 partials of decode_gqa.cu into the final output.
//
// One CTA per output row (request b, new token i, query head h) = (b * q_len + i) * hq + h.
// For the splits s = 0, 1, ... :
//   M = max_s m_s                       (computed here: no global max buffer, nothing to reset)
//   w_s = 2^(m_s - M), 0 for empty splits (m_s = -inf; their O is written as zeros)
//   out = sum_s w_s O_s / sum_s w_s l_s,   LSE = (M + log2 sum_s w_s l_s) * ln 2
// The merge is latency-bound, not bandwidth-bound (a batch-1 problem has 16 rows of a few KB per
// split), so it is spread wide and issued at once: thread t loads split t's statistics while
// warp w loads the O of splits w, w + WARPS, ... (IN_FLIGHT per round trip, 64 splits per CTA),
// and the warps' sums are added in warp order. Every reduction has a fixed shape and order, so the result is
// bitwise reproducible. Launched with programmatic dependent launch behind the decode kernel:
// the index arithmetic runs while decode drains, griddepcontrol.wait comes before the first load.
//
// Compile-time configuration: KVS_IS_F16, KVS_HEAD_DIM (as in decode_gqa.cu), KVS_MAX_SPLITS.
#include "ptx.cuh"
#include "params.cuh"

namespace kvs {
constexpr bool IS_F16 = KVS_IS_F16;
constexpr int HEAD_DIM = KVS_HEAD_DIM;
constexpr int MAX_SPLITS = KVS_MAX_SPLITS;
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int PER_LANE = HEAD_DIM / 32;  // 2 or 4 consecutive elements
constexpr int IN_FLIGHT = 8;             // per warp: WARPS * IN_FLIGHT splits' loads in flight
static_assert(MAX_SPLITS <= THREADS, "one thread per split for the statistics");

// Reduces `x` over the CTA with `op` in a fixed shape (butterfly in each warp, then the warps'
// results in warp order); every thread gets the result.
template <typename Op>
__device__ __forceinline__ float cta_reduce(float x, float* scratch, Op op) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, off));
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
    __syncthreads();
    float r = scratch[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) r = op(r, scratch[w]);
    __syncthreads();  // scratch is reused by the next reduction
    return r;
}
}  // namespace kvs

using namespace kvs;

extern "C" __global__ void __launch_bounds__(THREADS)
kvs_combine(const __grid_constant__ DecodeParams p) {
    __shared__ float weight[MAX_SPLITS];
    __shared__ float scratch[WARPS];
    __shared__ float warp_sum[WARPS][HEAD_DIM];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // 32-bit index math (the grid's x dimension is below 2^31): 64-bit divisions are
    // software loops, and they sit on the path to the first load.
    const int row32 = blockIdx.x;  // (b * q_len + i) * hq + h
    const int request_row = row32 / p.hq;  // b * q_len + i
    const int head = row32 - request_row * p.hq;
    const int token = p.q_len == 1 ? 0 : request_row % p.q_len;
    const int batch = p.q_len == 1 ? request_row : request_row / p.q_len;
    const long long row = row32;
    const long long rows = (long long)p.batch * p.q_len * p.hq;
    const int s_own = threadIdx.x;  // the split whose statistics this thread holds

    pdl_wait_for_producer();
    pdl_release_dependents();  // as in decode_gqa.cu: the next kernel waits resident, not queued

    // Where split s of this row left its partials: [split][row] (static plan), or the device
    // plan's slots [slot][column of the decode CTA] (plan_work.cu). Rows the device plan did
    // not split were written by the decode kernel itself.
    int splits = p.num_splits;
    long long first = row, step = rows;
    if (p.work) {
        splits = p.request_plan[2 * batch];
        if (splits == 1) return;
        const int column = token * p.group + head % p.group;  // within the KV head's rows
        const int unit = (head / p.group) * p.col_blocks + column / p.block_cols;
        first = (long long)(p.request_plan[2 * batch + 1] + unit * splits) * p.block_cols + column % p.block_cols;
        step = p.block_cols;
    }
    auto at = [&](int s) { return first + s * step; };

    // Everything the merge reads is issued in one go, before any of it is used: this thread's
    // split statistics and this warp's first IN_FLIGHT partial outputs (decode writes every
    // split's statistics and, for empty splits, a zero O, so no load depends on another).
    const float m_own = s_own < splits ? p.m_partial[at(s_own)] : neg_inf();
    const float l_own = s_own < splits ? p.l_partial[at(s_own)] : 0.f;
    float2 x[IN_FLIGHT][PER_LANE / 2];
    auto load_round = [&](int s0) {
#pragma unroll
        for (int j = 0; j < IN_FLIGHT; ++j) {
            const int s = s0 + j * WARPS;
            const float2* o = reinterpret_cast<const float2*>(p.o_partial + at(s) * HEAD_DIM) +
                              lane * (PER_LANE / 2);
#pragma unroll
            for (int i = 0; i < PER_LANE / 2; ++i) x[j][i] = s < splits ? o[i] : make_float2(0.f, 0.f);
        }
    };
    load_round(warp);

    const float m_max = cta_reduce(m_own, scratch, [](float a, float b) { return fmaxf(a, b); });
    const float w_own = m_own == neg_inf() ? 0.f : exp2_approx(m_own - m_max);
    if (s_own < splits) weight[s_own] = w_own;
    // (cta_reduce's barrier also publishes `weight`)
    const float l_sum = cta_reduce(w_own * l_own, scratch, [](float a, float b) { return a + b; });

    float acc[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.f;
    for (int s0 = warp; s0 < splits; s0 += WARPS * IN_FLIGHT) {
        if (s0 != warp) load_round(s0);
#pragma unroll
        for (int j = 0; j < IN_FLIGHT; ++j) {
            const int s = s0 + j * WARPS;
            const float w = s < splits ? weight[s] : 0.f;
#pragma unroll
            for (int i = 0; i < PER_LANE / 2; ++i) {
                acc[2 * i] += w * x[j][i].x;
                acc[2 * i + 1] += w * x[j][i].y;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) warp_sum[warp][lane * PER_LANE + i] = acc[i];
    __syncthreads();

    const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
    if (threadIdx.x < HEAD_DIM / 2) {
        const int d = threadIdx.x * 2;
        float o0 = 0.f, o1 = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            o0 += warp_sum[w][d];
            o1 += warp_sum[w][d + 1];
        }
        u32* out = reinterpret_cast<u32*>(reinterpret_cast<u16*>(p.out) + batch * p.o_batch_stride +
                                          token * p.o_token_stride + head * p.o_head_stride + d);
        *out = pack_half2<IS_F16>(o0 * inv, o1 * inv);
    }
    if (p.lse && threadIdx.x == 0) {
        p.lse[row] = l_sum > 0.f ? (m_max + __log2f(l_sum)) * 0.69314718055994531f : neg_inf();
    }
}
