// Swap-AB split-KV GQA decode for sm_90a.
//
//   S^T [tokens x group] = K [tokens x d] * Q^T [d x group]     (mma m16n8k16, tokens on M)
//   O^T [d x group]      = V^T [d x tokens] * P^T [tokens x group]
//
// KV positions sit on the MMA M dimension and the query heads of one KV head on N, so a group of
// 8 fills an n8 tile instead of padding a 64-row tile. One CTA handles one (request, kv head,
// split); the split's tiles stream through a ring of shared-memory stages filled by TMA.
//
// Warp roles (CTA of 4 * CONSUMER_GROUPS + PRODUCER_WARPS warps):
//   warps 0..4G-1 consumers, in CONSUMER_GROUPS groups of four; group g takes the tiles
//                t = g, g + G, ... (two groups work on two tiles at once, so the softmax and MMA
//                latency of one tile hides behind the other's). Inside a group each warp owns
//                ROWS_PER_WARP rows of the tile. Every warp keeps a private online softmax
//                (running max m, denominator l, O^T accumulators) over its rows, so no warp
//                waits for another inside the KV loop; they merge once, at the end of the split,
//                through shared memory.
//   warp 4G      producer (one lane): per stage, TMA box loads of the K tile, then the V tile
//                (64 head dims x TILE_TOKENS positions each, 128-byte swizzle), each completing
//                on its own `full` barrier, so S^T = K Q^T and the softmax run while V is still
//                in flight; waits on the stage's `empty` barrier before reusing it.
//   warp 4G + 1  (joined-halves pages only) a second producer: warp 4G then streams K and this
//                one V, each over the same stages and barriers.
//
// Ring protocol, stage s = tile % STAGES, parity = (tile / STAGES) & 1:
//   producer: wait empty[s] (from the second lap); for K then V: arrive.expect_tx(full, bytes), TMA
//   consumer: wait k_full[s] with parity, S^T and softmax, wait v_full[s], O^T, __syncwarp,
//             lane 0 arrives on empty[s]
//   (STAGES is a multiple of CONSUMER_GROUPS, so each stage is always read by the same group
//   and its `empty` barrier counts that group's four warps)
//
// Output, one of three ways:
//   one split          the CTA normalises and writes `out` (and LSE) itself;
//   kernel reduction   each split writes its unnormalised O, max and denominator to the FP32
//                      workspace for combine.cu; every split writes all three, empty ones
//                      included (O = 0, m = -inf, l = 0), so the combine reads nothing this call
//                      did not write;
//   cluster reduction  (p.cluster_splits > 1, a power of two up to 16) the splits of one
//                      (request, kv head) are one thread-block cluster and CTA r owns head-dim
//                      slice r. Each CTA pushes its max and denominator to every peer and each
//                      slice of its unnormalised O to the slice's owner (remote stores into
//                      distributed shared memory, all in flight at once); after one cluster
//                      barrier every CTA merges its slice from its own shared memory, in rank
//                      order, and writes `out`: one launch, no workspace, nothing zeroed,
//                      bitwise deterministic. Under a device plan the same holds for the long
//                      units (cluster_splits splits each); short units run unsplit, up to
//                      cluster_splits of them in one cluster that never synchronises.
//
// Compile-time configuration (NVRTC defines, chosen only by the host's plan module):
//   KVS_IS_F16       0: bf16, 1: f16 (Q and out; K and V too unless KVS_KV_FP8)
//   KVS_KV_FP8       1: K and V are float8 e4m3 with FP32 scales (kv_format.cuh; not with
//                    joined halves)
//   KVS_HEAD_DIM     64 or 128
//   KVS_N_TILES      ceil(group / 8): n8 tiles of query heads
//   KVS_TILE_TOKENS  KV positions per ring stage (multiple of 16 * 4)
//   KVS_STAGES       ring depth
//   KVS_CONSUMER_GROUPS  1 or 2 groups of four consumer warps
//   KVS_PAGED        0: contiguous cache (lane 0 streams whole tiles); 1: paged cache (the
//                    producer lanes stream page runs); separate variants keep the common
//                    contiguous kernel as small as it was before paging existed
//   KVS_JOINED_HALVES  1: d128 pages of 8-32 positions, both 64-dim halves of a page run in one
//                    TMA box (kv_chunk), two producer warps (K and V), and for split requests
//                    the first pages warmed in L2 before the PDL wait (WARMS_PAGES)
//   KVS_PRODUCER_WARPS  2 with joined halves, 1 otherwise (the host sizes the CTA from it)
//   KVS_SHARED_BYTES the dynamic shared memory the host launches with (checked against the
//                    layout below at compile time)
//   KVS_TRACE        1: debug build with the phase trace (see below); never in a plan
#include "ptx.cuh"
#include "params.cuh"
#include "kv_format.cuh"
#include "trace.cuh"


