// How a KV cache element type sits in a ring stage and reaches the tensor cores: both decode
// kernels' mainloops and producers take everything element-specific from one of these policies
// (the split engine's joined-halves pages excepted: 2-byte only), so a cache of another element
// type changes this file, not the schedulers, the rings or the epilogues.
//
// A tile is TILE_TOKENS positions of one KV head. Each position's HEAD_DIM elements arrive as
// BOXES rows of ROW_BYTES (one TMA box each, at most 128 bytes, swizzled at its own width:
// 16-byte chunk c of position t sits at chunk c ^ swizzle(t) of its row), box after box.
//
// The fragment loads return MMA operands of the m16n8k16 f16/bf16 MMA for 16 positions x 32
// head dims (K, two k-steps) or 32 head dims x 16 positions (V^T, two m-tiles):
//   - K fragments may hold the head dims of a k-step in a permuted order; the query rows must
//     then be permuted likewise (QUERY_PERMUTED, query_pair).
//   - The O^T accumulator's row r of m-tile dt is head dim o_dim(dt, r).
// MMA_F16 says which MMA the operands are for: f16 whatever the query dtype (the consumers
// convert the query rows), or the query dtype itself.
#pragma once

#include "ptx.cuh"

namespace kvs {

// Chunk placement shared by the formats: rows of 128 bytes use the 128-byte swizzle (chunk
// c ^ t % 8), rows of 64 bytes the 64-byte one (chunk c ^ (t / 2) % 4); either way the 8 rows
// one ldmatrix phase reads hit 8 different 16-byte bank groups.
template <int ROW_BYTES_, int BOXES_, int TILE_TOKENS>
struct SwizzledRows {
    static constexpr int ROW_BYTES = ROW_BYTES_;
    static constexpr int BOXES = BOXES_;
    static constexpr int BOX_BYTES = TILE_TOKENS * ROW_BYTES;
    static constexpr int TILE_BYTES = BOXES * BOX_BYTES;
    static constexpr int BOX_CHUNKS = ROW_BYTES / 16;
    static constexpr int ROW_CHUNKS = BOXES * BOX_CHUNKS;  // 16-byte chunks per position
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "TMA swizzle widths");

    __device__ static __forceinline__ int swizzle(int t) { return ROW_BYTES == 128 ? t % 8 : (t / 2) % 4; }
    // Shared-memory address of 16-byte chunk c (of ROW_CHUNKS) of position t.
    __device__ static __forceinline__ u32 chunk(u32 tile, int t, int c) {
        return tile + (c / BOX_CHUNKS) * BOX_BYTES + t * ROW_BYTES + (((c % BOX_CHUNKS) ^ swizzle(t)) << 4);
    }
    // The swizzle repeats every SWIZZLE_ROWS positions: chunk(tile, t, c) for t = 8 m + t8
    // (t8 < 8) is tile + row_part(t8, c) + m * SWIZZLE_BYTES, so a loop over positions adds a
    // constant.
    static constexpr int SWIZZLE_ROWS = 8;
    static constexpr int SWIZZLE_BYTES = SWIZZLE_ROWS * ROW_BYTES;
    __device__ static __forceinline__ u32 row_part(int t8, int c) { return chunk(0, t8, c); }
};

// 2-byte elements (bf16 / f16), stored as the MMA reads them: rows of 64 dims, the last one
// padded where the head dim is no multiple of 64 (d 96: dims 96..127 arrive as the box's
// out-of-bounds zeros and are never read).
template <int HEAD_DIM, int TILE_TOKENS, bool IS_F16>
struct KvHalf : SwizzledRows<128, (HEAD_DIM + 63) / 64, TILE_TOKENS> {
    using Rows = SwizzledRows<128, (HEAD_DIM + 63) / 64, TILE_TOKENS>;
    static constexpr int ELEM_BYTES = 2;
    static constexpr int DIMS_PER_BOX = 64;
    static constexpr int CHUNK_ELEMS = 8;
    static constexpr int DATA_CHUNKS = HEAD_DIM / CHUNK_ELEMS;  // chunks of a position holding dims
    static constexpr bool MMA_F16 = IS_F16;
    static constexpr bool QUERY_PERMUTED = false;
    static_assert(HEAD_DIM % 32 == 0, "fragments of 32 head dims");

    // K as the row-major A operand, k-steps kstep and kstep + 1 (head dims 16 kstep .. + 32) of
    // positions row .. row + 15.
    __device__ static __forceinline__ void k_fragments(u32 (&a0)[4], u32 (&a1)[4], u32 tile, int row, int kstep,
                                                       int lane) {
        const int r = row + lane % 16, c = (lane / 16);  // ldmatrix: a_row, a_col / 8
        ldmatrix_x4(a0, Rows::chunk(tile, r, 2 * kstep + c));
        ldmatrix_x4(a1, Rows::chunk(tile, r, 2 * kstep + 2 + c));
    }
    // V^T as the A operand, m-tiles dt and dt + 1 (head dims 16 dt .. + 32) x k16 (positions
    // row ..), transposed on the way out of shared memory.
    __device__ static __forceinline__ void v_fragments(u32 (&a0)[4], u32 (&a1)[4], u32 tile, int row, int dt,
                                                       int lane) {
        const int r = row + (lane / 16) * 8 + lane % 8, c = (lane / 8) % 2;
        ldmatrix_x4_trans(a0, Rows::chunk(tile, r, 2 * dt + c));
        ldmatrix_x4_trans(a1, Rows::chunk(tile, r, 2 * dt + 2 + c));
    }
    __device__ static __forceinline__ int o_dim(int dt, int r) { return dt * 16 + r; }
};

