// Cache write: the new tokens' K and V rows `[tokens, hkv, d]` (q's dtype) into a KV cache at the
// slots the caller gives (vLLM's slot_mapping: slot = page * page_size + offset for a paged pool,
// request * capacity + position for a contiguous cache; -1 skips a token), copied as they are
// into a 2-byte cache or quantised into an e4m3 one (KVS_KV_FP8): value / scale, rounded to the
// nearest e4m3, saturating to +-448 (a finite input never becomes NaN).
//
// One thread per 8 head dims of one row, K rows in blockIdx.y 0 and V rows in 1: a 16-byte load
// and a 16-byte (2-byte cache) or 8-byte (e4m3) store each. Nothing is read from the cache, so
// a replayed graph may write any slots.
//
// Parameters mirrored by `StoreKvParams` in crates/kvstream/src/params.rs.
//
// Compile-time configuration: KVS_IS_F16 (the new rows' dtype), KVS_HEAD_DIM, KVS_KV_FP8.
#include "ptx.cuh"

namespace kvs {

constexpr bool IS_F16 = KVS_IS_F16;
constexpr int HEAD_DIM = KVS_HEAD_DIM;
constexpr bool KV_FP8 = KVS_KV_FP8;
constexpr int THREADS = 256;
constexpr int CHUNK = 8;  // head dims per thread
constexpr int CHUNKS = HEAD_DIM / CHUNK;
static_assert(HEAD_DIM % CHUNK == 0, "whole 16-byte chunks per row");

struct alignas(128) StoreKvParams {
    const void* k_new;        // [tokens, hkv, d], strides below
    const void* v_new;
    const long long* slots;   // [tokens] int64; -1 (or any slot outside [0, num_slots)) skips
    void* k_cache;            // slot s, head h at (s / block_slots) * block_stride
    void* v_cache;            //   + (s % block_slots) * slot_stride + h * head_stride
    const float* k_scale;     // fp8: scale of block b, head h at scale[b * block_stride + h *
    const float* v_scale;     //   head_stride] (strides below; null: 1)
    long long new_token_stride, new_head_stride;      // elements of k_new / v_new
    long long block_stride, slot_stride, head_stride;  // elements of the caches
    long long num_slots;      // slots the caches hold
    int tokens, hkv, block_slots;
    int k_scale_block_stride, k_scale_head_stride;
    int v_scale_block_stride, v_scale_head_stride;
};
static_assert(sizeof(StoreKvParams) == 256, "StoreKvParams must match params.rs");

// Eight 2-byte values to eight e4m3 bytes: value / scale, round to nearest even, saturating
// (PTX ISA 9.7.9.21 cvt .e4m3x2 .satfinite; the division is IEEE, as the host reference's).
__device__ __forceinline__ uint2 quantise8(uint4 x, float scale) {
    const u32 in[4] = {x.x, x.y, x.z, x.w};
    u32 out[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
        u32 word = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float lo, hi;
            unpack_half2<IS_F16>(in[2 * w + h], lo, hi);
            unsigned short pair;
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi / scale), "f"(lo / scale));
            word |= (u32)pair << (16 * h);
        }
        out[w] = word;
    }
    return make_uint2(out[0], out[1]);
}

}  // namespace kvs

using namespace kvs;

extern "C" __global__ void __launch_bounds__(THREADS) kvs_store_kv(const __grid_constant__ StoreKvParams p) {
    const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    if (i >= (long long)p.tokens * p.hkv * CHUNKS) return;
    const bool is_v = blockIdx.y == 1;
    // 32-bit divisions (a 64-bit one is a long instruction sequence): the host keeps the chunk
    // count and the slots below 2^32
    const u32 per_token = (u32)p.hkv * CHUNKS, chunk = (u32)i;
    const int token = (int)(chunk / per_token);
    const u32 in_token = chunk - (u32)token * per_token;
    const int h = (int)(in_token / CHUNKS), c = (int)(in_token % CHUNKS);
    // Nothing below reads what a previous kernel in the stream may still write before this.
    pdl_wait_for_producer();
    const long long slot = p.slots[token];
    if (slot < 0 || slot >= p.num_slots) return;
    const u32 block = (u32)slot / (u32)p.block_slots, in_block = (u32)slot - block * (u32)p.block_slots;
    const u16* src = reinterpret_cast<const u16*>(is_v ? p.v_new : p.k_new) + token * p.new_token_stride +
                     h * p.new_head_stride + c * CHUNK;
    const uint4 x = *reinterpret_cast<const uint4*>(src);
    const long long at =
        (long long)block * p.block_stride + (long long)in_block * p.slot_stride + h * p.head_stride + c * CHUNK;
    if constexpr (KV_FP8) {
        const float* scales = is_v ? p.v_scale : p.k_scale;
        const float scale =
            scales ? scales[(long long)block * (is_v ? p.v_scale_block_stride : p.k_scale_block_stride) +
                            (long long)h * (is_v ? p.v_scale_head_stride : p.k_scale_head_stride)]
                   : 1.f;
        unsigned char* dst = reinterpret_cast<unsigned char*>(is_v ? p.v_cache : p.k_cache) + at;
        *reinterpret_cast<uint2*>(dst) = quantise8(x, scale);
    } else {
        u16* dst = reinterpret_cast<u16*>(is_v ? p.v_cache : p.k_cache) + at;
        *reinterpret_cast<uint4*>(dst) = x;
    }
}
