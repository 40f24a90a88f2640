// Launch parameters shared by the decode and combine kernels.
//
// Mirrored field for field by `DecodeParams` in crates/kvstream/src/params.rs (#[repr(C)]); both
// sides assert the size, so a field added on one side only fails to build. Strides are in
// elements; the innermost (head-dim) stride is always 1.
#pragma once

namespace kvs {

// A CUtensorMap, encoded on the host by cuTensorMapEncodeTiled; opaque to the kernel.
struct alignas(128) TensorMap {
    unsigned long long opaque[16];
};

// Query rows: request b's new token i (0 <= i < q_len) with query head h is output row
// (b * q_len + i) * hq + h; it sees cache positions [0, seqlens[b] - q_len + i] (causal among the
// new tokens). The decode kernel puts the q_len * group rows of one KV head on the MMA N
// dimension ("columns", token-major), in blocks of up to 32 columns per CTA.
struct alignas(128) DecodeParams {
    TensorMap k_map;        // contiguous: K as a 4-D tensor {d, hkv, max_len, batch}; paged: the
    TensorMap v_map;        //   page pool {d, hkv, page_size, num_pages}; box {64, 1, rows, 1},
                            //   128-byte swizzle; V likewise (decode kernel only). The caches'
                            //   addresses and strides reach the kernels only through these maps.
    const void* q;          // [batch, q_len, hq, d]     bf16 | f16, strides below
    void* out;              // [batch, q_len, hq, d]     same dtype as q, strides below
    float* lse;             // [batch, q_len, hq] natural log, or null
    const int* seqlens;     // [batch] int32, or null: every request has max_len tokens
    float* o_partial;       // [num_splits, rows, d]   unnormalised (kernel reduction only);
    float* m_partial;       // [num_splits, rows]      base-2 running max    rows = batch * q_len
    float* l_partial;       // [num_splits, rows]      softmax denominator          * hq
    const int* block_table; // paged: [batch, table_stride] int32 page ids; null: contiguous
    long long q_batch_stride, q_token_stride, q_head_stride;
    long long o_batch_stride, o_token_stride, o_head_stride;
    int batch, hq, hkv, group;
    int max_len;            // L: capacity of the cache per request; every seqlens[b] <= max_len
    int num_splits;         // CTAs along the KV axis per (request, kv head)
    float scale_log2;       // softmax_scale * log2(e): scores go straight to exp2
    int cluster_splits;     // > 1: the splits of one (request, kv head) form a cluster of this
                            //   size and merge through distributed shared memory (no combine)
    int q_len;              // new tokens per request, 1..8
    int cols;               // q_len * group: query rows (MMA columns) per KV head
    int col_blocks;         // CTAs along the columns of one KV head: ceil(cols / columns per CTA)
    int page_size;          // paged: tokens per page (a power of two); 0: contiguous
    int table_stride;       // paged: entries per block-table row
    // Device-side plan (plan_work.cu), or null: the grid is (num_splits, hkv * col_blocks, batch)
    int* work;              // [plan_grid] {request, item in request}: one per decode CTA
    int* request_plan;      // [batch] {splits, first FP32 partial slot}
    int plan_grid;          // decode CTAs (grid.x) of a device-planned launch
    int plan_target;        // CTAs the device plan aims for
    int plan_tile;          // positions per tile (the decode kernel's TILE_TOKENS)
    int block_cols;         // columns per decode CTA (8 x n8 tiles): partial slots hold this many
    int plan_slots;         // FP32 partial slots in the workspace (device plan)
    int num_pages;          // paged: pages in the pool (0 otherwise)
    // For the decode's L2 warm-up before the PDL wait only (prefetch addresses; the loads go
    // through the tensor maps): the caches' base addresses and strides, or k_cache = null where a
    // stride does not fit 32 bits. A page pool's "batch" stride is its page stride.
    const void* k_cache;
    const void* v_cache;
    long long k_batch_stride, v_batch_stride;
    int k_token_stride, k_head_stride, v_token_stride, v_head_stride;
    // e4m3 caches (KVS_KV_FP8): dequantisation scales, request b and KV head h at
    // scale[b * batch_stride + h * head_stride] (kv_format.cuh, kv_scale); null: 1
    const float* k_scale;
    const float* v_scale;
    int k_scale_batch_stride, k_scale_head_stride;
    int v_scale_batch_stride, v_scale_head_stride;
};

// params.rs asserts the same size, and its tests lay this struct out from this file's text and
// compare every field's offset with the Rust mirror's.
static_assert(sizeof(DecodeParams) == 640, "DecodeParams must match params.rs");

// Token range [begin, end) of one split. The cache is cut into whole tiles and split s takes
// tiles [s * tiles / splits, (s + 1) * tiles / splits): run lengths differ by at most one tile,
// only the last split can end in a partial tile, and a split is empty only when there are fewer
// tiles than splits. Mirrored by `plan::split_range` on the host.
struct SplitRange {
    int begin, end;
};

__device__ __forceinline__ SplitRange split_range(int len, int num_splits, int split,
                                                  int tile_tokens) {
    const long long tiles = (len + tile_tokens - 1) / tile_tokens;
    const int first = (int)(split * tiles / num_splits);
    const int last = (int)((split + 1) * tiles / num_splits);
    SplitRange r = {first * tile_tokens, min(len, last * tile_tokens)};
    return r;
}

}  // namespace kvs
