// The scheduler role of the persistent decode kernels (decode.cu, decode_mla.cu): consumer warp 0
// of every CTA works out, from the lengths in device memory, the call's tile sequence
// (schedule.cuh) and where this CTA's share of it starts; every role then walks the CTA's
// pieces with its own PieceWalk. Units are (request, KV head, column block): p.hkv *
// p.col_blocks of them per request (an MLA cache has one KV head), in one sequence or, with
// lanes (schedule.cuh), p.hkv * p.col_blocks / p.lanes per request in each lane's.
#pragma once

#include "decode_params.cuh"
#include "ptx.cuh"
#include "schedule.cuh"
#include "trace.cuh"

namespace kvs {

constexpr int SCAN_PER_LANE = 8;  // lengths one scheduler lane holds per round

// Lengths come from device memory the host never sees: clamped, never trusted.
__device__ __forceinline__ int request_len(const PersistentParams& p, int b) {
    return p.seqlens ? max(0, min(p.seqlens[b], p.max_len)) : p.max_len;
}

// Where the tiles of a request of `len` positions start (schedule.cuh): tiles of a paged cache
// start on a page run.
template <int TILE_TOKENS>
__device__ __forceinline__ int request_origin(const PersistentParams& p, int len) {
    return first_position(len, p.q_len, p.window_left, p.page_size ? min(p.page_size, TILE_TOKENS) : 1);
}

// Tiles each unit of a request of `len` positions streams.
template <int TILE_TOKENS>
__device__ __forceinline__ int request_tiles(const PersistentParams& p, int len) {
    return tiles_of(len - request_origin<TILE_TOKENS>(p, len), TILE_TOKENS);
}

// Units of one request in the sequence of one lane.
__device__ __forceinline__ int units_per_request(const PersistentParams& p) {
    return p.hkv * p.col_blocks / p.lanes;
}

// A unit's place among all the call's units, every lane's (a piece's unit already counts every
// lane's units of its request): the index of its arrival counter.
__device__ __forceinline__ long long unit_index(const PersistentParams& p, int batch, int unit) {
    return (long long)batch * p.hkv * p.col_blocks + unit;
}

// What the scheduler warp leaves for the other roles.
struct StartShared {
    long long total;  // tiles in the sequence
    long long lo, hi; // this CTA's tiles
    long long base;   // global index of the first tile of `batch`
    long long per;    // Schedule::per
    int unit;         // Schedule::unit
    int batch;        // the request holding tile lo
    int len;          // its length (clamped): the walks start without a load of their own
    short ctas;       // working CTAs (of each lane; at most MERGE_MAX_PIECES)
    short lane;       // this CTA's lane (lanes > 1): the last index of every unit it streams
    // (parts: per < unit, both int; a 32-bit division)
    __device__ __forceinline__ Schedule schedule() const {
        return {total, ctas, per, unit, unit ? (unit + (int)per - 1) / (int)per : 1};
    }
};

__device__ __forceinline__ long long warp_sum(long long v) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
__device__ __forceinline__ long long warp_min(long long v) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}
__device__ __forceinline__ long long warp_max(long long v) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Tiles x units of requests base + 8 lane .. base + 8 lane + 7 (0 past the batch), and their
// lengths (clamped, as request_len gives them). The loads are
// unconditional (an index past the batch reads the last length and is then dropped), so the
// eight leave back to back (with a branch per request ptxas issues them one round trip after
// another).
template <int TILE_TOKENS>
__device__ __forceinline__ void load_request_tiles(const PersistentParams& p, const int* lens, int base,
                                                   int lane, int uh, long long (&t)[SCAN_PER_LANE],
                                                   int (&len)[SCAN_PER_LANE]) {
#pragma unroll
    for (int i = 0; i < SCAN_PER_LANE; ++i) len[i] = lens[min(base + lane * SCAN_PER_LANE + i, p.batch - 1)];
#pragma unroll
    for (int i = 0; i < SCAN_PER_LANE; ++i) {
        len[i] = max(0, min(len[i], p.max_len));
        t[i] = base + lane * SCAN_PER_LANE + i < p.batch ? (long long)request_tiles<TILE_TOKENS>(p, len[i]) * uh : 0;
    }
}

