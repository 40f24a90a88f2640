// Launch parameters of the persistent decode kernel (decode.cu).
//
// Mirrored field for field by `PersistentParams` in crates/kvstream/src/params.rs (#[repr(C)]);
// both sides assert the size and the Rust tests compare every field's offset with this text.
// Strides are in elements; the innermost (head-dim) stride is always 1.
#pragma once

#include "params.cuh"

namespace kvs {

// Query rows: request b's new token i (0 <= i < q_len) with query head h is output row
// (b * q_len + i) * hq + h; it sees cache positions [0, len_b - q_len + i] (causal among the
// new tokens). The q_len * group rows of one KV head are the MMA N dimension ("columns",
// token-major), in column blocks of up to 32. With paired heads (decode.cu, KVS_HEADS_PER_ROW 2)
// hkv, group and cols describe the pairs (hkv / 2 rows of 128 dims, 2 x group query rows each)
// and d below is 64; the scales are still indexed by the real KV head.
struct alignas(128) PersistentParams {
    TensorMap k_map;          // contiguous: K as {d, hkv, max_len, batch}; paged: the pool
    TensorMap v_map;          //   {d, hkv, page_size, num_pages}; boxes of one row (kv_format.cuh)
    const void* q;            // [batch, q_len, hq, d]  bf16 | f16, strides below
    void* out;                // [batch, q_len, hq, d]  same dtype as q, strides below
    float* lse;               // [batch, q_len, hq] natural log, or null
    const int* seqlens;       // [batch] int32, or null: every request has max_len positions
    const int* block_table;   // paged: [batch, table_stride] int32 page ids; null: contiguous
    const void* k_cache;      // paged: the pools [num_pages, page_size, hkv, d] for the gathering
    const void* v_cache;      //   producer (KVS_GATHER); the tensor maps serve every other source
    float* o_partial;         // [2 * grid, block_cols, d] cut pieces' unnormalised O (schedule.cuh)
    float* ml_partial;        // [2 * grid, block_cols, 2] their base-2 max and denominator
    int* arrivals;            // [batch * hkv * col_blocks] pieces parked per unit: zero between
                              //   calls (zeroed once at allocation, reset by the merging CTA)
    int* schedule_log;        // tests: [grid, SCHEDULE_LOG_PIECES, 4] pieces per CTA, or null
    long long q_batch_stride, q_token_stride, q_head_stride;
    long long o_batch_stride, o_token_stride, o_head_stride;
    int batch, hq, hkv, group;
    int q_len;                // new tokens per request, 1..8
    int cols;                 // q_len * group: query rows (MMA columns) per KV head
    int col_blocks;           // ceil(cols / block_cols)
    int max_len;              // capacity per request; lengths are clamped to it
    float scale_log2;         // softmax_scale * log2(e): scores go straight to exp2
    int page_size;            // paged: positions per page (a power of two); 0: contiguous
    int table_stride;         // paged: entries per block-table row
    int num_pages;            // paged: pages in each pool; a page id outside [0, num_pages) reads zeros
    int min_tiles_per_cta;    // schedule: fewer CTAs work when there are few tiles (schedule.cuh)
    int lanes;                // schedule: 1, col_blocks or hkv x col_blocks lanes of CTAs (schedule.cuh)
    // fp8 caches (KVS_KV_FP8): FP32 dequantisation scales, request b's KV head h at
    // scale[b * batch_stride + h * head_stride] (one per tensor: strides 0; per KV head: 0, 1;
    // per request and KV head: hkv, 1); null: 1. K's scales the scores, V's the output.
    const float* k_scale;
    const float* v_scale;
    int k_scale_batch_stride, k_scale_head_stride;
    int v_scale_batch_stride, v_scale_head_stride;
    // Score modifiers (score_mods.cuh). Sinks: [hq] FP32 logits (natural log, on the scaled
    // scores' scale) that join each query row's softmax denominator and add no value, or null.
    const float* sinks;
    // Sliding window: the query at cache position t (t = len - q_len + i for new token i) sees
    // [t - window_left, t + window_right] within [0, len); -1: unbounded on that side.
    int window_left, window_right;
    // Softcap c (scores s become c tanh(s / c)): 2 / c and c log2(e); 0, 0: off
    float softcap_scale, softcap_log2;
    // [grid, 4] per CTA, the first tiles it streamed in the decoder's previous call {request,
    // KV head (of the tensor maps), first position, tiles}: warmed into L2 before the PDL wait
    // of the next call (decode.cu, "L2 warm-up"); read there as a hint only. Null: none.
    int* warm_hints;
};

static_assert(sizeof(PersistentParams) == 512, "PersistentParams must match params.rs");

// Pieces a CTA records in schedule_log (a count, then up to this many {batch, unit, first, end}).
constexpr int SCHEDULE_LOG_PIECES = 63;

}  // namespace kvs
