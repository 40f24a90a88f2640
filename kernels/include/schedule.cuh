// The persistent decode's schedule: which KV tiles each CTA streams, worked out by every CTA on
// the device from the lengths at every call (no planner launch, no host knowledge of lengths).
//
// Mirrored line for line by crates/kvstream/src/schedule.rs (the CPU model the tests compare
// with what the kernel recorded); change both or neither.
//
//   unit      (request b, KV head h, column block cb), id  u = b * units_per_request + h * col_blocks
//             + cb; it owns tiles(b) = ceil(len_b / TILE_TOKENS) tiles of TILE_TOKENS positions.
//   sequence  the tiles of all units in unit order: T tiles; a request of length 0 owns none.
//   CTAs      the first G = min(grid, ceil(T / min_tiles)) CTAs work; CTA c takes the tiles
//             [B(c), B(c + 1)) with B(c) = floor(c * T / G), so every working CTA has
//             floor(T / G) or ceil(T / G) tiles, whatever the lengths are.
//   piece     the part of one unit inside one CTA's range. A unit lying in one CTA is written
//             out by it directly; a unit cut by CTA boundaries has one piece per CTA it touches,
//             each parked as FP32 partials in a slot, and the CTA whose piece arrives last
//             merges them in CTA order (deterministic whatever the arrival order).
//   slot      only the first and the last piece of a CTA can be cut: a cut piece that starts at
//             B(c) takes slot 2c, one that starts later (so it ends at B(c + 1)) slot 2c + 1.
#pragma once

namespace kvs {

struct Schedule {
    long long total;  // T: tiles in the sequence
    int ctas;         // G: working CTAs (0 when T = 0)

    __device__ __host__ long long begin(int c) const { return (long long)c * total / ctas; }
    // The CTA whose range holds tile t: the largest c with B(c) <= t.
    __device__ __host__ int cta_of(long long t) const {
        return (int)(((t + 1) * ctas - 1) / total);
    }
    // Workspace slot of the cut piece of CTA c that starts at tile `start`.
    __device__ __host__ int slot(int c, long long start) const {
        return 2 * c + (start == begin(c) ? 0 : 1);
    }
};

__device__ __host__ inline Schedule make_schedule(long long total, int grid, int min_tiles) {
    const long long wanted = (total + min_tiles - 1) / min_tiles;
    return {total, (int)(wanted < grid ? wanted : grid)};
}

// Tiles of a request of `len` positions.
__device__ __host__ inline int tiles_of(int len, int tile_tokens) {
    return (len + tile_tokens - 1) / tile_tokens;
}

// One unit's part of one CTA's range: tiles [first, end) of the unit's `tiles`.
struct Piece {
    int batch;        // request
    int unit;         // unit within the request: kv_head * col_blocks + col_block
    int len;          // the request's positions (clamped to max_len)
    int first, end;   // tiles of the unit in this piece
    int tiles;        // tiles of the unit
    long long start;  // global index of the unit's first tile
    __device__ __host__ bool whole() const { return first == 0 && end == tiles; }
};

}  // namespace kvs
