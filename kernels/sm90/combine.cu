// Split-KV combine: merges the FP32 partials of decode_gqa.cu into the final output.
//
// One warp per (request, query head) row. For the splits s = 0, 1, ... :
//   M = max_s m_s                       (computed here: no global max buffer, nothing to reset)
//   w_s = 2^(m_s - M), 0 for empty splits (m_s = -inf), whose O is then never read
//   out = sum_s w_s O_s / sum_s w_s l_s,   LSE = (M + log2 sum_s w_s l_s) * ln 2
// The statistics are spread over the lanes (split s on lane s % 32) and reduced with a fixed
// butterfly; the weighted O sum runs over s in increasing order with each lane owning HEAD_DIM/32
// consecutive elements, eight splits' loads in flight at a time. Both orders are fixed, so the
// result is bitwise reproducible. The loop is latency-bound, not bandwidth-bound: issuing the
// loads of several splits before using any of them is what keeps a 64-split merge short.
// Launched with programmatic dependent launch behind the decode kernel: the index arithmetic runs
// while decode drains, griddepcontrol.wait comes before the first load.
//
// Compile-time configuration: KVS_IS_F16, KVS_HEAD_DIM (as in decode_gqa.cu), KVS_MAX_SPLITS.
#include "ptx.cuh"
#include "params.cuh"

namespace kvs {
constexpr bool IS_F16 = KVS_IS_F16;
constexpr int HEAD_DIM = KVS_HEAD_DIM;
constexpr int MAX_SPLITS = KVS_MAX_SPLITS;
constexpr int PER_LANE = HEAD_DIM / 32;  // 2 or 4 consecutive elements
constexpr int WARPS = 4;
constexpr int STATS_PER_LANE = (MAX_SPLITS + 31) / 32;
constexpr int IN_FLIGHT = 8;  // splits whose O loads are issued before the first is used
}  // namespace kvs

using namespace kvs;

extern "C" __global__ void __launch_bounds__(WARPS * 32)
kvs_combine(const __grid_constant__ DecodeParams p) {
    __shared__ float weight_smem[WARPS][MAX_SPLITS];
    const int lane = threadIdx.x % 32;
    float* weight = weight_smem[threadIdx.x / 32];
    const long long row = (long long)blockIdx.x * WARPS + threadIdx.x / 32;  // b * hq + h
    const long long rows = (long long)p.batch * p.hq;
    const int batch = (int)(row / p.hq), head = (int)(row % p.hq);
    const int splits = p.num_splits;

    pdl_wait_for_producer();
    if (row >= rows) return;  // whole warps only: nothing below synchronises across warps

    float m_split[STATS_PER_LANE];
    float m_max = neg_inf();
#pragma unroll
    for (int i = 0; i < STATS_PER_LANE; ++i) {
        const int s = lane + 32 * i;
        m_split[i] = s < splits ? p.m_partial[s * rows + row] : neg_inf();
        m_max = fmaxf(m_max, m_split[i]);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m_max = fmaxf(m_max, __shfl_xor_sync(0xffffffffu, m_max, off));

    float l_sum = 0.f;
#pragma unroll
    for (int i = 0; i < STATS_PER_LANE; ++i) {
        const int s = lane + 32 * i;
        if (s < splits) {
            const float w = m_split[i] == neg_inf() ? 0.f : exp2_approx(m_split[i] - m_max);
            weight[s] = w;
            if (w != 0.f) l_sum += w * p.l_partial[s * rows + row];
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) l_sum += __shfl_xor_sync(0xffffffffu, l_sum, off);
    __syncwarp();

    float acc[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.f;
    for (int s0 = 0; s0 < splits; s0 += IN_FLIGHT) {
        float2 x[IN_FLIGHT][PER_LANE / 2];
        float w[IN_FLIGHT];
#pragma unroll
        for (int j = 0; j < IN_FLIGHT; ++j) {
            const int s = s0 + j;
            w[j] = s < splits ? weight[s] : 0.f;
            const float2* o = reinterpret_cast<const float2*>(p.o_partial + (s * rows + row) * HEAD_DIM) + lane * (PER_LANE / 2);
#pragma unroll
            for (int i = 0; i < PER_LANE / 2; ++i) x[j][i] = w[j] != 0.f ? o[i] : make_float2(0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < IN_FLIGHT; ++j)
#pragma unroll
            for (int i = 0; i < PER_LANE / 2; ++i) {
                acc[2 * i] += w[j] * x[j][i].x;
                acc[2 * i + 1] += w[j] * x[j][i].y;
            }
    }
    pdl_release_dependents();

    const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
    u32* out = reinterpret_cast<u32*>(reinterpret_cast<u16*>(p.out) + batch * p.o_batch_stride +
                                      head * p.o_head_stride + lane * PER_LANE);
#pragma unroll
    for (int i = 0; i < PER_LANE / 2; ++i) out[i] = pack_half2<IS_F16>(acc[2 * i] * inv, acc[2 * i + 1] * inv);
    if (p.lse && lane == 0) {
        p.lse[row] = l_sum > 0.f ? (m_max + __log2f(l_sum)) * 0.69314718055994531f : neg_inf();
    }
}
