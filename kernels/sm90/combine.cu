// Split-KV combine: merges the FP32 partials of decode_gqa.cu into the final output.
//
// One warp per (request, query head) row; each lane owns HEAD_DIM / 32 consecutive elements.
// For the splits s = 0, 1, ... in this fixed order (deterministic rounding):
//   M = max_s m_s                       (computed here: no global max buffer, nothing to reset)
//   w_s = 2^(m_s - M), skipping empty splits (m_s = -inf) without reading their O
//   out = sum_s w_s O_s / sum_s w_s l_s,   LSE = (M + log2 sum_s w_s l_s) * ln 2
// Launched with programmatic dependent launch behind the decode kernel: the index arithmetic runs
// while decode drains, griddepcontrol.wait comes before the first load.
//
// Compile-time configuration: KVS_IS_F16, KVS_HEAD_DIM (as in decode_gqa.cu).
#include "ptx.cuh"
#include "params.cuh"

namespace kvs {
constexpr bool IS_F16 = KVS_IS_F16;
constexpr int HEAD_DIM = KVS_HEAD_DIM;
constexpr int PER_LANE = HEAD_DIM / 32;  // 2 or 4 consecutive elements
constexpr int WARPS = 4;
}  // namespace kvs

using namespace kvs;

extern "C" __global__ void __launch_bounds__(WARPS * 32)
kvs_combine(const __grid_constant__ DecodeParams p) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * WARPS + threadIdx.x / 32;  // b * hq + h
    const long long rows = (long long)p.batch * p.hq;
    const int batch = (int)(row / p.hq), head = (int)(row % p.hq);
    const long long split_stride = rows;  // partial index: split * rows + row

    pdl_wait_for_producer();
    if (row >= rows) return;

    float m_max = neg_inf();
    for (int s = 0; s < p.num_splits; ++s) m_max = fmaxf(m_max, p.m_partial[s * split_stride + row]);

    float acc[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.f;
    float l_sum = 0.f;
    if (m_max != neg_inf()) {
        for (int s = 0; s < p.num_splits; ++s) {
            const float m_s = p.m_partial[s * split_stride + row];
            if (m_s == neg_inf()) continue;  // empty split: its O was never written
            const float w = exp2_approx(m_s - m_max);
            l_sum += w * p.l_partial[s * split_stride + row];
            const float* o = p.o_partial + (s * split_stride + row) * HEAD_DIM + lane * PER_LANE;
#pragma unroll
            for (int i = 0; i < PER_LANE / 2; ++i) {
                const float2 x = reinterpret_cast<const float2*>(o)[i];
                acc[2 * i] += w * x.x;
                acc[2 * i + 1] += w * x.y;
            }
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