namespace kvs {

constexpr bool IS_F16 = KVS_IS_F16;
constexpr bool KV_FP8 = KVS_KV_FP8;
constexpr int HEAD_DIM = KVS_HEAD_DIM;
constexpr int N_TILES = KVS_N_TILES;
constexpr int TILE_TOKENS = KVS_TILE_TOKENS;
constexpr int STAGES = KVS_STAGES;

constexpr int CONSUMER_GROUPS = KVS_CONSUMER_GROUPS;
constexpr bool PAGED = KVS_PAGED;
constexpr bool JOINED_HALVES = KVS_JOINED_HALVES;  // see kv_chunk
constexpr int GROUP_WARPS = 4;
constexpr int CONSUMER_WARPS = GROUP_WARPS * CONSUMER_GROUPS;
constexpr int CONSUMER_THREADS = CONSUMER_WARPS * 32;
// Producer warps, from the host (DecodeVariant::producer_warps, which also sizes the launch):
// joined-halves pages are issued by two, one streaming K and one V (a small page's boxes leave
// one at a time from the lane that holds its id, so one warp issuing both tensors serialises a
// stage's 2 x (tile / page) boxes, see produce_paged); every other variant has one.
constexpr int PRODUCER_WARPS = KVS_PRODUCER_WARPS;
constexpr int THREADS = CONSUMER_THREADS + 32 * PRODUCER_WARPS;
constexpr int PRODUCER_WARP = CONSUMER_WARPS;  // the first one
constexpr int ROWS_PER_WARP = TILE_TOKENS / GROUP_WARPS;
constexpr int M_SLICES = ROWS_PER_WARP / 16;  // m16 slices per warp per tile
constexpr int GROUP_PAD = N_TILES * 8;
constexpr int D_TILES = HEAD_DIM / 16;
// Paged caches with the 2-stage ring run two CTAs per SM (plan.rs, PAGED_CTAS_PER_SM), so the
// register budget has to leave room for both, or the second CTA silently waits for the first
// (two consumer groups at 114 registers did: 1.2-1.4x slower on split-heavy paged rows). Two
// CTAs of nine warps put five warps on one SM quadrant: 96 registers each. ptxas fits d128 with
// one column block in 95; d64 (97+) and two column blocks (~150) would spill under that cap, and
// one consumer group (168 under the cap) fits up to two column blocks. The others keep one CTA
// per SM.
constexpr int MIN_CTAS_PER_SM =
    PAGED && STAGES == 2 && (CONSUMER_GROUPS == 1 ? N_TILES <= 2 : N_TILES == 1 && HEAD_DIM == 128) ? 2 : 1;

static_assert(!JOINED_HALVES || (PAGED && HEAD_DIM == 128 && !KV_FP8), "joined halves: paged 2-byte d128 only");
static_assert(PRODUCER_WARPS == (JOINED_HALVES ? 2 : 1), "producer warps: 2 for joined halves, else 1");

// K and V tiles: the cache's element format (kv_format.cuh). They arrive as TMA boxes of one row
// (up to 128 bytes) x TILE_TOKENS positions, swizzled so that the 8 rows one ldmatrix phase reads
// hit 8 different bank groups (joined-halves pages: see kv_chunk).
using Kv = typename KvFormatOf<KV_FP8, HEAD_DIM, TILE_TOKENS, IS_F16>::type;
constexpr bool MMA_F16 = Kv::MMA_F16;  // the MMAs' (and P's) 16-bit type
constexpr int BOXES = Kv::BOXES;
constexpr int BOX_BYTES = Kv::BOX_BYTES;
constexpr int TILE_BYTES = Kv::TILE_BYTES;
constexpr int ROW_BYTES = Kv::ROW_BYTES;
constexpr int STAGE_BYTES = 2 * TILE_BYTES;  // K tile then V tile
constexpr int TILE_TX_BYTES = TILE_BYTES;  // out-of-range rows are zero-filled, still counted
// Paged caches: a tile is loaded as up to TILE_TOKENS runs of whole pages, spread over the
// producer warp's lanes.
constexpr int RUNS_PER_LANE = TILE_TOKENS / 32;
// Q is staged by ordinary stores, rows padded by 16 bytes for the same conflict-free reads.
constexpr int SMEM_ROW = HEAD_DIM * 2 + 16;

// End-of-split merge scratch, laid over the ring once the ring is drained: per consumer warp its
// rescaled O^T as [group_pad][d], rows padded by 4 floats so the fragment stores are
// conflict-free.
constexpr int MERGE_ROW = HEAD_DIM + 4;
constexpr int MERGE_WARP_FLOATS = GROUP_PAD * MERGE_ROW;

constexpr int RING_BYTES = STAGES * STAGE_BYTES;
constexpr int MERGE_BYTES = CONSUMER_WARPS * MERGE_WARP_FLOATS * 4;
// The merge scratch reuses the drained ring; a shallow ring with many warps needs a bit more.
constexpr int RING_REGION_BYTES = RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES;
constexpr int Q_BYTES = GROUP_PAD * SMEM_ROW;
// Largest cluster (16 needs the non-portable cluster size; the host checks it fits).
constexpr int MAX_CLUSTER_CTAS = 16;

struct SharedPlan {
    // ring (and merge scratch) | q | barriers | per-warp statistics, from a 1024-byte aligned
    // base (the 128-byte swizzle pattern repeats every 1024 bytes and TMA expects that alignment)
    static constexpr int align = 1024;
    static constexpr int ring = 0;
    static constexpr int q = (RING_REGION_BYTES + 127) / 128 * 128;
    static constexpr int full = q + Q_BYTES;  // per stage: K full, V full
    static constexpr int empty = full + 16 * STAGES;
    static constexpr int warp_m = empty + 8 * STAGES;
    static constexpr int warp_l = warp_m + 4 * CONSUMER_WARPS * GROUP_PAD;
    // what the cluster peers push here (cluster reduction only): for every rank, its max and
    // denominator per query head and its unnormalised O over this CTA's head-dim slice
    static constexpr int recv_m = warp_l + 4 * CONSUMER_WARPS * GROUP_PAD;
    static constexpr int recv_l = recv_m + 4 * MAX_CLUSTER_CTAS * GROUP_PAD;
    static constexpr int recv_o = recv_l + 4 * MAX_CLUSTER_CTAS * GROUP_PAD;
    // per-column tables (Columns)
    static constexpr int col_q = recv_o + 4 * GROUP_PAD * HEAD_DIM;
    static constexpr int col_out = col_q + 8 * GROUP_PAD;
    static constexpr int col_row = col_out + 8 * GROUP_PAD;
    static constexpr int col_visible = col_row + 8 * GROUP_PAD;
    static constexpr int bytes = col_visible + 4 * GROUP_PAD;
};

static_assert(TILE_TOKENS % (16 * GROUP_WARPS) == 0, "tile must split into m16 slices");
// the host's mirror of this layout (DecodeVariant::shared_bytes) sizes the launch
static_assert(SharedPlan::bytes + SharedPlan::align <= KVS_SHARED_BYTES, "shared memory the host launches with");
static_assert(STAGES % CONSUMER_GROUPS == 0, "a stage must always feed the same group");
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head dim");
static_assert(N_TILES >= 1 && N_TILES <= 4, "group up to 32");
static_assert(TILE_TOKENS % 32 == 0, "producer lanes copy whole rounds of rows");
static_assert(SharedPlan::full % 8 == 0, "mbarrier alignment");
static_assert(STAGE_BYTES % 1024 == 0, "every box starts on a swizzle-pattern boundary");

// Joined-halves pages (pages of 8-32 positions at d128, bf16/f16; launch.rs, joined_page_map):
// one TMA box per page run holds both 64-dim halves, so the tile is [run][half][position in
// run][128 bytes] rather than the [half][position][128 bytes] of Kv's layout, and a tile takes
// half the boxes. Shared address of 16-byte chunk `chunk` (head dims 8 chunk .. 8 chunk + 7) of
// position `t` there; `run_rows` is the page size. Runs of 8+ positions keep every 8-row group
// on one swizzle phase, so the ldmatrix reads stay conflict-free.
__device__ __forceinline__ u32 kv_chunk(u32 tile, int t, int chunk, int run_rows) {
    const u32 swizzled = ((chunk % 8) ^ (t % 8)) << 4;
    return tile + (t & -run_rows) * (BOXES * 128) + (t & (run_rows - 1)) * 128 +
           (chunk / 8) * run_rows * 128 + swizzled;
}

// ================================ phase trace (KVS_TRACE builds) ==========================
// Where a CTA's time goes, per phase, on the clock all SMs share: one stamp per trace point,
// taken by the one thread that sees the phase end, parked in shared memory and written out as
// one record per CTA at its end (a ring of TRACE_RECORDS; `kvs_trace_count` counts every CTA
// ever recorded, so a reader takes the last min(count, TRACE_RECORDS)). Records are written
// only by consumer thread 0 once the output is stored; empty splits and device-plan CTAs
// without work leave none. The host side is `KVSTREAM_TRACE=<dir> kvstream bench` (bench.rs,
// bench/trace.py); release plans never compile it.
enum TracePoint {
    TRACE_ENTRY,            // first instruction (thread 0)
    TRACE_WAITED,           // PDL wait returned (thread 0)
    TRACE_PRODUCER_WAITED,  // PDL wait returned (producer, K warp, lane 0)
    TRACE_RELEASED,         // dependents released (same lane)
    TRACE_PLANNED,          // work item, length and range known (same lane)
    TRACE_IDS_READY,        // paged: the first page id has arrived (same lane)
    TRACE_PRODUCER_READY,   // the producer loop entered (same lane)
    TRACE_FIRST_ISSUE,      // the first tile's K and V boxes issued (same lane)
    TRACE_Q_ISSUED,         // Q loads issued (thread 0)
    TRACE_Q_STAGED,         // Q in shared memory (thread 0)
    TRACE_FIRST_TILE,       // the first K tile has landed (consumer warp 0)
    TRACE_SECOND_TILE,      // the second K tile has landed (first warp of its group)
    TRACE_LAST_TILE,        // the last V tile has landed (first warp of its group)
    TRACE_LOOP_DONE,        // consumer warp 0 left the KV loop
    TRACE_MERGED,           // the warps' O^T parked for the merge (thread 0)
    TRACE_EXIT,             // every consumer warp has stored its output (thread 0)
    TRACE_POINTS
};
static_assert(TRACE_POINTS <= TRACE_SLOTS, "trace slots");
// (record, ring and stamps: trace.cuh; flags: bit 0 paged, bit 1 joined halves)
constexpr u32 TRACE_FLAGS = (PAGED ? 1u : 0u) | (JOINED_HALVES ? 2u : 0u);

// ================================ query rows (columns) =====================================
// Column c of a CTA is query row (token i, head h) of its KV head with
// cb * GROUP_PAD + c = i * group + h (token-major), cb = the CTA's column block.
// Single-token decode (q_len 1, the common case) works every row out from its head index: no
// tables, so the first Q load and the epilogue's stores wait on nothing in shared memory.
// Multi-token decode needs a division by the group size per column, so fill_columns does that
// once per CTA into shared tables (runtime divisions are too slow to repeat per element).
struct Columns {
    int count;          // valid columns in this CTA (<= GROUP_PAD)
    bool single_token;  // q_len == 1: column c is head first_head + c of token 0
    int batch, first_head, len;
    // Multi-token tables, per column: element offsets of its Q and output rows, its output row
    // index (LSE and split partials) and how many cache positions it may see.
    const long long* q_off;
    const long long* out_off;
    const long long* out_row;
    const int* visible_len;

