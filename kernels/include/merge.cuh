// The merge of a cut unit's pieces, shared by the persistent decode kernels (decode.cu,
// decode_mla.cu). Every CTA holding a piece of a cut unit parks its FP32 partials (o rows of DIM
// floats and an (m, l) pair per column, in its slot of the workspace) and counts the piece in on
// the unit's first counter; once its own pieces are all parked it waits until the unit's are,
// merges an equal slice of the unit's head-dim groups over all pieces in CTA order and counts the
// slice in on the second counter, whose last arrival resets both (nothing is zeroed between
// calls). The wait ends because no CTA waits before parking all of its pieces and the grid is
// resident at once (the host checks it). The fixed order keeps results bitwise reproducible.
#pragma once

#include "ptx.cuh"
#include "scheduler.cuh"

namespace kvs {

// A softmax state: base-2 max m, denominator l, unnormalised o (four head dims).
struct MergeState {
    float m, l;
    float4 o;
    // folds in a state of weight 2^(m_in - max): -inf maxima (nothing seen) weigh 0
    __device__ __forceinline__ void add(float m_in, float l_in, float4 o_in) {
        const float m_new = fmaxf(m, m_in);
        const float m_use = m_new == neg_inf() ? 0.f : m_new;
        const float a = exp2_approx(m - m_use), b = exp2_approx(m_in - m_use);
        m = m_new;
        l = l * a + l_in * b;
        o = make_float4(o.x * a + o_in.x * b, o.y * a + o_in.y * b, o.z * a + o_in.z * b, o.w * a + o_in.w * b);
    }
};

// The counters of unit `unit` of request `batch`: pieces parked, slices merged.
__device__ __forceinline__ int* unit_counters(const PersistentParams& p, int batch, int unit) {
    return p.arrivals + 2 * unit_index(p, batch, unit);
}

// Thread 0 counts a piece in once the caller's barrier has ordered every thread's partials
// before it (the release pairs with wait_until_parked's acquire; nothing is acquired here).
__device__ __forceinline__ void count_piece_in(const PersistentParams& p, int batch, int unit) {
    if (threadIdx.x == 0) red_add_release_gpu(unit_counters(p, batch, unit), 1);
}

// The pieces of a cut unit whose tiles start at global tile `start` (`tiles` of them): piece i
// is that of the CTA at place c0 + i of the lane; only the first can sit in its CTA's second
// slot (schedule.cuh).
struct CutPieces {
    int c0, count, first_slot, lanes, lane;
    __device__ __forceinline__ CutPieces(const PersistentParams& p, const Schedule& s, long long start, int tiles,
                                         int lane_)
        : c0(s.cta_of(start)), count(s.cta_of(start + tiles - 1) - s.cta_of(start) + 1),
          first_slot(lane_slot(s.slot(s.cta_of(start), start), p.lanes, lane_)), lanes(p.lanes), lane(lane_) {}
    __device__ __forceinline__ int slot(int i) const { return i == 0 ? first_slot : lane_slot(2 * (c0 + i), lanes, lane); }
};

// The cut units a CTA parked a piece of: only its first and its last piece can be cut (walked
// again once the consumers are done: held through the KV loop they would take registers).
struct CutUnits {
    Piece first = {}, last = {};
    bool has_first = false, has_last = false;
};
template <int TILE_TOKENS>
__device__ __forceinline__ CutUnits cut_units(const PersistentParams& p, const StartShared& st) {
    CutUnits cuts;
    PieceWalk<TILE_TOKENS> walk(p, st);
    Piece pc;
    for (bool first = true; walk.next(p, pc); first = false) {
        if (pc.whole()) continue;
        if (first) {
            cuts.first = pc;
            cuts.has_first = true;
        } else {
            cuts.last = pc;
            cuts.has_last = true;
        }
    }
    return cuts;
}

// Thread 0 waits until the unit's pieces are all parked; then every one of THREADS threads.
// Traced builds: thread 0 stamps `parked_point` (the kernel's trace point, -1 for none) once, at
// the CTA's first merge.
template <int THREADS>
__device__ __forceinline__ void wait_until_parked(const int* counters, int pieces, int parked_point = -1) {
    if (threadIdx.x == 0) {
        while (ld_acquire_gpu(counters) < pieces) nanosleep(64);
        if (TRACE && parked_point >= 0 && !trace_stamped(parked_point)) trace_stamp(parked_point);
    }
    named_barrier_sync(1, THREADS);
}

// Once every thread's slice is written: the slice counted in; the last resets both counters.
// Relaxed: the slices' outputs are for the next kernel (ordered by the grid's end), and every
// count comes after its CTA's acquire of the full piece count (wait_until_parked), so the reset
// follows every read of it.
template <int THREADS>
__device__ __forceinline__ void count_slice_in(int* counters, int pieces) {
    named_barrier_sync(1, THREADS);
    if (threadIdx.x == 0 && atom_add_relaxed_gpu(counters + 1, 1) == pieces - 1) {
        counters[0] = 0;
        counters[1] = 0;
    }
}

// Most pieces a cut unit has: one per CTA of a lane, and a grid has at most two CTAs an SM of a
// 132-SM GPU (the host's plan::PERSISTENT_MAX_FORCED_GRID; a test compares the two).
constexpr int MERGE_MAX_PIECES = 264;
// Bytes a merge slice's scratch needs at least, for a unit of `columns` columns cut into up to
// `pieces` pieces: the slice's (m, l) pairs (n x slice columns <= columns + 2 n) and one head-dim
// group of every piece, so that a chunk holds one group at least (each kernel asserts its ring
// holds it).
__host__ __device__ constexpr int merge_scratch_floor(int pieces, int columns) {
    return 8 * (columns + 2 * pieces) + 16 + 16 * pieces;
}

// This CTA's slice of the unit's `columns` x DIM / 4 head-dim groups (split evenly among the
// pieces' CTAs; the CTA is the me-th), by THREADS threads. The slice's partials of every piece
// are first copied into `scratch` (shared memory the kernel no longer uses: the idle ring;
// `scratch_bytes` of it) by cp.async, all in flight at once, so the slice costs one L2 round
// trip, not one per trip of folds; a slice larger than the scratch goes in chunks (of one
// group at least: merge_scratch_floor). Then `split` adjacent threads share a group (as many as keep
// a chunk's groups in one trip), each folding pieces part, part + split, ... into a state of its
// own, and a butterfly merges their states in a fixed order; store(column, dim, state) gets each
// group's state once. The order depends only on the piece count and the slice: bitwise
// reproducible.
template <int DIM, int COLS, int THREADS, class Store>
__device__ __forceinline__ void merge_slice(const PersistentParams& p, const CutPieces& pieces, int me,
                                            int columns, unsigned char* scratch, int scratch_bytes, Store store) {
    constexpr int ROW_GROUPS = DIM / 4;
    const int n = pieces.count;
    const int groups = columns * ROW_GROUPS;
    const int g_begin = (int)((long long)me * groups / n);
    const int g_end = (int)((long long)(me + 1) * groups / n);
    if (g_end <= g_begin) return;
    const int c_lo = g_begin / ROW_GROUPS, slice_cols = (g_end - 1) / ROW_GROUPS - c_lo + 1;
    // [piece][column of the slice] pairs, then [piece][group of the chunk] partial rows
    float2* s_ml = reinterpret_cast<float2*>(scratch);
    const int ml_bytes = (n * slice_cols * 8 + 15) / 16 * 16;
    float4* s_o = reinterpret_cast<float4*>(scratch + ml_bytes);
    const int chunk = min(g_end - g_begin, (scratch_bytes - ml_bytes) / (16 * n));
    for (int i = threadIdx.x; i < n * slice_cols; i += THREADS) {
        const int piece = i / slice_cols, c = c_lo + i % slice_cols;
        const long long row = (long long)pieces.slot(piece) * COLS + c;
        cp_async_8(smem_addr(s_ml + i), p.ml_partial + row * 2);
    }
    const u64 policy = l2_policy_evict_first();  // every partial is read once
    for (int g0 = g_begin; g0 < g_end; g0 += chunk) {
        const int len = min(chunk, g_end - g0);
        for (int i = threadIdx.x; i < n * len; i += THREADS) {
            const int piece = i / len, e = g0 + i % len;
            const long long row = (long long)pieces.slot(piece) * COLS + e / ROW_GROUPS;
            cp_async_16(smem_addr(s_o + i), p.o_partial + row * DIM + (e % ROW_GROUPS) * 4, 16, policy);
        }
        cp_async_wait_all();
        named_barrier_sync(1, THREADS);
        int split = 1;
        while (split < 32 && 2 * split * len <= THREADS && split < n) split *= 2;
        const int part = threadIdx.x % split, lanes = THREADS / split;
        // every thread of a group of `split` runs the same trips, so the butterfly's lanes match
        const int trips = (len + lanes - 1) / lanes;
        for (int t = 0; t < trips; ++t) {
            const int j_raw = t * lanes + (int)threadIdx.x / split;
            const bool valid = j_raw < len;
            const int j = valid ? j_raw : 0;
            const int c = (g0 + j) / ROW_GROUPS, d = ((g0 + j) % ROW_GROUPS) * 4;
            MergeState st = {neg_inf(), 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
            for (int i = part; i < n; i += split) {
                const float2 ml = s_ml[i * slice_cols + c - c_lo];
                st.add(ml.x, ml.y, s_o[i * len + j]);
            }
            for (int off = 1; off < split; off *= 2) {
                const float m_o = __shfl_xor_sync(0xffffffffu, st.m, off), l_o = __shfl_xor_sync(0xffffffffu, st.l, off);
                const float4 o_o = make_float4(__shfl_xor_sync(0xffffffffu, st.o.x, off),
                                               __shfl_xor_sync(0xffffffffu, st.o.y, off),
                                               __shfl_xor_sync(0xffffffffu, st.o.z, off),
                                               __shfl_xor_sync(0xffffffffu, st.o.w, off));
                // the lower lane's state first on both sides: the same sum in both lanes
                if (part & off) {
                    MergeState lower = {m_o, l_o, o_o};
                    lower.add(st.m, st.l, st.o);
                    st = lower;
                } else {
                    st.add(m_o, l_o, o_o);
                }
            }
            if (valid && part == 0) store(c, d, st);
        }
        named_barrier_sync(1, THREADS);  // the chunk's rows read before the next overwrites them
    }
}

}  // namespace kvs