// Consumer warp 0: the sequence's length and where this CTA's range starts. Lane l holds the
// tile counts of requests base + 8l .. base + 8l + 7 per round, so up to 256 requests take one
// round trip to memory per pass.
// (lengths_point / written_point: trace points lane 0 stamps once the first round of lengths is
// in registers and once the start is written; -1 for none)
template <int TILE_TOKENS>
__device__ __forceinline__ void schedule_start(const PersistentParams& p, StartShared* out, int lengths_point = -1,
                                               int written_point = -1) {
    const int lane = threadIdx.x % 32;
    const int uh = units_per_request(p);
    const int* lens = p.seqlens;
    // the sequence's tiles, and the units' count and extreme lengths (x uh: per request)
    long long total = 0, busy = 0, t_min = 0, t_max = 0;
    // the first round's tile counts, kept for the search below: a batch of up to 32 x
    // SCAN_PER_LANE requests reads its lengths from memory once, not twice (a round trip of
    // ~1 us at the kernel's start, while the other CTAs' first loads fill the memory queues)
    long long first_round[SCAN_PER_LANE] = {};
    int first_lens[SCAN_PER_LANE] = {};
    if (!lens) {
        t_min = t_max = (long long)request_tiles<TILE_TOKENS>(p, p.max_len) * uh;
        busy = t_min > 0 ? p.batch : 0;
        total = busy * t_min;
    } else {
        constexpr long long NONE = 0x7fffffffffffffffLL;
        t_min = NONE;
        for (int base = 0; base < p.batch; base += 32 * SCAN_PER_LANE) {
            long long t[SCAN_PER_LANE];
            int l[SCAN_PER_LANE];
            load_request_tiles<TILE_TOKENS>(p, lens, base, lane, uh, t, l);
            if (base == 0)
#pragma unroll
                for (int i = 0; i < SCAN_PER_LANE; ++i) {
                    first_round[i] = t[i];
                    first_lens[i] = l[i];
                }
            long long mine = 0, lo = NONE, hi = 0;
            int n = 0;
#pragma unroll
            for (int i = 0; i < SCAN_PER_LANE; ++i) {
                mine += t[i];
                n += t[i] > 0;
                if (t[i] > 0) lo = min(lo, t[i]);
                hi = max(hi, t[i]);
            }
            total += warp_sum(mine);
            busy += warp_sum(n);
            // (a branch on the loaded values: the stamp cannot be scheduled before they land)
            if (TRACE && base == 0 && lengths_point >= 0 && lane == 0 && total >= 0) trace_stamp(lengths_point);
            t_min = min(t_min, warp_min(lo));
            t_max = max(t_max, warp_max(hi));
        }
    }
    const Schedule s =
        make_schedule(total, gridDim.x / p.lanes, p.min_tiles_per_cta, busy * uh, t_min / uh, t_max / uh);
    const int c = blockIdx.x / p.lanes;  // this CTA's place in its lane
    long long lo = 0, hi = 0, req_base = 0;
    int req = 0, req_len = 0;
    if (c < s.ctas) {
        lo = s.begin(c);
        hi = s.begin(c + 1);
        if (!lens) {
            const long long per = (long long)request_tiles<TILE_TOKENS>(p, p.max_len) * uh;
            req = (int)(lo / per);
            req_base = req * per;
            req_len = p.max_len;
        } else {
            // the request b with prefix(b) <= lo < prefix(b) + tiles(b) * uh, tiles(b) > 0
            long long prefix = 0;
            for (int base = 0;; base += 32 * SCAN_PER_LANE) {
                long long t[SCAN_PER_LANE];
                int l[SCAN_PER_LANE];
                if (base == 0) {
#pragma unroll
                    for (int i = 0; i < SCAN_PER_LANE; ++i) {
                        t[i] = first_round[i];
                        l[i] = first_lens[i];
                    }
                } else {
                    load_request_tiles<TILE_TOKENS>(p, lens, base, lane, uh, t, l);
                }
                long long mine = 0;
#pragma unroll
                for (int i = 0; i < SCAN_PER_LANE; ++i) mine += t[i];
                long long incl = mine;  // inclusive scan over lanes
#pragma unroll
                for (int off = 1; off < 32; off *= 2) {
                    const long long v = __shfl_up_sync(0xffffffffu, incl, off);
                    if (lane >= off) incl += v;
                }
                const long long lane_begin = prefix + incl - mine;
                const unsigned hit = __ballot_sync(0xffffffffu, lo >= lane_begin && lo < lane_begin + mine);
                if (hit) {
                    const int src = __ffs(hit) - 1;
                    if (lane == src) {
                        long long at = lane_begin;
                        int i = 0;
#pragma unroll
                        for (int k = 0; k < SCAN_PER_LANE; ++k) {
                            if (at + t[k] > lo) break;
                            at += t[k];
                            ++i;
                        }
                        req = base + lane * SCAN_PER_LANE + i;
                        req_base = at;
#pragma unroll
                        for (int k = 0; k < SCAN_PER_LANE; ++k)
                            if (k == i) req_len = l[k];
                    }
                    req = __shfl_sync(0xffffffffu, req, src);
                    req_base = __shfl_sync(0xffffffffu, req_base, src);
                    req_len = __shfl_sync(0xffffffffu, req_len, src);
                    break;
                }
                prefix += __shfl_sync(0xffffffffu, incl, 31);
            }
        }
    }
    if (lane == 0) *out = {total, lo, hi, req_base, s.per, s.unit, req, req_len, (short)s.ctas, (short)(blockIdx.x % p.lanes)};
    if (TRACE && written_point >= 0 && lane == 0) trace_stamp(written_point);
}