    __device__ __forceinline__ long long row(const DecodeParams& p, int c) const {
        return single_token ? (long long)batch * p.hq + first_head + c : out_row[c];
    }
    __device__ __forceinline__ u16* out(const DecodeParams& p, int c) const {
        return reinterpret_cast<u16*>(p.out) +
               (single_token ? head_offset(p.o_batch_stride, p.o_head_stride, c) : out_off[c]);
    }
    __device__ __forceinline__ const u16* q(const DecodeParams& p, int c) const {
        return reinterpret_cast<const u16*>(p.q) +
               (single_token ? head_offset(p.q_batch_stride, p.q_head_stride, c) : q_off[c]);
    }
    // Single-token: element offset of column c's row (token 0, head first_head + c) in Q or out.
    __device__ __forceinline__ long long head_offset(long long batch_stride, long long head_stride,
                                                     int c) const {
        return batch * batch_stride + (long long)(first_head + c) * head_stride;
    }
    // Cache positions column c may see: [0, len - q_len + token] (causal among the new tokens).
    __device__ __forceinline__ int visible(int c) const { return single_token ? len : visible_len[c]; }
};

// Fills the multi-token tables of `Columns` (threads 0 .. GROUP_PAD - 1; the caller
// synchronises). CTA column c is KV-head row first + c = token * group + h.
__device__ __forceinline__ void fill_columns(const DecodeParams& p, int first, int count, int batch,
                                             int kv_head, int len, long long* q_off, long long* out_off,
                                             long long* out_row, int* visible_len) {
    const int c = threadIdx.x;
    if (c >= GROUP_PAD) return;
    const int row = c < count ? first + c : 0;
    const int token = row / p.group;
    const int head = kv_head * p.group + row % p.group;
    q_off[c] = batch * p.q_batch_stride + token * p.q_token_stride + head * p.q_head_stride;
    out_off[c] = batch * p.o_batch_stride + token * p.o_token_stride + head * p.o_head_stride;
    out_row[c] = ((long long)batch * p.q_len + token) * p.hq + head;
    visible_len[c] = len - p.q_len + 1 + token;
}

// ================================ work item ================================================
// What this CTA computes: from the grid (static plan) or from the device planner's table
// (plan_work.cu; batch = -1: no work this call).
struct WorkItem {
    int batch, kv_head, col_block, split, num_splits;
    long long slot;  // device plan: FP32 partial slot of this split (requests with splits > 1)
};

// Static plan: from the grid and the kernel parameters alone, so it may be worked out before the
// PDL wait.
__device__ __forceinline__ WorkItem grid_work_item(const DecodeParams& p) {
    if (p.col_blocks == 1) return {(int)blockIdx.z, (int)blockIdx.y, 0, (int)blockIdx.x, p.num_splits, 0};
    return {(int)blockIdx.z, (int)blockIdx.y / p.col_blocks, (int)blockIdx.y % p.col_blocks,
            (int)blockIdx.x, p.num_splits, 0};
}

// Device plan (p.work): from the planner's table, written by the kernel before this one.
__device__ __forceinline__ WorkItem planned_work_item(const DecodeParams& p) {
    const int b = p.work[2 * blockIdx.x], j = p.work[2 * blockIdx.x + 1];
    if (b < 0) return {-1, 0, 0, 0, 1, 0};
    const int splits = p.request_plan[2 * b], slot_base = p.request_plan[2 * b + 1];
    const int unit = j / splits;
    return {b, unit / p.col_blocks, unit % p.col_blocks, j % splits, splits, (long long)slot_base + j};
}

// ================================ cluster reduction ========================================
// Protocol (every thread of every CTA of the cluster takes part in both barrier phases):
//   start    cluster_arrive_relaxed            (phase 1: "my shared memory exists")
//   push     cluster_wait_acquire, then remote stores of (m, l) to every peer and of each
//            head-dim slice of O to its owner (consumers; an empty split pushes m = -inf, l = 0
//            and no O: receivers skip ranks whose weight is 0)
//   merge    cluster_arrive_release + cluster_wait_acquire (phase 2: every push has landed),
//            then local reads only, so a CTA may leave as soon as it has written its slice.
// Slices: CTA r owns head dims [r * HEAD_DIM / peers, (r + 1) * HEAD_DIM / peers).
struct ClusterShape {
    int peers, rank, slice;
};

__device__ __forceinline__ ClusterShape cluster_shape(const DecodeParams& p) {
    return {p.cluster_splits, (int)cluster_ctarank(), HEAD_DIM / p.cluster_splits};
}

// One query head's statistics, to every peer (rank-major rows of GROUP_PAD).
__device__ __forceinline__ void cluster_push_stats(const ClusterShape& c, u32 recv_m, u32 recv_l,
                                                   int g, float m, float l) {
    const u32 off = 4 * (c.rank * GROUP_PAD + g);
    for (int r = 0; r < c.peers; ++r) {
        st_peer_f32(peer_smem_addr(recv_m + off, r), m);
        st_peer_f32(peer_smem_addr(recv_l + off, r), l);
    }
}

// Head dims d, d + 1 of query head g's unnormalised O, to the owner of their slice (the slice
// width is even, so both land in the same slice).
__device__ __forceinline__ void cluster_push_o(const ClusterShape& c, u32 recv_o, int g, int d,
                                               float o0, float o1) {
    const int owner = d / c.slice;
    const u32 off = 4 * ((c.rank * GROUP_PAD + g) * c.slice + d % c.slice);
    st_peer_f32x2(peer_smem_addr(recv_o + off, owner), o0, o1);
}

// After the pushes: merge this CTA's slice over the ranks in order and write it out. Each
// thread works out its query head's weights itself (at most 16 ranks, local shared memory):
// cheaper than a CTA barrier to share them, since a thread rarely has more than one pair.
__device__ __forceinline__ void cluster_merge_slice(const DecodeParams& p, const ClusterShape& c,
                                                    const float* recv_m, const float* recv_l,
                                                    const float* recv_o, const Columns& cols) {
    cluster_arrive_release();
    cluster_wait_acquire();
    const int pairs = c.slice / 2;
    for (int i = threadIdx.x; i < cols.count * pairs; i += THREADS) {
        const int g = i / pairs, e = 2 * (i % pairs);
        float m_max = neg_inf();
        for (int r = 0; r < c.peers; ++r) m_max = fmaxf(m_max, recv_m[r * GROUP_PAD + g]);
        const float m_use = m_max == neg_inf() ? 0.f : m_max;
        float l_sum = 0.f, o0 = 0.f, o1 = 0.f;
        for (int r = 0; r < c.peers; ++r) {
            const float m_r = recv_m[r * GROUP_PAD + g];
            if (m_r == neg_inf()) continue;  // empty split: l = 0 and it pushed no O
            const float w = exp2_approx(m_r - m_use);
            const float2 v = *reinterpret_cast<const float2*>(recv_o + (r * GROUP_PAD + g) * c.slice + e);
            l_sum += w * recv_l[r * GROUP_PAD + g];
            o0 += w * v.x;
            o1 += w * v.y;
        }
        const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
        *reinterpret_cast<u32*>(cols.out(p, g) + c.rank * c.slice + e) = pack_half2<IS_F16>(o0 * inv, o1 * inv);
        if (p.lse && c.rank == 0 && e == 0) {
            p.lse[cols.row(p, g)] =
                l_sum > 0.f ? (m_max + __log2f(l_sum)) * 0.69314718055994531f : neg_inf();
        }
    }
}

// ================================ producer ================================================
// Ring protocol as in the header comment: per tile, wait for the stage to be free (from the
// second lap), then K boxes on the stage's K barrier and V boxes on its V barrier. Positions past
// the request's length are loaded too (zeros past max_len or from page id -1, whatever the cache
// holds otherwise); the consumers mask them.
struct ProducerRing {
    unsigned char* ring;
    u64* k_full;
    u64* v_full;
    u64* empty;
    u64 policy;
};

// Contiguous cache: one lane, one box per 64 head dims per tile.
__device__ __forceinline__ void produce_contiguous(const DecodeParams& p, const ProducerRing& r,
                                                   SplitRange range, int num_tiles, int batch,
                                                   int kv_head) {
    if (TRACE) trace_stamp(TRACE_PRODUCER_READY);
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int stage = tile % STAGES;
        if (tile >= STAGES) mbarrier_wait(&r.empty[stage], ((tile / STAGES) - 1) & 1);
        unsigned char* k_dst = r.ring + stage * STAGE_BYTES;
        unsigned char* v_dst = k_dst + TILE_BYTES;
        const int tile_begin = range.begin + tile * TILE_TOKENS;
        mbarrier_arrive_expect_tx(&r.k_full[stage], TILE_TX_BYTES);
#pragma unroll
        for (int box = 0; box < BOXES; ++box)
            tma_load_4d(k_dst + box * BOX_BYTES, &p.k_map, box * Kv::DIMS_PER_BOX, kv_head, tile_begin, batch,
                        &r.k_full[stage], r.policy);
        mbarrier_arrive_expect_tx(&r.v_full[stage], TILE_TX_BYTES);
#pragma unroll
        for (int box = 0; box < BOXES; ++box)
            tma_load_4d(v_dst + box * BOX_BYTES, &p.v_map, box * Kv::DIMS_PER_BOX, kv_head, tile_begin, batch,
                        &r.v_full[stage], r.policy);
        if (TRACE && tile == 0) trace_stamp(TRACE_FIRST_ISSUE);
    }
}

