// Score modifiers of the GQA decode: logit softcap, attention sinks and the sliding window's
// column bounds. The kernels keep their softmax state in base 2 (scores times log2(e)); these
// helpers take and give values in that base, so the mainloop and the epilogue stay as they are.
#pragma once

#include "ptx.cuh"

namespace kvs {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.69314718055994531f;

// Softcap c of the scaled scores: s -> c tanh(s / c). With u = s log2(e) (what the mainloop holds)
// the capped score in base 2 is cl (1 - 2 / (1 + 2^(u (2 / c)))) with cl = c log2(e)
// (`scale` = 2 / c and `cl` come from the host): one exp2 and one reciprocal, exact to a few
// ulps of cl over the whole range (1 + inf gives 0, so u -> +-inf gives +-cl, never NaN), where
// tanh.approx would be off by up to 2^-11 of c.
__device__ __forceinline__ float softcap(float u, float scale, float cl) {
    return cl - 2.f * cl * rcp_approx(1.f + exp2_approx(u * scale));
}

// Where a softmax state (base-2 max m, denominator l, the output still unnormalised) becomes
// output: the factor that multiplies O (v_scale / l, and the sink's share of the denominator)
// and the LSE in natural log. `sink2` is the row's sink logit in base 2 (-inf: none). A row
// that saw no position gives factor 0 and LSE = its sink (-inf without one), never NaN.
struct Normalised {
    float factor;
    float lse;
};
__device__ __forceinline__ Normalised normalise(float m, float l, float v_scale, float sink2) {
    if (!(sink2 > neg_inf())) {
        return {l > 0.f ? v_scale / l : 0.f, l > 0.f ? (m + __log2f(l)) * LN2 : neg_inf()};
    }
    const float m_seen = l > 0.f ? m : neg_inf();
    const float m2 = fmaxf(m_seen, sink2);  // finite: the sink is
    const float w = exp2_approx(m_seen - m2);
    const float total = l * w + exp2_approx(sink2 - m2);
    return {v_scale * w / total, (m2 + __log2f(total)) * LN2};
}

// The sink of query head `head` in base 2, -inf without sinks.
__device__ __forceinline__ float sink_log2(const float* sinks, int head) {
    return sinks ? ld_global_l2(sinks + head) * LOG2E : neg_inf();
}

// The cache positions [low, high) the query at position t = len - q_len + token sees (the
// window's convention in decode_params.cuh); empty where high <= low.
struct VisibleRange {
    int low, high;
};
__device__ __forceinline__ VisibleRange visible_range(int len, int q_len, int token, int window_left,
                                                      int window_right) {
    const int t = len - q_len + token;
    const int high = window_right < 0 ? len : min(len, t + 1 + window_right);
    const int low = window_left < 0 ? 0 : max(0, t - window_left);
    return {low, high};
}

}  // namespace kvs
