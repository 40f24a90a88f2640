// The cut-unit merge in isolation (bench/merge_probe.py runs it; bench/NOTES.md says why: in the
// MLA decode at batch 1 each CTA's merge slice, ~32 KB of partials, takes 12-16 us where its loads
// should take one or two L2 round trips).
//
// One launch, one CTA per SM, the CTAs dealt in order into `units` cut units of equal pieces (the
// MLA seed row: one unit of every CTA, 12 rows of 512 dims; the GQA one: two units, 8 rows of 128),
// the decode's steps in its order:
//   stream   (FLAG_STREAM) a share of a large buffer read through L2 with evict_first, as the
//            decode streams its KV tiles;
//   write    (FLAG_WRITE) the piece's partials: `rows` rows of `dim` floats and (m, l) a row, in
//            slot blockIdx.x of `slot_floats` floats, as the MLA epilogue writes them (a warp
//            store: 4 rows x 8 consecutive floats) or as float4 rows (FLAG_VEC_WRITE); without
//            the flag the slots hold what the previous launch wrote;
//   park     a release add on the unit's arrival counter;
//   wait     thread 0 spins (acquire) until every piece has arrived;
//   merge    the CTA's slice of its unit's rows x dim outputs over the unit's pieces, with the
//            decode's rule (head-dim groups of four split evenly among the pieces' CTAs, `split`
//            threads a group, MERGE_LOADS partial rows in flight a thread, a butterfly in a fixed
//            order: decode_mla.cu's merge_slice, copied here so that each configuration can change
//            one thing of it); loads ld.global.cg as the decode's, or plain (FLAG_LOAD_CA);
//   (FLAG_TRANSPOSED: the partials stored group-major, the unit's pieces of one group of four
//            dims side by side, so that a merging thread's loads are contiguous; written as
//            float4 groups)
//   count    the last CTA to count in resets both counters (nothing zeroed between launches).
// Each CTA stamps %globaltimer after every step: stamps[cta][STAMPS].
#define THREADS 256
#define MERGE_LOADS 8
#define STAMPS 6

#define NEG_INF (-__int_as_float(0x7f800000))

#define FLAG_STREAM 1
#define FLAG_WRITE 2
#define FLAG_LOAD_CA 4
#define FLAG_VEC_WRITE 8
#define FLAG_TRANSPOSED 16

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ float4 ld_stream(const float4* p, unsigned long long policy) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p), "l"(policy));
    return v;
}