// Paged cache: a tile is `boxes` page runs of `run` positions (whole pages, or a tile-sized
// piece of a larger page); the lane holding a run's page id issues that run's boxes. The producer
// warp reads the block table a chunk of CHUNK_PAGES pages at a time, one coalesced load per 32
// pages (lane i holds pages i, i + 32, ... of the chunk), and keeps two chunks: while the tiles of
// one are issued the next is in flight, so a table read hides behind a whole chunk of tiles (16
// tiles of page 16, 64 of page 64). (Reading each tile's ids STAGES tiles ahead instead costs
// about one table read under full HBM traffic, 1-2 us, per tile at one CTA per request and head:
// a lone page-64 stream then ran 1.3x slower than a contiguous one.) The chunk loop is unrolled by two so each chunk
// buffer is refilled in place: moving a register whose load is in flight would wait for it.
constexpr int CHUNK_PAGES = 32 * RUNS_PER_LANE;
// Paged one-CTA variants read the first chunks right after the PDL wait (see the kernel); the
// two-CTA variants, at their 96-register cap, read them in the producer branch.
constexpr bool EARLY_TABLE_READ = PAGED && MIN_CTAS_PER_SM == 1;
static_assert(CHUNK_PAGES % TILE_TOKENS == 0, "a tile's runs never straddle two chunks");

struct PageWalk {
    const int* table;  // this request's block table
    int first_page;    // page of the split's first position
    int end_page;      // one past the page of its last position
    int page_shift;    // log2(page size): page sizes are powers of two
    int run;           // positions per TMA run: min(page size, TILE_TOKENS)
    int boxes;         // runs per tile
};

// The walk of a split's pages: parameters and the split's range only.
__device__ __forceinline__ PageWalk page_walk(const DecodeParams& p, int batch, SplitRange range) {
    const int shift = __ffs(p.page_size) - 1;
    const int run = min(p.page_size, TILE_TOKENS);
    return {p.block_table + (long long)batch * p.table_stride, range.begin >> shift,
            ((range.end - 1) >> shift) + 1, shift, run, TILE_TOKENS / run};
}

// Pages past the split read as -1: their boxes are out of bounds and arrive zero-filled.
__device__ __forceinline__ void load_page_chunk(int (&ids)[RUNS_PER_LANE], const PageWalk& w,
                                                int chunk, int lane) {
#pragma unroll
    for (int i = 0; i < RUNS_PER_LANE; ++i) {
        const int page = w.first_page + chunk * CHUNK_PAGES + lane + 32 * i;
        ids[i] = page < w.end_page ? w.table[page] : -1;
    }
}

// The entries of a split's first two chunks that lane `lane` reads (load_page_chunk's, chunks 0
// and 1): a pointer to its first one and how many entries from there on belong to the split.
// Worked out from parameters alone, so that only the loads remain after the PDL wait; the loads
// are volatile (`ld_global_l2`) so that they stay where the kernel issues them instead of sinking
// to their first use in the producer loop.
struct FirstPages {
    const int* entry;
    int count;
};

__device__ __forceinline__ FirstPages first_pages(const PageWalk& w, int lane) {
    return {w.table + w.first_page + lane, w.end_page - w.first_page - lane};
}

// The two chunks produce_paged starts from (as load_page_chunk(ids[c], w, c, lane) would; the
// in-loop refills keep load_page_chunk's form: folding both into one loader changes the SASS of
// every paged variant, which was not measured).
__device__ __forceinline__ void load_first_page_chunks(int (&ids)[2][RUNS_PER_LANE], FirstPages f) {
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int i = 0; i < RUNS_PER_LANE; ++i) {
            const int k = c * CHUNK_PAGES + 32 * i;
            ids[c][i] = k < f.count ? ld_global_l2(f.entry + k) : -1;
        }
}

// The ring as the paged loop hands it to the wrappers, by variant, both forms measured on both
// kinds of loop: plain paged loops take shared-window addresses, converted once (with
// generic pointers ptxas put the window base's S2R back inside the tile loop of some variants:
// 8% slower on 64-tile rows); joined-halves loops take generic pointers (with shared-window
// addresses ptxas kept the tensor maps' addresses in ordinary registers, an R2UR pair per box:
// 0.2-0.3 us slower on 64-tile rows).
template <bool SHARED_WINDOW>
struct PagedRingAddrs {
    u32 ring, k_full, v_full, empty;
    __device__ __forceinline__ explicit PagedRingAddrs(const ProducerRing& r)
        : ring(smem_addr(r.ring)), k_full(smem_addr(r.k_full)), v_full(smem_addr(r.v_full)),
          empty(smem_addr(r.empty)) {}
    __device__ __forceinline__ u32 stage(int s) const { return ring + s * STAGE_BYTES; }
    __device__ __forceinline__ u32 k_bar(int s) const { return k_full + 8 * s; }
    __device__ __forceinline__ u32 v_bar(int s) const { return v_full + 8 * s; }
    __device__ __forceinline__ u32 empty_bar(int s) const { return empty + 8 * s; }
};
template <>
struct PagedRingAddrs<false> {
    const ProducerRing& r;
    __device__ __forceinline__ explicit PagedRingAddrs(const ProducerRing& ring) : r(ring) {}
    __device__ __forceinline__ unsigned char* stage(int s) const { return r.ring + s * STAGE_BYTES; }
    __device__ __forceinline__ u64* k_bar(int s) const { return &r.k_full[s]; }
    __device__ __forceinline__ u64* v_bar(int s) const { return &r.v_full[s]; }
    __device__ __forceinline__ u64* empty_bar(int s) const { return &r.empty[s]; }
};

