// Persistent swap-AB GQA decode for sm_90a, scheduled on the device at every call.
//
//   S^T [tokens x group] = K [tokens x d] * Q^T [d x group]     (mma m16n8k16, tokens on M)
//   O^T [d x group]      = V^T [d x tokens] * P^T [tokens x group]
//
// One CTA per SM by default (two where the plan is told to and they fit). Every CTA works out
// the call's schedule itself from the lengths (scheduler, schedule.cuh): the KV tiles of all
// (request, KV head, column block) units form one sequence and each working CTA streams an
// equal share of it, across unit and request boundaries, so a CUDA graph replayed with any
// lengths stays balanced. A unit cut by CTA boundaries is merged by all of its pieces' CTAs, a
// slice each, once they have parked every piece (arrival counters the last slice resets: nothing
// is zeroed between calls); the merge order is fixed, so results are bitwise reproducible.
// With lanes (p.lanes > 1) the grid is dealt into one lane per column block (column lanes: L2
// serves the other lanes' reads of a tile) or per (KV head, column block) (head lanes: the
// heads of a position read at about the same time), each lane scheduled over the same tiles
// for its own units (schedule.cuh); workspace slots interleave the lanes.
//
// Roles (CTA of 4 * CONSUMER_GROUPS consumer warps + PRODUCER_WARPS producer warps):
//   scheduler  consumer warp 0 at entry: the total tile count and the request holding this
//              CTA's first tile, into shared memory (one pass over the lengths);
//   producer   the last warp(s): walks the same pieces and streams their K and V tiles through a
//              ring of STAGES shared-memory stages by TMA, without stopping at piece boundaries
//              (KvSource: contiguous cache, page runs looked up in the block table, or pages
//              gathered position by position), and the query rows of each piece into one of
//              Q_BUFFERS buffers a piece ahead;
//   consumers  per piece: wait for its Q, then the KV loop (group g of four warps takes the
//              CTA's tiles n = g, g + G, ...; each warp keeps a private online softmax over its
//              rows of each tile), then the epilogue;
//   epilogue   the warps' softmax states merged in shared memory; a whole unit is normalised
//              and written to `out` (and LSE); a cut one parks FP32 partials and counts itself in;
//   merge      once the CTA's last piece is done, its slice of each cut unit it holds a piece of
//              (merge_cut_unit: waits until the unit's pieces are all parked; the grid is
//              resident at once, so every wait ends).
//
// Ring protocol, n = the CTA's running tile count, stage s = n % STAGES, parity (n / STAGES) & 1:
//   producer  wait empty[s] (from the second lap); K boxes on k_full[s], V boxes on v_full[s]
//             (gathered pages: every lane's K copies, then its V copies, each arriving when
//             they have landed, so a full barrier counts 32 arrivals instead of bytes)
//   consumer  wait k_full[s], S^T and softmax, wait v_full[s], O^T, every lane arrives on
//             empty[s]: each lane releases its own shared-memory reads, an order that
//             compute-sanitizer's racecheck can follow (a warp barrier and one lane's arrive is
//             as correct but reported as a race against the gathered refills; both time the same)
//   (STAGES is a multiple of TILE_GROUPS: a stage always feeds the same group(s), whose warps'
//   lanes its `empty` barrier counts: one group's, or both groups' on 128-row wide blocks)
// Query rows, j = the CTA's piece count, buffer b = j % Q_BUFFERS, parity (j / Q_BUFFERS) & 1:
//   producer  at piece j - 1 (at the start for piece 0): wait q_empty[b] (from the second lap),
//             the rows as bulk copies on q_full[b]
//   consumer  wait q_full[b] before the KV loop; every lane arrives on q_empty[b] after it
//             (each releases its own reads, as on `empty`; e4m3 rows rewritten in place after a
//             proxy fence)
//
// Compile-time configuration (NVRTC defines, chosen only by the host's plan module):
//   KVS_IS_F16           0: bf16, 1: f16 (Q and out; K and V too unless KVS_KV_FP8)
//   KVS_KV_FP8           1: K and V are float8 e4m3 with FP32 scales (kv_format.cuh)
//   KVS_HEAD_DIM         64, 96, 128 or 256: the head dim of K and V (a tile row of 96 is padded
//                        to 128 in shared memory, kv_format.cuh); 128 or 192: a row of paired heads
//   KVS_HEADS_PER_ROW    1, or 2: two adjacent d 64 (d 96) KV heads side by side in one d 128
//                        (d 192) row (see "Paired heads")
//   KVS_N_TILES          n8 tiles of query rows per column block (1..4; 8 or 16: the wide
//                        consumer's blocks of 64 or 128 rows)
//   KVS_TILE_TOKENS      KV positions per ring stage (multiple of 64)
//   KVS_STAGES           ring depth
//   KVS_CONSUMER_GROUPS  1 or 2 groups of four consumer warps
//   KVS_PAGED            0: contiguous cache; 1: paged cache
//   KVS_GATHER           paged: 0 TMA boxes per page run; 1 pages gathered by 16-byte copies
//   KVS_PRODUCER_WARPS   1; gathering: 1, 2 or 4 warps, each copying its share of every tile
//   KVS_KV_L2            L2 priority of the K and V loads: 0 evict_first, 1 evict_normal,
//                        2 evict_last
//   KVS_SOFTMAX_SLICES   m16 slices of a warp's rows per online-softmax step (1 or 2): one max
//                        reduction, one rescale of O^T per step
//   KVS_SHARED_BYTES     the dynamic shared memory the host launches with (checked against the
//                        layout below at compile time)
//
// Score modifiers (score_mods.cuh) are parameters, not builds: a sliding window bounds each
// column's positions below as well (the schedule streams only the window's tiles), the softcap
// is a warp-uniform branch, and the epilogue reads p.sinks where they are set. Masks are
// applied only in the tiles that cross a column's bound, so a modifier that is off costs nothing.
//
// Wide column blocks (KVS_N_TILES 8 or 16: 64 or 128 query rows a block, d 64 and 128, large
// multi-token groups) take another consumer on the same scheduler, producer, ring and epilogue:
// the query rows are the M dimension of the warpgroup MMA (wgmma.cuh), as in decode_mla.cu, so
// neither product re-reads the rows per tile (see "wide consumer" below).
//
// Paired heads (KVS_HEADS_PER_ROW 2): a cache of d 64 heads stored next to each other
// ([.., hkv, 64] with head stride 64) is the same memory as [.., hkv / 2, 128], so the engine
// streams it as d 128 rows and a unit owns KV heads 2u and 2u + 1 (d 96 likewise, as d 192
// rows: three whole, aligned 128-byte boxes a position). Their query rows are the unit's
// columns (p.group = 2 x the real group: the first half of a block's heads belong to head 2u,
// the second half to 2u + 1), each row holding its q in its own head's Q_DIM dims and zeros
// in the other's, so S^T = K Q^T scores each column against its own head only; O^T rows of
// the other head's dims are computed and dropped. Where the real group fills less than half
// of an n8 tile (MHA, groups up to 4) this halves the softmax, rescale and epilogue work per
// KV position, which is what sets the d 64 rate. The zero halves are written once: every
// column slot of a buffer belongs to the same head of its pair on every piece (the host pairs
// only where a column block starts on a multiple of p.group).
#include "ptx.cuh"
#include "decode_params.cuh"
#include "kv_format.cuh"
#include "schedule.cuh"
#include "scheduler.cuh"
#include "merge.cuh"
#include "score_mods.cuh"
#include "trace.cuh"
#include "wgmma.cuh"