// float8 e4m3 elements, dequantised exactly to f16 in registers (the scales are applied to the
// FP32 scores and output, outside the MMAs). One byte per head dim: a position is rows of 128
// bytes where its width is a multiple of 128 (d128: one, d256: two), else of 64 (d64: one; an
// MLA row of 576: nine; d96: two, the second padded with the box's out-of-bounds zeros).
//   K: ldmatrix reads 4 consecutive head dims per lane; as the k order of an MMA is free, lane
//   (g, j) = (lane / 4, lane % 4) takes head dims 4j..4j+3 of chunk c as its k = 2j, 2j+1
//   (a0, a1) and 2j+8, 2j+9 (a2, a3): the query's 16-bit pair p of a chunk is its head-dim
//   pair query_pair(p).
//   V: ldmatrix.trans on byte pairs gives lane (g, j) head dims 2g, 2g+1 of positions 2j and
//   2j+1; one byte permute makes them two (positions 2j, 2j+1) pairs, of head dim 2g (row g
//   of the m-tile) and 2g+1 (row g + 8).
template <int HEAD_DIM>
__host__ __device__ constexpr int e4m3_row_bytes() { return HEAD_DIM % 128 == 0 ? 128 : 64; }

template <int HEAD_DIM>
__host__ __device__ constexpr int e4m3_boxes() { return (HEAD_DIM + e4m3_row_bytes<HEAD_DIM>() - 1) / e4m3_row_bytes<HEAD_DIM>(); }

template <int HEAD_DIM, int TILE_TOKENS>
struct KvE4m3 : SwizzledRows<e4m3_row_bytes<HEAD_DIM>(), e4m3_boxes<HEAD_DIM>(), TILE_TOKENS> {
    using Rows = SwizzledRows<e4m3_row_bytes<HEAD_DIM>(), e4m3_boxes<HEAD_DIM>(), TILE_TOKENS>;
    static constexpr int ELEM_BYTES = 1;
    static constexpr int DIMS_PER_BOX = Rows::ROW_BYTES;
    static constexpr int CHUNK_ELEMS = 16;
    static constexpr int DATA_CHUNKS = HEAD_DIM / CHUNK_ELEMS;  // chunks of a position holding dims
    static constexpr bool MMA_F16 = true;
    static constexpr bool QUERY_PERMUTED = true;
    static_assert(HEAD_DIM % 32 == 0, "fragments of 32 head dims");

    // logical 16-bit pair p (k = 2p, 2p + 1) of a 16-dim k-step holds the query's head dims
    // 2 query_pair(p), + 1
    __device__ static __forceinline__ int query_pair(int p) { return 2 * (p % 4) + p / 4; }

    __device__ static __forceinline__ void k_fragments(u32 (&a0)[4], u32 (&a1)[4], u32 tile, int row, int kstep,
                                                       int lane) {
        u32 r[4];
        ldmatrix_x4(r, Rows::chunk(tile, row + lane % 16, kstep + lane / 16));
        e4m3x4_to_f16x2(r[0], a0[0], a0[2]);
        e4m3x4_to_f16x2(r[1], a0[1], a0[3]);
        e4m3x4_to_f16x2(r[2], a1[0], a1[2]);
        e4m3x4_to_f16x2(r[3], a1[1], a1[3]);
    }
    __device__ static __forceinline__ void v_fragments(u32 (&a0)[4], u32 (&a1)[4], u32 tile, int row, int dt,
                                                       int lane) {
        u32 r[4];
        ldmatrix_x4_trans(r, Rows::chunk(tile, row + lane % 8 + ((lane / 8) % 2) * 8, dt + lane / 16));
        // bytes {d 2g @ 2j, d 2g+1 @ 2j, d 2g @ 2j+1, d 2g+1 @ 2j+1} -> d 2g pair, then d 2g+1 pair
        e4m3x4_to_f16x2(prmt(r[0], 0, 0x3120), a0[0], a0[1]);
        e4m3x4_to_f16x2(prmt(r[1], 0, 0x3120), a0[2], a0[3]);
        e4m3x4_to_f16x2(prmt(r[2], 0, 0x3120), a1[0], a1[1]);
        e4m3x4_to_f16x2(prmt(r[3], 0, 0x3120), a1[2], a1[3]);
    }
    __device__ static __forceinline__ int o_dim(int dt, int r) { return dt * 16 + 2 * (r % 8) + r / 8; }
};