// `producer`: which producer warp this is (PRODUCER_WARPS == 2: 0 streams K, 1 streams V).
// `ids`: the walk's first two chunks, already loaded (load_first_page_chunks).
__device__ __forceinline__ void produce_paged(const DecodeParams& p, const ProducerRing& r,
                                              SplitRange range, int num_tiles, const PageWalk& w,
                                              int (&ids)[2][RUNS_PER_LANE], int kv_head, int lane,
                                              int producer) {
    if (TRACE && lane == 0 && producer == 0) trace_stamp(TRACE_PRODUCER_READY);
    const int shift = w.page_shift, run = w.run;
    const int in_page_mask = p.page_size - 1;
    const PagedRingAddrs<!JOINED_HALVES> ring(r);
    int tile = 0;
    for (int chunk0 = 0; tile < num_tiles; chunk0 += 2) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const int chunk_page = w.first_page + (chunk0 + b) * CHUNK_PAGES;  // its first page
            for (; tile < num_tiles; ++tile) {
                const int tile_begin = range.begin + tile * TILE_TOKENS;
                const int tile_page = tile_begin >> shift;  // page of the tile's first run
                if (tile_page >= chunk_page + CHUNK_PAGES) break;
                const int stage = tile % STAGES;
                if (TRACE && tile == 0 && lane == 0 && producer == 0) {
                    computed_here(ids[b][0]);
                    trace_stamp(TRACE_IDS_READY);
                }
                if (tile >= STAGES) mbarrier_wait(ring.empty_bar(stage), ((tile / STAGES) - 1) & 1);
                const auto k_dst = ring.stage(stage);
                const decltype(k_dst) dst[2] = {k_dst, k_dst + TILE_BYTES};
                const TensorMap* map[2] = {&p.k_map, &p.v_map};
                const auto k_bar = ring.k_bar(stage);
                const decltype(k_bar) bar[2] = {k_bar, ring.v_bar(stage)};
#pragma unroll
                for (int kv = 0; kv < 2; ++kv) {  // K, then V
                    if (PRODUCER_WARPS == 2 && kv != producer) continue;
                    if (lane == 0) mbarrier_arrive_expect_tx(bar[kv], TILE_TX_BYTES);
                    __syncwarp();
#pragma unroll
                    for (int i = 0; i < RUNS_PER_LANE; ++i) {
                        const int rr = chunk_page + lane + 32 * i - tile_page;  // this lane's run
                        if (rr < 0 || rr >= w.boxes) continue;
                        const int in_page = (tile_begin + rr * run) & in_page_mask;
                        if constexpr (JOINED_HALVES) {  // whole pages: in_page is 0
                            tma_load_5d(dst[kv] + rr * run * BOXES * 128, map[kv], 0, 0, 0, kv_head,
                                        ids[b][i], bar[kv], r.policy);
                            continue;
                        }
#pragma unroll
                        for (int box = 0; box < BOXES; ++box)
                            tma_load_4d(dst[kv] + box * BOX_BYTES + rr * run * ROW_BYTES, map[kv],
                                        box * Kv::DIMS_PER_BOX,
                                        kv_head, in_page, ids[b][i], bar[kv], r.policy);
                    }
                }
                if (TRACE && tile == 0 && lane == 0 && producer == 0) trace_stamp(TRACE_FIRST_ISSUE);
            }
            load_page_chunk(ids[b], w, chunk0 + b + 2, lane);
        }
    }
}

// ================================ L2 warm-up before the PDL wait ============================
// A one- or two-tile split waits out its first DRAM round trip in full, and that trip starts
// only after the PDL wait. Prefetches into L2 may start before it: the previous kernel's writes
// land in L2, so the loads after the wait still see them. The consumer threads, idle until the
// wait, each warm one K or V row (position) of the split's first WARM_TILES tiles, a 128-byte
// `prefetch.global.L2` per line, through the load/store path (TMA prefetches queued in the SM's
// TMA unit ahead of the previous call's loads). The range assumes every request is max_len
// long, since the lengths may not be read yet: a shorter one only warms positions it will not
// read. Where it runs (decode kernel entry, each case measured with and without): contiguous
// caches under a static plan in kernel reduction, and joined-halves pages there when the
// request is split (WARMS_PAGES). Not other paged caches (their page ids, read before the wait
// as hints, made 5 of 10 paged rows slower, page 64 b8 L32768 by 6.6 us), not device plans
// (the work item is written by the planner, the kernel just before), not cluster reduction
// (0.2-0.45 us slower on three of the six mha rows, mha-d64-L1024 among them, whose automatic
// mode is cluster reduction; the cause is not known).
// Pages: a row's page id is read here as a hint only. The previous kernel may still be writing
// the table; a stale id then warms a page that is not read, and nothing else uses it (the
// producer reads the table again after the wait). The read is `ld.global.cg` (L2, no L1 line
// that the later read could hit stale), and the id is clamped to the pool.
constexpr int WARM_TILES = 2;
// (not where two CTAs share the SM: the n1 g2 variant then spills under its 96-register cap)
constexpr bool WARMS_PAGES = JOINED_HALVES && MIN_CTAS_PER_SM == 1;
constexpr int LINES_PER_ROW = HEAD_DIM * 2 / 128;  // 128-byte lines per query row
constexpr int KV_LINES_PER_ROW = (HEAD_DIM * Kv::ELEM_BYTES + 127) / 128;  // per K or V row

// `item` and `range`: the static plan's, for a request of max_len positions.
__device__ __forceinline__ void warm_first_tiles(const DecodeParams& p, const WorkItem& item,
                                                 const SplitRange& range) {
    const int rows = min(range.end - range.begin, WARM_TILES * TILE_TOKENS);
    for (int i = threadIdx.x; i < 2 * rows; i += CONSUMER_THREADS) {
        const bool is_v = i >= rows;
        const int pos = range.begin + (is_v ? i - rows : i);
        // contiguous: (request, position); pages: (page, position in the page)
        long long outer = item.batch, inner = pos;
        if constexpr (PAGED) {
            const int shift = __ffs(p.page_size) - 1;
            const int id = ld_global_l2(p.block_table + (long long)item.batch * p.table_stride + (pos >> shift));
            outer = min(max(id, 0), p.num_pages - 1);
            inner = pos & (p.page_size - 1);
        }
        const long long element =
            is_v ? outer * p.v_batch_stride + inner * p.v_token_stride + (long long)item.kv_head * p.v_head_stride
                 : outer * p.k_batch_stride + inner * p.k_token_stride + (long long)item.kv_head * p.k_head_stride;
        const unsigned char* row =
            static_cast<const unsigned char*>(is_v ? p.v_cache : p.k_cache) + element * Kv::ELEM_BYTES;
#pragma unroll
        for (int line = 0; line < KV_LINES_PER_ROW; ++line) prefetch_l2(row + line * 128);
    }
}

// The query rows, warmed in L2 before the PDL wait too (single-token decode, static plans: the
// case measured; multi-token rows would need fill_columns' per-column
// division first): the consumers' Q loads right after the wait can queue behind the first lap's
// KV traffic, and a split cannot start without them. As for the KV lines, a prefetch sees the
// previous kernel's writes (they land in L2), so only the addresses need to be known: the work
// item and the head strides, as in Columns::head_offset. (Building a Columns here instead
// added 248 instructions to the d128 s4 g2 kernel's prologue; the rows are computed again.)
__device__ __forceinline__ void warm_query_rows(const DecodeParams& p, const WorkItem& item) {
    const int first_col = item.col_block * GROUP_PAD;
    const int count = min(GROUP_PAD, p.cols - first_col);
    const int line = threadIdx.x;  // one 128-byte line per thread
    if (line >= count * LINES_PER_ROW) return;
    const int c = line / LINES_PER_ROW;
    const long long element = (long long)item.batch * p.q_batch_stride +
                              (long long)(item.kv_head * p.group + first_col + c) * p.q_head_stride;
    prefetch_l2(static_cast<const unsigned char*>(p.q) + element * 2 + (line % LINES_PER_ROW) * 128);
}

}  // namespace kvs

