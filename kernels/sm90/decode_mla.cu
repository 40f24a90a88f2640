// MLA decode (DeepSeek-V3 class, absorbed form) for sm_90a: persistent, scheduled on the device at
// every call like decode.cu, on the same schedule (scheduler.cuh) and parameters.
//
//   one shared KV row per cached position: [c_kv (512) | k_pe (64)], MLA_DIM = 576 dims
//   S^T [positions x cols] = K [positions x 576] * Q^T [576 x cols]    (mma m16n8k16, swap-AB)
//   O^T [512 x cols]       = V^T [512 x positions] * P^T [positions x cols],  V = K's first 512
// cols are the query rows (token i, head h) of a request, token-major, in column blocks of up to
// 32 (the schedule's units: p.hkv = 1, p.group = hq). A tile of TILE_TOKENS positions is read
// from memory once and serves as K and as V.
//
// A row is too wide for one warp to keep O^T for all of it, so the eight consumer warps split
// every tile two ways:
//   S phase   warp w scores positions [16 (w % 4), + 16) of a 64-position tile over its half
//             of the 576 dims (w / 4) against every column (so each K row is read once), swaps
//             the partial scores of the other half's columns with its partner warp (barrier 1),
//             and posts the maxima of its half of the columns over its positions (barrier 2);
//             of a 128-position tile (e4m3), positions [16 w, + 16) over all the dims: no
//             partner, no barrier 1, and it posts the maxima of every column;
//   softmax   every warp derives the same running max of every column from the four posts of
//             its positions' slices, rescales its O^T, and turns its scores into P^T rows in
//             shared memory, summing its share of the denominators (barrier 3);
//   O phase   warp w accumulates O^T for head dims [64 w, 64 w + 64) of every column over all
//             the tile's positions, then releases the stage.
//
// Roles (CTA of CONSUMER_WARPS consumer warps + a producer warpgroup, one warp of it working):
//   scheduler  consumer warp 0 at entry (scheduler.cuh);
//   producer   lane 0 of the last warp (contiguous) or the whole warp (paged): each piece's
//              query rows into one of Q_BUFFERS buffers, then its tiles through a ring of STAGES
//              stages by TMA, boxes of one row of head dims (kv_format.cuh) x TILE_TOKENS
//              positions (or a page's run of them);
//   consumers  per piece: the query rows (fp8: permuted for the K fragments), the KV loop, the
//              epilogue: a whole unit is normalised and written; a cut one parks FP32 partials
//              and counts itself in;
//   merge      once the CTA's last piece is done, every CTA holding a piece of a cut unit waits
//              until all of the unit's pieces are parked and merges its slice of the unit's
//              output (head-dim groups split evenly among the pieces' CTAs), in a fixed order
//              over the pieces: bitwise reproducible. The wait ends because every CTA parks all
//              of its pieces before it waits for any, and the grid (at most one CTA per SM,
//              which its shared memory enforces) is resident at once. The unit's second counter
//              counts the merged slices; the last one resets both (nothing zeroed between calls).
//
// Wide column blocks (KVS_N_TILES 8: 64 query rows, where a request has that many; the op is
// compute-bound there) take another consumer, on the same schedule, ring, epilogue and merge:
// the query rows are the M dimension of the warpgroup MMA (wgmma.cuh), both operands of every
// product in shared memory, so a KV tile is read from shared memory once per product for all 64
// rows.
//   warpgroup 0  S = Q K^T (64 rows x TILE_TOKENS positions, 36 k16 steps), the online softmax
//                of its rows, P (16-bit, 128-byte swizzle) and each row's rescale factor to
//                shared memory; then O[:, 0..255] += P V;
//   warpgroup 1  O[:, 256..511] += P V, after rescaling by the posted factors.
// Warpgroup 0 issues the next tile's S as soon as its P V is issued, so the tensor cores run
// both warpgroups' P V and the next S back to back; the softmax is the only gap. The one P
// buffer changes hands at two named barriers of both warpgroups: P_READY (P and the factors
// written) and P_FREE (warpgroup 1's P V done, before the next P is written; warpgroup 1 has
// nothing else to wait for, so neither costs a stall an arrive would save). The query rows are staged by the consumers (the 128-byte swizzle of a
// wgmma operand is no bulk copy's layout); positions past the length are zeroed in the
// request's last tile before P V reads them as V (P is 0 there, but 0 x NaN is NaN).
//
// Ring protocol, n = the CTA's running tile count, stage s = n % STAGES, parity (n / STAGES) & 1:
//   producer  wait empty[s] (from the second lap); the tile's boxes on full[s] (wide: box b on
//             full[s][b], so that S starts on a tile's first box)
//   consumer  wait full[s], S phase, softmax, O phase, every lane arrives on empty[s]
// Query rows, j = the CTA's piece count, buffer b = j % Q_BUFFERS, parity (j / Q_BUFFERS) & 1:
//   producer  when it reaches piece j: wait q_empty[b] (from the second lap), bulk copies on
//             q_full[b]; consumers: wait q_full[b], every lane arrives on q_empty[b] after the
//             piece's KV loop (fp8: after a proxy fence, as it rewrote the rows in place)
//
// Compile-time configuration (NVRTC defines, chosen only by the host's plan module):
//   KVS_IS_F16        0: bf16, 1: f16 (q and out; the cache too unless KVS_KV_FP8)
//   KVS_KV_FP8        1: the cache is float8 e4m3 with an FP32 scale (p.k_scale, as K and as V)
//   KVS_N_TILES       n8 tiles of query rows per column block (2 or 4: each warp scores half;
//                     8: the wide consumer)
//   KVS_TILE_TOKENS   positions per ring stage (64: four warps of m16 slices, each slice
//                     scored by two; 128: eight slices, one warp each)
//   KVS_STAGES        ring depth
//   KVS_PAGED         0: contiguous cache [batch, max_len, 576]; 1: page pool [pages, page_size, 576]
//   KVS_SHARED_BYTES  the dynamic shared memory the host launches with (checked against the
//                     layout below at compile time)
#include "ptx.cuh"
#include "decode_params.cuh"
#include "kv_format.cuh"
#include "schedule.cuh"
#include "scheduler.cuh"
#include "merge.cuh"
#include "trace.cuh"
#include "wgmma.cuh"

