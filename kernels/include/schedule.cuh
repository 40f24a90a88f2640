// The persistent decode's schedule: which KV tiles each CTA streams, worked out by every CTA on
// the device from the lengths at every call (no planner launch, no host knowledge of lengths).
//
// Mirrored line for line by crates/kvstream/src/schedule.rs (the CPU model the tests compare
// with what the kernel recorded); change both or neither.
//
//   unit      (request b, KV head h, column block cb), id  u = b * units_per_request + h * col_blocks
//             + cb; it owns tiles(b) = ceil((len_b - origin_b) / TILE_TOKENS) tiles of
//             TILE_TOKENS positions from position origin_b: 0, or with a sliding window of `left`
//             positions the first position its first new token sees, len_b - q_len - left,
//             rounded down to a page run of a paged cache (first_position), so the work follows
//             the window, not the cache.
//   sequence  the tiles of all units in unit order: T tiles; a request of length 0 owns none.
//   CTAs      balanced shares: the first G = min(grid, ceil(T / min_tiles)) CTAs work; CTA c
//             takes the tiles [B(c), B(c + 1)) with B(c) = floor(c * T / G), so every working
//             CTA has floor(T / G) or ceil(T / G) tiles, whatever the lengths are, and most
//             hold two pieces (the end of one unit, the start of the next);
//             aligned ranges instead where every unit has the same U tiles (N units) and the
//             longest range is at most aligned_limit(ceil(T / G)) tiles: whole units, k =
//             ceil(N / grid) a CTA (N >= G), CTA c takes units [c k, (c + 1) k), B(c) =
//             min(c k U, T), ceil(N / k) CTAs work and no unit is cut; or units in parts (N < G),
//             f = ceil(U / q) parts of q = ceil(U / floor(G / N)) tiles a unit, CTA c takes part
//             c % f of unit c / f, B(c) = (c / f) U + (c % f) q, N f CTAs work and none holds
//             two pieces. A piece boundary inside a range costs its CTA an epilogue and a
//             query-row wait, a cut unit a park and a merge: a few idle SMs cost less.
//   piece     the part of one unit inside one CTA's range. A unit lying in one CTA is written
//             out by it directly; a unit cut by CTA boundaries has one piece per CTA it touches,
//             each parked as FP32 partials in a slot, and merged in CTA order (deterministic
//             whatever the arrival order) by the pieces' CTAs, a slice each.
//   slot      only the first and the last piece of a CTA can be cut: a cut piece that starts at
//             B(c) takes slot 2c, one that starts later (so it ends at B(c + 1)) slot 2c + 1.
//   lanes     (L > 1) the grid's CTAs are dealt into L lanes, CTA i to lane i % L at place
//             i / L; each lane runs the schedule above on its floor(grid / L) CTAs ("c" is the
//             place) over the units whose id is l modulo L: L = col_blocks (column lanes: the
//             MLA decode and large multi-token groups) gives each lane one column block, and the
//             lanes stream every tile at about the same time, so memory serves it once and L2
//             the other lanes; L = hkv x col_blocks (head lanes) gives each lane one (KV head,
//             column block), so the heads of a position are read at about the same time (a
//             page of a pool holds them side by side). Slots interleave the lanes:
//             L slot(c, .) + l.
#pragma once

namespace kvs {

// The longest aligned range taken over balanced shares of `share` tiles: 1/32 more, plus four
// tiles (what a unit's cut and merge cost at least).
__device__ __host__ inline long long aligned_limit(long long share) { return share + share / 32 + 4; }

// a / b for a >= 0, b > 0: a 32-bit division where a fits (a 64-bit one is a called routine
// of ~70 instructions, and the schedule's run at the start and at every merge)
__device__ __host__ inline long long div_tiles(long long a, long long b) {
    return a <= 0x7fffffff && b <= 0x7fffffff ? (long long)((unsigned)a / (unsigned)b) : a / b;
}

struct Schedule {
    long long total;  // T: tiles in the sequence
    int ctas;         // G: working CTAs (0 when T = 0)
    long long per;    // aligned ranges: k U tiles a CTA (whole units) or q (parts); 0: balanced
    int unit;         // parts: U, the tiles of every unit; 0: whole units or balanced
    int parts;        // parts: f = ceil(U / q) a unit