using namespace kvs;

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS_PER_SM)
kvs_decode_gqa(const __grid_constant__ DecodeParams p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((SharedPlan::align - smem_addr(smem_raw) % SharedPlan::align) %
                                      SharedPlan::align);
    unsigned char* ring = smem + SharedPlan::ring;
    unsigned char* q_smem = smem + SharedPlan::q;
    u64* k_full = reinterpret_cast<u64*>(smem + SharedPlan::full);
    u64* v_full = k_full + STAGES;
    u64* empty = reinterpret_cast<u64*>(smem + SharedPlan::empty);
    float* warp_m = reinterpret_cast<float*>(smem + SharedPlan::warp_m);
    float* warp_l = reinterpret_cast<float*>(smem + SharedPlan::warp_l);
    float* recv_m = reinterpret_cast<float*>(smem + SharedPlan::recv_m);
    float* recv_l = reinterpret_cast<float*>(smem + SharedPlan::recv_l);
    float* recv_o = reinterpret_cast<float*>(smem + SharedPlan::recv_o);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (TRACE && threadIdx.x == 0) {
        trace_clear();
        trace_stamp(TRACE_ENTRY);
    }

    // The tensor maps are kernel parameters, never written by the previous kernel, so their
    // descriptor fetch may overlap its tail instead of delaying our first TMA.
    if (threadIdx.x == PRODUCER_WARP * 32) {
        prefetch_tensor_map(&p.k_map);
        prefetch_tensor_map(&p.v_map);
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&k_full[s], 1);
            mbarrier_init(&v_full[s], 1);
            mbarrier_init(&empty[s], GROUP_WARPS);
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    // Static plan: every CTA of a cluster works on one (request, KV head), so the cluster's
    // first phase starts before the previous kernel has finished. Device plan: a cluster holds
    // either the splits of one long unit or up to cluster_splits unsplit short units (which
    // never touch the cluster barrier), and only the work item says which.
    ClusterShape cluster = {};
    const bool static_cluster = p.cluster_splits > 1 && !p.work;
    if (static_cluster) {
        cluster = cluster_shape(p);
        cluster_arrive_relaxed();  // phase 1, waited on just before the first remote store
    }

    // What the kernel parameters alone decide is worked out here, ahead of the wait: the static
    // plan's work item, its KV range for a request of max_len positions, and whether anything
    // must be redone after the wait (`replan`: device plan or device lengths). Left to the
    // compiler, all of it sank below the wait, where one warp's chain of parameter reads,
    // compares and 64-bit divisions kept the first TMA 0.67 us behind the wait with no memory
    // access in the way (measured with a phase trace). Pinned only where one CTA has the
    // SM: the two-CTA variants sit at their 96-register cap and serve long one-split rows, where
    // this start matters least.
    const bool replan = p.work || p.seqlens;
    WorkItem item = {};
    SplitRange range = {};
    int len = p.max_len;
    if (!p.work) {
        item = grid_work_item(p);
        range = split_range(p.max_len, item.num_splits, item.split, TILE_TOKENS);
        if (MIN_CTAS_PER_SM == 1) {
            computed_here(range.begin);
            computed_here(range.end);
            computed_here(replan);
        }
    }
    FirstPages first = {};
    if (EARLY_TABLE_READ && !p.work && warp >= PRODUCER_WARP) {
        first = first_pages(page_walk(p, item.batch, range), lane);
        computed_here(first.entry);
        computed_here(first.count);
    }
    if (!p.work && p.q_len == 1 && warp < CONSUMER_WARPS) warm_query_rows(p, item);
    if ((!PAGED || (WARMS_PAGES && p.num_splits > 1)) && !p.work && !static_cluster && p.k_cache &&
        warp < CONSUMER_WARPS)
        warm_first_tiles(p, item, range);

    // Everything above overlaps the previous kernel's tail; nothing below may read global
    // memory before it has finished.
    pdl_wait_for_producer();
    // A paged split's first box needs its page id, one table round trip after the wait that a
    // contiguous split does not make. Where the range is final already (static plan, no device
    // lengths), the producers issue that read as the first thing after the wait, its addresses
    // worked out before it, so the trip overlaps the rest of the prologue; otherwise they read
    // once the range is known. (One-CTA variants only, like the pins above.)
    int page_ids[2][RUNS_PER_LANE];
    if (EARLY_TABLE_READ && !replan && warp >= PRODUCER_WARP) load_first_page_chunks(page_ids, first);
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_WAITED);
    if (TRACE && threadIdx.x == PRODUCER_WARP * 32) trace_stamp(TRACE_PRODUCER_WAITED);
    // The next kernel (the combine, or the next decode) may launch as soon as every CTA of this
    // grid has started: its CTAs then sit resident at their own wait, and our completion, not
    // their launch, is what remains on the critical path.
    pdl_release_dependents();
    if (TRACE && threadIdx.x == PRODUCER_WARP * 32) trace_stamp(TRACE_RELEASED);

    if (replan) {
        if (p.work) {
            item = planned_work_item(p);
            if (item.batch < 0) return;  // device plan: more CTAs than work this call
        }
        // Lengths come from device memory the host never sees: clamp rather than trust them.
        if (p.seqlens) len = max(0, min(p.seqlens[item.batch], p.max_len));
        range = split_range(len, item.num_splits, item.split, TILE_TOKENS);
    }
    const bool in_cluster = p.cluster_splits > 1 && item.num_splits > 1;
    if (in_cluster && !static_cluster) {
        cluster = cluster_shape(p);
        cluster_arrive_relaxed();
    }
    const int batch = item.batch, kv_head = item.kv_head, split = item.split;
    const int num_tiles = range.end > range.begin
                              ? (range.end - range.begin + TILE_TOKENS - 1) / TILE_TOKENS
                              : 0;
    if (TRACE && threadIdx.x == PRODUCER_WARP * 32) {
        computed_here(num_tiles);
        trace_stamp(TRACE_PLANNED);
    }
    long long* col_q = reinterpret_cast<long long*>(smem + SharedPlan::col_q);
    long long* col_out = reinterpret_cast<long long*>(smem + SharedPlan::col_out);
    long long* col_row = reinterpret_cast<long long*>(smem + SharedPlan::col_row);
    int* col_visible = reinterpret_cast<int*>(smem + SharedPlan::col_visible);
    const int first_col = item.col_block * GROUP_PAD;
    const Columns cols = {min(GROUP_PAD, p.cols - first_col), p.q_len == 1, batch,
                          kv_head * p.group + first_col, len, col_q, col_out, col_row, col_visible};
    // The column tables are filled by consumer threads; the producer warp does not wait for
    // them, so its first TMA leaves as early as it would without them (a one- or two-tile
    // split's time is mostly that first round trip).
    if (!cols.single_token)
        fill_columns(p, first_col, cols.count, batch, kv_head, len, col_q, col_out, col_row, col_visible);
    // FP32 partials of column g: static plan [split][output row], device plan [slot][column].
    const long long partial_base =
        p.work ? item.slot * GROUP_PAD : split * ((long long)p.batch * p.q_len * p.hq);
    auto partial_row = [&](int g) { return partial_base + (p.work ? (long long)g : cols.row(p, g)); };

    if (num_tiles == 0) {
        // ---------------- empty split: publish neutral statistics and leave ----------------
        __syncthreads();  // column tables
        if (in_cluster) {
            cluster_wait_acquire();
            for (int g = threadIdx.x; g < cols.count; g += THREADS) {
                cluster_push_stats(cluster, smem_addr(recv_m), smem_addr(recv_l), g, neg_inf(), 0.f);
            }
            cluster_merge_slice(p, cluster, recv_m, recv_l, recv_o, cols);
        } else if (item.num_splits > 1) {
            // Neutral partials, O included: the combine then loads every split unconditionally,
            // all in one round trip, and still reads only what this call wrote.
            for (int g = threadIdx.x; g < cols.count; g += THREADS) {
                p.m_partial[partial_row(g)] = neg_inf();
                p.l_partial[partial_row(g)] = 0.f;
            }
            for (int i = threadIdx.x; i < cols.count * HEAD_DIM / 4; i += THREADS) {
                const int g = i / (HEAD_DIM / 4), e = i % (HEAD_DIM / 4);
                reinterpret_cast<float4*>(p.o_partial + partial_row(g) * HEAD_DIM)[e] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        } else {
            // zero-length request: out = 0, LSE = -inf
            for (int i = threadIdx.x; i < cols.count * HEAD_DIM; i += THREADS) {
                cols.out(p, i / HEAD_DIM)[i % HEAD_DIM] = 0;
            }
            if (p.lse) {
                for (int g = threadIdx.x; g < cols.count; g += THREADS) p.lse[cols.row(p, g)] = neg_inf();
            }
        }
        return;
    }

    if (warp >= PRODUCER_WARP) {
        // ============================== producer warp(s) =================================
        ProducerRing ring_state = {ring, k_full, v_full, empty, l2_policy_evict_first()};
        if constexpr (PAGED) {
            // The walk is worked out again here rather than kept from before the wait: carried
            // across the prologue it cost 12 registers and put the ring's address conversion
            // back inside the tile loop.
            const PageWalk walk = page_walk(p, batch, range);
            if (!EARLY_TABLE_READ || replan) load_first_page_chunks(page_ids, first_pages(walk, lane));
            produce_paged(p, ring_state, range, num_tiles, walk, page_ids, kv_head, lane, warp - PRODUCER_WARP);
        } else if (lane == 0) {
            produce_contiguous(p, ring_state, range, num_tiles, batch, kv_head);
        }
        if (in_cluster) {
            cluster_wait_acquire();
            cluster_merge_slice(p, cluster, recv_m, recv_l, recv_o, cols);
        }
        return;
    }

    // ================================= consumer warps ======================================
    if (!cols.single_token) named_barrier_sync(1, CONSUMER_THREADS);  // column tables
    // Q of the group -> shared memory, rows past the group zero-filled (their columns are
    // computed and dropped; zeros keep them finite).
    // Every load is issued before the first store: a loop that stores each chunk before loading
    // the next pays one global-load latency per chunk a thread owns (2-4), and on a one- or
    // two-tile split that can outlast the first K tile's TMA.
    {
        constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row
        constexpr int Q_CHUNKS = GROUP_PAD * CHUNKS;
        constexpr int PER_THREAD = (Q_CHUNKS + CONSUMER_THREADS - 1) / CONSUMER_THREADS;
        uint4 val[PER_THREAD];
#pragma unroll
        for (int k = 0; k < PER_THREAD; ++k) {
            const int i = threadIdx.x + k * CONSUMER_THREADS, g = i / CHUNKS, c = i % CHUNKS;
            val[k] = make_uint4(0, 0, 0, 0);
            if (i < Q_CHUNKS && g < cols.count) val[k] = *reinterpret_cast<const uint4*>(cols.q(p, g) + c * 8);
        }
        if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_Q_ISSUED);
#pragma unroll
        for (int k = 0; k < PER_THREAD; ++k) {
            const int i = threadIdx.x + k * CONSUMER_THREADS, g = i / CHUNKS, c = i % CHUNKS;
            if (i < Q_CHUNKS) *reinterpret_cast<uint4*>(q_smem + g * SMEM_ROW + c * 16) = val[k];
        }
        named_barrier_sync(1, CONSUMER_THREADS);
        if constexpr (Kv::QUERY_PERMUTED) {
            permute_query_rows<Kv, HEAD_DIM, SMEM_ROW, CONSUMER_THREADS, IS_F16>(smem_addr(q_smem), cols.count);
            named_barrier_sync(1, CONSUMER_THREADS);
        }
        if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_Q_STAGED);
    }

    const int group = warp / GROUP_WARPS;
    const int row0 = (warp % GROUP_WARPS) * ROWS_PER_WARP;  // first row of this warp in a tile
    const u32 q_base = smem_addr(q_smem);
    // the KV head's dequantisation scales (1 for 2-byte caches)
    const float score_scale =
        p.scale_log2 * kv_scale<KV_FP8>(p.k_scale, p.k_scale_batch_stride, p.k_scale_head_stride, batch, kv_head);
    const float v_scale = kv_scale<KV_FP8>(p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride, batch, kv_head);
    const u32 ring_base = smem_addr(ring);

    // Per-thread state. Fragment columns (query heads) of S^T and O^T coincide: lane holds
    // columns nt*8 + 2*(lane%4) + {0,1}, so one (m, l, alpha) pair per column covers both.
    float o_acc[D_TILES][N_TILES][4];
    float m_run[N_TILES][2], l_run[N_TILES][2];
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            m_run[nt][j] = neg_inf();
            l_run[nt][j] = 0.f;
        }
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) o_acc[dt][nt][i] = 0.f;
    }

    // Last position (exclusive) each of this lane's columns may see inside the split: the split's
    // end, or earlier for the first new tokens of a multi-token decode.
    int limit[N_TILES][2];
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int c = nt * 8 + 2 * (lane % 4) + j;
            limit[nt][j] = c < cols.count ? min(range.end, cols.visible(c)) : range.end;
        }

    // ldmatrix lane addressing (see ptx.cuh): joined-halves K as row-major A and V^T via .trans
    // (every other tile through Kv's fragment loads), Q as col B.
    const int a_row = lane % 16, a_col = (lane / 16) * 8;                       // K
    const int v_row = (lane / 16) * 8 + lane % 8, v_col = ((lane / 8) % 2) * 8;  // V^T
    const int q_row = lane % 8, q_col = (lane / 8) * 8;                          // Q, 2 k-steps

    for (int tile = group; tile < num_tiles; tile += CONSUMER_GROUPS) {
        const int stage = tile % STAGES;
        const u32 parity = (tile / STAGES) & 1;
        mbarrier_wait(&k_full[stage], parity);
        if (TRACE && tile == 0 && warp == 0 && lane == 0) trace_stamp(TRACE_FIRST_TILE);
        if (TRACE && tile == 1 && warp % GROUP_WARPS == 0 && lane == 0) trace_stamp(TRACE_SECOND_TILE);
        const u32 k_tile = ring_base + stage * STAGE_BYTES;
        const u32 v_tile = k_tile + TILE_BYTES;
        const int tile_begin = range.begin + tile * TILE_TOKENS;

#pragma unroll
        for (int ms = 0; ms < M_SLICES; ++ms) {
            const int slice_row = row0 + ms * 16;

            // ---- S^T = K Q^T for 16 tokens x GROUP_PAD heads ----
            float s[N_TILES][4];
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D_TILES; kk += 2) {
                u32 a0[4], a1[4];
                if constexpr (JOINED_HALVES) {
                    ldmatrix_x4(a0, kv_chunk(k_tile, slice_row + a_row, 2 * kk + a_col / 8, p.page_size));
                    ldmatrix_x4(a1, kv_chunk(k_tile, slice_row + a_row, 2 * (kk + 1) + a_col / 8, p.page_size));
                } else {
                    Kv::k_fragments(a0, a1, k_tile, slice_row, kk, lane);
                }
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt) {
                    u32 b[4];
                    ldmatrix_x4(b, q_base + (nt * 8 + q_row) * SMEM_ROW + (kk * 16 + q_col) * 2);
                    mma_m16n8k16<MMA_F16>(s[nt], a0, b[0], b[1]);
                    mma_m16n8k16<MMA_F16>(s[nt], a1, b[2], b[3]);
                }
            }

            // ---- online softmax over this warp's rows (base 2) ----
            const int tok_lo = tile_begin + slice_row + lane / 4;  // rows of s[..][0..1]
            u32 p_frag[N_TILES][2];
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt) {
                float x[4];
                x[0] = tok_lo < limit[nt][0] ? s[nt][0] * score_scale : neg_inf();
                x[1] = tok_lo < limit[nt][1] ? s[nt][1] * score_scale : neg_inf();
                x[2] = tok_lo + 8 < limit[nt][0] ? s[nt][2] * score_scale : neg_inf();
                x[3] = tok_lo + 8 < limit[nt][1] ? s[nt][3] * score_scale : neg_inf();
                float mx[2] = {fmaxf(x[0], x[2]), fmaxf(x[1], x[3])};
#pragma unroll
                for (int j = 0; j < 2; ++j) {
#pragma unroll
                    for (int off = 4; off < 32; off *= 2)
                        mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], off));
                    const float m_new = fmaxf(m_run[nt][j], mx[j]);
                    // A column that has seen only masked rows keeps m = -inf; subtract 0 then so
                    // that exp2 gives 0 rather than NaN.
                    const float m_use = m_new == neg_inf() ? 0.f : m_new;
                    const float alpha = exp2_approx(m_run[nt][j] - m_use);
                    m_run[nt][j] = m_new;
                    x[j] = exp2_approx(x[j] - m_use);
                    x[j + 2] = exp2_approx(x[j + 2] - m_use);
                    l_run[nt][j] = l_run[nt][j] * alpha + x[j] + x[j + 2];