namespace kvs {

// Trace points (trace.cuh; KVS_TRACE builds only), by the thread named; the first twelve as
// decode.cu's, for bench/trace.py.
enum TracePoint {
    TRACE_ENTRY,        // thread 0, first instruction
    TRACE_WAITED,       // thread 0, PDL wait returned
    TRACE_SCHEDULED,    // thread 0, the schedule's start known to every role
    TRACE_FIRST_ISSUE,  // producer, first tile's boxes issued
    TRACE_LAST_ISSUE,   // producer, last tile's boxes issued
    TRACE_Q_STAGED,     // thread 0, the first piece's query rows in shared memory
    TRACE_FIRST_TILE,   // thread 0, first tile landed
    TRACE_FIRST_LOOP,   // thread 0, first piece's KV loop done
    TRACE_LAST_LOOP,    // thread 0, last piece's KV loop done
    TRACE_PARKED,       // thread 0, last piece's epilogue done (written or parked)
    TRACE_MERGED,       // thread 0, the merges of its cut units done
    TRACE_EXIT,         // thread 0, every consumer done
    TRACE_ALL_PARKED,   // thread 0, its first cut unit's pieces all parked (the merge may start)
    TRACE_MERGE_START,  // thread 0, the first merge's barrier passed
    TRACE_MERGE_DONE,   // thread 0, its own part of the first merge done
    TRACE_MERGE_SYNCED, // thread 0, every thread's part of the first merge done
};

constexpr bool IS_F16 = KVS_IS_F16;
constexpr bool KV_FP8 = KVS_KV_FP8;
constexpr int N_TILES = KVS_N_TILES;
constexpr int TILE_TOKENS = KVS_TILE_TOKENS;
constexpr int STAGES = KVS_STAGES;
constexpr bool PAGED = KVS_PAGED;
constexpr bool WIDE = N_TILES == 8;  // 64 query rows on the wgmma M dimension

constexpr int MLA_DIM = 576;  // a cached row, and a query row: latent 512 + rope 64
constexpr int V_DIM = 512;    // the latent part: V, and an output row
constexpr int CONSUMER_WARPS = 8;
constexpr int SLICES = TILE_TOKENS / 16;           // m16 slices of positions per tile
constexpr int COL_SPLIT = CONSUMER_WARPS / SLICES;  // warps scoring one slice: each a part of the dims,
                                                    // then of the columns
constexpr int CONSUMER_THREADS = CONSUMER_WARPS * 32;
constexpr int PRODUCER_WARP = CONSUMER_WARPS;  // of a warpgroup of its own (setmaxnreg)
constexpr int THREADS = CONSUMER_THREADS + 128;
// registers per thread: the producer warpgroup gives its share to the consumers
// (the narrow paged producer holds a tile's page ids and runs: it needs more than one lane's
// loop; the wide consumers need the most a thread can have, their O half and S live at once,
// so their producer keeps the least that serves it: 24, the setmaxnreg floor, contiguous)
constexpr int PRODUCER_REGS = WIDE ? (PAGED ? 40 : 24) : (PAGED ? 56 : 40);
constexpr int CONSUMER_REGS = WIDE ? (PAGED ? 232 : 240) : (PAGED ? 224 : 232);
static_assert(fits_launch_registers(THREADS, PRODUCER_REGS, 2, CONSUMER_REGS),
              "the consumers' registers come from the producer warpgroup's (ptx.cuh)");
constexpr int GROUP_PAD = N_TILES * 8;                 // columns per block
constexpr int K_STEPS = MLA_DIM / 16;                  // k16 steps of a score
// independent score accumulators per n8 tile (with four n8 tiles, two chains are as many
// independent MMAs in flight as four with two)
constexpr int S_CHAINS = N_TILES <= 2 ? 4 : 2;
constexpr int S_TILES = N_TILES / COL_SPLIT;          // n8 tiles whose softmax a warp does
constexpr int S_STEPS = K_STEPS / COL_SPLIT;          // k16 steps of a warp's partial scores
// the query rows' B fragments of a warp's dims stay in registers where they fit (16 rows over
// half the dims: 72 registers); more are read from shared memory at every tile
constexpr bool Q_IN_REGISTERS = N_TILES * S_STEPS <= 2 * 18;
constexpr int O_TILES = V_DIM / 16 / CONSUMER_WARPS;   // m16 tiles of O^T per warp
constexpr int PV_STEPS = TILE_TOKENS / 16;             // k16 steps of the O^T update

using Kv = typename KvFormatOf<KV_FP8, MLA_DIM, TILE_TOKENS, IS_F16>::type;
constexpr bool MMA_F16 = Kv::MMA_F16;
constexpr int BOXES = Kv::BOXES;
constexpr int BOX_BYTES = Kv::BOX_BYTES;
constexpr int TILE_BYTES = Kv::TILE_BYTES;  // one stage: K and V at once
constexpr int SMEM_ROW = MLA_DIM * 2 + 16;  // query rows, padded for conflict-free ldmatrix
constexpr int Q_BYTES = GROUP_PAD * SMEM_ROW;
// query-row buffers: the next piece's rows load while this piece streams; 32 rows leave room
// for one only next to the ring and the score exchange
constexpr int Q_BUFFERS = N_TILES <= 2 ? 2 : 1;
constexpr int P_ROW = TILE_TOKENS * 2 + 16;  // P^T as [column][position], padded likewise
constexpr int RUNS_PER_LANE = TILE_TOKENS / 32;  // paged: page runs per tile, per producer lane
// full barriers a stage: one a box for the wide consumer of a 2-byte cache, whose S starts on a
// tile's first box while the rest are still landing (a 72 KB tile takes ~1.5 us to arrive at an
// SM's share of the bandwidth); one for the narrow consumer, whose warps split the dims among
// them, and for an e4m3 tile, widened whole first
constexpr int FULL_PARTS = WIDE && !KV_FP8 ? BOXES : 1;

// the wide consumer (WIDE): query rows and P in the 128-byte swizzle, box after box like a tile
// of a 2-byte cache; an e4m3 tile is widened into one such tile (the staging tile) first
constexpr int WIDE_TOKENS = 64;  // positions a wide tile: the N of S's MMA
using WideTile = KvHalf<MLA_DIM, WIDE_TOKENS, MMA_F16>;
constexpr int WIDE_BOX = WideTile::BOX_BYTES;
constexpr int WIDE_STAGING_BYTES = KV_FP8 ? WideTile::TILE_BYTES : 0;
constexpr int WIDE_ROWS = 64;
constexpr int WIDE_Q_BYTES = WIDE_ROWS * MLA_DIM * 2;
constexpr int WIDE_P_BYTES = WIDE_ROWS * WIDE_TOKENS * 2;
constexpr int WG_THREADS = 128;
constexpr int WIDE_O_DIMS = V_DIM / 2;  // output dims per consumer warpgroup
enum WideBarrier { BAR_CONSUMERS = 1, BAR_P_READY = 2, BAR_P_FREE = 3, BAR_STAGING = 4 };

struct NarrowShared {
    static constexpr int align = 1024;  // the 128-byte swizzle repeats every 1024 bytes
    static constexpr int ring = 0;
    static constexpr int q = STAGES * TILE_BYTES;
    static constexpr int p = q + Q_BUFFERS * Q_BYTES;
    static constexpr int tile_max = p + GROUP_PAD * P_ROW;          // [slice][column]
    static constexpr int slice_l = tile_max + 4 * SLICES * GROUP_PAD;  // [slice][column]
    static constexpr int partial = slice_l + 4 * SLICES * GROUP_PAD;   // [slice][n8 tile][lane] x 4
    static constexpr int full = partial + (COL_SPLIT > 1 ? 16 * SLICES * N_TILES * 32 : 0);
    static constexpr int empty = full + 8 * STAGES * FULL_PARTS;
    static constexpr int q_full = empty + 8 * STAGES;
    static constexpr int q_empty = q_full + 8 * Q_BUFFERS;
    static constexpr int start = q_empty + 8 * Q_BUFFERS;  // StartShared
    static constexpr int bytes = start + 64;
};
struct WideShared {
    static constexpr int align = 1024;
    static constexpr int ring = 0;
    static constexpr int staging = STAGES * TILE_BYTES;  // e4m3: the tile widened to f16
    static constexpr int q = staging + WIDE_STAGING_BYTES;
    static constexpr int p = q + WIDE_Q_BYTES;
    static constexpr int row_alpha = p + WIDE_P_BYTES;  // [row]: this tile's rescale factor
    static constexpr int row_m = row_alpha + 4 * WIDE_ROWS;  // [row]: the piece's max and
    static constexpr int row_l = row_m + 4 * WIDE_ROWS;      // denominator, for the epilogue
    static constexpr int full = row_l + 4 * WIDE_ROWS;  // [stage][part]
    static constexpr int empty = full + 8 * STAGES * FULL_PARTS;
    static constexpr int q_full = empty + 8 * STAGES;  // unused: the consumers stage the rows
    static constexpr int q_empty = q_full + 8 * Q_BUFFERS;
    static constexpr int start = q_empty + 8 * Q_BUFFERS;
    static constexpr int bytes = start + 64;
};
template <bool C, class A, class B>
struct Pick {
    using type = A;
};
template <class A, class B>
struct Pick<false, A, B> {
    using type = B;
};
using SharedPlan = typename Pick<WIDE, WideShared, NarrowShared>::type;

static_assert(CONSUMER_WARPS % SLICES == 0 && N_TILES % COL_SPLIT == 0 && K_STEPS % (2 * COL_SPLIT) == 0,
              "warps cover slices x parts of the dims and of the columns");
static_assert(V_DIM % (16 * CONSUMER_WARPS) == 0 && O_TILES % 2 == 0, "O^T m-tiles in pairs per warp");
static_assert(N_TILES == 2 || N_TILES == 4 || N_TILES == 8, "column blocks of 16, 32 or 64 rows");
// the host's mirror of this layout (MlaVariant::shared_bytes) sizes the launch
static_assert(SharedPlan::bytes + SharedPlan::align <= KVS_SHARED_BYTES, "shared memory the host launches with");
static_assert(!WIDE || (TILE_TOKENS == WIDE_TOKENS && CONSUMER_WARPS == 8 && STAGES == 2 && WIDE_BOX == 8192),
              "wide: tiles of 64 positions (64 dims a box once 2-byte), two consumer warpgroups, two stages");
static_assert(!WIDE || (SharedPlan::p % 1024 == 0 && SharedPlan::q % 1024 == 0 && WideShared::staging % 1024 == 0),
              "swizzled operands 1024-aligned");
static_assert(TILE_BYTES % 1024 == 0, "every stage starts on a swizzle-pattern boundary");
static_assert(STAGES * TILE_BYTES >= merge_scratch_floor(MERGE_MAX_PIECES, GROUP_PAD),
              "the ring holds a merge slice's chunk of one group (merge.cuh)");
static_assert(SharedPlan::full % 8 == 0, "mbarrier alignment");
static_assert(sizeof(StartShared) <= 64, "StartShared slot");
static_assert(SMEM_ROW % 16 == 0 && Q_BYTES % 16 == 0 && P_ROW % 16 == 0, "16-byte rows");

using Walk = PieceWalk<TILE_TOKENS>;

// A query row (column) of a piece: request b's new token `token` with query head `head`.
struct Column {
    int token, head;
};
__device__ __forceinline__ Column column_of(const PersistentParams& p, int unit, int c) {
    const int col = unit * GROUP_PAD + c;
    return {col / p.hq, col % p.hq};
}
__device__ __forceinline__ long long out_row(const PersistentParams& p, int b, Column col) {
    return ((long long)b * p.q_len + col.token) * p.hq + col.head;
}
__device__ __forceinline__ u16* out_ptr(const PersistentParams& p, int b, Column col) {
    return reinterpret_cast<u16*>(p.out) + b * p.o_batch_stride + col.token * p.o_token_stride +
           (long long)col.head * p.o_head_stride;
}
__device__ __forceinline__ int columns_in(const PersistentParams& p, int unit) {
    return min(GROUP_PAD, p.cols - unit * GROUP_PAD);
}

// ================================ producer ================================================
struct Ring {
    u32 base, full, empty, q, q_full, q_empty;
    __device__ __forceinline__ u32 stage(int s) const { return base + s * TILE_BYTES; }
    // the full barrier of box `box` of stage s
    __device__ __forceinline__ u32 full_of(int s, int box) const {
        return full + 8 * (s * FULL_PARTS + box * FULL_PARTS / BOXES);
    }
    // one arrival a part announcing its bytes
    __device__ __forceinline__ void expect_tile(int s) const {
#pragma unroll
        for (int part = 0; part < FULL_PARTS; ++part)
            mbarrier_arrive_expect_tx(full + 8 * (s * FULL_PARTS + part), TILE_BYTES / FULL_PARTS);
    }
};

__device__ __forceinline__ int acquire_stage(const Ring& r, int n) {
    const int s = n % STAGES;
    if (n >= STAGES) mbarrier_wait(r.empty + 8 * s, ((n / STAGES) - 1) & 1);
    return s;
}

// One thread: piece j's query rows, one bulk copy per valid column (the rest of the buffer is
// left as it is: its columns are masked out of the softmax and their outputs dropped).
__device__ __forceinline__ void load_query_rows(const PersistentParams& p, const Ring& r, const Piece& pc, int j) {
    const int b = j % Q_BUFFERS;
    if (j >= Q_BUFFERS) mbarrier_wait(r.q_empty + 8 * b, ((j / Q_BUFFERS) - 1) & 1);
    const int count = columns_in(p, pc.unit);
    const u32 bar = r.q_full + 8 * b, dst = r.q + b * Q_BYTES;
    mbarrier_arrive_expect_tx(bar, count * MLA_DIM * 2);
    for (int c = 0; c < count; ++c) {
        const Column col = column_of(p, pc.unit, c);
        const u16* src = reinterpret_cast<const u16*>(p.q) + pc.batch * p.q_batch_stride +
                         (long long)col.token * p.q_token_stride + (long long)col.head * p.q_head_stride;
        bulk_load(dst + c * SMEM_ROW, src, MLA_DIM * 2, bar);
    }
}

// Contiguous cache, lane 0: BOXES boxes per tile. Positions past the request's length are
// loaded too (zeros past max_len); the consumers mask them.
__device__ __forceinline__ void produce_contiguous(const PersistentParams& p, const Ring& r,
                                                   const StartShared& start, u64 policy) {
    Walk walk(p, start);
    Piece pc;
    int n = 0, j = 0;
    while (walk.next(p, pc)) {
        if constexpr (!WIDE) load_query_rows(p, r, pc, j++);
        for (int k = pc.first; k < pc.end; ++k, ++n) {
            const int s = acquire_stage(r, n);
            r.expect_tile(s);
#pragma unroll
            for (int box = 0; box < BOXES; ++box)
                tma_load_4d(r.stage(s) + box * BOX_BYTES, &p.k_map, box * Kv::DIMS_PER_BOX, 0, pc.tile_begin(k, TILE_TOKENS),
                            pc.batch, r.full_of(s, box), policy);
            if (TRACE && n == 0) trace_stamp(TRACE_FIRST_ISSUE);
        }
    }
    if (TRACE) trace_stamp(TRACE_LAST_ISSUE);
}

// Paged cache, the whole warp: a tile is TILE_TOKENS / run runs of run = min(page, tile)
// positions; the lane holding a run issues its boxes. A tile's page ids are read before the
// wait for its stage, so their latency hides behind the consumers; pages past the request's
// last one read as -1 (out of bounds: zero-filled boxes, masked by the consumers).
__device__ __forceinline__ void produce_paged(const PersistentParams& p, const Ring& r, const StartShared& start,
                                              u64 policy) {
    const int lane = threadIdx.x % 32;
    const int shift = __ffs(p.page_size) - 1;
    const int run = min(p.page_size, TILE_TOKENS);
    const int runs = TILE_TOKENS / run;
    const int in_page_mask = p.page_size - 1;
    Walk walk(p, start);
    Piece pc;
    int n = 0, j = 0;
    while (walk.next(p, pc)) {
        if (!WIDE && lane == 0) load_query_rows(p, r, pc, j);
        ++j;
        const int* table = p.block_table + (long long)pc.batch * p.table_stride;
        const int end_page = ((pc.len - 1) >> shift) + 1;
        for (int k = pc.first; k < pc.end; ++k, ++n) {
            const int tile_begin = pc.tile_begin(k, TILE_TOKENS);
            int ids[RUNS_PER_LANE];
#pragma unroll
            for (int i = 0; i < RUNS_PER_LANE; ++i) {
                const int rr = lane + 32 * i;
                const int page = (tile_begin + rr * run) >> shift;
                ids[i] = rr < runs && page < end_page ? ld_global_l2(table + page) : -1;
            }
            const int s = acquire_stage(r, n);
            if (lane == 0) r.expect_tile(s);
            __syncwarp();
#pragma unroll
            for (int i = 0; i < RUNS_PER_LANE; ++i) {
                const int rr = lane + 32 * i;
                if (rr >= runs) continue;
                const int in_page = (tile_begin + rr * run) & in_page_mask;
#pragma unroll
                for (int box = 0; box < BOXES; ++box)
                    tma_load_4d(r.stage(s) + box * BOX_BYTES + rr * run * Kv::ROW_BYTES, &p.k_map,
                                box * Kv::DIMS_PER_BOX, 0, in_page, ids[i], r.full_of(s, box), policy);
            }
        }
    }
}

// ================================ epilogue and merge ======================================
// A softmax state (base-2 max m, denominator l, unnormalised o) as output: o v_scale / l in the
// output dtype, LSE = (m + log2 l) ln 2; l = 0 (nothing visible) gives 0 and -inf, never NaN.
__device__ __forceinline__ float normaliser(float l, float v_scale) { return l > 0.f ? v_scale / l : 0.f; }
__device__ __forceinline__ float lse_of(float m, float l) {
    return l > 0.f ? (m + __log2f(l)) * 0.69314718055994531f : neg_inf();
}

// Waits until every piece of the cut unit is parked, merges this CTA's slice (merge.cuh), counts
// it in; the last slice resets both counters.
__device__ __forceinline__ void merge_cut_unit(const PersistentParams& p, const Schedule& s, const Piece& u,
                                               int lane, unsigned char* smem) {
    const CutPieces pieces(p, s, u.start, u.tiles, lane);
    int* counters = unit_counters(p, u.batch, u.unit);
    wait_until_parked<CONSUMER_THREADS>(counters, pieces.count, TRACE_ALL_PARKED);
    const bool first = TRACE && threadIdx.x == 0 && !trace_stamped(TRACE_MERGE_START);
    if (first) trace_stamp(TRACE_MERGE_START);
    const float v_scale = kv_scale<KV_FP8>(p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride, u.batch, 0);
    // (the ring is idle: the merges come after the CTA's last tile)
    merge_slice<V_DIM, GROUP_PAD, CONSUMER_THREADS>(
        p, pieces, lane_place(p) - pieces.c0, columns_in(p, u.unit), smem + SharedPlan::ring, STAGES * TILE_BYTES,
        [&](int c, int d, const MergeState& st) {
            const Column col = column_of(p, u.unit, c);
            const float inv = normaliser(st.l, v_scale);
            *reinterpret_cast<uint2*>(out_ptr(p, u.batch, col) + d) = make_uint2(
                pack_half2<IS_F16>(st.o.x * inv, st.o.y * inv), pack_half2<IS_F16>(st.o.z * inv, st.o.w * inv));
            if (p.lse && d == 0) p.lse[out_row(p, u.batch, col)] = lse_of(st.m, st.l);
        });
    if (first) trace_stamp(TRACE_MERGE_DONE);
    count_slice_in<CONSUMER_THREADS>(counters, pieces.count);
    if (first) trace_stamp(TRACE_MERGE_SYNCED);
}

// Zero-length requests own no tiles: the CTAs write their output (0, LSE -inf) by request
// index, all CTAs of the grid taking part.
__device__ __forceinline__ void write_empty_requests(const PersistentParams& p) {
    const int rows = p.q_len * p.hq;
    for (int b = blockIdx.x; b < p.batch; b += gridDim.x) {
        if (request_len(p, b) > 0) continue;
        for (int i = threadIdx.x; i < rows * (V_DIM / 8); i += CONSUMER_THREADS) {
            const int r = i / (V_DIM / 8), e = (i % (V_DIM / 8)) * 8;
            *reinterpret_cast<uint4*>(out_ptr(p, b, {r / p.hq, r % p.hq}) + e) = make_uint4(0, 0, 0, 0);
        }
        if (p.lse)
            for (int r = threadIdx.x; r < rows; r += CONSUMER_THREADS) p.lse[(long long)b * rows + r] = neg_inf();
    }
}

// ================================ consumers ===============================================
// What a CTA's consumers streamed, for the trace.
struct Tally {
    int tiles, pieces;
};

// Parks a cut piece once every consumer has written its partials (the barrier orders them before
// thread 0's release).
__device__ __forceinline__ void park_piece(const PersistentParams& p, const Piece& pc) {
    named_barrier_sync(1, CONSUMER_THREADS);
    count_piece_in(p, pc.batch, pc.unit);
}

// The eight consumer warps of a narrow column block (16 or 32 rows; see the top of the file).
__device__ __forceinline__ Tally consume_narrow(const PersistentParams& p, unsigned char* smem, const StartShared& st) {
    u64* full = reinterpret_cast<u64*>(smem + NarrowShared::full);
    u64* empty = reinterpret_cast<u64*>(smem + NarrowShared::empty);
    u64* q_full = reinterpret_cast<u64*>(smem + NarrowShared::q_full);
    u64* q_empty = reinterpret_cast<u64*>(smem + NarrowShared::q_empty);
    float* tile_max = reinterpret_cast<float*>(smem + NarrowShared::tile_max);
    float* slice_l = reinterpret_cast<float*>(smem + NarrowShared::slice_l);
    const Schedule sched = st.schedule();
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    const u32 q_base0 = smem_addr(smem + NarrowShared::q);
    const u32 ring_base = smem_addr(smem + NarrowShared::ring);
    const u32 p_base = smem_addr(smem + NarrowShared::p);
    const int slice = warp % SLICES, row0 = slice * 16;  // this warp's positions of every tile,
    const int part = warp / SLICES;                          // its part of the dims and columns:
    const int k0 = part * S_STEPS;                           // its first k16 step,
    const int s_nt0 = part * S_TILES;                        // its first n8 tile of the softmax
    const u32 partial_base = smem_addr(smem + NarrowShared::partial);
    // ldmatrix lane addressing of a [column][k] row-major B operand, two k-steps
    const int b_row = lane % 8, b_col = (lane / 8) * 8;

    Walk walk(p, st);
    Piece pc;
    int n0 = 0;  // the CTA's tiles before this piece
    int pieces_done = 0;
    while (walk.next(p, pc)) {
        const int count = columns_in(p, pc.unit);
        const float k_scale = kv_scale<KV_FP8>(p.k_scale, p.k_scale_batch_stride, p.k_scale_head_stride, pc.batch, 0);
        const float v_scale = kv_scale<KV_FP8>(p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride, pc.batch, 0);
        const float score_scale = p.scale_log2 * k_scale;
        const int q_buf = pieces_done % Q_BUFFERS;
        const u32 q_base = q_base0 + q_buf * Q_BYTES;

        float o_acc[O_TILES][N_TILES][4];
        float m_run[N_TILES][2];  // every column's running max: the same in every warp
        float l_run[S_TILES][2];  // denominators of the scored columns over this lane's positions
        int limit[S_TILES][2];    // positions (exclusive) each scored column of this lane may see
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
            for (int j = 0; j < 2; ++j) m_run[nt][j] = neg_inf();
#pragma unroll
            for (int dt = 0; dt < O_TILES; ++dt)
#pragma unroll
                for (int i = 0; i < 4; ++i) o_acc[dt][nt][i] = 0.f;
        }
#pragma unroll
        for (int st_ = 0; st_ < S_TILES; ++st_)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                l_run[st_][j] = 0.f;
                const int c = (s_nt0 + st_) * 8 + 2 * (lane % 4) + j;
                // padding columns see nothing: their P is 0 and their output is dropped
                limit[st_][j] = c < count ? pc.len - p.q_len + 1 + column_of(p, pc.unit, c).token : 0;
            }