namespace kvs {

// Trace points (trace.cuh; KVS_TRACE builds only), by the thread named.
enum TracePoint {
    TRACE_ENTRY,        // thread 0, first instruction
    TRACE_WAITED,       // thread 0, PDL wait returned
    TRACE_SCHEDULED,    // thread 0, the schedule's start known to every role
    TRACE_FIRST_ISSUE,  // producer, first tile's boxes issued
    TRACE_LAST_ISSUE,   // producer, last tile's boxes issued
    TRACE_Q_STAGED,     // thread 0, the first piece's Q in shared memory
    TRACE_FIRST_TILE,   // thread 0, first K tile landed
    TRACE_FIRST_LOOP,   // thread 0, first piece's KV loop done
    TRACE_LAST_LOOP,    // thread 0, last piece's KV loop done
    TRACE_PARKED,       // thread 0, every piece written or parked
    TRACE_MERGED,       // thread 0, its slices of the cut units' merges written
    TRACE_EXIT,         // thread 0, every consumer done
    TRACE_LENGTHS,      // scheduler lane 0, the first round of lengths in registers
    TRACE_START_WRITTEN,  // scheduler lane 0, the CTA's start written for the other roles
    TRACE_PRODUCER_READY,  // contiguous producer, its role entered (the schedule read)
    TRACE_Q_ISSUED,     // contiguous producer, the first piece's query rows issued
    TRACE_ALL_PARKED,   // thread 0, its first cut unit's pieces all parked (the merge may start)
    TRACE_MERGE_START,  // thread 0, the first merge's barrier passed
    TRACE_MERGE_DONE,   // thread 0, its own part of the first merge done
    TRACE_MERGE_SYNCED, // thread 0, every thread's part of the first merge done
    TRACE_FIRST_COUNTED,  // thread 0, its first cut piece counted in (the release returned)
};

constexpr bool IS_F16 = KVS_IS_F16;
constexpr bool KV_FP8 = KVS_KV_FP8;
constexpr int HEAD_DIM = KVS_HEAD_DIM;
constexpr int HEADS_PER_ROW = KVS_HEADS_PER_ROW;
constexpr int Q_DIM = HEAD_DIM / HEADS_PER_ROW;  // head dim of q, out and of one KV head
static_assert(HEADS_PER_ROW == 1 || (HEADS_PER_ROW == 2 && (HEAD_DIM == 128 || HEAD_DIM == 192)),
              "paired heads: two d 64 or two d 96 heads");
constexpr int N_TILES = KVS_N_TILES;
// the wide consumer: query rows on the wgmma M dimension, blocks of 64 (N_TILES 8) or 128
// (N_TILES 16: each warpgroup takes 64 of the rows on every tile)
constexpr bool WIDE = N_TILES == 8 || N_TILES == 16;
constexpr int TILE_TOKENS = KVS_TILE_TOKENS;
constexpr int STAGES = KVS_STAGES;
constexpr int CONSUMER_GROUPS = KVS_CONSUMER_GROUPS;
constexpr bool PAGED = KVS_PAGED;
constexpr bool GATHER = KVS_GATHER;
constexpr int PRODUCER_WARPS = KVS_PRODUCER_WARPS;
static_assert(PAGED || !GATHER, "only a paged pool is gathered");
static_assert(PRODUCER_WARPS == 1 || (GATHER && (PRODUCER_WARPS == 2 || PRODUCER_WARPS == 4)),
              "several producer warps only gather");
constexpr int KV_L2 = KVS_KV_L2;
constexpr int SOFTMAX_SLICES = KVS_SOFTMAX_SLICES;
static_assert(KV_L2 >= 0 && KV_L2 <= 2, "L2 priority");

constexpr int GROUP_WARPS = 4;
constexpr int CONSUMER_WARPS = GROUP_WARPS * CONSUMER_GROUPS;
constexpr int CONSUMER_THREADS = CONSUMER_WARPS * 32;
constexpr int PRODUCER_WARP = CONSUMER_WARPS;  // the first producer warp
constexpr int THREADS = CONSUMER_THREADS + 32 * PRODUCER_WARPS;
constexpr int ROWS_PER_WARP = TILE_TOKENS / GROUP_WARPS;
constexpr int M_SLICES = ROWS_PER_WARP / 16;  // m16 slices per warp per tile
constexpr int GROUP_PAD = N_TILES * 8;        // columns per block
constexpr int D_TILES = HEAD_DIM / 16;

// K and V tiles: the cache's element format (kv_format.cuh). They arrive as TMA boxes of one
// row (up to 128 bytes) x TILE_TOKENS positions, swizzled so that the 8 rows one ldmatrix phase
// reads hit 8 different bank groups.
using Kv = typename KvFormatOf<KV_FP8, HEAD_DIM, TILE_TOKENS, IS_F16>::type;
constexpr bool MMA_F16 = Kv::MMA_F16;  // the MMAs' (and P's) 16-bit type
constexpr int BOXES = Kv::BOXES;
constexpr int BOX_BYTES = Kv::BOX_BYTES;
constexpr int TILE_BYTES = Kv::TILE_BYTES;
constexpr int STAGE_BYTES = 2 * TILE_BYTES;  // K tile then V tile
constexpr int RUNS_PER_LANE = TILE_TOKENS / 32;  // paged: page runs per tile, per producer lane
// Paged producers read a piece's page ids a chunk of CHUNK_PAGES at a time (walk_paged_tiles)
constexpr int CHUNK_PAGES = 32 * RUNS_PER_LANE;
constexpr int SMEM_ROW = HEAD_DIM * 2 + 16;     // Q rows, padded for conflict-free ldmatrix
constexpr int Q_BYTES = GROUP_PAD * SMEM_ROW;   // one piece's query rows
// Buffers of query rows: the producer loads piece j + 1's while the consumers may still be on
// piece j - 1 (it runs at most STAGES tiles ahead of them)
constexpr int Q_BUFFERS = 3;
constexpr int MERGE_ROW = HEAD_DIM + 4;         // epilogue scratch rows, padded likewise
constexpr int MERGE_WARP_FLOATS = GROUP_PAD * MERGE_ROW;
// The wide consumer's warpgroups split a block's rows (WIDE_ROW_GROUPS of 64 rows, all on every
// tile) and take alternate tiles (TILE_GROUPS): 1 x 2 for blocks of 64 rows, 2 x 1 for 128.
constexpr int WIDE_ROW_GROUPS = WIDE ? GROUP_PAD / 64 : 1;
constexpr int TILE_GROUPS = CONSUMER_GROUPS / WIDE_ROW_GROUPS;
// Softmax states per column the epilogue merges: one per consumer warp, or one per tile group
// of the wide consumer (each warpgroup holds whole rows)
constexpr int EPI_PARTS = WIDE ? TILE_GROUPS : CONSUMER_WARPS;
// (the wide consumer stages its query rows itself, as a wgmma operand: the producer loads none)
constexpr int Q_REGION = WIDE ? GROUP_PAD * HEAD_DIM * 2 : Q_BUFFERS * Q_BYTES;
// The epilogue scratch: each part's rescaled O of every column (the merge of cut units stages
// the parked partials in the idle ring instead: merge_slice)
constexpr int MERGE_FLOATS = EPI_PARTS * MERGE_WARP_FLOATS;
// The wide consumer with an e4m3 cache: a ring tile is widened into f16 K and V tiles in the
// 2-byte layout (rows of 128 bytes, 64 dims a box), which the warpgroup MMAs read (a wgmma operand
// in shared memory is 16-bit here): blocks of 64 rows, by each warpgroup into copies of its own;
// blocks of 128, by both warpgroups into two copies taken in turn (a copy is rewritten two tiles
// later, when both warpgroups have waited for their P V of it)
using WideTile = KvHalf<HEAD_DIM, 64, true>;
constexpr int WIDE_STAGING = WIDE && KV_FP8 ? CONSUMER_GROUPS * 2 * WideTile::TILE_BYTES : 0;

struct SharedPlan {
    // from a 1024-byte aligned base (the 128-byte swizzle repeats every 1024 bytes; TMA expects it)
    static constexpr int align = 1024;
    static constexpr int ring = 0;
    static constexpr int staging = STAGES * STAGE_BYTES;  // the wide consumer's f16 tiles (e4m3)
    static constexpr int q = staging + WIDE_STAGING;
    // the epilogue's scratch has its own space: the producer is filling the ring with the next
    // piece's tiles while the consumers finish this one
    static constexpr int merge = q + Q_REGION;
    static constexpr int full = merge + MERGE_FLOATS * 4;  // K, V per stage
    static constexpr int empty = full + 16 * STAGES;
    static constexpr int q_full = empty + 8 * STAGES;
    static constexpr int q_empty = q_full + 8 * Q_BUFFERS;
    static constexpr int warp_m = q_empty + 8 * Q_BUFFERS;
    static constexpr int warp_l = warp_m + 4 * EPI_PARTS * GROUP_PAD;
    static constexpr int col_out = warp_l + 4 * EPI_PARTS * GROUP_PAD;  // Columns tables
    static constexpr int col_row = col_out + 8 * GROUP_PAD;
    static constexpr int col_visible = col_row + 8 * GROUP_PAD;
    static constexpr int col_low = col_visible + 4 * GROUP_PAD;
    static constexpr int start = col_low + 4 * GROUP_PAD;  // StartShared (56 bytes at most)
    // gather: each producer warp's copy of one chunk's page ids, one tile's pool rows
    // (produce_gathered)
    static constexpr int cut_count = start + 56;  // int: cut pieces parked so far
    static constexpr int cut_pieces = start + 64;  // Piece[2]: the CTA's cut pieces (its first, last)
    static constexpr int page_ids = cut_pieces + 2 * 48;
    static constexpr int pool_rows = page_ids + (GATHER ? 4 * CHUNK_PAGES * PRODUCER_WARPS : 0);
    static constexpr int bytes = pool_rows + (GATHER ? 4 * TILE_TOKENS : 0);
};

static_assert(TILE_TOKENS % (16 * GROUP_WARPS) == 0, "tile must split into m16 slices");
static_assert(TILE_TOKENS % 32 == 0, "producer lanes take whole rounds of page runs");
static_assert(STAGES % TILE_GROUPS == 0, "a stage must always feed the same group");
static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256 ||
                  (HEAD_DIM == 192 && HEADS_PER_ROW == 2),
              "head dim");
static_assert((N_TILES >= 1 && N_TILES <= (HEAD_DIM > 128 ? 2 : 4)) || WIDE,
              "column blocks of up to 32 rows (16 at d 256: the O^T accumulators fill the registers)");
static_assert(!WIDE || (HEADS_PER_ROW == 1 && (HEAD_DIM == 64 || HEAD_DIM == 128) && CONSUMER_GROUPS == 2 &&
                        TILE_TOKENS == 64 && SOFTMAX_SLICES == 1),
              "wide column blocks: d 64 or 128, two warpgroups on 64-position tiles");
static_assert((SOFTMAX_SLICES == 1 || SOFTMAX_SLICES == 2) && M_SLICES % SOFTMAX_SLICES == 0,
              "softmax steps of whole m16 slices of a warp's rows");
static_assert(SharedPlan::full % 8 == 0, "mbarrier alignment");
// the host's mirror of this layout (PersistentVariant::shared_bytes) sizes the launch
static_assert(SharedPlan::bytes + SharedPlan::align <= KVS_SHARED_BYTES, "shared memory the host launches with");
static_assert(STAGE_BYTES % 1024 == 0, "every box starts on a swizzle-pattern boundary");
static_assert(STAGES * STAGE_BYTES >= merge_scratch_floor(MERGE_MAX_PIECES, GROUP_PAD),
              "the ring holds a merge slice's chunk of one group (merge.cuh)");
static_assert(SMEM_ROW % 16 == 0 && Q_BYTES % 16 == 0, "bulk copies of query rows: 16-byte aligned");


// ================================ scheduler (scheduler.cuh) ================================
static_assert(sizeof(StartShared) <= SharedPlan::cut_count - SharedPlan::start && sizeof(Piece) <= 48,
              "StartShared and Piece slots");
using Walk = PieceWalk<TILE_TOKENS>;

// ================================ producer ================================================
struct Ring {
    u32 base;    // stage 0
    u32 k_full;  // barriers, 8 bytes apart per stage
    u32 v_full;
    u32 empty;
    u32 q;       // query-row buffer 0
    u32 q_full;  // barriers, 8 bytes apart per buffer
    u32 q_empty;
    __device__ __forceinline__ u32 stage(int s) const { return base + s * STAGE_BYTES; }
};

// Which head of its row query head h of a unit's group (0 ..< p.group) attends: its dims of the
// K and V rows are [part * Q_DIM, (part + 1) * Q_DIM).
__device__ __forceinline__ int row_part(const PersistentParams& p, int h) {
    return HEADS_PER_ROW == 1 ? 0 : (h >= p.group / 2 ? 1 : 0);
}

// A per-head value of the row's head `part` (a select, not a runtime index: that would put the
// array in local memory)
__device__ __forceinline__ float of_part(const float (&per_head)[HEADS_PER_ROW], int part) {
    return HEADS_PER_ROW == 1 || part == 0 ? per_head[0] : per_head[HEADS_PER_ROW - 1];
}