// The format of a cache: e4m3 bytes (KV_FP8) or the query's 2-byte type.
template <bool KV_FP8, int HEAD_DIM, int TILE_TOKENS, bool IS_F16>
struct KvFormatOf {
    using type = KvHalf<HEAD_DIM, TILE_TOKENS, IS_F16>;
};
template <int HEAD_DIM, int TILE_TOKENS, bool IS_F16>
struct KvFormatOf<true, HEAD_DIM, TILE_TOKENS, IS_F16> {
    using type = KvE4m3<HEAD_DIM, TILE_TOKENS>;
};

// A KV head's dequantisation scale for request b: one per tensor, per KV head or per (request,
// KV head), through the strides; no tensor (or a 2-byte cache) means 1.
template <bool KV_FP8>
__device__ __forceinline__ float kv_scale(const float* scale, int batch_stride, int head_stride, int b, int h) {
    return KV_FP8 && scale ? ld_global_l2(scale + (long long)b * batch_stride + (long long)h * head_stride) : 1.f;
}

// Two 16-bit values (bf16 when !IS_F16) as f16, beyond f16's range saturated to +-65504: query
// rows for the f16 MMAs of an e4m3 cache.
template <bool IS_F16>
__device__ __forceinline__ u32 to_f16x2_saturated(u32 x) {
    float lo, hi;
    unpack_half2<IS_F16>(x, lo, hi);
    return pack_half2<true>(fminf(fmaxf(lo, -65504.f), 65504.f), fminf(fmaxf(hi, -65504.f), 65504.f));
}

// ROWS rows of COLS 2-byte elements as a wgmma operand in shared memory, staged from global
// memory by THREADS threads without a register round trip (cp.async): the 128-byte swizzle,
// COLS / 64 boxes of [ROWS][128 bytes], chunk c of row r at box c / 8, row r, chunk
// (c % 8) ^ (r % 8). `row(r)` is row r's address; rows from `count` on are zeros. TO_F16: bf16
// rows made f16 in place (to_f16x2_saturated), each thread converting the chunks it copied.
// The caller fences (the MMAs read through the async proxy) and synchronises the threads.
template <int ROWS, int COLS, int THREADS, bool TO_F16, class Row>
__device__ __forceinline__ void stage_rows_sw128(u32 base, int count, Row row, u64 policy) {
    constexpr int CHUNKS = COLS / 8;  // 16-byte chunks a row
    static_assert(COLS % 8 == 0, "rows of whole 16-byte chunks (the last box may be part-filled)");
    auto at = [&](int r, int c) { return base + (c / 8) * (ROWS * 128) + r * 128 + (((c % 8) ^ (r % 8)) << 4); };
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        cp_async_16(at(r, c), row(r < count ? r : 0) + c * 8, r < count ? 16 : 0, policy);
    }
    cp_async_wait_all();
    if constexpr (TO_F16) {
        for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            u32 w[4];
            ld_shared_v4(w, at(r, c));
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = to_f16x2_saturated<false>(w[j]);
            st_shared_v4(at(r, c), w);
        }
    }
}

// The consumers' pass over the staged query rows (`count` rows of SMEM_ROW bytes from q_base,
// THREADS threads) where the K fragments want them in another type or order
// (Fmt::QUERY_PERMUTED): every 16-dim k-step of every row becomes f16 pairs in the order
// Fmt::query_pair gives, in place; the caller synchronises the threads after it. Values beyond
// f16's range saturate to +-65504.
template <class Fmt, int HEAD_DIM, int SMEM_ROW, int THREADS, bool IS_F16>
__device__ __forceinline__ void permute_query_rows(u32 q_base, int count) {
    constexpr int STEPS = HEAD_DIM / 16;
    for (int i = threadIdx.x; i < count * STEPS; i += THREADS) {
        const u32 at = q_base + (i / STEPS) * SMEM_ROW + (i % STEPS) * 32;
        u32 in[8], out[8];
        ld_shared_v4(in, at);
        ld_shared_v4(in + 4, at + 16);
#pragma unroll
        for (int pr = 0; pr < 8; ++pr) out[pr] = to_f16x2_saturated<IS_F16>(in[Fmt::query_pair(pr)]);
        st_shared_v4(at, out);
        st_shared_v4(at + 16, out + 4);
    }
}

// O^T m-tiles dt, dt + 1 += V^T (a: their two fragments, as v_fragments gives them) x P^T
// (p_frag: N_TILES n8 tiles), after clearing the V^T columns (positions) the keep masks drop:
// P is 0 there, but the V rows past the length may hold anything (NaN included, 0 x NaN = NaN).
template <bool MMA_F16, int D_TILES, int N_TILES>
__device__ __forceinline__ void accumulate_o(float (&o_acc)[D_TILES][N_TILES][4], int dt, u32 (&a)[2][4],
                                             u32 keep_lo, u32 keep_hi, const u32 (&p_frag)[N_TILES][2]) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        a[t][0] &= keep_lo;
        a[t][1] &= keep_lo;
        a[t][2] &= keep_hi;
        a[t][3] &= keep_hi;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
            mma_m16n8k16<MMA_F16>(o_acc[dt + t][nt], a[t], p_frag[nt][0], p_frag[nt][1]);
    }
}

}  // namespace kvs