        mbarrier_wait(&q_full[q_buf], (pieces_done / Q_BUFFERS) & 1);
        if (TRACE && threadIdx.x == 0 && n0 == 0) trace_stamp(TRACE_Q_STAGED);
        if constexpr (Kv::QUERY_PERMUTED) {
            permute_query_rows<Kv, MLA_DIM, SMEM_ROW, CONSUMER_THREADS, IS_F16>(q_base, count);
            named_barrier_sync(1, CONSUMER_THREADS);
        }
        // this warp's dims of every column as B fragments, two k-steps per entry
        u32 q_frag[Q_IN_REGISTERS ? S_STEPS / 2 : 1][N_TILES][4];
        if constexpr (Q_IN_REGISTERS) {
#pragma unroll
            for (int i = 0; i < S_STEPS / 2; ++i)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
                    ldmatrix_x4(q_frag[i][nt], q_base + (nt * 8 + b_row) * SMEM_ROW + ((k0 + 2 * i) * 16 + b_col) * 2);
        }

        for (int k = pc.first; k < pc.end; ++k) {
            const int n = n0 + k - pc.first;
            const int stage = n % STAGES;
            mbarrier_wait(&full[stage * FULL_PARTS], (n / STAGES) & 1);
            if (TRACE && n == 0 && threadIdx.x == 0) trace_stamp(TRACE_FIRST_TILE);
            const u32 tile = ring_base + stage * TILE_BYTES;
            const int tile_begin = pc.tile_begin(k, TILE_TOKENS);

            // ---- S phase: partial S^T = K Q^T over this warp's dims, 16 positions x every
            // column (S_CHAINS independent accumulators: one would chain the k-steps' MMAs) ----
            float sc[S_CHAINS][N_TILES][4];
#pragma unroll
            for (int ch = 0; ch < S_CHAINS; ++ch)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) sc[ch][nt][i] = 0.f;
#pragma unroll
            for (int i = 0; i < S_STEPS / 2; ++i) {
                const int kk = k0 + 2 * i;
                u32 a0[4], a1[4];
                Kv::k_fragments(a0, a1, tile, row0, kk, lane);
                const int ch = i % (S_CHAINS / 2) * 2;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt) {
                    u32 b[4];
                    if constexpr (Q_IN_REGISTERS) {
#pragma unroll
                        for (int r = 0; r < 4; ++r) b[r] = q_frag[Q_IN_REGISTERS ? i : 0][nt][r];
                    } else {
                        ldmatrix_x4(b, q_base + (nt * 8 + b_row) * SMEM_ROW + (kk * 16 + b_col) * 2);
                    }
                    mma_m16n8k16<MMA_F16>(sc[ch][nt], a0, b[0], b[1]);
                    mma_m16n8k16<MMA_F16>(sc[ch + 1][nt], a1, b[2], b[3]);
                }
            }
            // swap with the partner warp (same positions, the other dims): post the partial
            // scores of its columns, add its partial of mine, in the accumulator layout
            float s[S_TILES][4];
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt) {
                float v[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    v[i] = sc[0][nt][i];
#pragma unroll
                    for (int ch = 1; ch < S_CHAINS; ++ch) v[i] += sc[ch][nt][i];
                }
                const bool mine = nt / S_TILES == part;
                if (!mine) {
                    const u32 at = partial_base + ((slice * N_TILES + nt) * 32 + lane) * 16;
                    st_shared_v4(at, reinterpret_cast<const u32*>(v));
                }
#pragma unroll
                for (int st_ = 0; st_ < S_TILES; ++st_)
                    if (nt == s_nt0 + st_)
#pragma unroll
                        for (int i = 0; i < 4; ++i) s[st_][i] = v[i];
            }
            // (a warp that scores all the dims of its positions has no partner)
            if constexpr (COL_SPLIT > 1) named_barrier_sync(1, CONSUMER_THREADS);