// One thread: the query rows of piece j (columns of its column block, token-major) as one bulk
// copy per row into buffer j % Q_BUFFERS, once the consumers are done with that buffer's
// previous piece. Rows past the block's valid columns are not loaded; their columns are
// computed from whatever the buffer holds and dropped (columns never mix: each is its own
// query row in both MMAs and in the softmax).
__device__ __forceinline__ void load_query_rows(const PersistentParams& p, const Ring& r, const Piece& pc,
                                                int j) {
    const int b = j % Q_BUFFERS;
    if (j >= Q_BUFFERS) mbarrier_wait(r.q_empty + 8 * b, ((j / Q_BUFFERS) - 1) & 1);
    const int kv_head = pc.unit / p.col_blocks, first = (pc.unit % p.col_blocks) * GROUP_PAD;
    const int count = min(GROUP_PAD, p.cols - first);
    const u32 bar = r.q_full + 8 * b, dst = r.q + b * Q_BYTES;
    mbarrier_arrive_expect_tx(bar, count * Q_DIM * 2);
    int token = first / p.group, h = first % p.group;  // of column 0; then stepped
    for (int c = 0; c < count; ++c) {
        const u16* src = reinterpret_cast<const u16*>(p.q) + pc.batch * p.q_batch_stride +
                         (long long)token * p.q_token_stride + (long long)(kv_head * p.group + h) * p.q_head_stride;
        bulk_load(dst + c * SMEM_ROW + row_part(p, h) * Q_DIM * 2, src, Q_DIM * 2, bar);
        if (++h == p.group) {
            h = 0;
            ++token;
        }
    }
}

// The producer's walk over the CTA's pieces, one piece ahead: a piece is handed out only once
// the query rows of the piece after it are on their way (issued by the `issuer` thread).
struct ProducerWalk {
    Walk walk;
    Piece ahead;
    bool more;
    int j = 0;  // pieces whose query rows are on their way

    __device__ __forceinline__ ProducerWalk(const PersistentParams& p, const StartShared& start, const Ring& r,
                                            bool issuer)
        : walk(p, start) {
        more = walk.next(p, ahead);
        issue(p, r, issuer);
    }
    __device__ __forceinline__ void issue(const PersistentParams& p, const Ring& r, bool issuer) {
        if (!more) return;
        if (issuer && !WIDE) load_query_rows(p, r, ahead, j);
        ++j;
    }
    __device__ __forceinline__ bool next(const PersistentParams& p, const Ring& r, bool issuer, Piece& pc) {
        if (!more) return false;
        pc = ahead;
        more = walk.next(p, ahead);
        issue(p, r, issuer);
        return true;
    }
};

// Waits for stage n % STAGES to be free and announces a K and a V tile on its barriers.
__device__ __forceinline__ int acquire_stage(const Ring& r, int n) {
    const int s = n % STAGES;
    if (n >= STAGES) mbarrier_wait(r.empty + 8 * s, ((n / STAGES) - 1) & 1);
    return s;
}

// ================================ L2 warm-up before the PDL wait ==========================
// A CTA's first tiles wait out a DRAM round trip after its schedule is known, which is after the
// PDL wait: the schedule needs the lengths, which the previous kernel may still be writing.
// Prefetches into L2 may start before the wait (the previous kernel's writes land in L2, so
// the loads after it still see them), of tiles guessed without the lengths. A decode step calls
// one decoder once a layer, every layer with the same lengths, so a CTA's first tiles in the
// decoder's previous call are its first ones in this call (from a step's second layer on; the
// first layer's are one position off): each CTA writes them as a hint once its schedule is
// known (write_warm_hint), and the next call's CTA of that index prefetches them
// (warm_hinted_tiles). A hint decides nothing the decode computes: it is read while the
// previous call may still be writing it and clamped to the tensors. Contiguous and strided
// caches only: a page pool's boxes need page ids, and ids read before the wait as hints made
// paged rows slower in the split engine (decode_gqa.cu, "L2 warm-up before the PDL wait").
constexpr int WARM_TILES = 2;

// Producer lane 0, before the PDL wait: the hinted tiles' K and V boxes into L2.
__device__ __forceinline__ void warm_hinted_tiles(const PersistentParams& p) {
    if (PAGED || !p.warm_hints) return;
    const int* hint = p.warm_hints + 4 * blockIdx.x;
    const int batch = ld_global_l2(hint), kv_head = ld_global_l2(hint + 1);
    const int first = ld_global_l2(hint + 2), tiles = min(ld_global_l2(hint + 3), WARM_TILES);
    if (batch < 0 || batch >= p.batch || kv_head < 0 || kv_head >= p.hkv || first < 0 || first >= p.max_len)
        return;
    for (int k = 0; k < tiles; ++k)
#pragma unroll
        for (int box = 0; box < BOXES; ++box) {
            tma_prefetch_l2_4d(&p.k_map, box * Kv::DIMS_PER_BOX, kv_head, first + k * TILE_TOKENS, batch);
            tma_prefetch_l2_4d(&p.v_map, box * Kv::DIMS_PER_BOX, kv_head, first + k * TILE_TOKENS, batch);
        }
}

// Thread 0, once the schedule is known: this call's first tiles as the next call's hint (a CTA
// without work writes a request of -1: nothing to warm).
__device__ __forceinline__ void write_warm_hint(const PersistentParams& p, const StartShared& st) {
    if (PAGED || !p.warm_hints) return;
    Walk walk(p, st);
    Piece pc;
    int4 hint = make_int4(-1, 0, 0, 0);
    if (walk.next(p, pc))
        hint = make_int4(pc.batch, pc.unit / p.col_blocks, pc.tile_begin(pc.first, TILE_TOKENS),
                         min(pc.end - pc.first, WARM_TILES));
    *reinterpret_cast<int4*>(p.warm_hints + 4 * blockIdx.x) = hint;
}

// Contiguous cache (KvSource for KVS_PAGED 0), lane 0: one box per row of head dims per tile.
// Positions past the request's length are loaded too (zeros past max_len, whatever the cache
// holds before it); the consumers mask them.
__device__ __forceinline__ void produce_contiguous(const PersistentParams& p, const Ring& r,
                                                   const StartShared& start, u64 policy) {
    if (TRACE) trace_stamp(TRACE_PRODUCER_READY);
    ProducerWalk walk(p, start, r, true);
    if (TRACE) trace_stamp(TRACE_Q_ISSUED);
    Piece pc;
    int n = 0;
    while (walk.next(p, r, true, pc)) {
        const int kv_head = pc.unit / p.col_blocks;
        for (int k = pc.first; k < pc.end; ++k, ++n) {
            const int s = acquire_stage(r, n);
            const u32 k_dst = r.stage(s), v_dst = k_dst + TILE_BYTES;
            mbarrier_arrive_expect_tx(r.k_full + 8 * s, TILE_BYTES);
#pragma unroll
            for (int box = 0; box < BOXES; ++box)
                tma_load_4d(k_dst + box * BOX_BYTES, &p.k_map, box * Kv::DIMS_PER_BOX, kv_head, pc.tile_begin(k, TILE_TOKENS),
                            pc.batch, r.k_full + 8 * s, policy);
            mbarrier_arrive_expect_tx(r.v_full + 8 * s, TILE_BYTES);
#pragma unroll
            for (int box = 0; box < BOXES; ++box)
                tma_load_4d(v_dst + box * BOX_BYTES, &p.v_map, box * Kv::DIMS_PER_BOX, kv_head, pc.tile_begin(k, TILE_TOKENS),
                            pc.batch, r.v_full + 8 * s, policy);
            if (TRACE && n == 0) trace_stamp(TRACE_FIRST_ISSUE);
        }
    }
    if (TRACE) trace_stamp(TRACE_LAST_ISSUE);
}

// Paged caches, the whole warp: a piece's tiles with the page ids they need. The warp reads a
// piece's page ids a chunk of CHUNK_PAGES at a time (lane i holds pages i, i + 32, ... of the
// chunk) and keeps ID_CHUNKS chunks, so a chunk's table read is issued ID_CHUNKS - 1 chunks
// before its tiles: with pages of 1 a chunk is one tile, and one tile's time does not cover a
// table read while the memory system is saturated (the producer then stalls on the ids). A
// piece's first chunks are read when the producer reaches it, while the ring still holds the
// previous piece's last STAGES tiles. `use_chunk(ids)` runs when a chunk becomes current,
// `issue(stage, kv_head, tile_begin, chunk_page, ids)` once per tile with its stage acquired;
// the warp with `query_rows` also loads the pieces' query rows.
static_assert(CHUNK_PAGES % TILE_TOKENS == 0, "a tile's pages never straddle two chunks");
constexpr int ID_CHUNKS = 4;

// Page ids of pages [first + 32 * i + lane] (i < RUNS_PER_LANE), -1 from `end` on: their boxes
// are out of bounds and arrive zero-filled, their gathered copies are zero-filled (masked by
// the consumers).
__device__ __forceinline__ void load_page_chunk(int (&ids)[RUNS_PER_LANE], const int* table,
                                                int first, int end, int lane) {
#pragma unroll
    for (int i = 0; i < RUNS_PER_LANE; ++i) {
        const int page = first + lane + 32 * i;
        ids[i] = page < end ? ld_global_l2(table + page) : -1;
    }
}

template <class UseChunk, class Issue>
__device__ __forceinline__ void walk_paged_tiles(const PersistentParams& p, const Ring& r,
                                                 const StartShared& start, bool query_rows, UseChunk use_chunk,
                                                 Issue issue) {
    const int lane = threadIdx.x % 32;
    const int shift = __ffs(p.page_size) - 1;
    const bool issuer = query_rows && lane == 0;
    ProducerWalk walk(p, start, r, issuer);
    Piece pc;
    int n = 0;
    while (walk.next(p, r, issuer, pc)) {
        __syncwarp();
        const int kv_head = pc.unit / p.col_blocks;
        const int* table = p.block_table + (long long)pc.batch * p.table_stride;
        const int first_page = pc.tile_begin(pc.first, TILE_TOKENS) >> shift;
        const int end_page = ((min(pc.len, pc.tile_begin(pc.end, TILE_TOKENS)) - 1) >> shift) + 1;
        int ids[ID_CHUNKS][RUNS_PER_LANE];
#pragma unroll
        for (int b = 0; b < ID_CHUNKS; ++b) load_page_chunk(ids[b], table, first_page + b * CHUNK_PAGES, end_page, lane);
        int k = pc.first;
        for (int chunk = 0; k < pc.end; chunk += ID_CHUNKS) {
#pragma unroll
            for (int b = 0; b < ID_CHUNKS; ++b) {
                if (k >= pc.end) break;  // a piece shorter than ID_CHUNKS chunks: none to make current
                const int chunk_page = first_page + (chunk + b) * CHUNK_PAGES;
                use_chunk(ids[b]);
                for (; k < pc.end; ++k, ++n) {
                    const int tile_begin = pc.tile_begin(k, TILE_TOKENS);
                    if ((tile_begin >> shift) >= chunk_page + CHUNK_PAGES) break;
                    issue(acquire_stage(r, n), kv_head, tile_begin, chunk_page, ids[b]);
                }
                load_page_chunk(ids[b], table, first_page + (chunk + b + ID_CHUNKS) * CHUNK_PAGES, end_page, lane);
            }
        }
    }
}

