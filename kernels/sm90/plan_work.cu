// Device-side work planner: reads the request lengths from device memory and writes the work
// partition the decode kernel's CTAs follow, at every call, so that a grid sized from the
// problem's maxima (and captured into a CUDA graph) stays balanced whatever the lengths are.
//
// Units are (request b, KV head, column block); a unit of request b streams
// tiles_b = ceil(len_b / TILE) tiles. With T the total over all units and P = p.plan_target the
// CTAs that stream at once, the fair share is C0 = ceil(T / P) tiles. Units of at most C0 tiles
// ("short") take one CTA each; together they need about S = ceil(T_short / C0) CTA slots, which
// they share as they finish one after another. The long units split the remaining P - S slots:
//   C = ceil(T_long / (P - S)),   n_b = clamp(ceil(tiles_b / C), 1, MAX_SPLITS)
// so the long splits fill one wave instead of spilling a few CTAs into a second one (one
// request of 2^20 positions and fifteen of 2048 at 32/8 heads: 128 long CTAs + 120 short ones on
// 132 SMs, not 136 + 120). Rounding up per unit can still overshoot (eight requests of 32768 at
// 32/8: C = 249 gives 3 splits, 192 CTAs, two waves); then, with U long units,
//   C = ceil(T_long / (P - S - U))
// which bounds sum ceil(tiles_u / C) <= T_long / C + U <= P - S (two splits each, 128 CTAs), or
// one split per unit when U >= P - S. Items (one decode CTA each)
// are numbered request-major: item k = (b, j), j = unit * n_b + split, and CTAs past the last
// item find b = -1 and leave at once. Requests with n_b > 1 also get FP32 partial slots, one per
// item, numbered the same way (slot = slot_base_b + j); the combine merges them.
//   items <= target + batch * units   (each request rounds up by less than one split per unit)
//   slots <= p.plan_slots             (the host's capacity; a request that would overflow it runs
//                                      unsplit: slower, never wrong)
// Both bounds are what the host sizes the grid and the workspace with.
//
// Writes (every entry, every call: nothing is zeroed beforehand):
//   p.work[k]          = {b, j} for k < items, {-1, 0} up to the grid size p.plan_grid
//   p.request_plan[b]  = {n_b, slot_base_b}
//
// Cluster reduction (p.cluster_splits = C > 1): the splits of a unit must be one cluster of C
// consecutive CTAs, so a request is either long (tiles_b > C0: C splits per unit, rank = split)
// or short (one CTA per unit). Long requests' items come first, so every long unit starts on a
// cluster boundary; the short units follow, packed C to a cluster (those CTAs never synchronise
// with each other). items <= batch * units * C, the grid the host launches; no partial slots.
//
// One CTA of THREADS threads; requests are scanned in chunks of THREADS with a carried prefix.
// Mirrored on the host by `plan::device_plan_splits` (tests check its bounds).
// Compile-time configuration: KVS_MAX_SPLITS.
#include "ptx.cuh"
#include "params.cuh"

namespace kvs {
constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr int MAX_SPLITS = KVS_MAX_SPLITS;

// Exclusive prefix sum over the CTA of one 64-bit value per thread; `total` gets the sum.
__device__ __forceinline__ long long block_exclusive_scan(long long x, long long* warp_sums,
                                                         long long& total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    long long incl = x;
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
        const long long y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    long long before = 0;
    total = 0;
    for (int w = 0; w < WARPS; ++w) {
        if (w < warp) before += warp_sums[w];
        total += warp_sums[w];
    }
    __syncthreads();  // warp_sums is reused by the next scan
    return before + incl - x;
}

__device__ __forceinline__ int request_len(const DecodeParams& p, int b) {
    return max(0, min(p.seqlens ? p.seqlens[b] : p.max_len, p.max_len));
}

__device__ __forceinline__ long long request_tiles(const DecodeParams& p, int b) {
    return b < p.batch ? (request_len(p, b) + p.plan_tile - 1) / p.plan_tile : 0;
}

// Writes request b's items {b, j}, j < items, from work item `base` on.
__device__ __forceinline__ void write_items(const DecodeParams& p, int b, long long base,
                                            long long items) {
    for (long long j = 0; j < items; ++j) {
        p.work[2 * (base + j)] = b;
        p.work[2 * (base + j) + 1] = (int)j;
    }
}

// Decode CTAs `first` .. plan_grid - 1 get no work this call.
__device__ __forceinline__ void mark_idle(const DecodeParams& p, long long first) {
    for (long long k = first + threadIdx.x; k < p.plan_grid; k += THREADS) {
        p.work[2 * k] = -1;
        p.work[2 * k + 1] = 0;
    }
}

// The cluster-reduction partition (header comment); returns the number of items.
__device__ long long plan_clusters(const DecodeParams& p, long long fair, long long units,
                                   long long* warp_sums) {
    const long long cluster = p.cluster_splits;
    long long long_items = 0;
    for (int b0 = 0; b0 < p.batch; b0 += THREADS) {
        const long long tiles = request_tiles(p, b0 + threadIdx.x);
        long long chunk;
        block_exclusive_scan(tiles > fair ? units * cluster : 0, warp_sums, chunk);
        long_items += chunk;
    }
    long long long_carry = 0, short_carry = 0;
    for (int b0 = 0; b0 < p.batch; b0 += THREADS) {
        const int b = b0 + threadIdx.x;
        const long long tiles = request_tiles(p, b);
        const bool is_long = tiles > fair;
        long long long_chunk, short_chunk;
        const long long long_base =
            long_carry + block_exclusive_scan(is_long ? units * cluster : 0, warp_sums, long_chunk);
        const long long short_base = long_items + short_carry +
                                     block_exclusive_scan(is_long || b >= p.batch ? 0 : units,
                                                          warp_sums, short_chunk);
        if (b < p.batch) {
            const int splits = is_long ? (int)cluster : 1;
            p.request_plan[2 * b] = splits;
            p.request_plan[2 * b + 1] = 0;
            write_items(p, b, is_long ? long_base : short_base, splits * units);
        }
        long_carry += long_chunk;
        short_carry += short_chunk;
    }
    return long_items + short_carry;
}
}  // namespace kvs