#pragma unroll
            for (int st_ = 0; st_ < S_TILES && COL_SPLIT > 1; ++st_) {
                u32 w[4];
                ld_shared_v4(w, partial_base + ((slice * N_TILES + s_nt0 + st_) * 32 + lane) * 16);
                // the lower dims' partial first in both warps of a pair: the same sums as
                // a single warp's would be, whichever half this warp holds
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    s[st_][i] = part == 0 ? s[st_][i] + __uint_as_float(w[i]) : __uint_as_float(w[i]) + s[st_][i];
            }
            // masked scores and their maxima over this warp's positions
            const int tok = tile_begin + row0 + lane / 4;  // rows of s[..][0..1]; +8 for [2..3]
#pragma unroll
            for (int st_ = 0; st_ < S_TILES; ++st_) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    s[st_][j] = tok < limit[st_][j] ? s[st_][j] * score_scale : neg_inf();
                    s[st_][j + 2] = tok + 8 < limit[st_][j] ? s[st_][j + 2] * score_scale : neg_inf();
                    float mx = fmaxf(s[st_][j], s[st_][j + 2]);
#pragma unroll
                    for (int off = 4; off < 32; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
                    if (lane < 4) tile_max[slice * GROUP_PAD + (s_nt0 + st_) * 8 + 2 * lane + j] = mx;
                }
            }
            named_barrier_sync(1, CONSUMER_THREADS);

            // ---- softmax: every column's new max and O^T rescale; P^T of the scored ones ----
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int c = nt * 8 + 2 * (lane % 4) + j;
                    float m_tile = tile_max[c];