// Paged cache by TMA boxes (KvSource for KVS_PAGED 1, KVS_GATHER 0): a tile is
// TILE_TOKENS / run runs of `run` = min(page, tile) positions; the lane holding a run's page id
// issues its boxes.
__device__ __forceinline__ void produce_paged(const PersistentParams& p, const Ring& r,
                                              const StartShared& start, u64 policy) {
    const int lane = threadIdx.x % 32;
    const int shift = __ffs(p.page_size) - 1;
    const int run = min(p.page_size, TILE_TOKENS);
    const int runs = TILE_TOKENS / run;
    const int in_page_mask = p.page_size - 1;
    walk_paged_tiles(
        p, r, start, true, [](const int (&)[RUNS_PER_LANE]) {},
        [&](int s, int kv_head, int tile_begin, int chunk_page, const int (&ids)[RUNS_PER_LANE]) {
            const int tile_page = tile_begin >> shift;  // page of the tile's first run
            const u32 dst[2] = {r.stage(s), r.stage(s) + TILE_BYTES};
            const u32 bar[2] = {r.k_full + 8 * s, r.v_full + 8 * s};
            const TensorMap* map[2] = {&p.k_map, &p.v_map};
#pragma unroll
            for (int kv = 0; kv < 2; ++kv) {  // K, then V
                if (lane == 0) mbarrier_arrive_expect_tx(bar[kv], TILE_BYTES);
                __syncwarp();
#pragma unroll
                for (int i = 0; i < RUNS_PER_LANE; ++i) {
                    const int rr = chunk_page + lane + 32 * i - tile_page;  // this lane's run
                    if (rr < 0 || rr >= runs) continue;
                    const int in_page = (tile_begin + rr * run) & in_page_mask;
#pragma unroll
                    for (int box = 0; box < BOXES; ++box)
                        tma_load_4d(dst[kv] + box * BOX_BYTES + rr * run * Kv::ROW_BYTES, map[kv], box * Kv::DIMS_PER_BOX,
                                    kv_head, in_page, ids[i], bar[kv], policy);
                }
            }
        });
}

// Paged cache gathered (KvSource for KVS_GATHER 1), every producer warp: pages too small for
// boxes to pay (one descriptor per page run and row of head dims, issued by one lane) are copied in
// 16-byte chunks by every lane, ROW_CHUNKS lanes per position so that each copy instruction
// reads whole rows, into the same swizzled tile the boxes fill. Producer warp w copies
// positions [w, w + 1) x GATHER_WARP_POSITIONS of every tile: one warp alone cannot issue
// copies as fast as HBM delivers them. Each warp keeps the current chunk's page ids in shared
// memory and, per tile, turns them into its positions' rows in the pool (-1 past the pages),
// so that a copy costs one shared load and one multiply. A lane's K copies arrive on k_full
// once they have landed, then its V copies on v_full.
constexpr int GATHER_WARP_POSITIONS = TILE_TOKENS / PRODUCER_WARPS;
constexpr int GATHER_ROWS = 32 / Kv::ROW_CHUNKS;                   // positions per warp-wide copy
constexpr int GATHER_COPIES = GATHER_WARP_POSITIONS / GATHER_ROWS;  // per lane per tile, K or V
constexpr int GATHER_PARTS = Kv::SWIZZLE_ROWS / GATHER_ROWS;        // a lane's swizzled row offsets
// (rows of 24 chunks, paired d 96 heads, are not gathered: their page runs are whole boxes)
static_assert(!GATHER || (32 % Kv::ROW_CHUNKS == 0 && Kv::SWIZZLE_ROWS % GATHER_ROWS == 0), "gather lanes");
static_assert(!GATHER || GATHER_WARP_POSITIONS % Kv::SWIZZLE_ROWS == 0, "a warp's share starts a swizzle period");

__device__ __forceinline__ void produce_gathered(const PersistentParams& p, const Ring& r,
                                                 const StartShared& start, u64 policy, int w, int* page_ids,
                                                 int* pool_rows) {
    const int lane = threadIdx.x % 32;
    const int shift = __ffs(p.page_size) - 1;
    const int in_page_mask = p.page_size - 1;
    const int row = lane / Kv::ROW_CHUNKS, c = lane % Kv::ROW_CHUNKS;  // lane's position, chunk
    const u32 row_bytes = p.hkv * HEAD_DIM * Kv::ELEM_BYTES;          // one pool position
    const int first = w * GATHER_WARP_POSITIONS;                     // this warp's positions
    // copy i lands at stage + part[i % GATHER_PARTS] + (i / GATHER_PARTS) * SWIZZLE_BYTES
    u32 part[GATHER_PARTS];
#pragma unroll
    for (int j = 0; j < GATHER_PARTS; ++j) part[j] = first * Kv::ROW_BYTES + Kv::row_part(j * GATHER_ROWS + row, c);
    const int* my_rows = pool_rows + row;  // copy i reads my_rows[i * GATHER_ROWS]
    walk_paged_tiles(
        p, r, start, w == 0,
        [&](const int (&ids)[RUNS_PER_LANE]) {
            __syncwarp();  // every lane is done with the previous chunk's ids
#pragma unroll
            for (int i = 0; i < RUNS_PER_LANE; ++i) page_ids[lane + 32 * i] = ids[i];
            __syncwarp();
        },
        [&](int s, int kv_head, int tile_begin, int chunk_page, const int (&)[RUNS_PER_LANE]) {
            // this warp's pool rows of the tile, once every lane is done with the previous
            // tile's; -1 (zeros) past the pages and for ids outside the pools, which the boxes
            // would zero-fill too. A pool row fits an int: 2^31 rows of >= 64 bytes exceed
            // any GPU's memory.
            __syncwarp();
#pragma unroll
            for (int i = 0; i < (GATHER_WARP_POSITIONS + 31) / 32; ++i) {
                const int e = lane + 32 * i;
                if (GATHER_WARP_POSITIONS % 32 != 0 && e >= GATHER_WARP_POSITIONS) break;
                const int pos = tile_begin + first + e;
                const int id = page_ids[(pos >> shift) - chunk_page];
                pool_rows[e] = (u32)id < (u32)p.num_pages ? (id << shift) | (pos & in_page_mask) : -1;
            }
            __syncwarp();
            // a padded row's chunks past the head dim are not copied (nothing reads them)
            const bool data = c < Kv::DATA_CHUNKS;
            const u64 head_bytes =
                ((u64)kv_head * HEAD_DIM + min(c, Kv::DATA_CHUNKS - 1) * Kv::CHUNK_ELEMS) * Kv::ELEM_BYTES;
            const u64 pools[2] = {reinterpret_cast<u64>(p.k_cache) + head_bytes,
                                  reinterpret_cast<u64>(p.v_cache) + head_bytes};
            const u32 bars[2] = {r.k_full + 8 * s, r.v_full + 8 * s};
#pragma unroll
            for (int kv = 0; kv < 2; ++kv) {  // K, then V
                const u32 tile = r.stage(s) + kv * TILE_BYTES;
#pragma unroll
                for (int i = 0; i < GATHER_COPIES; ++i) {
                    const int pool_row = my_rows[i * GATHER_ROWS];
                    const u64 src = pools[kv] + (u64)(u32)max(pool_row, 0) * row_bytes;
                    cp_async_16(tile + part[i % GATHER_PARTS] + (i / GATHER_PARTS) * Kv::SWIZZLE_BYTES,
                                reinterpret_cast<const void*>(src), pool_row >= 0 && data ? 16 : 0, policy);
                }
                cp_async_arrive_noinc(bars[kv]);
            }
        });
}

// ================================ query rows (columns) =====================================
// Column c of a piece is query row (token i, head h) of its KV head with
// col_block * GROUP_PAD + c = i * group + h (token-major). Single-token decode works every row
// out from its head index; multi-token decode fills per-column tables once per piece (a runtime
// division by the group size per element would be too slow).
struct Columns {
    int count;          // valid columns (<= GROUP_PAD)
    bool single_token;  // q_len == 1: column c is head first_head + c of token 0
    int batch, first_head, first_col, len;
    VisibleRange token0;  // single token: what every column sees
    const long long* out_off;
    const long long* out_row;
    const int* visible_len;
    const int* visible_low;

    __device__ __forceinline__ long long row(const PersistentParams& p, int c) const {
        return single_token ? (long long)batch * p.hq + first_head + c : out_row[c];
    }
    __device__ __forceinline__ u16* out(const PersistentParams& p, int c) const {
        return reinterpret_cast<u16*>(p.out) +
               (single_token ? batch * p.o_batch_stride + (long long)(first_head + c) * p.o_head_stride
                             : out_off[c]);
    }
    // Cache positions column c may see: [low(c), visible(c)) (score_mods.cuh, visible_range).
    __device__ __forceinline__ int visible(int c) const { return single_token ? token0.high : visible_len[c]; }
    __device__ __forceinline__ int low(int c) const { return single_token ? token0.low : visible_low[c]; }
    // The query head of column c (of any valid column)
    __device__ __forceinline__ int head(const PersistentParams& p, int c) const {
        return single_token ? first_head + c : (int)(out_row[c] % p.hq);
    }
    // The head of its row column c attends (row_part)
    __device__ __forceinline__ int part(const PersistentParams& p, int c) const {
        return HEADS_PER_ROW == 1 ? 0 : row_part(p, (first_col + c) % p.group);
    }
};

__device__ __forceinline__ Columns piece_columns(const PersistentParams& p, const Piece& pc,
                                                 unsigned char* smem) {
    const int kv_head = pc.unit / p.col_blocks, first_col = (pc.unit % p.col_blocks) * GROUP_PAD;
    return {min(GROUP_PAD, p.cols - first_col), p.q_len == 1, pc.batch, kv_head * p.group + first_col, first_col,
            pc.len,
            visible_range(pc.len, 1, 0, p.window_left, p.window_right),
            reinterpret_cast<long long*>(smem + SharedPlan::col_out),
            reinterpret_cast<long long*>(smem + SharedPlan::col_row),
            reinterpret_cast<int*>(smem + SharedPlan::col_visible),
            reinterpret_cast<int*>(smem + SharedPlan::col_low)};
}

// Multi-token tables (threads 0 .. GROUP_PAD - 1; the caller synchronises).
__device__ __forceinline__ void fill_columns(const PersistentParams& p, const Piece& pc,
                                             unsigned char* smem) {
    const int c = threadIdx.x;
    if (c >= GROUP_PAD) return;
    const int kv_head = pc.unit / p.col_blocks, first = (pc.unit % p.col_blocks) * GROUP_PAD;
    const int row = first + c < p.cols ? first + c : 0;
    const int token = row / p.group;
    const int head = kv_head * p.group + row % p.group;
    reinterpret_cast<long long*>(smem + SharedPlan::col_out)[c] =
        pc.batch * p.o_batch_stride + token * p.o_token_stride + head * p.o_head_stride;
    reinterpret_cast<long long*>(smem + SharedPlan::col_row)[c] = ((long long)pc.batch * p.q_len + token) * p.hq + head;
    const VisibleRange seen = visible_range(pc.len, p.q_len, token, p.window_left, p.window_right);
    reinterpret_cast<int*>(smem + SharedPlan::col_visible)[c] = seen.high;
    reinterpret_cast<int*>(smem + SharedPlan::col_low)[c] = seen.low;
}