#pragma unroll
                    for (int dt = 0; dt < D_TILES; ++dt) {
                        o_acc[dt][nt][j] *= alpha;
                        o_acc[dt][nt][j + 2] *= alpha;
                    }
                }
                // P^T as the B operand: the S^T accumulator halves are 8x8 blocks with tokens on
                // rows; transposing each in registers gives the k-major B fragment.
                p_frag[nt][0] = movmatrix_trans(pack_half2<MMA_F16>(x[0], x[1]));
                p_frag[nt][1] = movmatrix_trans(pack_half2<MMA_F16>(x[2], x[3]));
            }

            // ---- O^T += V^T P^T ----
            if (ms == 0) mbarrier_wait(&v_full[stage], parity);
            if (TRACE && ms == 0 && tile == num_tiles - 1 && warp % GROUP_WARPS == 0 && lane == 0)
                trace_stamp(TRACE_LAST_TILE);
            // Positions past the end carry P = 0, but the V rows there may hold anything
            // (NaN included, and 0 * NaN = NaN): clear them in the partial last tile. Lane holds
            // V^T columns (positions) 2*(lane%4) + {0,1} in a[0..1] and 8 more in a[2..3].
            u32 keep_lo = 0xffffffffu, keep_hi = 0xffffffffu;
            if (tile_begin + TILE_TOKENS > range.end) {
                const int t0 = tile_begin + slice_row + 2 * (lane % 4);
                keep_lo = (t0 < range.end ? 0x0000ffffu : 0u) | (t0 + 1 < range.end ? 0xffff0000u : 0u);
                keep_hi = (t0 + 8 < range.end ? 0x0000ffffu : 0u) | (t0 + 9 < range.end ? 0xffff0000u : 0u);
            }