#pragma unroll
                    for (int sl = 1; sl < SLICES; ++sl) m_tile = fmaxf(m_tile, tile_max[sl * GROUP_PAD + c]);
                    const float m_new = fmaxf(m_run[nt][j], m_tile);
                    // a column that has seen only masked positions keeps m = -inf: subtract 0
                    // then, so that exp2 gives 0 rather than NaN
                    const float m_use = m_new == neg_inf() ? 0.f : m_new;
                    const float alpha = exp2_approx(m_run[nt][j] - m_use);
                    m_run[nt][j] = m_new;
#pragma unroll
                    for (int dt = 0; dt < O_TILES; ++dt) {
                        o_acc[dt][nt][j] *= alpha;
                        o_acc[dt][nt][j + 2] *= alpha;
                    }
                    const int st_ = nt - s_nt0;  // a runtime test, compile-time indices below
#pragma unroll
                    for (int sc = 0; sc < S_TILES; ++sc) {
                        if (sc != st_) continue;
                        const float p_lo = exp2_approx(s[sc][j] - m_use), p_hi = exp2_approx(s[sc][j + 2] - m_use);
                        l_run[sc][j] = l_run[sc][j] * alpha + p_lo + p_hi;
                        const u32 pair = pack_half2<MMA_F16>(p_lo, p_hi);
                        const u32 at = p_base + c * P_ROW + (row0 + lane / 4) * 2;
                        st_shared_u16(at, (u16)(pair & 0xffffu));
                        st_shared_u16(at + 16, (u16)(pair >> 16));
                    }
                }
            }
            named_barrier_sync(1, CONSUMER_THREADS);

            // ---- O phase: O^T[this warp's dims] += V^T P^T over the tile's positions ----
#pragma unroll
            for (int ks = 0; ks < PV_STEPS; ks += 2) {
                u32 b[N_TILES][4];
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
                    ldmatrix_x4(b[nt], p_base + (nt * 8 + b_row) * P_ROW + (ks * 16 + b_col) * 2);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int rows = (ks + h) * 16;
                    // Positions past the length carry P = 0, but the V rows there may hold
                    // anything (NaN included, and 0 * NaN = NaN): clear them in the request's
                    // last tile. Lane holds V^T columns (positions) 2 (lane % 4) + {0, 1} of the
                    // k-step in a[0..1] and 8 more in a[2..3].
                    u32 keep_lo = 0xffffffffu, keep_hi = 0xffffffffu;
                    if (tile_begin + TILE_TOKENS > pc.len) {
                        const int t0 = tile_begin + rows + 2 * (lane % 4);
                        keep_lo = (t0 < pc.len ? 0x0000ffffu : 0u) | (t0 + 1 < pc.len ? 0xffff0000u : 0u);
                        keep_hi = (t0 + 8 < pc.len ? 0x0000ffffu : 0u) | (t0 + 9 < pc.len ? 0xffff0000u : 0u);
                    }
                    u32 p_frag[N_TILES][2];
#pragma unroll
                    for (int nt = 0; nt < N_TILES; ++nt) {
                        p_frag[nt][0] = b[nt][2 * h];
                        p_frag[nt][1] = b[nt][2 * h + 1];
                    }
#pragma unroll
                    for (int dt = 0; dt < O_TILES; dt += 2) {
                        u32 a[2][4];
                        Kv::v_fragments(a[0], a[1], tile, rows, warp * O_TILES + dt, lane);
                        accumulate_o<MMA_F16>(o_acc, dt, a, keep_lo, keep_hi, p_frag);
                    }
                }
            }
            mbarrier_arrive(&empty[stage]);
        }
        // the rows' next bulk copy (async proxy) must follow this lane's reads and, fp8, writes
        if constexpr (Kv::QUERY_PERMUTED) fence_proxy_async_shared();
        mbarrier_arrive(&q_empty[q_buf]);
        if (TRACE && threadIdx.x == 0) trace_stamp(n0 == 0 ? TRACE_FIRST_LOOP : TRACE_LAST_LOOP);
        n0 += pc.end - pc.first;
        ++pieces_done;

        // ============================ epilogue ============================================
        // The denominators are per lane over its positions: finish them over the 8 lanes that
        // share a column, post them per slice, and sum the slices (fixed order).