// ================================ epilogue =================================================
// The one place where a softmax state (max m in base 2, denominator l, unnormalised O) becomes
// output: O v_scale / l in the output dtype, LSE = (m + log2 l) ln 2, the column's sink joining
// the denominator where there are sinks (score_mods.cuh); l = 0 (nothing visible) gives 0 and
// -inf (or the sink), never NaN.
__device__ __forceinline__ void store_normalised(const PersistentParams& p, const Columns& cols, int g,
                                                 int d, float4 o, float m, float l, float v_scale) {
    const Normalised n = normalise(m, l, v_scale, p.sinks ? sink_log2(p.sinks, cols.head(p, g)) : neg_inf());
    const float inv = n.factor;
    *reinterpret_cast<uint2*>(cols.out(p, g) + d) =
        make_uint2(pack_half2<IS_F16>(o.x * inv, o.y * inv), pack_half2<IS_F16>(o.z * inv, o.w * inv));
    if (p.lse && d == 0) p.lse[cols.row(p, g)] = n.lse;
}

// This CTA's slice of the cut unit of `batch`, `unit` whose tiles are [start, start + tiles) of
// the sequence (merge.cuh), once every piece of it is parked; the column tables (multi-token)
// are the unit's for it. At the end of the kernel, twice at most.
__device__ __forceinline__ void merge_cut_unit(const PersistentParams& p, const Schedule& s, const Piece& u,
                                               int lane, unsigned char* smem) {
    const CutPieces pieces(p, s, u.start, u.tiles, lane);
    int* counters = unit_counters(p, u.batch, u.unit);
    const Columns cols = piece_columns(p, u, smem);
    named_barrier_sync(1, CONSUMER_THREADS);  // the tables are free
    if (!cols.single_token) fill_columns(p, u, smem);
    wait_until_parked<CONSUMER_THREADS>(counters, pieces.count, TRACE_ALL_PARKED);
    const bool first = TRACE && threadIdx.x == 0 && !trace_stamped(TRACE_MERGE_START);
    if (first) trace_stamp(TRACE_MERGE_START);
    const int kv_head = u.unit / p.col_blocks;
    float v_scale[HEADS_PER_ROW];
#pragma unroll
    for (int r = 0; r < HEADS_PER_ROW; ++r)
        v_scale[r] = kv_scale<KV_FP8>(p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride, u.batch,
                                      kv_head * HEADS_PER_ROW + r);
    // (the ring is idle: the merges come after the CTA's last tile)
    merge_slice<Q_DIM, GROUP_PAD, CONSUMER_THREADS>(
        p, pieces, lane_place(p) - pieces.c0, cols.count, smem + SharedPlan::ring, STAGES * STAGE_BYTES,
        [&](int g, int d, const MergeState& st) {
            store_normalised(p, cols, g, d, st.o, st.m, st.l, of_part(v_scale, cols.part(p, g)));
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
        for (int i = threadIdx.x; i < rows * (Q_DIM / 8); i += CONSUMER_THREADS) {
            const int r = i / (Q_DIM / 8), e = (i % (Q_DIM / 8)) * 8;
            const int token = r / p.hq, head = r % p.hq;
            u16* o = reinterpret_cast<u16*>(p.out) + b * p.o_batch_stride + token * p.o_token_stride +
                     head * p.o_head_stride + e;
            *reinterpret_cast<uint4*>(o) = make_uint4(0, 0, 0, 0);
        }
        if (p.lse)
            for (int r = threadIdx.x; r < rows; r += CONSUMER_THREADS)
                p.lse[(long long)b * rows + r] = p.sinks ? ld_global_l2(p.sinks + r % p.hq) : neg_inf();
    }
}

// ================================ wide consumer ============================================
// Column blocks of 64 or 128 query rows (KVS_N_TILES 8 or 16) where a KV head has more than 32
// (large multi-token groups: the op is compute-bound there, and the narrow consumer re-reads its
// rows from shared memory on every tile). Blocks of 64: warpgroup g (warps 4 g .. 4 g + 3)
// takes the tiles of group g as the four-warp groups of the narrow consumer do; blocks of 128
// (2-byte caches): both warpgroups take every tile, warpgroup g rows 64 g .. 64 g + 63, so a
// tile is read once for all of them and both release its stage. Either way a warpgroup keeps
// its own online softmax over whole rows:
//   S = Q K^T    64 rows x 64 positions (m64n64k16 over the head dims), both operands in shared
//                memory: the rows as the consumers staged them, K as the ring holds it;
//   softmax      thread t (warp w of its warpgroup, lane l) holds rows r0 = 16 w + l / 4 and
//                r0 + 8 (the accumulator layout, wgmma.cuh): a row's max and sum are four
//                lanes' (two shuffles);
//   O += P V     P packed in pairs from the S accumulator is the A fragment (no trip through
//                shared memory), V the ring's tile as the N-major B operand.
// Positions outside [unit_low, len) of a masked tile get P = 0, and their V rows are cleared in
// shared memory first (they may hold anything, and 0 x NaN = NaN). An e4m3 cache: the tile is
// widened into f16 K and V tiles (exact; those positions as zeros; see WIDE_STAGING for whose),
// the stage handed back at once, and both products read the f16 tiles, with the query
// rows staged in f16 too (the MMAs' type, as in the narrow consumer). The epilogue merges the
// tile groups' states of each row (EPI_PARTS: two on blocks of 64, one on blocks of 128) in the
// narrow consumer's scratch.
// (sized by its own constants, so that every variant compiles it; only wide ones call it)
constexpr int WG_THREADS = 128;
constexpr int WIDE_TOKENS = 64;                 // = TILE_TOKENS of a wide variant
constexpr int WIDE_S_REGS = WIDE_TOKENS / 2;    // 64 rows x 64 positions f32 over a warpgroup
constexpr int WIDE_O_REGS = HEAD_DIM / 2;       // 64 rows x HEAD_DIM f32
constexpr int WIDE_K_STEPS = WIDE_TOKENS / 16;  // k16 steps of P V
static_assert(!WIDE || TILE_TOKENS == WIDE_TOKENS, "wide tiles");
// a box of a 2-byte (or widened) tile: 64 positions x 128 bytes
constexpr int WIDE_BOX = WideTile::BOX_BYTES;
// a box of the staged query rows: the block's rows x 128 bytes (a warpgroup's 64 start at row
// 64 x its row group)
constexpr int Q_BOX = GROUP_PAD * 128;
static_assert(WIDE_BOX == 64 * 128, "64-position tiles of 128-byte rows");
// the threads that share each tile: one warpgroup, or both where they split the rows
constexpr int TILE_THREADS = WG_THREADS * WIDE_ROW_GROUPS;
static_assert(!WIDE || KV_FP8 || BOX_BYTES == WIDE_BOX, "2-byte wide tiles are read in place");

// e4m3: the ring's tile (K then V) widened to f16 into `dst` (K tile, then V tile), by the
// TILE_THREADS threads that read the tile (index `thread`); positions outside [below, from) as
// zeros.
__device__ __forceinline__ void widen_wide_tile(u32 src, u32 dst, int below, int from, int thread) {
    constexpr int CHUNKS = HEAD_DIM / 16;  // 16-byte e4m3 chunks a position
    for (int i = thread; i < WIDE_TOKENS * CHUNKS; i += TILE_THREADS) {
        const int t = i / CHUNKS, c = i % CHUNKS;
        const bool keep = t >= below && t < from;
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
            u32 in[4] = {0u, 0u, 0u, 0u};
            if (keep) ld_shared_v4(in, Kv::Rows::chunk(src + kv * TILE_BYTES, t, c));
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // 8 e4m3 bytes -> one 16-byte chunk of f16
                u32 out[4];
                e4m3x4_to_f16x2(in[2 * h], out[0], out[1]);
                e4m3x4_to_f16x2(in[2 * h + 1], out[2], out[3]);
                st_shared_v4(WideTile::Rows::chunk(dst + kv * WideTile::TILE_BYTES, t, 2 * c + h), out);
            }
        }
    }
}

// (a template, so that only the head dim's MMA is instantiated)
template <int D>
__device__ __forceinline__ void wgmma_pv(float (&o)[D / 2], const u32 (&a)[4], u64 v_desc) {
    if constexpr (D == 128) {
        wgmma_m64n128k16_rs<MMA_F16, 1>(o, a, v_desc, true);
    } else if constexpr (D == 64) {
        wgmma_m64n64k16_rs<MMA_F16, 1>(o, a, v_desc, true);
    }
}

// The block's query rows (columns, token-major) as the A operand of S = Q K^T (the layout of
// a widened tile: rows of 128 bytes, 64 dims a box), f16 for an e4m3 cache's MMAs; rows past the
// block's valid columns are zeros.
__device__ __forceinline__ void stage_query_rows_wide(const PersistentParams& p, const Piece& pc, const Columns& cols,
                                                      u32 q_base) {
    const int kv_head = pc.unit / p.col_blocks;
    stage_rows_sw128<GROUP_PAD, HEAD_DIM, CONSUMER_THREADS, MMA_F16 && !IS_F16>(
        q_base, cols.count,
        [&](int r) {
            const int row = cols.first_col + r, token = row / p.group, h = row % p.group;
            return reinterpret_cast<const u16*>(p.q) + pc.batch * p.q_batch_stride +
                   (long long)token * p.q_token_stride + (long long)(kv_head * p.group + h) * p.q_head_stride;
        },
        l2_policy_evict_last());  // every piece of a cut unit reads the rows
}

