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
// before it (the release pairs with wait_until_parked's acquire).
__device__ __forceinline__ void count_piece_in(const PersistentParams& p, int batch, int unit) {
    if (threadIdx.x == 0) atom_add_acq_rel_gpu(unit_counters(p, batch, unit), 1);
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
template <int THREADS>
__device__ __forceinline__ void wait_until_parked(const int* counters, int pieces) {
    if (threadIdx.x == 0)
        while (ld_acquire_gpu(counters) < pieces) nanosleep(64);
    named_barrier_sync(1, THREADS);
}

// Once every thread's slice is written: the slice counted in; the last resets both counters.
template <int THREADS>
__device__ __forceinline__ void count_slice_in(int* counters, int pieces) {
    named_barrier_sync(1, THREADS);
    if (threadIdx.x == 0 && atom_add_acq_rel_gpu(counters + 1, 1) == pieces - 1) {
        counters[0] = 0;
        counters[1] = 0;
    }
}

// This CTA's slice of the unit's `columns` x DIM / 4 head-dim groups (split evenly among the
// pieces' CTAs; the CTA is the me-th), by THREADS threads: `split` adjacent threads share a
// group (as many as keep every group in one trip), each folding pieces part, part + split, ...
// into a state of its own with LOADS pieces' partials in flight (one L2 round trip per LOADS
// pieces), and a butterfly merges their states in a fixed order; store(column, dim, state) gets
// each group's state once.
template <int DIM, int COLS, int THREADS, int LOADS, class Store>
__device__ __forceinline__ void merge_slice(const PersistentParams& p, const CutPieces& pieces, int me,
                                            int columns, Store store) {
    const int groups = columns * (DIM / 4);
    const int g_begin = (int)((long long)me * groups / pieces.count);
    const int g_end = (int)((long long)(me + 1) * groups / pieces.count);
    int split = 1;
    while (split < 32 && 2 * split * (g_end - g_begin) <= THREADS && split < pieces.count) split *= 2;
    const int part = threadIdx.x % split, lanes = THREADS / split;
    // every thread of a group of `split` runs the same trips, so the butterfly's lanes match
    const int trips = (g_end - g_begin + lanes - 1) / lanes;
    for (int t = 0; t < trips; ++t) {
        const int e = g_begin + t * lanes + (int)threadIdx.x / split;
        const bool valid = e < g_end;
        const int c = (valid ? e : g_begin) / (DIM / 4), d = ((valid ? e : g_begin) % (DIM / 4)) * 4;
        MergeState st = {neg_inf(), 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
        for (int i0 = part; i0 < pieces.count; i0 += LOADS * split) {
            // every load leaves before the first use; an index past the end loads nothing (the
            // load queue, not the latency, is what a merge waits on) and is not folded in
            float4 v[LOADS];
            float2 ml[LOADS];
#pragma unroll
            for (int k = 0; k < LOADS; ++k) {
                v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
                ml[k] = make_float2(neg_inf(), 0.f);
                if (i0 + k * split < pieces.count) {
                    const long long row = (long long)pieces.slot(i0 + k * split) * COLS + c;
                    v[k] = ld_global_acquired(reinterpret_cast<const float4*>(p.o_partial + row * DIM + d));
                    ml[k] = ld_global_acquired(reinterpret_cast<const float2*>(p.ml_partial + row * 2));
                }
            }
#pragma unroll
            for (int k = 0; k < LOADS; ++k)
                if (i0 + k * split < pieces.count) st.add(ml[k].x, ml[k].y, v[k]);
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
}

}  // namespace kvs