#pragma unroll
        for (int st_ = 0; st_ < S_TILES; ++st_)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int off = 4; off < 32; off *= 2) l_run[st_][j] += __shfl_xor_sync(0xffffffffu, l_run[st_][j], off);
                if (lane < 4) slice_l[slice * GROUP_PAD + (s_nt0 + st_) * 8 + 2 * lane + j] = l_run[st_][j];
            }
        named_barrier_sync(1, CONSUMER_THREADS);
        const bool whole = pc.whole();
        const long long slot_row = whole ? 0 : (long long)piece_slot(p, sched, st.lane, pc.start + pc.first) * GROUP_PAD;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int c = nt * 8 + 2 * (lane % 4) + j;
                float l = slice_l[c];
#pragma unroll
                for (int sl = 1; sl < SLICES; ++sl) l += slice_l[sl * GROUP_PAD + c];
                if (c >= count) continue;
                if (whole) {
                    const Column col = column_of(p, pc.unit, c);
                    u16* o = out_ptr(p, pc.batch, col);
                    const float inv = normaliser(l, v_scale);
#pragma unroll
                    for (int dt = 0; dt < O_TILES; ++dt) {
                        const int g = warp * O_TILES + dt;
                        o[Kv::o_dim(g, lane / 4)] = (u16)(pack_half2<IS_F16>(o_acc[dt][nt][j] * inv, 0.f) & 0xffffu);
                        o[Kv::o_dim(g, lane / 4 + 8)] =
                            (u16)(pack_half2<IS_F16>(o_acc[dt][nt][j + 2] * inv, 0.f) & 0xffffu);
                    }
                    if (p.lse && warp == 0 && lane < 4) p.lse[out_row(p, pc.batch, col)] = lse_of(m_run[nt][j], l);
                } else {
                    float* o = p.o_partial + (slot_row + c) * V_DIM;
#pragma unroll
                    for (int dt = 0; dt < O_TILES; ++dt) {
                        const int g = warp * O_TILES + dt;
                        o[Kv::o_dim(g, lane / 4)] = o_acc[dt][nt][j];
                        o[Kv::o_dim(g, lane / 4 + 8)] = o_acc[dt][nt][j + 2];
                    }
                    if (warp == 0 && lane < 4) {
                        p.ml_partial[(slot_row + c) * 2] = m_run[nt][j];
                        p.ml_partial[(slot_row + c) * 2 + 1] = l;
                    }
                }
            }
        if (!whole) park_piece(p, pc);
        // the next piece's epilogue rewrites warp_l only after at least one more tile's two
        // barriers, which every warp reaches after reading it here
    }
    return {n0, pieces_done};
}

// ---------------------------------- wide consumer ------------------------------------------
// A piece's query rows into the wide layout (BOXES boxes of [64 rows][128 bytes], 128-byte
// swizzle; rows past `count` zero), by every consumer thread, copied without registers
// (cp.async; a register round trip would hold 18 loads a thread while O's registers are
// taken); for an e4m3 cache then made f16 in place (its MMAs are f16 ones, as its values
// widen exactly), saturated to +-65504. The caller fences and syncs.
__device__ __forceinline__ void stage_query_rows_wide(const PersistentParams& p, const Piece& pc,
                                                      unsigned char* q, int count) {
    stage_rows_sw128<WIDE_ROWS, MLA_DIM, CONSUMER_THREADS, KV_FP8 && !IS_F16>(
        smem_addr(q), count,
        [&](int r) {
            const Column col = column_of(p, pc.unit, r);
            return reinterpret_cast<const u16*>(p.q) + pc.batch * p.q_batch_stride +
                   (long long)col.token * p.q_token_stride + (long long)col.head * p.q_head_stride;
        },
        l2_policy_evict_normal());
}

// Zeroes the V part (dims 0..511) of a 2-byte tile's positions [from, WIDE_TOKENS), by the
// threads of one warpgroup (index `me` in it).
__device__ __forceinline__ void clear_v_rows(unsigned char* smem, int tile_offset, int from, int me) {
    constexpr int CHUNKS = V_DIM * 2 / 16;
    for (int i = me; i < (WIDE_TOKENS - from) * CHUNKS; i += WG_THREADS) {
        const int t = from + i / CHUNKS, c = i % CHUNKS;
        *reinterpret_cast<uint4*>(smem + tile_offset + (int)WideTile::Rows::chunk(0, t, c)) = make_uint4(0, 0, 0, 0);
    }
}

// e4m3 caches: the tile of ring stage `stage` widened into the staging tile (f16, exact), by
// every consumer thread; positions past the length (from `valid` on) written as zeros, for V
// (in the same pass: a second one would race with this one's writes).
__device__ __forceinline__ void widen_tile(unsigned char* smem, int stage, int valid) {
    if constexpr (KV_FP8) {
        constexpr int CHUNKS = MLA_DIM / 16;  // 16-byte e4m3 chunks a position
        const u32 src = smem_addr(smem + stage * TILE_BYTES);
        for (int i = threadIdx.x; i < WIDE_TOKENS * CHUNKS; i += CONSUMER_THREADS) {
            const int t = i / CHUNKS, c = i % CHUNKS;
            u32 in[4] = {0u, 0u, 0u, 0u};
            if (t < valid) ld_shared_v4(in, Kv::Rows::chunk(src, t, c));
            const u32 dst = smem_addr(smem + WideShared::staging);
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // 8 e4m3 bytes -> one 16-byte chunk of f16
                u32 out[4];
                e4m3x4_to_f16x2(in[2 * h], out[0], out[1]);
                e4m3x4_to_f16x2(in[2 * h + 1], out[2], out[3]);
                st_shared_v4(WideTile::Rows::chunk(dst, t, 2 * c + h), out);
            }
        }
    }
}

// O[:, 256 wg .. + 256] of rows r0, r0 + 8 times their factors (a warp whose rows all keep
// their max skips it).
__device__ __forceinline__ void rescale_o(float (&o)[WIDE_O_DIMS / 2], float a0, float a1) {
    if (!__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) return;
#pragma unroll
    for (int j = 0; j < WIDE_O_DIMS / 8; ++j) {
        o[4 * j] *= a0;
        o[4 * j + 1] *= a0;
        o[4 * j + 2] *= a1;
        o[4 * j + 3] *= a1;
    }
}

// Issues O[:, 256 wg .. + 256] += P V for the 2-byte tile at `tile`, P from shared memory
// (p_desc). V is N-major: rows are positions (8 of them 1024 bytes apart), 64 dims a box, boxes
// WIDE_BOX apart.
__device__ __forceinline__ void issue_pv(float (&o)[WIDE_O_DIMS / 2], u64 p_desc, u32 tile, int wg) {
    const u64 v_desc = smem_desc_sw128(tile + wg * (WIDE_O_DIMS / 64) * WIDE_BOX, WIDE_BOX, 1024);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < WIDE_TOKENS / 16; ++ks)
        wgmma_m64n256k16<MMA_F16, 1>(o, p_desc + ((ks * 32) >> 4), v_desc + ((ks * 16 * 128) >> 4), true);
    wgmma_commit();
}