// One piece on the wide consumer, up to its warpgroups' states parked in the epilogue scratch
// (warp_m / warp_l [part][row], merge [part][row][dim]) for the shared epilogue.
__device__ __forceinline__ void consume_wide_piece(const PersistentParams& p, const Piece& pc, const Columns& cols,
                                                   unsigned char* smem, int n0, float score_scale) {
    u64* k_full = reinterpret_cast<u64*>(smem + SharedPlan::full);
    u64* v_full = k_full + STAGES;
    u64* empty = reinterpret_cast<u64*>(smem + SharedPlan::empty);
    float* warp_m = reinterpret_cast<float*>(smem + SharedPlan::warp_m);
    float* warp_l = reinterpret_cast<float*>(smem + SharedPlan::warp_l);
    float* merge = reinterpret_cast<float*>(smem + SharedPlan::merge);
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / WG_THREADS, 0);  // warp-uniform for ptxas
    const int me = threadIdx.x % WG_THREADS;
    const int tile_group = wg / WIDE_ROW_GROUPS;            // the tiles it takes
    const int row_base = (wg % WIDE_ROW_GROUPS) * 64;       // the block's rows it holds
    const int tile_thread = (wg % WIDE_ROW_GROUPS) * WG_THREADS + me;  // of TILE_THREADS
    const int lane = threadIdx.x % 32;
    const int r0 = 16 * (me / 32) + lane / 4;  // and r0 + 8
    const int pair = 2 * (lane % 4);           // first of the two accumulator columns of an n8 tile
    const u32 ring_base = smem_addr(smem + SharedPlan::ring);
    const u32 q_base = smem_addr(smem + SharedPlan::q);

    // (the previous piece's products are done: both warpgroups waited for them before the
    // epilogue's barriers)
    stage_query_rows_wide(p, pc, cols, q_base);
    fence_proxy_async_shared();
    named_barrier_sync(1, CONSUMER_THREADS);
    if (TRACE && threadIdx.x == 0 && n0 == 0) trace_stamp(TRACE_Q_STAGED);
    // K-major operands (Q, K): a k16 step is 32 bytes along the row, a box 64 k further
    const u64 q_desc = smem_desc_sw128(q_base + row_base * 128, 16, 1024);

    float o[WIDE_O_REGS];
#pragma unroll
    for (int i = 0; i < WIDE_O_REGS; ++i) o[i] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    int low[2], high[2];  // positions each of the thread's rows sees: [low, high)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = row_base + r0 + 8 * i;
        high[i] = r < cols.count ? cols.visible(r) : pc.len;
        low[i] = r < cols.count ? cols.low(r) : 0;
    }
    const bool capped = p.softcap_log2 > 0.f;
    const VisibleRange first_token = visible_range(pc.len, p.q_len, 0, p.window_left, p.window_right);
    const int unit_low = first_token.low;
    const int last_low = visible_range(pc.len, p.q_len, p.q_len - 1, p.window_left, p.window_right).low;

    // ---- one tile, in three steps: its S issued, its softmax, its P V issued ----
    struct TileAt {
        int n, stage, tile_begin, below, from;  // below / from: its positions outside [unit_low, len)
        u32 parity, ring_tile, k_tile, v_tile;   // the ring's tile; the tiles the MMAs read
        bool masked;
    };
    auto tile_at = [&](int k) {
        TileAt t;
        t.n = n0 + k - pc.first;
        t.stage = t.n % STAGES;
        t.parity = (t.n / STAGES) & 1;
        t.tile_begin = pc.tile_begin(k, TILE_TOKENS);
        t.masked = t.tile_begin + TILE_TOKENS > first_token.high || t.tile_begin < last_low;
        t.below = min(max(unit_low - t.tile_begin, 0), TILE_TOKENS);
        t.from = max(min(pc.len - t.tile_begin, TILE_TOKENS), 0);
        t.ring_tile = ring_base + t.stage * STAGE_BYTES;
        // e4m3: the f16 copy the MMAs read
        const int copy = WIDE_ROW_GROUPS == 1 ? wg : t.n % 2;
        t.k_tile = KV_FP8 ? ring_base + SharedPlan::staging + copy * 2 * WideTile::TILE_BYTES : t.ring_tile;
        t.v_tile = t.k_tile + (KV_FP8 ? WideTile::TILE_BYTES : TILE_BYTES);
        return t;
    };
    // S = Q K^T into `sc` once K has landed (e4m3: the tile first widened into its f16 copy,
    // which no P V reads any more, and the stage handed back at once)
    auto issue_scores = [&](float (&sc)[WIDE_S_REGS], const TileAt& t) {
        mbarrier_wait(&k_full[t.stage], t.parity);
        if (TRACE && t.n == 0 && threadIdx.x == 0) trace_stamp(TRACE_FIRST_TILE);
        if constexpr (KV_FP8) {
            mbarrier_wait(&v_full[t.stage], t.parity);
            widen_wide_tile(t.ring_tile, t.k_tile, t.below, t.from, tile_thread);
            fence_proxy_async_shared();
            mbarrier_arrive(&empty[t.stage]);
            named_barrier_sync(2 + tile_group, TILE_THREADS);
        }
        const u64 k_desc = smem_desc_sw128(t.k_tile, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D_TILES; ++kk)
            wgmma_m64n64k16<MMA_F16, 0>(sc, q_desc + (((kk / 4) * Q_BOX + (kk % 4) * 32) >> 4),
                                        k_desc + (((kk / 4) * WIDE_BOX + (kk % 4) * 32) >> 4), kk > 0);
        wgmma_commit();
    };
    // The online softmax of rows r0, r0 + 8 (base 2) over a tile's scores, in named steps: the
    // rows' new maxima and the factor `alpha` that takes the running state to them (l rescaled
    // here, O by rescale_o); the exponentials and their sums; P packed as the A fragments of the
    // k16 steps over positions (n8 tiles 2 ks and 2 ks + 1).
    u32 pa[WIDE_K_STEPS][4];
    float m_use[2];
    auto softmax_max = [&](float (&sc)[WIDE_S_REGS], const TileAt& t, float (&alpha)[2]) {
#pragma unroll
        for (int e = 0; e < WIDE_S_REGS; ++e) {
            const float u = sc[e] * score_scale;
            sc[e] = capped ? softcap(u, p.softcap_scale, p.softcap_log2) : u;
        }
        if (t.masked) {
#pragma unroll
            for (int j = 0; j < WIDE_TOKENS / 8; ++j)
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int pos = t.tile_begin + 8 * j + pair + c;
                        if (pos < low[i] || pos >= high[i]) sc[4 * j + 2 * i + c] = neg_inf();
                    }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = neg_inf();
#pragma unroll
            for (int j = 0; j < WIDE_TOKENS / 8; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * i], sc[4 * j + 2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_run[i], mx);
            // a row that has seen only masked positions keeps m = -inf: subtract 0 then
            m_use[i] = m_new == neg_inf() ? 0.f : m_new;
            alpha[i] = exp2_approx(m_run[i] - m_use[i]);
            m_run[i] = m_new;
            l_run[i] *= alpha[i];
        }
    };
    auto rescale_o = [&](const float (&alpha)[2]) {
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
            o[4 * j] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
    };
    auto softmax_exp = [&](float (&sc)[WIDE_S_REGS]) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < WIDE_TOKENS / 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    float& v = sc[4 * j + 2 * i + c];
                    v = exp2_approx(v - m_use[i]);
                    sum += v;
                }
            l_run[i] += sum;  // this lane's positions; the epilogue adds the others
        }
    };
    auto pack_p = [&](const float (&sc)[WIDE_S_REGS]) {
#pragma unroll
        for (int ks = 0; ks < WIDE_K_STEPS; ++ks)
#pragma unroll
            for (int q = 0; q < 4; ++q) pa[ks][q] = pack_half2<MMA_F16>(sc[8 * ks + 2 * q], sc[8 * ks + 2 * q + 1]);
    };
    // O += P V once V has landed; a masked tile's V rows outside [below, from) cleared first
    // (whole 128-byte rows: the swizzle moves chunks within a row), by every thread that reads
    // the tile (uniform: a tile's mask)
    auto issue_pv = [&](const TileAt& t) {
        if (!KV_FP8) mbarrier_wait(&v_full[t.stage], t.parity);
        if (!KV_FP8 && t.masked && (t.below > 0 || t.from < TILE_TOKENS)) {
            unsigned char* v_rows = smem + SharedPlan::ring + t.stage * STAGE_BYTES + TILE_BYTES;
            for (int i = tile_thread; i < BOXES * TILE_TOKENS * 8; i += TILE_THREADS) {
                const int box = i / (8 * TILE_TOKENS), pos = (i / 8) % TILE_TOKENS;
                if (pos < t.below || pos >= t.from)
                    *reinterpret_cast<uint4*>(v_rows + box * WIDE_BOX + pos * 128 + (i % 8) * 16) = make_uint4(0, 0, 0, 0);
            }
            fence_proxy_async_shared();
            named_barrier_sync(2 + tile_group, TILE_THREADS);
        }
        // V N-major: rows are positions (8 of them 1024 bytes apart), 64 dims a box
        const u64 v_desc = smem_desc_sw128(t.v_tile, WIDE_BOX, 1024);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < WIDE_K_STEPS; ++ks) wgmma_pv<HEAD_DIM>(o, pa[ks], v_desc + ((ks * 16 * 128) >> 4));
        wgmma_commit();
    };
    // every lane hands the tile's stage back once its products have read it (e4m3: done at
    // the widening)
    auto release = [&](const TileAt& t) {
        if (!KV_FP8) mbarrier_arrive(&empty[t.stage]);
    };

    const int first = pc.first + ((tile_group - n0) % TILE_GROUPS + TILE_GROUPS) % TILE_GROUPS;
    // each product waited for before the next step (a score set held across a step, to run a
    // tile's softmax under the previous P V, makes ptxas serialise every product; bench/NOTES.md)
    for (int k = first; k < pc.end; k += TILE_GROUPS) {
        const TileAt t = tile_at(k);
        float sc[WIDE_S_REGS], alpha[2];
        issue_scores(sc, t);
        wgmma_wait<0>();
        wgmma_hold(sc);
        softmax_max(sc, t, alpha);
        rescale_o(alpha);
        softmax_exp(sc);
        pack_p(sc);
        issue_pv(t);
        wgmma_wait<0>();
        wgmma_hold(o);
        release(t);
    }

    // ---- the warpgroup's states into the epilogue scratch ----
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
    }
    if (lane % 4 == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            warp_m[tile_group * GROUP_PAD + row_base + r0 + 8 * i] = m_run[i];
            warp_l[tile_group * GROUP_PAD + row_base + r0 + 8 * i] = l_run[i];
        }
    }
    named_barrier_sync(1, CONSUMER_THREADS);
    // each warpgroup rescales its O to the CTA-wide max of the row and parks it
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = row_base + r0 + 8 * i;
        float m_cta = neg_inf();
#pragma unroll
        for (int w = 0; w < EPI_PARTS; ++w) m_cta = fmaxf(m_cta, warp_m[w * GROUP_PAD + row]);
        const float m_use = m_cta == neg_inf() ? 0.f : m_cta;
        const float factor = exp2_approx(m_run[i] - m_use);
        float* dst = merge + tile_group * MERGE_WARP_FLOATS + row * MERGE_ROW + pair;
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j)
            *reinterpret_cast<float2*>(dst + 8 * j) =
                make_float2(o[4 * j + 2 * i] * factor, o[4 * j + 2 * i + 1] * factor);
    }
    named_barrier_sync(1, CONSUMER_THREADS);
}

}  // namespace kvs

