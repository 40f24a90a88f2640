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

struct alignas(128) DecodeParams {
    TensorMap k_map;        // K as a 4-D tensor {d, hkv, max_len, batch}, box {64, 1, tile, 1},
    TensorMap v_map;        //   128-byte swizzle; V likewise (decode kernel only)
    const void* q;          // [batch, hq, d]            bf16 | f16
    const void* k;          // [batch, max_len, hkv, d]  strides below
    const void* v;          // [batch, max_len, hkv, d]  strides below
    void* out;              // [batch, hq, d]            same dtype as q
    float* lse;             // [batch, hq] natural log, or null
    const int* seqlens;     // [batch] int32, or null: every request has max_len tokens
    float* o_partial;       // [num_splits, batch, hq, d]  unnormalised (kernel reduction only)
    float* m_partial;       // [num_splits, batch, hq]     base-2 running max (kernel reduction)
    float* l_partial;       // [num_splits, batch, hq]     softmax denominator (kernel reduction)
    long long q_batch_stride, q_head_stride;
    long long k_batch_stride, k_token_stride, k_head_stride;
    long long v_batch_stride, v_token_stride, v_head_stride;
    long long o_batch_stride, o_head_stride;
    int batch, hq, hkv, group;
    int max_len;            // L: capacity of the cache per request; every seqlens[b] <= max_len
    int num_splits;         // CTAs along the KV axis per (request, kv head)
    float scale_log2;       // softmax_scale * log2(e): scores go straight to exp2
    int cluster_splits;     // > 1: the splits of one (request, kv head) form a cluster of this
                            //   size and merge through distributed shared memory (no combine)
};

static_assert(sizeof(DecodeParams) == 512, "DecodeParams must match params.rs");

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