    __device__ __host__ long long begin(int c) const {
        if (unit) return (long long)(c / parts) * unit + (long long)(c % parts) * per;
        if (per) return (long long)c * per < total ? (long long)c * per : total;
        return div_tiles((long long)c * total, ctas);
    }
    // The CTA whose range holds tile t: the largest c with B(c) <= t.
    __device__ __host__ int cta_of(long long t) const {
        if (unit) {
            const long long u = div_tiles(t, unit);
            return (int)u * parts + (int)(t - u * unit) / (int)per;
        }
        return (int)(per ? div_tiles(t, per) : div_tiles((t + 1) * ctas - 1, total));
    }
    // Workspace slot of the cut piece of CTA c that starts at tile `start`.
    __device__ __host__ int slot(int c, long long start) const {
        return 2 * c + (start == begin(c) ? 0 : 1);
    }
};

// `units` units of tiles, the shortest `unit_min` tiles and the longest `unit_max`.
__device__ __host__ inline Schedule make_schedule(long long total, int grid, int min_tiles, long long units,
                                                  long long unit_min, long long unit_max) {
    const long long wanted = div_tiles(total + min_tiles - 1, min_tiles);
    const int ctas = (int)(wanted < grid ? wanted : grid);
    if (total > 0 && unit_min == unit_max) {
        const long long limit = aligned_limit(div_tiles(total + ctas - 1, ctas));
        if (units >= ctas) {
            const long long k = div_tiles(units + grid - 1, grid);
            if (k * unit_min <= limit) return {total, (int)div_tiles(units + k - 1, k), k * unit_min, 0, 1};
        } else {
            const int each = ctas / (int)units;  // CTAs a unit (units < ctas)
            const long long q = div_tiles(unit_min + each - 1, each);
            const int f = (int)div_tiles(unit_min + q - 1, q);
            if (q <= limit) return {total, (int)units * f, q, f > 1 ? (int)unit_min : 0, f};
        }
    }
    return {total, ctas, 0, 0, 1};
}

// Workspace slot of a cut piece of lane `lane` (of `lanes`) whose in-lane slot is `slot`.
__device__ __host__ inline int lane_slot(int slot, int lanes, int lane) { return slot * lanes + lane; }

// Tiles of a request of `len` positions.
__device__ __host__ inline int tiles_of(int len, int tile_tokens) {
    return (len + tile_tokens - 1) / tile_tokens;
}

// The first position a request of `len` positions streams: 0, or with a window of
// `window_left` positions (>= 0; -1: none) the first position its first new token sees, rounded
// down to a multiple of `granularity` (1 for a contiguous cache; a paged cache's tiles start on
// a page run: min(page_size, TILE_TOKENS)).
__device__ __host__ inline int first_position(int len, int q_len, int window_left, int granularity) {
    const int lo = window_left < 0 ? 0 : len - q_len - window_left;
    return lo > 0 ? lo / granularity * granularity : 0;
}

// One unit's part of one CTA's range: tiles [first, end) of the unit's `tiles`; tile k holds
// positions origin + k TILE_TOKENS ..
struct Piece {
    int batch;        // request
    int unit;         // unit within the request: kv_head * col_blocks + col_block
    int len;          // the request's positions (clamped to max_len)
    int first, end;   // tiles of the unit in this piece
    int tiles;        // tiles of the unit
    long long start;  // global index of the unit's first tile
    int origin;       // the position of the unit's tile 0 (first_position)
    __device__ __host__ bool whole() const { return first == 0 && end == tiles; }
    // first position of tile k
    __device__ __host__ int tile_begin(int k, int tile_tokens) const { return origin + k * tile_tokens; }
};

}  // namespace kvs