#pragma unroll
            for (int dt = 0; dt < D_TILES; dt += 2) {
                u32 a[2][4];
                if constexpr (JOINED_HALVES) {
#pragma unroll
                    for (int t = 0; t < 2; ++t)
                        ldmatrix_x4_trans(a[t], kv_chunk(v_tile, slice_row + v_row, 2 * (dt + t) + v_col / 8,
                                                         p.page_size));
                } else {
                    Kv::v_fragments(a[0], a[1], v_tile, slice_row, dt, lane);
                }
                accumulate_o<MMA_F16>(o_acc, dt, a, keep_lo, keep_hi, p_frag);
            }
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty[stage]);
    }
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_LOOP_DONE);

    // ============================ end of split: merge the warps ============================
    // Denominators were accumulated per lane over its own rows; finish them across the 8 lanes
    // that share a column.
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

    // Each warp rescales its O^T to the CTA-wide max and parks it in the drained ring.
    float* merge = reinterpret_cast<float*>(ring);
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = nt * 8 + 2 * (lane % 4) + j;
            float m_cta = neg_inf();
#pragma unroll
            for (int w = 0; w < CONSUMER_WARPS; ++w) m_cta = fmaxf(m_cta, warp_m[w * GROUP_PAD + col]);
            const float m_use = m_cta == neg_inf() ? 0.f : m_cta;
            // the V scale rides on the rescale factor: every output path below (normalised,
            // FP32 partials, cluster pushes) then carries dequantised values
            const float factor = exp2_approx(m_run[nt][j] - m_use) * v_scale;
            float* dst = merge + warp * MERGE_WARP_FLOATS + col * MERGE_ROW;
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt) {
                dst[Kv::o_dim(dt, lane / 4)] = o_acc[dt][nt][j] * factor;
                dst[Kv::o_dim(dt, lane / 4 + 8)] = o_acc[dt][nt][j + 2] * factor;
            }
        }
    named_barrier_sync(1, CONSUMER_THREADS);
    if (TRACE && threadIdx.x == 0) trace_stamp(TRACE_MERGED);

    // Sum the warps in a fixed order and write: four head-dim elements per thread per step
    // (a cluster slice is at least four wide, HEAD_DIM / 16 at d64). Each thread works its
    // column's CTA max and denominator out again from the warps' statistics: measured faster
    // than sharing them through shared memory, which puts one thread's chain in front of the
    // merge barrier.
    const bool single_split = item.num_splits == 1;
    if (in_cluster) cluster_wait_acquire();  // every peer has started: its shared memory exists
    for (int i = threadIdx.x; i < cols.count * (HEAD_DIM / 4); i += CONSUMER_THREADS) {
        const int g = i / (HEAD_DIM / 4), d = (i % (HEAD_DIM / 4)) * 4;
        float m_cta = neg_inf();
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; ++w) m_cta = fmaxf(m_cta, warp_m[w * GROUP_PAD + g]);
        const float m_use = m_cta == neg_inf() ? 0.f : m_cta;
        float l_cta = 0.f;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; ++w) {
            l_cta += warp_l[w * GROUP_PAD + g] * exp2_approx(warp_m[w * GROUP_PAD + g] - m_use);
            const float4 v = *reinterpret_cast<const float4*>(merge + w * MERGE_WARP_FLOATS + g * MERGE_ROW + d);
            o.x += v.x;
            o.y += v.y;
            o.z += v.z;
            o.w += v.w;
        }
        if (single_split) {
            const float inv = l_cta > 0.f ? 1.f / l_cta : 0.f;
            *reinterpret_cast<uint2*>(cols.out(p, g) + d) =
                make_uint2(pack_half2<IS_F16>(o.x * inv, o.y * inv), pack_half2<IS_F16>(o.z * inv, o.w * inv));
            if (p.lse && d == 0) {
                p.lse[cols.row(p, g)] =
                    l_cta > 0.f ? (m_cta + __log2f(l_cta)) * 0.69314718055994531f : neg_inf();
            }
        } else if (in_cluster) {
            cluster_push_o(cluster, smem_addr(recv_o), g, d, o.x, o.y);
            cluster_push_o(cluster, smem_addr(recv_o), g, d + 2, o.z, o.w);
            if (d == 0) cluster_push_stats(cluster, smem_addr(recv_m), smem_addr(recv_l), g, m_cta, l_cta);
        } else {
            const long long row = partial_row(g);
            *reinterpret_cast<float4*>(p.o_partial + row * HEAD_DIM + d) = o;
            if (d == 0) {
                p.m_partial[row] = m_cta;
                p.l_partial[row] = l_cta;
            }
        }
    }
    if (TRACE) {
        named_barrier_sync(1, CONSUMER_THREADS);
        if (threadIdx.x == 0) {
            trace_stamp(TRACE_EXIT);
            trace_write(num_tiles, item.num_splits, len, TRACE_FLAGS);
        }
    }
    if (in_cluster) cluster_merge_slice(p, cluster, recv_m, recv_l, recv_o, cols);
}