using namespace kvs;

// The scheduler role as a function of its own: inlined into the consumer warps' code, its
// registers made ptxas spill the paired-softmax variants (two consumer groups at 168 registers).
// It runs once a CTA, before any tile is issued.
__device__ __noinline__ void schedule_apart(const PersistentParams& p, StartShared* out) {
    schedule_start<TILE_TOKENS>(p, out, TRACE_LENGTHS, TRACE_START_WRITTEN);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) kvs_decode(const __grid_constant__ PersistentParams p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((SharedPlan::align - smem_addr(smem_raw) % SharedPlan::align) %
                                      SharedPlan::align);
    u64* k_full = reinterpret_cast<u64*>(smem + SharedPlan::full);
    u64* v_full = k_full + STAGES;
    u64* empty = reinterpret_cast<u64*>(smem + SharedPlan::empty);
    u64* q_full = reinterpret_cast<u64*>(smem + SharedPlan::q_full);
    u64* q_empty = reinterpret_cast<u64*>(smem + SharedPlan::q_empty);
    float* warp_m = reinterpret_cast<float*>(smem + SharedPlan::warp_m);
    float* warp_l = reinterpret_cast<float*>(smem + SharedPlan::warp_l);
    StartShared* start = reinterpret_cast<StartShared*>(smem + SharedPlan::start);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (TRACE && threadIdx.x == 0) {
        trace_clear();
        trace_stamp(TRACE_ENTRY);
    }

    // Tensor maps are kernel parameters, never written by the previous kernel: their descriptor
    // fetch may overlap its tail.
    if (threadIdx.x == PRODUCER_WARP * 32) {
        prefetch_tensor_map(&p.k_map);
        prefetch_tensor_map(&p.v_map);
        warm_hinted_tiles(p);
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&k_full[s], GATHER ? 32 * PRODUCER_WARPS : 1);
            mbarrier_init(&v_full[s], GATHER ? 32 * PRODUCER_WARPS : 1);
            mbarrier_init(&empty[s], 32 * GROUP_WARPS * WIDE_ROW_GROUPS);  // every group the stage feeds
        }
        for (int b = 0; b < Q_BUFFERS; ++b) {
            mbarrier_init(&q_full[b], 1);
            mbarrier_init(&q_empty[b], CONSUMER_THREADS);
        }
        fence_mbarrier_init();
        *reinterpret_cast<int*>(smem + SharedPlan::cut_count) = 0;
    }
    // Nothing below may read global memory the previous kernel writes before it has finished.
    pdl_wait_for_producer();
    pdl_release_dependents();
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_WAITED);
    if (warp == 0) schedule_apart(p, start);
    if constexpr (HEADS_PER_ROW > 1) {
        // the other head's half of every query row: zero for good (the bulk copies write only
        // their own half, and a column slot keeps its half on every piece)
        for (int i = threadIdx.x; i < Q_BUFFERS * Q_BYTES / 16; i += THREADS)
            *reinterpret_cast<uint4*>(smem + SharedPlan::q + 16 * i) = make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_SCHEDULED);
    const StartShared st = *start;
    const Schedule sched = st.schedule();

    if (p.schedule_log && threadIdx.x == 0) record_schedule<TILE_TOKENS>(p, st);
    if (threadIdx.x == 0) write_warm_hint(p, st);

    if (warp >= PRODUCER_WARP) {
        // ================================ producer warp(s) ================================
        const Ring ring = {smem_addr(smem + SharedPlan::ring), smem_addr(k_full), smem_addr(v_full),
                           smem_addr(empty), smem_addr(smem + SharedPlan::q), smem_addr(q_full),
                           smem_addr(q_empty)};
        // column lanes read every tile once per lane: L2 keeps it for the others
        const bool shared_tiles = p.lanes > 1 && p.col_blocks > 1;
        const u64 policy = KV_L2 == 2                  ? l2_policy_evict_last()
                           : KV_L2 == 1 || shared_tiles ? l2_policy_evict_normal()
                                                        : l2_policy_evict_first();
        if constexpr (GATHER) {
            const int w = warp - PRODUCER_WARP;
            produce_gathered(p, ring, st, policy, w,
                             reinterpret_cast<int*>(smem + SharedPlan::page_ids) + w * CHUNK_PAGES,
                             reinterpret_cast<int*>(smem + SharedPlan::pool_rows) + w * GATHER_WARP_POSITIONS);
        } else if constexpr (PAGED) {
            produce_paged(p, ring, st, policy);
        } else if (lane == 0) {
            produce_contiguous(p, ring, st, policy);
        }
        return;
    }

    // ================================= consumer warps ======================================
    const int group = warp / GROUP_WARPS;
    const int row0 = (warp % GROUP_WARPS) * ROWS_PER_WARP;  // first row of this warp in a tile
    const u32 q_base0 = smem_addr(smem + SharedPlan::q);
    const u32 ring_base = smem_addr(smem + SharedPlan::ring);
    float* merge = reinterpret_cast<float*>(smem + SharedPlan::merge);
    // ldmatrix lane addressing of Q as the col B operand, two k-steps (K and V^T: kv_format.cuh)
    const int q_row = lane % 8, q_col = (lane / 8) * 8;

    Walk walk(p, st);
    Piece pc;
    int n0 = 0;  // the CTA's tiles before this piece
    int pieces_done = 0;
    while (walk.next(p, pc)) {
        const Columns cols = piece_columns(p, pc, smem);
        // The previous piece's epilogue is done with the tables and the scratch.
        named_barrier_sync(1, CONSUMER_THREADS);
        if (!cols.single_token) {
            fill_columns(p, pc, smem);
            named_barrier_sync(1, CONSUMER_THREADS);
        }
        // the KV heads' dequantisation scales (their loads overlap the wait for the rows)
        const int kv_head = pc.unit / p.col_blocks;  // of the row (its first head when paired)
        float head_score_scale[HEADS_PER_ROW], v_scale[HEADS_PER_ROW];
#pragma unroll
        for (int r = 0; r < HEADS_PER_ROW; ++r) {
            const int h = kv_head * HEADS_PER_ROW + r;
            head_score_scale[r] =
                p.scale_log2 * kv_scale<KV_FP8>(p.k_scale, p.k_scale_batch_stride, p.k_scale_head_stride, pc.batch, h);
            v_scale[r] = kv_scale<KV_FP8>(p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride, pc.batch, h);
        }
        if constexpr (WIDE) {
            consume_wide_piece(p, pc, cols, smem, n0, head_score_scale[0]);
        } else {
            // this piece's query rows, loaded by the producer
            const int q_buf = pieces_done % Q_BUFFERS;
            const u32 q_base = q_base0 + q_buf * Q_BYTES;
            mbarrier_wait(&q_full[q_buf], (pieces_done / Q_BUFFERS) & 1);
            if constexpr (Kv::QUERY_PERMUTED) {
                permute_query_rows<Kv, HEAD_DIM, SMEM_ROW, CONSUMER_THREADS, IS_F16>(q_base, cols.count);
                named_barrier_sync(1, CONSUMER_THREADS);
            }
            if (TRACE && threadIdx.x == 0 && n0 == 0) trace_stamp(TRACE_Q_STAGED);

            float o_acc[D_TILES][N_TILES][4];
            float m_run[N_TILES][2], l_run[N_TILES][2];
            float score_scale[N_TILES][2];  // softmax scale x the K scale of each column's head
            const bool capped = p.softcap_log2 > 0.f;
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    m_run[nt][j] = neg_inf();
                    l_run[nt][j] = 0.f;
                    const int c = nt * 8 + 2 * (lane % 4) + j;
                    score_scale[nt][j] = of_part(head_score_scale, cols.part(p, c));
                }
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) o_acc[dt][nt][i] = 0.f;
            }

            // this group's tiles of the piece: CTA tile counts n = n0 + (k - first) = group (mod G)
            const int skip = ((group - n0) % CONSUMER_GROUPS + CONSUMER_GROUPS) % CONSUMER_GROUPS;
            for (int k = pc.first + skip; k < pc.end; k += CONSUMER_GROUPS) {
                const int n = n0 + k - pc.first;
                const int stage = n % STAGES;
                const u32 parity = (n / STAGES) & 1;
                mbarrier_wait(&k_full[stage], parity);
                if (TRACE && n == 0 && threadIdx.x == 0) trace_stamp(TRACE_FIRST_TILE);
                const u32 k_tile = ring_base + stage * STAGE_BYTES;
                const u32 v_tile = k_tile + TILE_BYTES;
                const int tile_begin = pc.tile_begin(k, TILE_TOKENS);
                // Every column of the piece sees positions within [unit_low, pc.len) and at least
                // [max_low, min_high) of them (token 0 sees the least far, the last token the least
                // far back): only tiles reaching past those bounds need masks, in the scores and in
                // V (whose rows below unit_low, stale pages perhaps, are cleared like those past the
                // length). Worked out per tile from the parameters: a few integer operations, no
                // registers held across the loop.
                const VisibleRange first_token = visible_range(pc.len, p.q_len, 0, p.window_left, p.window_right);
                const int unit_low = first_token.low;
                const bool masked =
                    tile_begin + TILE_TOKENS > first_token.high ||
                    tile_begin < visible_range(pc.len, p.q_len, p.q_len - 1, p.window_left, p.window_right).low;

#pragma unroll
                for (int ms0 = 0; ms0 < M_SLICES; ms0 += SOFTMAX_SLICES) {
                    // ---- S^T = K Q^T for SOFTMAX_SLICES x 16 positions x GROUP_PAD columns ----
                    float s[SOFTMAX_SLICES][N_TILES][4];
#pragma unroll
                    for (int h = 0; h < SOFTMAX_SLICES; ++h) {
                        const int slice_row = row0 + (ms0 + h) * 16;
#pragma unroll
                        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                            for (int i = 0; i < 4; ++i) s[h][nt][i] = 0.f;
#pragma unroll
                        for (int kk = 0; kk < D_TILES; kk += 2) {
                            u32 a0[4], a1[4];
                            Kv::k_fragments(a0, a1, k_tile, slice_row, kk, lane);
#pragma unroll
                            for (int nt = 0; nt < N_TILES; ++nt) {
                                u32 b[4];
                                ldmatrix_x4(b, q_base + (nt * 8 + q_row) * SMEM_ROW + (kk * 16 + q_col) * 2);
                                mma_m16n8k16<MMA_F16>(s[h][nt], a0, b[0], b[1]);
                                mma_m16n8k16<MMA_F16>(s[h][nt], a1, b[2], b[3]);
                            }
                        }
                    }

                    // ---- online softmax over this warp's rows of the step (base 2) ----
                    u32 p_frag[SOFTMAX_SLICES][N_TILES][2];
#pragma unroll
                    for (int nt = 0; nt < N_TILES; ++nt) {
                        float x[SOFTMAX_SLICES][4];
#pragma unroll
                        for (int h = 0; h < SOFTMAX_SLICES; ++h) {
                            const int tok_lo = tile_begin + row0 + (ms0 + h) * 16 + lane / 4;  // rows of s[h][..][0..1]
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                const float u = s[h][nt][i] * score_scale[nt][i % 2];
                                x[h][i] = capped ? softcap(u, p.softcap_scale, p.softcap_log2) : u;
                            }
                            if (masked) {
                                // the bounds of this lane's two columns (dropped columns: the piece's)
#pragma unroll
                                for (int j = 0; j < 2; ++j) {
                                    const int c = nt * 8 + 2 * (lane % 4) + j;
                                    const int high = c < cols.count ? cols.visible(c) : pc.len;
                                    const int low = c < cols.count ? cols.low(c) : 0;
                                    if (tok_lo < low || tok_lo >= high) x[h][j] = neg_inf();
                                    if (tok_lo + 8 < low || tok_lo + 8 >= high) x[h][j + 2] = neg_inf();
                                }
                            }
                        }
                        float mx[2] = {fmaxf(x[0][0], x[0][2]), fmaxf(x[0][1], x[0][3])};
#pragma unroll
                        for (int h = 1; h < SOFTMAX_SLICES; ++h) {
                            mx[0] = fmaxf(mx[0], fmaxf(x[h][0], x[h][2]));
                            mx[1] = fmaxf(mx[1], fmaxf(x[h][1], x[h][3]));
                        }
#pragma unroll
                        for (int j = 0; j < 2; ++j) {
#pragma unroll
                            for (int off = 4; off < 32; off *= 2)
                                mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], off));
                            const float m_new = fmaxf(m_run[nt][j], mx[j]);
                            // a column that has seen only masked rows keeps m = -inf: subtract 0 then,
                            // so that exp2 gives 0 rather than NaN
                            const float m_use = m_new == neg_inf() ? 0.f : m_new;
                            const float alpha = exp2_approx(m_run[nt][j] - m_use);
                            m_run[nt][j] = m_new;