// Two consumer warpgroups on column blocks of 64 rows (see the top of the file). Thread t of
// warpgroup wg holds rows r0 = 16 (t / 32) + (t % 32) / 4 and r0 + 8 of S (warpgroup 0) and of
// O[:, 256 wg .. + 256], in the wgmma accumulator layout (wgmma.cuh).
__device__ __forceinline__ Tally consume_wide(const PersistentParams& p, unsigned char* smem, const StartShared& st) {
    u64* full = reinterpret_cast<u64*>(smem + WideShared::full);
    u64* empty = reinterpret_cast<u64*>(smem + WideShared::empty);
    float* row_alpha = reinterpret_cast<float*>(smem + WideShared::row_alpha);
    float* row_m = reinterpret_cast<float*>(smem + WideShared::row_m);
    float* row_l = reinterpret_cast<float*>(smem + WideShared::row_l);
    const Schedule sched = st.schedule();
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / WG_THREADS, 0);  // warp-uniform for ptxas
    const int lane = threadIdx.x % 32;
    const int r0 = 16 * ((threadIdx.x % WG_THREADS) / 32) + lane / 4;  // and r0 + 8
    const int pair = 2 * (lane % 4);  // first of the two accumulator columns of an n8 tile
    const u32 ring_base = smem_addr(smem + WideShared::ring);
    const u32 p_base = smem_addr(smem + WideShared::p);
    // this lane's row address for stmatrix of P (128-byte swizzle: 16-byte chunk c of row r at
    // c ^ (r % 8)): row 16 warp + 8 ((lane / 8) % 2) + lane % 8 of block lane / 16; the row's
    // own bits sit at 128 and above, so a later block j (even) is an XOR with j << 4
    const int p_row = 16 * ((threadIdx.x % WG_THREADS) / 32) + 8 * ((lane / 8) % 2) + lane % 8;
    const u32 p_lane = p_base + p_row * 128 + (((lane / 16) ^ (lane % 8)) << 4);
    // K-major operands (Q, K, P): a k16 step is 32 bytes along the row, a box 64 k further
    const u64 q_desc = smem_desc_sw128(smem_addr(smem + WideShared::q), 16, 1024);
    const u64 p_desc = smem_desc_sw128(p_base, 16, 1024);
    const u32 staging = ring_base + (WideShared::staging - WideShared::ring);  // an offset, no register

    Walk walk(p, st);
    Piece pc;
    int n0 = 0, pieces_done = 0;
    while (walk.next(p, pc)) {
        const int count = columns_in(p, pc.unit);
        const float score_scale =
            p.scale_log2 * kv_scale<KV_FP8>(p.k_scale, p.k_scale_batch_stride, p.k_scale_head_stride, pc.batch, 0);
        stage_query_rows_wide(p, pc, smem + WideShared::q, count);
        fence_proxy_async_shared();
        named_barrier_sync(BAR_CONSUMERS, CONSUMER_THREADS);
        if (TRACE && threadIdx.x == 0 && n0 == 0) trace_stamp(TRACE_Q_STAGED);

        float o[WIDE_O_DIMS / 2];
        float s[WIDE_TOKENS / 2];
#pragma unroll
        for (int i = 0; i < WIDE_O_DIMS / 2; ++i) o[i] = 0.f;
#pragma unroll
        for (int i = 0; i < WIDE_TOKENS / 2; ++i) s[i] = 0.f;
        float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
        int limit[2];  // positions (exclusive) each of the thread's rows may see
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = r0 + 8 * i;
            limit[i] = r < count ? pc.len - p.q_len + 1 + column_of(p, pc.unit, r).token : 0;
        }

        // the warpgroups' loops apart: a wgmma left in flight on one side of a branch inside the
        // loop would make ptxas serialise every wgmma
        if (wg == 0) {
            for (int k = pc.first; k < pc.end; ++k) {
                const int n = n0 + k - pc.first;
                const int stage = n % STAGES;
                const int tile_begin = k * WIDE_TOKENS;
                if (TRACE && n == 0 && threadIdx.x == 0) trace_stamp(TRACE_FIRST_TILE);
                if constexpr (KV_FP8) {
                    // the staging tile is free once both warpgroups' P V of the last tile is
                    // done (this one's waited here, the other's announced by P_FREE, which
                    // frees the P buffer too); widened, the e4m3 stage goes back to the
                    // producer at once
                    mbarrier_wait(&full[stage * FULL_PARTS], (n / STAGES) & 1);
                    wgmma_wait<0>();
                    wgmma_hold(o);
                    if (k > pc.first) named_barrier_sync(BAR_P_FREE, CONSUMER_THREADS);
                    widen_tile(smem, stage, pc.len - tile_begin);
                    fence_proxy_async_shared();
                    mbarrier_arrive(&empty[stage]);
                    named_barrier_sync(BAR_STAGING, CONSUMER_THREADS);
                }
                const u32 tile = KV_FP8 ? staging : ring_base + stage * TILE_BYTES;
                // ---- S = Q K^T over the 576 dims, a 2-byte tile's boxes as they land ----
                const u64 k_desc = smem_desc_sw128(tile, 16, 1024);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < K_STEPS; ++kk) {
                    if (FULL_PARTS > 1 && kk % 4 == 0) {
                        mbarrier_wait(&full[stage * FULL_PARTS + kk / 4], (n / STAGES) & 1);
                        wgmma_fence();  // ordered after the wait's loop, not left to ptxas
                    }
                    wgmma_m64n64k16<MMA_F16, 0>(s, q_desc + (((kk / 4) * WIDE_BOX + (kk % 4) * 32) >> 4),
                                                k_desc + (((kk / 4) * WIDE_BOX + (kk % 4) * 32) >> 4), kk > 0);
                }
                wgmma_commit();
                wgmma_wait<0>();  // this S, and the previous tile's P V
                wgmma_hold(s);
                wgmma_hold(o);
                if (!KV_FP8 && k > pc.first) mbarrier_arrive(&empty[(n - 1) % STAGES]);
                if (!KV_FP8 && tile_begin + WIDE_TOKENS > pc.len)
                    clear_v_rows(smem, stage * TILE_BYTES, pc.len - tile_begin, threadIdx.x % WG_THREADS);

                // ---- online softmax of rows r0, r0 + 8 over the tile's positions ----
                // (its instructions run with nothing under them on the tensor cores: one warp a
                // scheduler, so every instruction and every dependent latency counts)
                // (an e4m3 scale is the caller's device tensor, of any sign: scaled first)
                if constexpr (KV_FP8)
#pragma unroll
                    for (int i = 0; i < WIDE_TOKENS / 2; ++i) s[i] *= score_scale;
                const float exp_scale = KV_FP8 ? 1.f : score_scale;
                // A row's positions are masked only in the tiles that reach its limit.
                if (tile_begin + WIDE_TOKENS > min(limit[0], limit[1])) {
#pragma unroll
                    for (int i = 0; i < 2; ++i)
#pragma unroll
                        for (int j = 0; j < WIDE_TOKENS / 8; ++j)
#pragma unroll
                            for (int c = 0; c < 2; ++c)
                                if (tile_begin + 8 * j + pair + c >= limit[i]) s[4 * j + 2 * i + c] = neg_inf();
                }
                float alpha[2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    // four partial maxima and sums: short dependent chains
                    float mx4[4] = {neg_inf(), neg_inf(), neg_inf(), neg_inf()};
#pragma unroll
                    for (int j = 0; j < WIDE_TOKENS / 8; ++j)
#pragma unroll
                        for (int c = 0; c < 2; ++c) mx4[(2 * j + c) % 4] = fmaxf(mx4[(2 * j + c) % 4], s[4 * j + 2 * i + c]);
                    float mx = fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    // a 2-byte cache: the raw scores' max, scaled (the softmax scale is checked
                    // positive on the host, so they commute), and one FFMA a score below
                    const float m_new = fmaxf(m_run[i], mx * exp_scale);
                    // rows that have seen only masked positions keep m = -inf: subtract 0 then
                    const float m_use = m_new == neg_inf() ? 0.f : m_new;
                    alpha[i] = exp2_approx(m_run[i] - m_use);
                    m_run[i] = m_new;
                    float sum4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int j = 0; j < WIDE_TOKENS / 8; ++j)
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            float& v = s[4 * j + 2 * i + c];
                            v = exp2_approx(fmaf(v, exp_scale, -m_use));
                            sum4[(2 * j + c) % 4] += v;
                        }
                    l_run[i] = l_run[i] * alpha[i] + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
                }
                // ---- hand P and the factors to warpgroup 1 (once it is done with the last) ----
                if (!KV_FP8 && k > pc.first) named_barrier_sync(BAR_P_FREE, CONSUMER_THREADS);
                // P's 8x8 blocks (row half i, positions 8 j..) by stmatrix, four a call: (0, j),
                // (1, j), (0, j + 1), (1, j + 1) for j = 0, 2, 4, 6; p_lane ^ (j << 4) is the
                // swizzled address of this lane's row in them