// This CTA's place in its lane (schedule.cuh), and the workspace slot of its cut piece that
// starts at tile `start` of the lane's sequence.
__device__ __forceinline__ int lane_place(const PersistentParams& p) { return blockIdx.x / p.lanes; }
__device__ __forceinline__ int piece_slot(const PersistentParams& p, const Schedule& s, int lane, long long start) {
    return lane_slot(s.slot(lane_place(p), start), p.lanes, lane);
}

// The pieces of this CTA's range, in order; every role walks its own copy.
template <int TILE_TOKENS>
struct PieceWalk {
    long long t, hi, base;
    int batch, tiles, origin, len, uh, lanes, lane;

    __device__ __forceinline__ PieceWalk(const PersistentParams& p, const StartShared& s)
        : t(s.lo), hi(s.hi), base(s.base), batch(s.batch), uh(units_per_request(p)), lanes(p.lanes),
          lane(s.lane) {
        len = t < hi ? s.len : 0;
        set_request(p);
    }
    __device__ __forceinline__ void set_request(const PersistentParams& p) {
        origin = request_origin<TILE_TOKENS>(p, len);
        tiles = tiles_of(len - origin, TILE_TOKENS);
    }

    __device__ __forceinline__ bool next(const PersistentParams& p, Piece& pc) {
        if (t >= hi) return false;
        while (t >= base + (long long)tiles * uh) {  // requests of 0 tiles are passed over here
            base += (long long)tiles * uh;
            len = request_len(p, ++batch);
            set_request(p);
        }
        const int unit = (int)div_tiles(t - base, tiles);
        const long long start = base + (long long)unit * tiles;
        const long long end = hi - start < tiles ? hi - start : tiles;
        pc = {batch, unit * lanes + lane, len, (int)(t - start), (int)end, tiles, start, origin};
        t = start + end;
        return true;
    }
};

// Tests (p.schedule_log): one thread records the pieces of this CTA's range, as the roles
// walk them (a count, then up to SCHEDULE_LOG_PIECES {batch, unit, first, end}).
template <int TILE_TOKENS>
__device__ __forceinline__ void record_schedule(const PersistentParams& p, const StartShared& st) {
    int* log = p.schedule_log + (long long)blockIdx.x * (SCHEDULE_LOG_PIECES + 1) * 4;
    PieceWalk<TILE_TOKENS> walk(p, st);
    Piece pc;
    int count = 0;
    while (walk.next(p, pc)) {
        if (count < SCHEDULE_LOG_PIECES) {
            int* e = log + 4 * (count + 1);
            e[0] = pc.batch;
            e[1] = pc.unit;
            e[2] = pc.first;
            e[3] = pc.end;
        }
        ++count;
    }
    log[0] = count;
    log[1] = st.ctas;
    log[2] = (int)(st.hi - st.lo);
    log[3] = 0;
}

}  // namespace kvs