#pragma unroll
                            for (int h = 0; h < SOFTMAX_SLICES; ++h) {
                                x[h][j] = exp2_approx(x[h][j] - m_use);
                                x[h][j + 2] = exp2_approx(x[h][j + 2] - m_use);
                            }
                            float l = l_run[nt][j] * alpha + x[0][j] + x[0][j + 2];
#pragma unroll
                            for (int h = 1; h < SOFTMAX_SLICES; ++h) l += x[h][j] + x[h][j + 2];
                            l_run[nt][j] = l;
#pragma unroll
                            for (int dt = 0; dt < D_TILES; ++dt) {
                                o_acc[dt][nt][j] *= alpha;
                                o_acc[dt][nt][j + 2] *= alpha;
                            }
                        }
                        // P^T as the B operand: the S^T accumulator halves are 8x8 blocks with
                        // positions on rows; transposing each in registers gives the k-major fragment.
#pragma unroll
                        for (int h = 0; h < SOFTMAX_SLICES; ++h) {
                            p_frag[h][nt][0] = movmatrix_trans(pack_half2<MMA_F16>(x[h][0], x[h][1]));
                            p_frag[h][nt][1] = movmatrix_trans(pack_half2<MMA_F16>(x[h][2], x[h][3]));
                        }
                    }

                    // ---- O^T += V^T P^T ----
                    if (ms0 == 0) mbarrier_wait(&v_full[stage], parity);
#pragma unroll
                    for (int h = 0; h < SOFTMAX_SLICES; ++h) {
                        const int slice_row = row0 + (ms0 + h) * 16;
                        // Positions past the length carry P = 0, but the V rows there may hold
                        // anything (NaN included, and 0 * NaN = NaN): clear them in the request's
                        // last tile, and those before the window in its first. Lane holds V^T
                        // columns (positions) 2*(lane%4) + {0,1} in a[0..1] and 8 more in a[2..3].
                        u32 keep_lo = 0xffffffffu, keep_hi = 0xffffffffu;
                        if (masked) {
                            const int t0 = tile_begin + slice_row + 2 * (lane % 4);
                            auto kept = [&](int t) { return t < pc.len && t >= unit_low; };
                            keep_lo = (kept(t0) ? 0x0000ffffu : 0u) | (kept(t0 + 1) ? 0xffff0000u : 0u);
                            keep_hi = (kept(t0 + 8) ? 0x0000ffffu : 0u) | (kept(t0 + 9) ? 0xffff0000u : 0u);
                        }
#pragma unroll
                        for (int dt = 0; dt < D_TILES; dt += 2) {
                            u32 a[2][4];
                            Kv::v_fragments(a[0], a[1], v_tile, slice_row, dt, lane);
                            accumulate_o<MMA_F16>(o_acc, dt, a, keep_lo, keep_hi, p_frag[h]);
                        }
                    }
                }
                mbarrier_arrive(&empty[stage]);
            }
            // (rows rewritten in place, e4m3: ordered before the producer's bulk copies refill them)
            if constexpr (Kv::QUERY_PERMUTED) fence_proxy_async_shared();
            mbarrier_arrive(&q_empty[q_buf]);
            if (TRACE && threadIdx.x == 0) trace_stamp(n0 == 0 ? TRACE_FIRST_LOOP : TRACE_LAST_LOOP);

            // ============================ epilogue: merge the warps ============================
            // Denominators were accumulated per lane over its own rows; finish them across the 8
            // lanes that share a column.
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int off = 4; off < 32; off *= 2)
                        l_run[nt][j] += __shfl_xor_sync(0xffffffffu, l_run[nt][j], off);
            if (lane < 4) {
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int col = nt * 8 + 2 * lane + j;
                        warp_m[warp * GROUP_PAD + col] = m_run[nt][j];
                        warp_l[warp * GROUP_PAD + col] = l_run[nt][j];
                    }
            }
            named_barrier_sync(1, CONSUMER_THREADS);
            // each warp rescales its O^T to the CTA-wide max and parks it in the scratch
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int col = nt * 8 + 2 * (lane % 4) + j;
                    float m_cta = neg_inf();
#pragma unroll
                    for (int w = 0; w < CONSUMER_WARPS; ++w) m_cta = fmaxf(m_cta, warp_m[w * GROUP_PAD + col]);
                    const float m_use = m_cta == neg_inf() ? 0.f : m_cta;
                    const float factor = exp2_approx(m_run[nt][j] - m_use);
                    float* dst = merge + warp * MERGE_WARP_FLOATS + col * MERGE_ROW;
#pragma unroll
                    for (int dt = 0; dt < D_TILES; ++dt) {
                        dst[Kv::o_dim(dt, lane / 4)] = o_acc[dt][nt][j] * factor;
                        dst[Kv::o_dim(dt, lane / 4 + 8)] = o_acc[dt][nt][j + 2] * factor;
                    }
                }
            named_barrier_sync(1, CONSUMER_THREADS);
        }
        n0 += pc.end - pc.first;
        ++pieces_done;

        // Sum the warps' (warpgroups') states in a fixed order: four head-dim elements per thread
        // per step.
        const bool whole = pc.whole();
        const long long piece_start = pc.start + pc.first;
        const long long slot_row = whole ? 0 : (long long)piece_slot(p, sched, st.lane, piece_start) * GROUP_PAD;
        for (int i = threadIdx.x; i < cols.count * (Q_DIM / 4); i += CONSUMER_THREADS) {
            const int g = i / (Q_DIM / 4), d = (i % (Q_DIM / 4)) * 4;  // d: of the column's head
            const int part = cols.part(p, g);
            float m_cta = neg_inf();
#pragma unroll
            for (int w = 0; w < EPI_PARTS; ++w) m_cta = fmaxf(m_cta, warp_m[w * GROUP_PAD + g]);
            const float m_use = m_cta == neg_inf() ? 0.f : m_cta;
            float l_cta = 0.f;
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int w = 0; w < EPI_PARTS; ++w) {
                l_cta += warp_l[w * GROUP_PAD + g] * exp2_approx(warp_m[w * GROUP_PAD + g] - m_use);
                const float4 v =
                    *reinterpret_cast<const float4*>(merge + w * MERGE_WARP_FLOATS + g * MERGE_ROW + part * Q_DIM + d);
                o.x += v.x;
                o.y += v.y;
                o.z += v.z;
                o.w += v.w;
            }
            if (whole) {
                store_normalised(p, cols, g, d, o, m_cta, l_cta, of_part(v_scale, part));
            } else {
                *reinterpret_cast<float4*>(p.o_partial + (slot_row + g) * Q_DIM + d) = o;
                if (d == 0) {
                    p.ml_partial[(slot_row + g) * 2] = m_cta;
                    p.ml_partial[(slot_row + g) * 2 + 1] = l_cta;
                }
            }
        }
        if (!whole) {
            // Park: count this piece in once every thread's partials are written (the barrier
            // orders them before thread 0's release; merge_cut_unit's acquire pairs with it),
            // and note it for the merges after the last piece (kept in shared memory: walking
            // the pieces again there spilled the consumers that sit at 255 registers)
            named_barrier_sync(1, CONSUMER_THREADS);
            count_piece_in(p, pc.batch, pc.unit);
            if (TRACE && threadIdx.x == 0 && !trace_stamped(TRACE_FIRST_COUNTED)) trace_stamp(TRACE_FIRST_COUNTED);
            if (threadIdx.x == 0) {
                int* cuts = reinterpret_cast<int*>(smem + SharedPlan::cut_count);
                reinterpret_cast<Piece*>(smem + SharedPlan::cut_pieces)[*cuts] = pc;
                *cuts += 1;
            }
        }
    }
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_PARKED);
    {
        // the CTA's cut pieces (its first and last at most), as thread 0 recorded them
        named_barrier_sync(1, CONSUMER_THREADS);
        const Piece* cut = reinterpret_cast<const Piece*>(smem + SharedPlan::cut_pieces);
        const int cuts = *reinterpret_cast<const int*>(smem + SharedPlan::cut_count);
        for (int i = 0; i < cuts; ++i) merge_cut_unit(p, sched, cut[i], st.lane, smem);
    }
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_MERGED);
    write_empty_requests(p);
    if (TRACE) {
        named_barrier_sync(1, CONSUMER_THREADS);
        if (threadIdx.x == 0 && n0 > 0) {
            trace_stamp(TRACE_EXIT);
            trace_write(n0, pieces_done, (int)(st.hi - st.lo), PAGED ? 1u : 0u);
        }
    }
}
