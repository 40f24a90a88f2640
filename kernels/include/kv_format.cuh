// How a KV cache element type sits in a ring stage and reaches the tensor cores: the persistent
// decode's mainloop and producer take everything element-specific from one of these policies,
// so a cache of another element type (one byte plus scales) changes this file, not the
// scheduler, the ring or the epilogue.
//
// A tile is TILE_TOKENS positions of one KV head. Each position's HEAD_DIM elements arrive as
// BOXES 128-byte rows (one TMA box each, 128-byte swizzle: 16-byte chunk c of position t sits
// at chunk c ^ (t % 8) of its row), box after box. The fragment loads return the MMA operands
// in the MMA's element type.
#pragma once

#include "ptx.cuh"

namespace kvs {

// 2-byte elements (bf16 / f16), stored as the MMA reads them.
template <int HEAD_DIM, int TILE_TOKENS>
struct KvHalf {
    static constexpr int ELEM_BYTES = 2;
    static constexpr int DIMS_PER_BOX = 128 / ELEM_BYTES;  // head dims in one 128-byte row
    static constexpr int BOXES = HEAD_DIM / DIMS_PER_BOX;
    static constexpr int BOX_BYTES = TILE_TOKENS * 128;
    static constexpr int TILE_BYTES = BOXES * BOX_BYTES;
    static constexpr int ROW_CHUNKS = HEAD_DIM * ELEM_BYTES / 16;  // 16-byte chunks per position
    static constexpr int CHUNK_ELEMS = 16 / ELEM_BYTES;
    static_assert(HEAD_DIM % DIMS_PER_BOX == 0, "whole boxes per position");

    // Shared-memory address of 16-byte chunk c (of ROW_CHUNKS) of position t.
    __device__ static __forceinline__ u32 chunk(u32 tile, int t, int c) {
        return tile + (c / 8) * BOX_BYTES + t * 128 + (((c % 8) ^ (t % 8)) << 4);
    }
    // The swizzle repeats every SWIZZLE_ROWS positions: chunk(tile, t, c) for t = 8 m + t8
    // (t8 < 8) is tile + row_part(t8, c) + m * SWIZZLE_BYTES, so a loop over positions adds a
    // constant.
    static constexpr int SWIZZLE_ROWS = 8;
    static constexpr int SWIZZLE_BYTES = SWIZZLE_ROWS * 128;
    __device__ static __forceinline__ u32 row_part(int t8, int c) { return chunk(0, t8, c); }
    // K as the row-major A operand: the m16 x k16 fragment of positions row.. and head dims
    // 16 kstep.. (ldmatrix lane addressing: a_row = lane % 16, a_col = (lane / 16) * 8).
    __device__ static __forceinline__ void k_fragment(u32 (&a)[4], u32 tile, int row, int kstep, int a_col) {
        ldmatrix_x4(a, chunk(tile, row, 2 * kstep + a_col / 8));
    }
    // V^T as the A operand: the m16 (head dims 16 dt..) x k16 (positions) fragment, transposed
    // on the way out of shared memory.
    __device__ static __forceinline__ void v_fragment(u32 (&a)[4], u32 tile, int row, int dt, int v_col) {
        ldmatrix_x4_trans(a, chunk(tile, row, 2 * dt + v_col / 8));
    }
};

}  // namespace kvs