using namespace kvs;

extern "C" __global__ void __launch_bounds__(THREADS, 1)
kvs_plan_work(const __grid_constant__ DecodeParams p) {
    __shared__ long long warp_sums[WARPS];
    // The lengths may be written by the kernel before this one.
    pdl_wait_for_producer();
    // The decode grid launches while this CTA plans: its prologue overlaps the planning, and its
    // own griddepcontrol.wait still orders every read of the plan after our completion.
    pdl_release_dependents();
    const long long units = (long long)p.hkv * p.col_blocks;

    // ---- total tiles over all units ----
    long long total_tiles = 0;
    for (int b0 = 0; b0 < p.batch; b0 += THREADS) {
        const int b = b0 + threadIdx.x;
        const long long tiles = request_tiles(p, b);
        long long chunk;
        block_exclusive_scan(tiles, warp_sums, chunk);
        total_tiles += chunk;
    }
    total_tiles *= units;
    const long long fair = max(1ll, (total_tiles + p.plan_target - 1) / p.plan_target);
    if (p.cluster_splits > 1) {
        mark_idle(p, plan_clusters(p, fair, units, warp_sums));
        return;
    }

    // ---- tiles of the short units, and the split length of the long ones ----
    long long short_tiles = 0, long_requests = 0;
    for (int b0 = 0; b0 < p.batch; b0 += THREADS) {
        const int b = b0 + threadIdx.x;
        const long long tiles = request_tiles(p, b);
        long long chunk, count;
        block_exclusive_scan(tiles <= fair ? tiles : 0, warp_sums, chunk);
        block_exclusive_scan(tiles > fair ? 1 : 0, warp_sums, count);
        short_tiles += chunk;
        long_requests += count;
    }
    short_tiles *= units;
    const long long long_tiles = total_tiles - short_tiles;
    const long long short_slots = (short_tiles + fair - 1) / fair;
    const long long long_slots = max(1ll, p.plan_target - short_slots);
    long long per_split = max(1ll, (long_tiles + long_slots - 1) / long_slots);

    // ---- one wave: lengthen the splits if rounding up per unit overshoots the long slots ----
    long long long_items = 0;
    for (int b0 = 0; b0 < p.batch; b0 += THREADS) {
        const int b = b0 + threadIdx.x;
        const long long tiles = request_tiles(p, b);
        const long long splits =
            tiles > fair ? min((long long)MAX_SPLITS, (tiles + per_split - 1) / per_split) : 0;
        long long chunk;
        block_exclusive_scan(splits, warp_sums, chunk);
        long_items += chunk;
    }
    if (long_items * units > long_slots) {
        const long long long_units = long_requests * units;
        per_split = long_slots > long_units
                        ? (long_tiles + long_slots - long_units - 1) / (long_slots - long_units)
                        : long_tiles;  // one split each
    }

    // ---- splits per request, items and slots, request-major ----
    long long item_carry = 0, slot_carry = 0;
    for (int b0 = 0; b0 < p.batch; b0 += THREADS) {
        const int b = b0 + threadIdx.x;
        int splits = 1;
        if (b < p.batch) {
            const long long tiles = request_tiles(p, b);
            if (tiles > fair)
                splits = (int)min((long long)MAX_SPLITS, max(1ll, (tiles + per_split - 1) / per_split));
        }
        long long slots_chunk;
        long long slots = splits > 1 ? splits * units : 0;
        long long slot_base = slot_carry + block_exclusive_scan(slots, warp_sums, slots_chunk);
        if (slot_base + slots > p.plan_slots) {  // out of partial slots: this request runs unsplit
            splits = 1;
            slots = 0;
        }
        slot_base = slot_carry + block_exclusive_scan(slots, warp_sums, slots_chunk);
        const long long items = b < p.batch ? splits * units : 0;
        long long items_chunk;
        const long long item_base = item_carry + block_exclusive_scan(items, warp_sums, items_chunk);
        if (b < p.batch) {
            p.request_plan[2 * b] = splits;
            p.request_plan[2 * b + 1] = (int)slot_base;
            write_items(p, b, item_base, items);
        }
        item_carry += items_chunk;
        slot_carry += slots_chunk;
    }
    mark_idle(p, item_carry);
}