#pragma unroll
                for (int j = 0; j < WIDE_TOKENS / 8; j += 2)
                    stmatrix_x4(p_lane ^ (j << 4), pack_half2<MMA_F16>(s[4 * j], s[4 * j + 1]),
                                pack_half2<MMA_F16>(s[4 * j + 2], s[4 * j + 3]),
                                pack_half2<MMA_F16>(s[4 * j + 4], s[4 * j + 5]),
                                pack_half2<MMA_F16>(s[4 * j + 6], s[4 * j + 7]));
                if (lane % 4 == 0) {
                    row_alpha[r0] = alpha[0];
                    row_alpha[r0 + 8] = alpha[1];
                }
                fence_proxy_async_shared();
                named_barrier_sync(BAR_P_READY, CONSUMER_THREADS);
                // ---- O[:, 0..255] += P V; the next tile's S follows it on the tensor cores ----
                rescale_o(o, alpha[0], alpha[1]);
                issue_pv(o, p_desc, tile, 0);
            }
            wgmma_wait<0>();
            wgmma_hold(o);
            if (!KV_FP8) mbarrier_arrive(&empty[(n0 + pc.end - pc.first - 1) % STAGES]);
        } else {
            for (int k = pc.first; k < pc.end; ++k) {
                const int n = n0 + k - pc.first;
                const int stage = n % STAGES;
                if constexpr (KV_FP8) {
                    // (both warpgroups' P V of the last tile is done: this one's waited below,
                    // the other's before it passed P_FREE with this one)
                    mbarrier_wait(&full[stage * FULL_PARTS], (n / STAGES) & 1);
                    widen_tile(smem, stage, pc.len - k * WIDE_TOKENS);
                    fence_proxy_async_shared();
                    mbarrier_arrive(&empty[stage]);
                    named_barrier_sync(BAR_STAGING, CONSUMER_THREADS);
                }
                named_barrier_sync(BAR_P_READY, CONSUMER_THREADS);
                rescale_o(o, row_alpha[r0], row_alpha[r0 + 8]);
                issue_pv(o, p_desc, KV_FP8 ? staging : ring_base + stage * TILE_BYTES, 1);
                wgmma_wait<0>();
                wgmma_hold(o);
                if (!KV_FP8) mbarrier_arrive(&empty[stage]);
                if (k + 1 < pc.end) named_barrier_sync(BAR_P_FREE, CONSUMER_THREADS);
            }
        }
        if (TRACE && threadIdx.x == 0) trace_stamp(n0 == 0 ? TRACE_FIRST_LOOP : TRACE_LAST_LOOP);
        n0 += pc.end - pc.first;
        ++pieces_done;

        // ============================ epilogue ============================================
        if (wg == 0)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float l = l_run[i];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                if (lane % 4 == 0) {
                    row_l[r0 + 8 * i] = l;
                    row_m[r0 + 8 * i] = m_run[i];
                }
            }
        named_barrier_sync(BAR_CONSUMERS, CONSUMER_THREADS);
        const bool whole = pc.whole();
        const long long slot_row = whole ? 0 : (long long)piece_slot(p, sched, st.lane, pc.start + pc.first) * GROUP_PAD;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = r0 + 8 * i;
            if (r >= count) continue;
            const float l = row_l[r], m = row_m[r];
            const int d0 = wg * WIDE_O_DIMS + pair;
            if (whole) {
                const Column col = column_of(p, pc.unit, r);
                u16* out = out_ptr(p, pc.batch, col) + d0;
                const float inv = normaliser(
                    l, kv_scale<KV_FP8>(p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride, pc.batch, 0));
#pragma unroll
                for (int j = 0; j < WIDE_O_DIMS / 8; ++j)
                    *reinterpret_cast<u32*>(out + 8 * j) =
                        pack_half2<IS_F16>(o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv);
                if (p.lse && wg == 0 && lane % 4 == 0) p.lse[out_row(p, pc.batch, col)] = lse_of(m, l);
            } else {
                float* out = p.o_partial + (slot_row + r) * V_DIM + d0;
#pragma unroll
                for (int j = 0; j < WIDE_O_DIMS / 8; ++j)
                    *reinterpret_cast<float2*>(out + 8 * j) = make_float2(o[4 * j + 2 * i], o[4 * j + 2 * i + 1]);
                if (wg == 0 && lane % 4 == 0) {
                    p.ml_partial[(slot_row + r) * 2] = m;
                    p.ml_partial[(slot_row + r) * 2 + 1] = l;
                }
            }
        }
        if (!whole) park_piece(p, pc);
    }
    return {n0, pieces_done};
}

}  // namespace kvs

using namespace kvs;

extern "C" __global__ void __launch_bounds__(THREADS, 1) kvs_decode_mla(const __grid_constant__ PersistentParams p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((SharedPlan::align - smem_addr(smem_raw) % SharedPlan::align) %
                                      SharedPlan::align);
    u64* full = reinterpret_cast<u64*>(smem + SharedPlan::full);
    u64* empty = reinterpret_cast<u64*>(smem + SharedPlan::empty);
    u64* q_full = reinterpret_cast<u64*>(smem + SharedPlan::q_full);
    u64* q_empty = reinterpret_cast<u64*>(smem + SharedPlan::q_empty);
    StartShared* start = reinterpret_cast<StartShared*>(smem + SharedPlan::start);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (TRACE && threadIdx.x == 0) {
        trace_clear();
        trace_stamp(TRACE_ENTRY);
    }

    if (threadIdx.x == PRODUCER_WARP * 32) prefetch_tensor_map(&p.k_map);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            for (int part = 0; part < FULL_PARTS; ++part) mbarrier_init(&full[s * FULL_PARTS + part], 1);
            mbarrier_init(&empty[s], CONSUMER_THREADS);
        }
        for (int b = 0; b < Q_BUFFERS; ++b) {
            mbarrier_init(&q_full[b], 1);
            mbarrier_init(&q_empty[b], CONSUMER_THREADS);
        }
        fence_mbarrier_init();
    }
    // Nothing below may read global memory the previous kernel writes before it has finished.
    pdl_wait_for_producer();
    pdl_release_dependents();
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_WAITED);
    if (warp == 0) schedule_start<TILE_TOKENS>(p, start);
    __syncthreads();
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_SCHEDULED);
    if (warp >= PRODUCER_WARP) {
        // ================================ producer warpgroup =============================
        setmaxnreg_dec<PRODUCER_REGS>();
        if (warp != PRODUCER_WARP) return;
        const StartShared st = *start;
        const Ring ring = {smem_addr(smem + SharedPlan::ring), smem_addr(full),  smem_addr(empty),
                           smem_addr(smem + SharedPlan::q),    smem_addr(q_full), smem_addr(q_empty)};
        // a tile is streamed once, but by every lane (schedule.cuh): evict it first only then
        const u64 policy = p.lanes > 1 ? l2_policy_evict_normal() : l2_policy_evict_first();
        if constexpr (PAGED) {
            produce_paged(p, ring, st, policy);
        } else if (lane == 0) {
            produce_contiguous(p, ring, st, policy);
        }
        return;
    }

    // ================================= consumer warps ======================================
    setmaxnreg_inc<CONSUMER_REGS>();
    const StartShared st = *start;
    if (p.schedule_log && threadIdx.x == 0) record_schedule<TILE_TOKENS>(p, st);
    Tally tally;
    if constexpr (WIDE) {
        tally = consume_wide(p, smem, st);
    } else {
        tally = consume_narrow(p, smem, st);
    }
    const CutUnits cuts = cut_units<TILE_TOKENS>(p, st);
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_PARKED);
    const Schedule sched = st.schedule();
    if (cuts.has_first) merge_cut_unit(p, sched, cuts.first, st.lane, smem);
    if (cuts.has_last) merge_cut_unit(p, sched, cuts.last, st.lane, smem);
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_MERGED);
    write_empty_requests(p);
    if (TRACE) {
        named_barrier_sync(1, CONSUMER_THREADS);
        if (threadIdx.x == 0 && tally.tiles > 0) {
            trace_stamp(TRACE_EXIT);
            trace_write(tally.tiles, tally.pieces, (int)(st.hi - st.lo), PAGED ? 1u : 0u);
        }
    }
}