template <bool CG>
__device__ __forceinline__ float4 ld4(const float* p) {
    float4 v;
    if (CG)
        asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    else
        asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

template <bool CG>
__device__ __forceinline__ float2 ld2(const float* p) {
    float2 v;
    if (CG)
        asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    else
        asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}

struct State {
    float m, l;
    float4 o;
    __device__ __forceinline__ void add(float m_in, float l_in, float4 o_in) {
        const float m_new = fmaxf(m, m_in);
        const float m_use = m_new == NEG_INF ? 0.f : m_new;
        const float a = exp2f(m - m_use), b = exp2f(m_in - m_use);
        m = m_new;
        l = l * a + l_in * b;
        o = make_float4(o.x * a + o_in.x * b, o.y * a + o_in.y * b, o.z * a + o_in.z * b, o.w * a + o_in.w * b);
    }
};

template <bool CG, bool TRANSPOSED>
__device__ __forceinline__ void merge_slice(const float* o_part, const float* ml_part, float* out, int rows, int dim,
                                            long long slot_floats, int pieces, int me, int split_max) {
    const int groups = rows * (dim / 4);
    const int g_begin = (int)((long long)me * groups / pieces), g_end = (int)((long long)(me + 1) * groups / pieces);
    int split = 1;
    while (split < split_max && 2 * split * (g_end - g_begin) <= THREADS && split < pieces) split *= 2;
    const int part = threadIdx.x % split, lanes = THREADS / split;
    const int trips = (g_end - g_begin + lanes - 1) / lanes;
    for (int t = 0; t < trips; ++t) {
        const int e = g_begin + t * lanes + (int)threadIdx.x / split;
        const bool valid = e < g_end;
        const int c = (valid ? e : g_begin) / (dim / 4), d = ((valid ? e : g_begin) % (dim / 4)) * 4;
        State st = {NEG_INF, 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
        for (int i0 = part; i0 < pieces; i0 += MERGE_LOADS * split) {
            float4 v[MERGE_LOADS];
            float2 ml[MERGE_LOADS];
#pragma unroll
            for (int k = 0; k < MERGE_LOADS; ++k) {
                v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
                ml[k] = make_float2(NEG_INF, 0.f);
                const int i = i0 + k * split;
                if (i < pieces) {
                    v[k] = TRANSPOSED ? ld4<CG>(o_part + ((long long)(c * dim + d) / 4 * pieces + i) * 4)
                                      : ld4<CG>(o_part + i * slot_floats + (long long)c * dim + d);
                    ml[k] = ld2<CG>(ml_part + ((long long)i * rows + c) * 2);
                }
            }
#pragma unroll
            for (int k = 0; k < MERGE_LOADS; ++k)
                if (i0 + k * split < pieces) st.add(ml[k].x, ml[k].y, v[k]);
        }
        for (int off = 1; off < split; off *= 2) {
            const float m_o = __shfl_xor_sync(0xffffffffu, st.m, off), l_o = __shfl_xor_sync(0xffffffffu, st.l, off);
            const float4 o_o = make_float4(__shfl_xor_sync(0xffffffffu, st.o.x, off), __shfl_xor_sync(0xffffffffu, st.o.y, off),
                                           __shfl_xor_sync(0xffffffffu, st.o.z, off), __shfl_xor_sync(0xffffffffu, st.o.w, off));
            if (part & off) {
                State lower = {m_o, l_o, o_o};
                lower.add(st.m, st.l, st.o);
                st = lower;
            } else {
                st.add(m_o, l_o, o_o);
            }
        }
        if (valid && part == 0) {
            const float inv = st.l > 0.f ? 1.f / st.l : 0.f;
            *reinterpret_cast<float4*>(out + (long long)c * dim + d) =
                make_float4(st.o.x * inv, st.o.y * inv, st.o.z * inv, st.o.w * inv);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    merge_probe(const float4* __restrict__ stream, long long stream_vec4, float* o_part, float* ml_part, int* counters,
                float* out, unsigned long long* stamps, float* sink, int rows, int dim, int units,
                long long slot_floats, int flags, int split_max) {
    unsigned long long* my = stamps + blockIdx.x * STAMPS;
    // this CTA's unit, its place among the unit's pieces, the unit's slots, counters and output
    const int pieces = gridDim.x / units, unit = blockIdx.x / pieces, me = blockIdx.x % pieces;
    if (unit >= units) return;  // (the grid's remainder)
    counters += 2 * unit;
    out += (long long)unit * rows * dim;
    ml_part += (long long)unit * pieces * rows * 2;
    o_part += (long long)unit * pieces * slot_floats;
    if (threadIdx.x == 0) my[0] = now();
    if (flags & FLAG_STREAM) {
        unsigned long long policy;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        const long long per = stream_vec4 / gridDim.x;
        const float4* mine = stream + blockIdx.x * per;
        float acc = 0.f;
        for (long long i = threadIdx.x; i < per; i += 4 * THREADS) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) v[u] = i + u * THREADS < per ? ld_stream(mine + i + u * THREADS, policy) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int u = 0; u < 4; ++u) acc += v[u].x + v[u].y + v[u].z + v[u].w;
        }
        if (acc == 1.2345f) sink[blockIdx.x] = acc;  // keeps the loads
    }
    __syncthreads();
    if (threadIdx.x == 0) my[1] = now();
    float* slot = o_part + me * slot_floats;
    if (flags & FLAG_WRITE) {
        const float base = 0.001f * me;
        if (flags & FLAG_TRANSPOSED) {
            // group g holds dims 4 (g % (dim / 4)) .. of row g / (dim / 4): the values the
            // epilogue pattern below writes, so the merged rows check alike
            for (int g = threadIdx.x; g < rows * dim / 4; g += THREADS) {
                const int r = g / (dim / 4), d = (g % (dim / 4)) * 4;
                const float v = base + r + d / 8;
                reinterpret_cast<float4*>(o_part)[(long long)g * pieces + me] = make_float4(v, v, v, v);
            }
        } else if (flags & FLAG_VEC_WRITE) {
            for (int i = threadIdx.x; i < rows * dim / 4; i += THREADS)
                reinterpret_cast<float4*>(slot)[i] = make_float4(base + i, base - i, base, 1.f);
        } else {
            // the MLA epilogue's stores: lane l of a warp writes dim (l / 4) of row (l % 4) + 4 r
            const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
            for (int r0 = 4 * (lane % 4); r0 < rows; r0 += 16)
                for (int r = r0; r < r0 + 4 && r < rows; ++r)
                    for (int g = warp; g < dim / 8; g += THREADS / 32) slot[r * dim + g * 8 + lane / 4] = base + r + g;
        }
        for (int r = threadIdx.x; r < rows; r += THREADS) {
            ml_part[((long long)me * rows + r) * 2] = 0.5f * (me % 7);
            ml_part[((long long)me * rows + r) * 2 + 1] = 1.f + r;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counters) : "memory");
        my[2] = now();
        int seen;
        do {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(counters) : "memory");
            if (seen < pieces) __nanosleep(64);
        } while (seen < pieces);
        my[3] = now();
    }
    __syncthreads();
    if (flags & FLAG_TRANSPOSED)
        merge_slice<true, true>(o_part, ml_part, out, rows, dim, slot_floats, pieces, me, split_max);
    else if (flags & FLAG_LOAD_CA)
        merge_slice<false, false>(o_part, ml_part, out, rows, dim, slot_floats, pieces, me, split_max);
    else
        merge_slice<true, false>(o_part, ml_part, out, rows, dim, slot_floats, pieces, me, split_max);
    __syncthreads();
    if (threadIdx.x == 0) {
        my[4] = now();
        int old;
        asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;" : "=r"(old) : "l"(counters + 1) : "memory");
        if (old == pieces - 1) {
            counters[0] = 0;
            counters[1] = 0;
        }
        my[5] = now();
    }
}
