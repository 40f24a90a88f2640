//! From a problem to a launch plan: kernel variant, tile shape, split count, grid and workspace.
//!
//! Every heuristic of the library lives here, next to the measurements that set its constants,
//! so that the kernels and the launch code only execute decisions.
//!
//! # Engines
//!
//! Two engines decode; [`choose`] picks one per problem ([`PlanOptions::engine`] forces it).
//!
//! - The **persistent engine** (`decode.cu`): one CTA per SM, each working out its share of the
//!   call's KV tiles on the device from the lengths (`schedule.cuh`, mirrored by
//!   [`crate::schedule`]), so nothing here depends on the lengths and a captured graph stays
//!   balanced whatever lengths it is replayed with. The host decides only the kernel variant
//!   ([`persistent_variant`]), the grid (the SM count, at most [`PERSISTENT_MAX_GRID`]) and
//!   the fewest tiles a working CTA takes ([`PERSISTENT_MIN_TILES_PER_CTA`]). The default
//!   where the batch fills the GPU ([`persistent_by_default`]).
//! - The **split engine** (`decode_gqa.cu` + `combine.cu`, or `plan_work.cu` for a device
//!   plan): one CTA per (request, KV head, split), planned below. The default elsewhere.
//!
//! A knob of one engine selects it: `num_splits`, `reduction`, `device_plan`, `stages`,
//! `consumer_groups`, `resident_ctas` the split engine; `persistent_ctas`, `min_tiles_per_cta`,
//! `persistent_stages`, `persistent_groups`, `persistent_tile_tokens`, `persistent_kv_l2`,
//! `persistent_paged_gather`, `persistent_producer_warps`, `persistent_softmax_slices` the
//! persistent one.
//!
//! # Split engine: split count and reduction mode
//!
//! 1. `ctas = batch * hkv`; `target = sm_count / 2` ([`TARGET_CTAS_PER_SM`] = 1/2): about 64
//!    streaming CTAs saturate HBM on the H200;
//! 2. `splits = max(1, target / ctas)`: one split as soon as the batch alone supplies the target;
//! 3. at most one split per tile ([`MIN_TILES_PER_SPLIT`] = 1), at most [`MAX_SPLITS`].
//!
//! Worked example: 16/2 heads, d 128, batch 1, L 131072 on 132 SMs: 2 CTAs, target 66, so
//! 33 splits of 62 tiles (64 positions each): 66 CTAs.
//!
//! Reduction ([`auto_reduction`]): cluster reduction for 2, 4 or 8 splits of at most 2 tiles
//! each and at most 8 query columns per KV head ([`AUTO_CLUSTER_MAX_SPLITS`],
//! [`AUTO_CLUSTER_MAX_TILES`], [`AUTO_CLUSTER_MAX_COLUMNS`]), two splits in a cluster on the
//! paged plan where the heuristic wants 2-4 ([`paged_cluster_pair`]), kernel reduction
//! otherwise; PDL on in both modes. The sweeps and same-run comparisons behind every number
//! here are in docs/tuning.md.

use crate::error::{Error, Result};
use crate::kernels::{
    CombineVariant, DecodeVariant, KvSource, MlaVariant, PersistentVariant, MAX_N_TILES,
};
use crate::problem::{DType, DecodeProblem, KvDType};

/// Most CTAs of a persistent grid: the SMs of an H100/H200 (the kernel's merge scratch is sized
/// for a unit cut into at most this many pieces, `MAX_GRID` in decode.cu).
pub const PERSISTENT_MAX_GRID: usize = 132;
/// Fewest tiles a working CTA of the persistent engine takes: a short cache is spread over
/// fewer CTAs rather than cut into single-tile pieces that each cost a partial and a merge.
pub const PERSISTENT_MIN_TILES_PER_CTA: usize = 2;
/// Deepest ring of the persistent engine at d 64 (four 32 KB stages; see [`persistent_variant`]).
pub const PERSISTENT_MAX_STAGES: usize = 4;
/// Ring of the persistent engine at d 128: one group of consumer warps and two 32 KB stages
/// (see [`persistent_variant`]).
pub const PERSISTENT_D128_RING: (usize, usize) = (1, 2);

/// The persistent variant for a head dim, column-block width and cache kind. d 128: one
/// consumer group and a two-stage ring ([`PERSISTENT_D128_RING`]): 64 KB in flight per SM
/// measured fastest on every batch >= 16 row and serving row against deeper rings and two
/// groups (TMA streams lose rate past that; docs/tuning.md, "Persistent ring"). d 64: two
/// consumer groups where their accumulators fit ([`DecodeVariant::groups_fit`]) and the
/// deepest ring up to [`PERSISTENT_MAX_STAGES`] that fits the shared memory (two stages
/// measured 1-2.5% slower there).
pub fn persistent_variant(
    dtype: DType,
    kv_dtype: KvDType,
    head_dim: usize,
    n_tiles: usize,
    kv_source: KvSource,
) -> PersistentVariant {
    let (consumer_groups, max_stages) = default_ring(kv_dtype, head_dim, n_tiles);
    let wide = crate::kernels::WIDE_BLOCK_N_TILES.contains(&n_tiles);
    let v = PersistentVariant {
        dtype,
        kv_dtype,
        head_dim,
        heads_per_row: 1,
        n_tiles,
        tile_tokens: if wide {
            crate::kernels::WIDE_TILE_TOKENS
        } else {
            tile_tokens(head_dim)
        },
        stages: consumer_groups,
        consumer_groups,
        kv_source,
        producer_warps: default_producer_warps(kv_source),
        kv_l2: crate::kernels::L2Hint::default(),
        softmax_slices: 1,
    };
    with_deepest_ring(v, max_stages)
}

/// The persistent variant that streams pairs of adjacent KV heads of `head_dim` (64 or 96) as
/// rows of twice that ([`can_pair_heads`]): [`persistent_variant`] of the row's width (its ring,
/// tile and sources) with two heads per row.
pub fn persistent_paired_variant(
    dtype: DType,
    kv_dtype: KvDType,
    head_dim: usize,
    n_tiles: usize,
    kv_source: KvSource,
) -> PersistentVariant {
    PersistentVariant {
        heads_per_row: 2,
        ..persistent_variant(dtype, kv_dtype, 2 * head_dim, n_tiles, kv_source)
    }
}

/// Head dims whose KV heads the persistent engine can stream in adjacent pairs: d 64 as d 128
/// rows; d 96 as d 192 rows, three whole 128-byte boxes a position where a d 96 row alone
/// takes a box and a half (its second box half out of bounds, and every odd head's row starting
/// mid-line).
pub const PAIRED_HEAD_DIMS: [usize; 2] = [64, 96];

/// Whether the persistent engine can stream `problem`'s KV heads in adjacent pairs
/// (decode.cu, "Paired heads"): a head dim of [`PAIRED_HEAD_DIMS`], an even number of KV heads,
/// each cache's heads next to each other (head stride = head dim: always so in a page pool),
/// and the pair's query rows fitting one column block (of at most [`MAX_N_TILES`] n8 tiles, two
/// at d 96 pairs' width); in a page pool, a producer for the pair rows (e4m3 d 96 pairs, twelve
/// 16-byte chunks in 64-byte boxes, are neither gathered nor boxed at pages of 1:
/// [`crate::kernels::boxes_carry_pages`]). (A K element of +-Inf or NaN in one head then reaches its pair's
/// scores too, as 0 x Inf; finite caches, and every cache `store_kv` writes, are unaffected.)
pub fn can_pair_heads(problem: &DecodeProblem) -> bool {
    let d = problem.head_dim;
    let adjacent = |s: crate::problem::KvStrides| s.head == d as i64;
    let elem = problem.kv_elem_bytes();
    // a pool's pair rows need a producer: gathered, or by boxes where their runs land aligned
    let pages_readable = |page: usize| {
        crate::kernels::gathers_rows(2 * d, elem)
            || crate::kernels::boxes_carry_pages(2 * d, elem, page)
    };
    PAIRED_HEAD_DIMS.contains(&d)
        && problem.hkv % 2 == 0
        && match problem.paged {
            Some(pg) => pages_readable(pg.page_size),
            None => adjacent(problem.k_strides) && adjacent(problem.v_strides),
        }
        && 2 * problem.columns() <= 8 * crate::kernels::max_n_tiles(2 * d)
}

/// Whether the plan pairs `problem`'s KV heads by default: heads that [`can_pair_heads`] where
/// a KV head's rows leave more than half of their last n8 tile empty (`columns % 8` in 1..=4:
/// MHA, groups up to 4, small multi-token groups): the pair then computes the softmax of one
/// tile where two heads alone compute two (and d 96 pairs read three whole boxes a position
/// where a d 96 row takes a box and a half). The measurements: docs/tuning.md, "Paired heads".
pub fn pairs_heads(problem: &DecodeProblem) -> bool {
    can_pair_heads(problem) && (1..=4).contains(&(problem.columns() % 8))
}

/// `problem` as the paired-heads kernel sees its caches: half the KV heads, rows of 128 dims
/// (strides of the d 64 caches, the head stride doubled). Query rows, outputs, scales and the
/// softmax scale stay the problem's own.
fn paired_view(problem: &DecodeProblem) -> DecodeProblem {
    let pair = |s: crate::problem::KvStrides| crate::problem::KvStrides {
        head: 2 * s.head,
        ..s
    };
    DecodeProblem {
        hkv: problem.hkv / 2,
        head_dim: 2 * problem.head_dim,
        softmax_scale: Some(problem.scale()),
        k_strides: pair(problem.k_strides),
        v_strides: pair(problem.v_strides),
        ..problem.clone()
    }
}

/// Pages smaller than this many positions are gathered by the persistent producer
/// ([`KvSource::PagedGather`], [`PERSISTENT_GATHER_WARPS`] warps of 16-byte copies); larger ones
/// arrive as one TMA box per page run and row of head dims ([`KvSource::PagedBoxes`]), for
/// positions of `row_bytes` (head dim x element bytes). 128-byte rows (d 64 bf16): a box of a
/// page of 16 carries 2 KB, and the boxes streamed 1.08-1.14x slower than the gather there at
/// batch >= 8; 256-byte rows (d 128 bf16): the boxes of pages of 16 ran 1.0-1.9% faster than
/// the gather. Pages of 1 by boxes (a descriptor per position and row) ran 5-7x slower than
/// gathered. 64-byte rows (d 64 fp8) follow the box size: below 64. Tables: docs/tuning.md,
/// "Gathered pages".
pub fn persistent_gather_below_page(row_bytes: usize) -> usize {
    match row_bytes {
        ..=64 => 2 * PERSISTENT_GATHER_BELOW_PAGE_D64,
        65..=128 => PERSISTENT_GATHER_BELOW_PAGE_D64,
        _ => PERSISTENT_GATHER_BELOW_PAGE_D128,
    }
}
/// The L2 promotion of the K and V boxes for rows of `row_bytes` (head dim x element bytes):
/// 128 bytes, a row's line, where rows are a multiple of 128 bytes; 64 bytes otherwise: for
/// 64-byte rows (d 64 e4m3) 128 bytes fetched the next KV head's row as well and read the cache
/// twice from DRAM (ncu: 529 MB for a 268 MB cache), and rows of 192 bytes (d 96 bf16) start
/// off a line, where 128-byte promotion ran 25% slower (docs/tuning.md, "L2 promotion").
pub fn kv_promotion_for(row_bytes: usize) -> crate::launch::TmaPromotion {
    if row_bytes <= 64 || row_bytes % 128 != 0 {
        crate::launch::TmaPromotion::B64
    } else {
        crate::launch::TmaPromotion::B128
    }
}
/// The forced promotion, else [`kv_promotion_for`] the problem's rows (every engine's plan).
fn kv_promotion(problem: &DecodeProblem, options: PlanOptions) -> crate::launch::TmaPromotion {
    options
        .kv_promotion
        .unwrap_or_else(|| kv_promotion_for(problem.head_dim * problem.kv_elem_bytes()))
}
/// (see [`persistent_gather_below_page`])
pub const PERSISTENT_GATHER_BELOW_PAGE_D64: usize = 32;
/// (see [`persistent_gather_below_page`])
pub const PERSISTENT_GATHER_BELOW_PAGE_D128: usize = 16;

/// Producer warps gathering pages ([`KvSource::PagedGather`]): one warp issuing every 16-byte
/// copy streamed pages of 1 at a third of a contiguous cache's rate, two at half; four reach
/// 1.33-1.41x of it on pages of 1 and 1.02-1.05x on pages of 16 at d 64 (docs/tuning.md,
/// "Gathered pages").
pub const PERSISTENT_GATHER_WARPS: usize = 4;

/// Where the persistent producer reads `problem`'s K and V from by default (page runs by boxes
/// where the gathering warps cannot copy its rows, [`crate::kernels::gathers_rows`]).
pub fn persistent_kv_source(problem: &DecodeProblem) -> KvSource {
    let elem = problem.kv_elem_bytes();
    match problem.paged {
        None => KvSource::Contiguous,
        Some(pg)
            if pg.page_size < persistent_gather_below_page(problem.head_dim * elem)
                && crate::kernels::gathers_rows(problem.head_dim, elem) =>
        {
            KvSource::PagedGather
        }
        Some(_) => KvSource::PagedBoxes,
    }
}

/// Producer warps of a source: [`PERSISTENT_GATHER_WARPS`] gathering, one otherwise.
fn default_producer_warps(source: KvSource) -> usize {
    if source == KvSource::PagedGather {
        PERSISTENT_GATHER_WARPS
    } else {
        1
    }
}

/// `v` with every variant-level knob of the persistent engine in `o` applied, each checked:
/// the producer of a paged cache ([`PlanOptions::persistent_paged_gather`]), its warps
/// ([`PlanOptions::persistent_producer_warps`]), the ring ([`persistent_variant_with_ring`])
/// and the L2 priority ([`PlanOptions::persistent_kv_l2`]). The one place the plan and the
/// CLI's ring sweeps turn knobs into a variant.
pub fn persistent_variant_forced(
    mut v: PersistentVariant,
    o: &PlanOptions,
) -> Result<PersistentVariant> {
    if let (true, Some(gather)) = (v.kv_source.paged(), o.persistent_paged_gather) {
        let elem = v.kv_dtype.size(v.dtype);
        if gather && !crate::kernels::gathers_rows(v.head_dim, elem) {
            return Err(Error::invalid(
                "persistent_paged_gather",
                true,
                format!(
                    "false or none for rows of {} elements (paired heads): a gathering warp \
                     copies whole rows of 16-byte chunks, at most 32 and dividing 32",
                    v.head_dim
                ),
            ));
        }
        v.kv_source = if gather {
            KvSource::PagedGather
        } else {
            KvSource::PagedBoxes
        };
        v.producer_warps = default_producer_warps(v.kv_source);
    }
    v.producer_warps = match o.persistent_producer_warps {
        None => v.producer_warps,
        Some(1) => 1,
        Some(w) if v.kv_source == KvSource::PagedGather && [2, 4].contains(&w) => w,
        Some(w) => {
            return Err(Error::invalid(
                "persistent_producer_warps",
                w,
                "1; 2 or 4 only for a paged cache the persistent engine gathers \
                 (persistent_paged_gather)",
            ))
        }
    };
    let mut v = persistent_variant_with_ring(
        v,
        o.persistent_groups,
        o.persistent_stages,
        o.persistent_tile_tokens,
    )?;
    if let Some(m) = o.persistent_softmax_slices {
        // m16 slices of one warp's rows of a tile (four warps share a tile)
        let slices = v.tile_tokens / 4 / 16;
        if !(1..=2).contains(&m) || slices % m != 0 {
            return Err(Error::invalid(
                "persistent_softmax_slices",
                m,
                format!(
                    "1, or 2 where a warp holds an even number of m16 slices of a tile ({slices} \
                     at {} positions per tile)",
                    v.tile_tokens
                ),
            ));
        }
        v.softmax_slices = m;
    }
    if v.wide() && (v.tile_tokens != crate::kernels::WIDE_TILE_TOKENS || v.softmax_slices != 1) {
        return Err(Error::invalid(
            "persistent_tile_tokens / persistent_softmax_slices",
            format!("{} / {}", v.tile_tokens, v.softmax_slices),
            format!(
                "none with persistent_wide_columns (its consumer takes tiles of {} positions, one \
                 softmax step a tile)",
                crate::kernels::WIDE_TILE_TOKENS
            ),
        ));
    }
    Ok(PersistentVariant {
        kv_l2: o.persistent_kv_l2.unwrap_or(v.kv_l2),
        ..v
    })
}

/// Whether the persistent engine's wide consumer can serve `problem` (decode.cu, "wide
/// consumer"): a head dim of [`crate::kernels::WIDE_HEAD_DIMS`] (2-byte or e4m3 cache) and
/// more query rows a KV head than one narrow column block holds (32).
pub fn can_take_wide_columns(problem: &DecodeProblem) -> bool {
    crate::kernels::WIDE_HEAD_DIMS.contains(&problem.head_dim)
        && problem.columns() > 8 * MAX_N_TILES
}

/// n8 tiles of `problem`'s wide column blocks ([`PlanOptions::persistent_wide_rows`]): blocks
/// of 64 rows unless 128 are asked for, which need more than 64 rows a KV head. docs/tuning.md,
/// "Wide consumer".
pub fn wide_n_tiles(problem: &DecodeProblem, rows: Option<usize>) -> Result<usize> {
    match rows {
        None | Some(64) => Ok(crate::kernels::WIDE_N_TILES),
        Some(128) if problem.columns() > 64 => Ok(crate::kernels::WIDE_SPLIT_N_TILES),
        Some(r) => Err(Error::invalid(
            "persistent_wide_rows",
            r,
            format!(
                "64, or 128 for more than 64 query rows a KV head (this problem: {} rows)",
                problem.columns()
            ),
        )),
    }
}

/// (consumer groups, deepest ring) of the persistent variant (see [`persistent_variant`]).
/// fp8 caches: the same tiles (a larger one spills at four column tiles), two consumer groups
/// where they fit (twice the elements per byte to compute: one group streamed 6% slower at
/// d 128); at d 128 [`PERSISTENT_FP8_D128_STAGES`] stages, elsewhere twice the 2-byte stages,
/// so that the ring holds the bytes measured best for 2-byte caches (docs/tuning.md, "FP8
/// caches"). Head dims 96 and 256 take d 128's rules (rows of 128 bytes as well; the ring is
/// cut to what fits), not yet measured on their own.
fn default_ring(kv_dtype: KvDType, head_dim: usize, n_tiles: usize) -> (usize, usize) {
    if crate::kernels::WIDE_BLOCK_N_TILES.contains(&n_tiles) {
        // two warpgroups, as many stages in flight as fit
        return (2, PERSISTENT_WIDE_MAX_STAGES);
    }
    if kv_dtype == KvDType::Fp8E4m3 {
        // two groups hold twice the O^T accumulators: at most 256 head dims x 8 columns a thread
        let groups = if DecodeVariant::groups_fit(n_tiles, 2) && head_dim * n_tiles <= 256 {
            2
        } else {
            1
        };
        if head_dim >= 96 {
            return (groups, PERSISTENT_FP8_D128_STAGES);
        }
        let (_, stages) = default_ring(KvDType::AsQuery, head_dim, n_tiles);
        return (groups, 2 * stages.max(groups));
    }
    if head_dim >= 96 {
        PERSISTENT_D128_RING
    } else if DecodeVariant::groups_fit(n_tiles, 2) {
        (2, PERSISTENT_MAX_STAGES)
    } else {
        (1, PERSISTENT_MAX_STAGES)
    }
}

/// Deepest ring of the wide consumer (cut to what fits: blocks of 64 rows four 32 KB stages at
/// d 128, eight 16 KB ones at d 64; blocks of 128 three and seven). Not swept.
pub const PERSISTENT_WIDE_MAX_STAGES: usize = 8;

/// Ring depth of the persistent engine for e4m3 caches at d 128: eight 16 KB stages (128 KB in
/// flight, twice what 2-byte caches measured best) ran 0.4-2.4% faster than four on the
/// batch-filling rows in two runs (b16 L32768, b128 L4096; docs/tuning.md, "FP8 caches").
pub const PERSISTENT_FP8_D128_STAGES: usize = 8;

/// `v` with the deepest ring of at most `max_stages` stages (a multiple of its consumer groups)
/// that fits one SM's shared memory; one lap of its groups at least.
fn with_deepest_ring(mut v: PersistentVariant, max_stages: usize) -> PersistentVariant {
    let groups = v.tile_groups();
    let mut stages = (max_stages / groups * groups).max(groups);
    while stages > groups && v.shared_bytes_with(stages) > PERSISTENT_SHARED_BUDGET {
        stages -= groups;
    }
    v.stages = stages;
    v
}

/// Dynamic shared memory one persistent CTA may use (one CTA per SM).
const PERSISTENT_SHARED_BUDGET: usize = SM_SHARED_BYTES - SHARED_BYTES_RESERVED_PER_CTA;

/// Largest forced ring depth of the persistent engine ([`PlanOptions::persistent_stages`]).
pub const PERSISTENT_MAX_FORCED_STAGES: usize = 8;
/// Largest forced KV positions per stage ([`PlanOptions::persistent_tile_tokens`]): a TMA box
/// spans at most 256 rows.
pub const PERSISTENT_MAX_TILE_TOKENS: usize = 256;

/// `v` with a forced ring, each part checked ([`PlanOptions::persistent_groups`],
/// [`PlanOptions::persistent_stages`], [`PlanOptions::persistent_tile_tokens`]; `None` keeps
/// the default).
pub fn persistent_variant_with_ring(
    mut v: PersistentVariant,
    groups: Option<usize>,
    stages: Option<usize>,
    tile_tokens: Option<usize>,
) -> Result<PersistentVariant> {
    if let Some(t) = tile_tokens {
        if t == 0 || t % 64 != 0 || t > PERSISTENT_MAX_TILE_TOKENS {
            return Err(Error::invalid(
                "persistent_tile_tokens",
                t,
                format!("a multiple of 64 up to {PERSISTENT_MAX_TILE_TOKENS}"),
            ));
        }
        v.tile_tokens = t;
    }
    if let Some(g) = groups {
        let fits = if v.wide() {
            g == 2
        } else {
            (1..=2).contains(&g) && DecodeVariant::groups_fit(v.n_tiles, g)
        };
        if !fits {
            return Err(Error::invalid(
                "persistent_groups",
                g,
                if v.wide() {
                    "2 with the wide consumer (its two warpgroups; persistent_wide_columns \
                     false for narrow blocks)"
                        .to_string()
                } else {
                    format!(
                        "1, or 2 for at most 16 query rows per column block (this problem has {})",
                        v.n_tiles * 8
                    )
                },
            ));
        }
        v.consumer_groups = g;
    }
    match stages {
        None => Ok(with_deepest_ring(
            v,
            default_ring(v.kv_dtype, v.head_dim, v.n_tiles).1,
        )),
        Some(s) => {
            let g = v.tile_groups();
            v.stages = s;
            if s == 0 || s % g != 0 || s > PERSISTENT_MAX_FORCED_STAGES {
                return Err(Error::invalid(
                    "persistent_stages",
                    s,
                    format!(
                        "a multiple of the {g} group(s) that take alternate tiles, up to \
                         {PERSISTENT_MAX_FORCED_STAGES}"
                    ),
                ));
            }
            if v.shared_bytes() > PERSISTENT_SHARED_BUDGET {
                return Err(Error::invalid(
                    "persistent_stages",
                    s,
                    format!(
                        "a ring that fits the {PERSISTENT_SHARED_BUDGET} bytes of shared memory \
                         (this one needs {} with {} positions per stage)",
                        v.shared_bytes(),
                        v.tile_tokens
                    ),
                ));
            }
            Ok(v)
        }
    }
}

/// A persistent decode's plan: what [`plan`] decides when no split-engine knob is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PersistentPlan {
    /// The kernel variant.
    pub variant: PersistentVariant,
    /// CTAs launched (one per SM).
    pub grid: usize,
    /// Fewest tiles a working CTA takes.
    pub min_tiles_per_cta: usize,
    /// Column blocks per KV head (per pair of heads where `variant.heads_per_row` is 2).
    pub col_blocks: usize,
    /// Lanes of CTAs (schedule.cuh): 1, `col_blocks` ([`PlanOptions::persistent_column_lanes`])
    /// or `hkv x col_blocks` ([`PlanOptions::persistent_head_lanes`]).
    pub lanes: usize,
    /// Launch with PDL.
    pub pdl: bool,
    /// L2 promotion of the K and V tensor maps.
    pub kv_promotion: crate::launch::TmaPromotion,
}

impl PersistentPlan {
    /// `problem` as the kernel streams it: with heads paired ([`pairs_heads`]), half the KV
    /// heads in rows of 128 dims; otherwise `problem` itself. Its query rows, outputs and scales
    /// are still `problem`'s.
    pub fn kernel_problem(&self, problem: &DecodeProblem) -> DecodeProblem {
        if self.variant.heads_per_row == 2 {
            paired_view(problem)
        } else {
            problem.clone()
        }
    }

    /// Workspace, in bytes: `[o_partial | ml_partial | arrivals | warm_hints]` (offsets, then the
    /// size), each 256-byte aligned; two arrival counters a unit (pieces parked, slices merged),
    /// which must be zero before the first call (the engine keeps them so), and four int32 a CTA
    /// of L2 warm-up hints (any value is safe: the kernel clamps them).
    pub fn workspace_offsets(
        &self,
        problem: &DecodeProblem,
    ) -> (usize, usize, usize, usize, usize) {
        let columns = self.variant.n_tiles * 8;
        let slots = 2 * self.grid;
        let o = 0;
        let ml = align(slots * columns * problem.head_dim * 4);
        let arrivals = ml + align(slots * columns * 2 * 4);
        let hints = arrivals + align(problem.batch * problem.hkv * self.col_blocks * 2 * 4);
        let end = hints + align(self.grid * 4 * 4);
        (o, ml, arrivals, hints, end)
    }
}

/// The grid of a persistent kernel: one CTA per SM, or `persistent_ctas` up to `max` (the
/// kernel's merge bound; the MLA decode's merge needs every CTA resident: one per SM).
fn persistent_grid(device: DeviceFacts, options: &PlanOptions, max: usize) -> Result<usize> {
    match options.persistent_ctas {
        None => Ok(device.sm_count.clamp(1, PERSISTENT_MAX_GRID)),
        Some(c) if (1..=max).contains(&c) => Ok(c),
        Some(c) => Err(Error::invalid(
            "persistent_ctas",
            c,
            format!("1..={max} for this kernel"),
        )),
    }
}

/// Most CTAs a forced grid of the GQA persistent decode may have
/// ([`PlanOptions::persistent_ctas`]): two per SM, where two fit (the merge waits for every
/// CTA: the decoder checks with the occupancy API that the grid is resident at once).
pub const PERSISTENT_MAX_FORCED_GRID: usize = 2 * PERSISTENT_MAX_GRID;

/// The fewest tiles a working CTA of a persistent kernel takes: `default`, or the knob.
fn min_tiles_per_cta(options: &PlanOptions, default: usize) -> Result<usize> {
    match options.min_tiles_per_cta {
        None => Ok(default),
        Some(t) if t >= 1 => Ok(t),
        Some(t) => Err(Error::invalid("min_tiles_per_cta", t, ">= 1")),
    }
}

/// The persistent plan for `problem` on `device`.
pub fn plan_persistent(
    problem: &DecodeProblem,
    device: DeviceFacts,
    options: PlanOptions,
) -> Result<PersistentPlan> {
    problem.validate()?;
    let paired = match options.persistent_pair_heads {
        None => pairs_heads(problem),
        Some(true) if !can_pair_heads(problem) => {
            return Err(Error::invalid(
                "persistent_pair_heads",
                true,
                format!(
                    "false or none for this problem (d {}, {} KV heads, {} query rows per KV \
                     head): pairs need d 64 or 96, an even head count, adjacent heads and the \
                     pair's rows in one column block (at most 16; 8 at d 96); pools of e4m3 d 96 \
                     pairs need pages of 2 positions or more",
                    problem.head_dim,
                    problem.hkv,
                    problem.columns()
                ),
            ))
        }
        Some(p) => p,
    };
    let wide = match options.persistent_wide_columns {
        Some(true) if paired || !can_take_wide_columns(problem) => {
            return Err(Error::invalid(
                "persistent_wide_columns",
                true,
                format!(
                    "false or none for this problem (d {}, {} query rows per KV head{}): the \
                     wide consumer takes d 64 or 128 with more than 32 rows a KV head, heads \
                     not paired",
                    problem.head_dim,
                    problem.columns(),
                    if paired { ", paired" } else { "" }
                ),
            ))
        }
        Some(w) => w,
        // a forced tile, softmax step or group count the wide consumer does not take asks for
        // narrow blocks
        None => {
            !paired
                && can_take_wide_columns(problem)
                && options
                    .persistent_tile_tokens
                    .map_or(true, |t| t == crate::kernels::WIDE_TILE_TOKENS)
                && options.persistent_softmax_slices.map_or(true, |m| m == 1)
                && options.persistent_groups.map_or(true, |g| g == 2)
        }
    };
    let view = if paired {
        paired_view(problem)
    } else {
        problem.clone()
    };
    let n_tiles = if wide {
        wide_n_tiles(&view, options.persistent_wide_rows)?
    } else if let Some(rows) = options.persistent_wide_rows {
        return Err(Error::invalid(
            "persistent_wide_rows",
            rows,
            "none without the wide consumer (persistent_wide_columns; d 64 or 128, more than 32 \
             query rows a KV head, heads not paired)",
        ));
    } else {
        view.columns()
            .div_ceil(8)
            .min(crate::kernels::max_n_tiles(view.head_dim))
    };
    let source = persistent_kv_source(&view);
    let variant = persistent_variant_forced(
        if paired {
            persistent_paired_variant(view.dtype, view.kv_dtype, problem.head_dim, n_tiles, source)
        } else {
            persistent_variant(view.dtype, view.kv_dtype, view.head_dim, n_tiles, source)
        },
        &options,
    )?;
    let problem = &view;
    if let (KvSource::PagedBoxes, Some(pg)) = (variant.kv_source, problem.paged) {
        let elem = problem.kv_elem_bytes();
        if !crate::kernels::boxes_carry_pages(problem.head_dim, elem, pg.page_size) {
            return Err(Error::invalid(
                "persistent_paged_gather",
                "false (TMA boxes)",
                format!(
                    "true or none for pages of {} positions of {}-byte box rows: a box lands \
                     on a 128-byte boundary",
                    pg.page_size,
                    crate::kernels::kv_box_row_bytes(problem.head_dim, elem)
                ),
            ));
        }
    }
    let grid = persistent_grid(device, &options, PERSISTENT_MAX_FORCED_GRID)?;
    let min_tiles_per_cta = min_tiles_per_cta(&options, PERSISTENT_MIN_TILES_PER_CTA)?;
    let col_blocks = variant.column_blocks(problem);
    // a lane needs one CTA at least
    let lanes = match (
        options.persistent_head_lanes,
        options.persistent_column_lanes,
    ) {
        (Some(true), _) if problem.hkv * col_blocks <= grid => problem.hkv * col_blocks,
        (_, Some(true) | None) if col_blocks > 1 && col_blocks <= grid => col_blocks,
        _ => 1,
    };
    Ok(PersistentPlan {
        variant,
        grid,
        min_tiles_per_cta,
        col_blocks,
        lanes,
        pdl: !options.disable_pdl,
        kv_promotion: kv_promotion(problem, options),
    })
}

/// Column-block widths (n8 tiles) of the MLA decode: 16 or 32 query rows for the narrow
/// consumer (each of its warps scores half of a block's columns), 64 for the wide one (the
/// rows are the M dimension of the warpgroup MMA; 2-byte caches).
pub const MLA_N_TILES: [usize; 3] = [2, 4, MLA_WIDE_N_TILES];
/// The wide consumer's column block, in n8 tiles (64 query rows).
pub const MLA_WIDE_N_TILES: usize = 8;
/// Positions per ring stage of the MLA decode with a 2-byte cache: four m16 slices, one per
/// scoring warp of a column half (decode_mla.cu); the wide consumer's S is 64 positions wide.
pub const MLA_TILE_TOKENS: usize = 64;
/// Positions per ring stage of the narrow MLA consumer with an e4m3 cache: eight m16 slices,
/// one per warp, each scoring all 576 dims of its positions (no partner warp to swap partial
/// scores with: two barriers a tile instead of three, for twice the positions), in stages of
/// the 2-byte ring's 72 KB.
pub const MLA_FP8_TILE_TOKENS: usize = 128;
/// Ring depth of the MLA decode: two 72 KB stages (the most that fit next to two buffers of 32
/// query rows of 576 dims), whatever the cache.
pub const MLA_STAGES: usize = 2;
/// Fewest tiles a working CTA of the MLA decode takes (as [`PERSISTENT_MIN_TILES_PER_CTA`]).
pub const MLA_MIN_TILES_PER_CTA: usize = 2;

/// The MLA variant for a column-block width and cache kind.
pub fn mla_variant(dtype: DType, kv_dtype: KvDType, n_tiles: usize, paged: bool) -> MlaVariant {
    MlaVariant {
        dtype,
        kv_dtype,
        n_tiles,
        // (the wide consumer's tiles are 64 positions whatever the cache: an e4m3 one is
        // widened into a 2-byte staging tile)
        tile_tokens: match kv_dtype {
            KvDType::Fp8E4m3 if n_tiles != MLA_WIDE_N_TILES => MLA_FP8_TILE_TOKENS,
            _ => MLA_TILE_TOKENS,
        },
        stages: MLA_STAGES,
        paged,
    }
}

/// Launch decisions of the MLA decode (`decode_mla.cu`): the persistent schedule of the GQA
/// engine (one unit per request and column block), so nothing depends on the lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaPlan {
    /// The kernel variant.
    pub variant: MlaVariant,
    /// CTAs launched (one per SM).
    pub grid: usize,
    /// Fewest tiles a working CTA takes.
    pub min_tiles_per_cta: usize,
    /// Column blocks per request.
    pub col_blocks: usize,
    /// Lanes of CTAs (schedule.cuh): `col_blocks` where there are several (each lane streams
    /// one column block of every request, all lanes the same tiles at about the same time, so
    /// the cache is read from memory once), else 1.
    pub lanes: usize,
    /// Launch with PDL.
    pub pdl: bool,
    /// L2 promotion of the cache's tensor map.
    pub kv_promotion: crate::launch::TmaPromotion,
}

impl MlaPlan {
    /// Workspace, in bytes: `[o_partial | ml_partial | counters]`, each 256-byte aligned; two
    /// counters per unit (parked pieces, merged slices) that must be zero before the first call.
    pub fn workspace_offsets(&self, batch: usize) -> (usize, usize, usize, usize) {
        let columns = self.variant.n_tiles * 8;
        let slots = 2 * self.grid;
        let ml = align(slots * columns * crate::mla::MLA_V_DIM * 4);
        let counters = ml + align(slots * columns * 2 * 4);
        let end = counters + align(batch * self.col_blocks * 2 * 4);
        (0, ml, counters, end)
    }
}

/// The MLA plan for `problem` on `device`. Of [`PlanOptions`] it takes `persistent_ctas`,
/// `min_tiles_per_cta`, `disable_pdl`, `record_schedule` and `kv_promotion`; any other knob is
/// an error naming it.
pub fn plan_mla(
    problem: &crate::mla::MlaProblem,
    device: DeviceFacts,
    options: PlanOptions,
) -> Result<MlaPlan> {
    problem.validate()?;
    let foreign = options
        .split_knob()
        .or_else(|| options.persistent_ring_knob())
        .or_else(|| options.engine.is_some().then_some("engine"));
    if let Some(knob) = foreign {
        return Err(Error::invalid(
            knob,
            "set",
            "unset for MLA decode (it takes persistent_ctas, min_tiles_per_cta, disable_pdl, \
             record_schedule and kv_promotion)",
        ));
    }
    if let Some(pg) = problem.paged {
        // a box lands on a 128-byte aligned address: a page run must fill 128 bytes at least
        let run_bytes = pg.page_size * crate::mla::MLA_DIM * problem.kv_elem_bytes();
        if run_bytes % 128 != 0 {
            return Err(Error::invalid(
                "page_size",
                pg.page_size,
                "2..=512 for an e4m3 MLA cache (a page of one 576-byte row is no whole number \
                 of 128-byte TMA box rows)",
            ));
        }
    }
    let columns = problem.columns();
    // More rows than a narrow block holds share the KV tile of one wide block: the tile is read
    // from memory (or L2) once for 64 rows, not once per 32 (docs/tuning.md, MLA).
    let n_tiles = if columns <= 16 {
        2
    } else if columns <= 32 {
        4
    } else {
        MLA_WIDE_N_TILES
    };
    let variant = mla_variant(
        problem.dtype,
        problem.kv_dtype,
        n_tiles,
        problem.paged.is_some(),
    );
    let grid = persistent_grid(device, &options, PERSISTENT_MAX_GRID)?;
    let min_tiles_per_cta = min_tiles_per_cta(&options, MLA_MIN_TILES_PER_CTA)?;
    let col_blocks = columns.div_ceil(n_tiles * 8);
    Ok(MlaPlan {
        variant,
        grid,
        min_tiles_per_cta,
        col_blocks,
        lanes: if col_blocks <= grid { col_blocks } else { 1 },
        pdl: !options.disable_pdl,
        kv_promotion: options.kv_promotion.unwrap_or_default(),
    })
}

/// The two decode engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    /// One CTA per SM, scheduled on the device from the lengths at every call (`decode.cu`).
    Persistent,
    /// One CTA per (request, KV head, split), planned on the host or by a planner kernel
    /// (`decode_gqa.cu`, `plan_work.cu`, `combine.cu`).
    Split,
}

impl Engine {
    /// `"persistent"` or `"split"`.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Persistent => "persistent",
            Engine::Split => "split",
        }
    }
}

impl std::str::FromStr for Engine {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "persistent" => Ok(Engine::Persistent),
            "split" => Ok(Engine::Split),
            other => Err(Error::invalid(
                "engine",
                format!("{other:?}"),
                "\"persistent\" or \"split\" (or None: chosen by the plan)",
            )),
        }
    }
}

/// Whether the persistent engine is the default for `problem`: where the batch alone supplies
/// about as many (request, KV head, column block) units as there are SMs, so that the split
/// engine's host plan would not split and one long request replayed in a captured graph would
/// run on a handful of SMs (9x slower than its floor on the skewed serving row). There the
/// persistent engine balances every call whatever the lengths, at 0-11% over the split engine
/// on uniform lengths; on smaller batches every request is split and the split engine measured
/// 1.05-3.3x faster (a cut unit costs the persistent engine its partials, an arrival and a
/// merge by one CTA). The measurements: docs/tuning.md, "Engine choice". fp8 caches
/// ([`KvDType::Fp8E4m3`]) follow the same rule.
///
/// Pages smaller than [`PERSISTENT_GATHER_ALWAYS_BELOW_PAGE`] take the persistent engine at
/// any batch: its gathering producer streams them several times faster than the split engine's
/// boxes (docs/tuning.md, "Engine choice").
///
/// Worked example: 16 requests of 32/8 heads, d 128: 128 units, 128 x 4 >= 132: persistent;
/// 4 such requests: 32 units, 128 < 132: split; with pages of 8: persistent. One request of
/// 16/16 heads, d 64, e4m3, L 131072: 8 pairs x 2048 tiles >= 64 x 132: persistent (paired).
pub fn persistent_by_default(problem: &DecodeProblem, device: DeviceFacts) -> bool {
    if persistent_only(problem).is_some() {
        return true;
    }
    if problem
        .paged
        .is_some_and(|pg| pg.page_size < PERSISTENT_GATHER_ALWAYS_BELOW_PAGE)
    {
        return true;
    }
    let sms = device.sm_count.min(PERSISTENT_MAX_GRID);
    if problem.kv_dtype == KvDType::Fp8E4m3 && pairs_heads(problem) {
        // paired heads: 128-byte rows of 64 positions a tile, one column block a pair
        let tiles = problem.batch * problem.hkv / 2 * problem.max_len.div_ceil(tile_tokens(128));
        if tiles >= PERSISTENT_PAIRED_FP8_MIN_TILES_PER_SM * sms {
            return true;
        }
    }
    let n_tiles = problem.columns().div_ceil(8).min(MAX_N_TILES);
    let units = problem.batch * problem.hkv * problem.columns().div_ceil(8 * n_tiles);
    units * PERSISTENT_MAX_PIECES_PER_UNIT >= sms
}

/// What only the persistent engine serves in `problem`, if anything: head dims other than
/// [`crate::problem::SPLIT_ENGINE_HEAD_DIMS`] and the score modifiers (a sliding window, a
/// softcap, sinks). The split engine is the faster one on some small batches of plain decode
/// only (see [`persistent_by_default`]); new features are built once, on the engine that
/// schedules every call on the device.
pub fn persistent_only(problem: &DecodeProblem) -> Option<String> {
    if !crate::problem::SPLIT_ENGINE_HEAD_DIMS.contains(&problem.head_dim) {
        return Some(format!("head dim {}", problem.head_dim));
    }
    if problem.window != crate::problem::Window::CAUSAL {
        let (l, r) = problem.window.to_window_size();
        return Some(format!("window_size ({l}, {r})"));
    }
    if problem.softcap.is_some() {
        return Some("a softcap".into());
    }
    if problem.sinks {
        return Some("attention sinks".into());
    }
    None
}

/// See [`persistent_by_default`]: e4m3 caches whose d 64 heads pair ([`pairs_heads`]) take the
/// persistent engine at any batch once the capacity gives each SM this many 64-position tiles:
/// there the split engine's unpaired consumers set the rate; below it the cut units' merges and
/// the ring's fill do not amortise (docs/tuning.md, "Paired heads").
pub const PERSISTENT_PAIRED_FP8_MIN_TILES_PER_SM: usize = 64;

/// See [`persistent_by_default`]: smaller pages take the persistent engine whatever the batch
/// (at d 64 pages of 16 are gathered too, but at batch 1 the split engine's boxes of them
/// measured faster: docs/tuning.md, "Engine choice").
pub const PERSISTENT_GATHER_ALWAYS_BELOW_PAGE: usize = 16;

/// See [`persistent_by_default`]: the persistent engine is the default where its schedule cuts
/// a unit into at most this many pieces on average.
pub const PERSISTENT_MAX_PIECES_PER_UNIT: usize = 4;

/// What [`choose`] decided: the engine and its plan.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// The persistent engine (default).
    Persistent(PersistentPlan),
    /// The split engine (a split-engine knob was set).
    Split(DecodePlan),
}

impl Plan {
    /// The split engine's plan, if this is one.
    pub fn split(&self) -> Option<&DecodePlan> {
        match self {
            Plan::Split(p) => Some(p),
            Plan::Persistent(_) => None,
        }
    }

    /// Whether the launches use PDL.
    pub fn pdl(&self) -> bool {
        match self {
            Plan::Persistent(p) => p.pdl,
            Plan::Split(p) => p.pdl,
        }
    }

    /// Short description for reports: `persistent` or the split engine's mode.
    pub fn mode(&self) -> String {
        match self {
            Plan::Persistent(_) => "persistent".into(),
            Plan::Split(p) if p.device_plan.is_some() => "device-plan".into(),
            Plan::Split(p) if p.num_splits == 1 => "one-split".into(),
            Plan::Split(p) => format!(
                "{}+{}",
                p.reduction.name(),
                if p.pdl { "pdl" } else { "nopdl" }
            ),
        }
    }
}

/// The engine and plan for `problem`: the persistent engine unless a split-engine knob is set.
pub fn choose(problem: &DecodeProblem, device: DeviceFacts, options: PlanOptions) -> Result<Plan> {
    problem.validate()?;
    let (split_knob, persistent_knob) = (options.split_knob(), options.persistent_knob());
    if let (Some(s), Some(p)) = (split_knob, persistent_knob) {
        return Err(Error::invalid(
            p,
            "set",
            format!("knobs of one engine only ({s} is a knob of the split engine, {p} of the persistent one)"),
        ));
    }
    let engine = match (options.engine, split_knob, persistent_knob) {
        (Some(Engine::Persistent), Some(knob), _) => {
            return Err(Error::invalid(
                "engine",
                "persistent",
                format!("the split engine: {knob} is one of its knobs"),
            ))
        }
        (Some(Engine::Split), _, Some(knob)) => {
            return Err(Error::invalid(
                "engine",
                "split",
                format!("the persistent engine: {knob} is one of its knobs"),
            ))
        }
        (Some(e), _, _) => e,
        (None, Some(_), _) => Engine::Split,
        (None, _, Some(_)) => Engine::Persistent,
        (None, None, None) if persistent_by_default(problem, device) => Engine::Persistent,
        (None, None, None) => Engine::Split,
    };
    match engine {
        Engine::Persistent => plan_persistent(problem, device, options).map(Plan::Persistent),
        Engine::Split => plan(problem, device, options).map(Plan::Split),
    }
}

impl PlanOptions {
    /// Whether a knob of the split engine is set (which then runs instead of the persistent one).
    pub fn wants_split_engine(&self) -> bool {
        self.split_knob().is_some()
    }

    /// The first knob of the split engine that is set.
    fn split_knob(&self) -> Option<&'static str> {
        [
            ("num_splits", self.num_splits.is_some()),
            ("reduction", self.reduction.is_some()),
            ("device_plan", self.device_plan),
            ("stages", self.stages.is_some()),
            ("consumer_groups", self.consumer_groups.is_some()),
            ("resident_ctas", self.resident_ctas.is_some()),
        ]
        .into_iter()
        .find_map(|(name, set)| set.then_some(name))
    }

    /// The first knob of the persistent engine that is set.
    fn persistent_knob(&self) -> Option<&'static str> {
        [
            ("persistent_ctas", self.persistent_ctas.is_some()),
            ("min_tiles_per_cta", self.min_tiles_per_cta.is_some()),
            (
                "persistent_column_lanes",
                self.persistent_column_lanes.is_some(),
            ),
            (
                "persistent_head_lanes",
                self.persistent_head_lanes.is_some(),
            ),
        ]
        .into_iter()
        .find_map(|(name, set)| set.then_some(name))
        .or_else(|| self.persistent_ring_knob())
    }

    /// The first knob of the persistent GQA kernel's ring and mainloop that is set.
    fn persistent_ring_knob(&self) -> Option<&'static str> {
        [
            ("persistent_stages", self.persistent_stages.is_some()),
            ("persistent_groups", self.persistent_groups.is_some()),
            (
                "persistent_tile_tokens",
                self.persistent_tile_tokens.is_some(),
            ),
            ("persistent_kv_l2", self.persistent_kv_l2.is_some()),
            (
                "persistent_paged_gather",
                self.persistent_paged_gather.is_some(),
            ),
            (
                "persistent_producer_warps",
                self.persistent_producer_warps.is_some(),
            ),
            (
                "persistent_softmax_slices",
                self.persistent_softmax_slices.is_some(),
            ),
            (
                "persistent_pair_heads",
                self.persistent_pair_heads.is_some(),
            ),
            (
                "persistent_wide_columns",
                self.persistent_wide_columns.is_some(),
            ),
            ("persistent_wide_rows", self.persistent_wide_rows.is_some()),
        ]
        .into_iter()
        .find_map(|(name, set)| set.then_some(name))
    }
}

/// Ring depth of the decode kernel.
pub const STAGES: usize = 4;
/// Fewest tiles a split should stream (see the module docs).
pub const MIN_TILES_PER_SPLIT: usize = 1;
/// Streaming CTAs per SM the heuristic aims for (as a fraction: numerator / denominator); half
/// the SMs saturate HBM on the H200.
pub const TARGET_CTAS_PER_SM: (usize, usize) = (1, 2);
/// Streaming CTAs per SM for an e4m3 cache: a CTA consumes positions at the 2-byte rate, so it
/// pulls half the bytes, and twice the CTAs are needed for the same bandwidth (docs/tuning.md,
/// "FP8 caches").
pub const FP8_TARGET_CTAS_PER_SM: usize = 1;
/// Streaming CTAs per SM for multi-token decode: q_len x group query rows per CTA multiply the
/// MMA and softmax work per byte (q_len 4 at 32/8 heads: one CTA per (request, KV head) pulled
/// 27 GB/s where single-token CTAs pull 55-70), so these aim for a full wave.
pub const MULTI_TOKEN_CTAS_PER_SM: usize = 1;
/// Streaming CTAs per SM for a cache of pages smaller than a tile ([`takes_paged_plan`]), with
/// the [`PAGED_STAGES`]-deep ring that lets two CTAs share an SM: one producer warp per SM
/// issuing a TMA per page run is the limit there, not DRAM (docs/tuning.md, `PAGED_CTAS_PER_SM`).
pub const PAGED_CTAS_PER_SM: usize = 2;
/// Ring depth for paged caches (see [`PAGED_CTAS_PER_SM`]).
pub const PAGED_STAGES: usize = 2;
/// Fewest tiles a paged split streams: a paged split pays one more dependent load before its
/// first byte (length, block table, then TMA), so two-tile splits lose to four-tile ones
/// (docs/tuning.md, `PAGED_MIN_TILES_PER_SPLIT`).
pub const PAGED_MIN_TILES_PER_SPLIT: usize = 4;
/// Ring depth of a plan whose unsplit CTAs fill the GPU ([`fills_the_gpu_unsplit`]), with at
/// most [`FULL_WAVE_RESIDENT_CTAS`] CTAs per SM: fewer, longer streams per SM
/// (docs/tuning.md, `FULL_WAVE_STAGES`).
pub const FULL_WAVE_STAGES: usize = 2;
/// CTAs per SM of a plan whose unsplit CTAs fill the GPU (see [`FULL_WAVE_STAGES`]).
pub const FULL_WAVE_RESIDENT_CTAS: usize = 1;
/// CTAs per SM of a device plan on a paged cache (docs/tuning.md,
/// `DEVICE_PLAN_PAGED_RESIDENT_CTAS`).
pub const DEVICE_PLAN_PAGED_RESIDENT_CTAS: usize = 1;

/// Whether a problem takes the paged plan ([`PAGED_CTAS_PER_SM`], [`PAGED_STAGES`],
/// [`PAGED_MIN_TILES_PER_SPLIT`]): pages smaller than a tile, which cost one TMA per page run,
/// except joined-halves pages of at least [`JOINED_CONTIGUOUS_PLAN_MIN_PAGE`] positions
/// ([`DecodeVariant::joins_halves`]); every other cache takes the contiguous plan
/// (docs/tuning.md, `takes_paged_plan`).
pub fn takes_paged_plan(problem: &DecodeProblem) -> bool {
    let tile = tile_tokens(problem.head_dim);
    problem.paged.is_some_and(|pg| {
        pg.page_size < tile
            && !(pg.page_size >= JOINED_CONTIGUOUS_PLAN_MIN_PAGE
                && DecodeVariant::joins_halves(
                    problem.head_dim,
                    problem.kv_dtype,
                    tile,
                    pg.page_size,
                ))
    })
}

/// Smallest joined-halves page that takes the contiguous plan (see [`takes_paged_plan`]).
pub const JOINED_CONTIGUOUS_PLAN_MIN_PAGE: usize = 16;

/// Whether one split per (request, KV head) already gives at least 15/16 of the SMs a CTA.
pub fn fills_the_gpu_unsplit(ctas: usize, num_splits: usize, device: DeviceFacts) -> bool {
    num_splits == 1 && ctas * 16 >= device.sm_count * 15
}

/// Most splits per (request, KV head): bounds the workspace and the combine's loop.
pub const MAX_SPLITS: usize = 128;

/// KV positions per ring stage. Stages of 64 rows of d128 (or 128 rows of d64) move 32 KB per
/// stage, so four stages keep ~128 KB in flight per SM, well over the ~35 KB that hides
/// DRAM latency at full bandwidth.
pub fn tile_tokens(head_dim: usize) -> usize {
    if head_dim <= 64 {
        128
    } else {
        64
    }
}

/// How the splits of one (request, KV head) are merged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reduction {
    /// Splits write FP32 partials; a combine kernel merges them (PDL-chained, no memset).
    #[default]
    Kernel,
    /// The splits form one thread-block cluster and merge through distributed shared memory:
    /// one launch, no workspace; a power of two up to [`MAX_CLUSTER_SPLITS`] splits.
    Cluster,
}

impl Reduction {
    /// The name used on the command line and in Python: `kernel` or `cluster`.
    pub fn name(self) -> &'static str {
        match self {
            Reduction::Kernel => "kernel",
            Reduction::Cluster => "cluster",
        }
    }
}

impl std::str::FromStr for Reduction {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kernel" => Ok(Reduction::Kernel),
            "cluster" => Ok(Reduction::Cluster),
            other => Err(Error::invalid("reduction", other, "'kernel' or 'cluster'")),
        }
    }
}

/// Largest cluster the cluster reduction uses: 16, past the portable size of 8 (the decoder
/// checks with the occupancy API that the GPU can co-schedule it).
pub const MAX_CLUSTER_SPLITS: usize = 16;

/// Split counts the cluster reduction accepts: powers of two, so every CTA owns an equal,
/// even-width slice of the head dimension.
pub const CLUSTER_SPLITS: [usize; 5] = [1, 2, 4, 8, 16];

/// Largest split count for which the automatic choice takes cluster reduction (module docs).
pub const AUTO_CLUSTER_MAX_SPLITS: usize = 8;
/// Longest split (in tiles) for which the automatic choice takes cluster reduction.
pub const AUTO_CLUSTER_MAX_TILES: usize = 2;
/// Most query columns per KV head (q_len x group) for which the automatic choice takes cluster
/// reduction: every CTA of a cluster merges its head-dim slice of every column from every peer,
/// so the in-cluster merge grows with the columns while the combine spreads rows over CTAs.
pub const AUTO_CLUSTER_MAX_COLUMNS: usize = 8;

/// The reduction mode chosen when the caller does not force one (module docs):
/// `num_splits` splits of at most `tiles_per_split` tiles each, `columns` query rows per KV head.
pub fn auto_reduction(num_splits: usize, tiles_per_split: usize, columns: usize) -> Reduction {
    let cluster_size = num_splits > 1 && CLUSTER_SPLITS.contains(&num_splits);
    if cluster_size
        && num_splits <= AUTO_CLUSTER_MAX_SPLITS
        && tiles_per_split <= AUTO_CLUSTER_MAX_TILES
        && columns <= AUTO_CLUSTER_MAX_COLUMNS
    {
        Reduction::Cluster
    } else {
        Reduction::Kernel
    }
}

/// Whether the clusters of a cluster-merged `plan` are all resident at once, given that the GPU
/// holds `resident` of them (`cuOccupancyMaxActiveClusters`): otherwise the grid runs in waves
/// and kernel reduction is faster. With one 137 KB CTA an SM, an H100 held fewer than the 16
/// clusters of 8 that 16 heads x 8 splits ask for: e4m3 16/16 heads d 64 L 1024 ran 9.1 us
/// merged by cluster against 4.8 by kernel (docs/tuning.md, "Cluster waves").
pub fn clusters_fit_one_wave(plan: &DecodePlan, resident: usize) -> bool {
    plan.clusters() <= resident
}

/// Whether `plan`'s cluster merge is the heuristic's choice, which `Decoder::new` keeps only
/// where the clusters fit one wave ([`clusters_fit_one_wave`]); a merge the caller forces, or
/// the device planner's, is kept as it is.
pub fn cluster_merge_checked(plan: &DecodePlan, options: &PlanOptions) -> bool {
    plan.reduction == Reduction::Cluster
        && plan.num_splits > 1
        && options.reduction.is_none()
        && plan.device_plan.is_none()
}

impl DecodePlan {
    /// Thread-block clusters of the grid under cluster reduction: one a (request, KV head,
    /// column block), of `num_splits` CTAs.
    pub fn clusters(&self) -> usize {
        let ctas: usize = self.grid.iter().map(|&g| g as usize).product();
        ctas.div_ceil(self.num_splits.max(1))
    }
}

/// Most splits the paged heuristic may ask for and still be served by two splits merged in a
/// cluster ([`paged_cluster_pair`]).
pub const PAGED_PAIR_MAX_SPLITS: usize = 4;

/// Whether a paged-plan problem ([`takes_paged_plan`]) for which the heuristic wants
/// `heuristic` splits (2..=[`PAGED_PAIR_MAX_SPLITS`]) runs two splits merged in a cluster
/// instead: the combine launch then costs more than the extra splits save, and clusters of 4
/// paged CTAs place badly. Query columns as in [`auto_reduction`] (docs/tuning.md,
/// `paged_cluster_pair`).
pub fn paged_cluster_pair(problem: &DecodeProblem, heuristic: usize) -> bool {
    takes_paged_plan(problem)
        && (2..=PAGED_PAIR_MAX_SPLITS).contains(&heuristic)
        && problem.columns() <= AUTO_CLUSTER_MAX_COLUMNS
}

/// What the caller may force.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanOptions {
    /// Force this many KV splits (1..=MAX_SPLITS) instead of the heuristic.
    pub num_splits: Option<usize>,
    /// Launch with programmatic dependent launch (default on).
    pub disable_pdl: bool,
    /// Force 1 or 2 groups of consumer warps (2: two tiles in flight per CTA; only for groups
    /// of up to 16 query heads, see [`DecodeVariant::groups_fit`]). `None`: two groups when
    /// they fit and each split has at least two tiles (see [`consumer_groups`]).
    pub consumer_groups: Option<usize>,
    /// Force the ring depth: [`STAGES`] or 2 (a third of the shared memory, so two or three
    /// CTAs share an SM; the default for paged caches, [`PAGED_STAGES`]).
    pub stages: Option<usize>,
    /// Force the reduction mode. `None`: chosen from the split count ([`auto_reduction`]).
    pub reduction: Option<Reduction>,
    /// Plan the work partition on the device, from the lengths in device memory, at every call
    /// (a planner kernel ahead of the decode): the grid is sized from the problem's maxima and
    /// each request gets splits in proportion to its length, so a captured graph stays balanced
    /// whatever lengths it is replayed with. With cluster reduction the clusters have one size
    /// ([`device_plan_cluster_size`]): a request longer than its fair share runs one cluster per
    /// KV head, any other request one CTA per KV head.
    pub device_plan: bool,
    /// Tuning knob: at most this many decode CTAs resident per SM (1..=[`MAX_RESIDENT_CTAS`]),
    /// enforced by padding each CTA's shared memory ([`resident_shared_bytes`]). `None`: as
    /// many as fit.
    pub resident_ctas: Option<usize>,
    /// Force the engine. `None`: the engine whose knob is set (setting knobs of both is an
    /// error), else the persistent engine where [`persistent_by_default`] says so and the split
    /// engine elsewhere.
    pub engine: Option<Engine>,
    /// Tests: the persistent engine records the pieces each CTA streams, read back with
    /// [`crate::Decoder::last_schedule`].
    pub record_schedule: bool,
    /// Persistent engine, tuning knob: launch this many CTAs instead of one per SM: up to
    /// [`PERSISTENT_MAX_FORCED_GRID`] for GQA decode (two per SM, where the kernel's resources
    /// let two be resident: the decoder checks), [`PERSISTENT_MAX_GRID`] for MLA decode.
    pub persistent_ctas: Option<usize>,
    /// Persistent engine, tuning knob: the fewest tiles a working CTA takes instead of
    /// [`PERSISTENT_MIN_TILES_PER_CTA`].
    pub min_tiles_per_cta: Option<usize>,
    /// Persistent engine, tuning knob: ring depth (a multiple of the consumer groups, up to
    /// [`PERSISTENT_MAX_FORCED_STAGES`], fitting the shared memory). `None`: the deepest ring
    /// that fits up to the head dim's default depth ([`persistent_variant`]).
    pub persistent_stages: Option<usize>,
    /// Persistent engine, tuning knob: groups of four consumer warps (1, or 2 where
    /// [`DecodeVariant::groups_fit`]).
    pub persistent_groups: Option<usize>,
    /// Persistent engine, tuning knob: KV positions per ring stage (a multiple of 64 up to
    /// [`PERSISTENT_MAX_TILE_TOKENS`]) instead of [`tile_tokens`].
    pub persistent_tile_tokens: Option<usize>,
    /// Persistent engine, tuning knob: the L2 eviction priority of the K and V loads.
    pub persistent_kv_l2: Option<crate::kernels::L2Hint>,
    /// Persistent engine, tuning knob, paged caches: `true` gathers the pages by 16-byte copies
    /// from every producer lane, `false` loads them as TMA boxes. `None`: gather pages smaller
    /// than [`persistent_gather_below_page`]. No effect on a contiguous cache.
    pub persistent_paged_gather: Option<bool>,
    /// Persistent engine, tuning knob, gathered pages: producer warps issuing the copies (1, 2
    /// or 4) instead of [`PERSISTENT_GATHER_WARPS`].
    pub persistent_producer_warps: Option<usize>,
    /// Persistent engine, tuning knob: m16 slices of a warp's rows per online-softmax step (1
    /// or 2; two share one max reduction and one rescale of the accumulators). `None`: 1.
    pub persistent_softmax_slices: Option<usize>,
    /// Persistent engine, tuning knob: `true` streams adjacent d 64 or d 96 KV heads in pairs
    /// (an error where [`can_pair_heads`] says it cannot), `false` one at a time. `None`: pairs where
    /// [`pairs_heads`] says so.
    pub persistent_pair_heads: Option<bool>,
    /// Tuning knob of both engines: the L2 promotion of the K and V tensor maps instead of
    /// [`crate::launch::TmaPromotion::default`].
    pub kv_promotion: Option<crate::launch::TmaPromotion>,
    /// Persistent engine, knob: `true` or `None` deal the grid into one lane of CTAs per column
    /// block where a KV head has several (more than 32 query rows: large multi-token groups),
    /// each lane streaming the same tiles for its block so that L2 serves the other lanes'
    /// reads (schedule.cuh, "lanes"; measured: docs/tuning.md, "Lanes"); `false`: one
    /// sequence of every unit.
    pub persistent_column_lanes: Option<bool>,
    /// Persistent engine, knob: `true` deals the grid into one lane of CTAs per (KV head,
    /// column block), each lane streaming its own units over the same position ranges at the
    /// same places, so the KV heads of a position (side by side in a page of a pool, or in a
    /// row of a `[b, L, hkv, d]` cache) are read at about the same time, not one head's share
    /// of a request after another's (schedule.cuh, "lanes"); it takes precedence over
    /// [`Self::persistent_column_lanes`]. `false` or `None`: as that knob says. An experiment
    /// (slower on the pools of pages of 1 it was built for: docs/tuning.md, "Lanes").
    pub persistent_head_lanes: Option<bool>,
    /// Persistent engine, knob: `true` runs column blocks of 64 query rows on the wide consumer
    /// (the rows on the M dimension of the warpgroup MMA, decode.cu "wide consumer"; an error
    /// where [`can_take_wide_columns`] says it cannot), for large multi-token groups, which are
    /// compute-bound on the narrow consumer. `None`: wide wherever it can serve (docs/tuning.md,
    /// "Wide consumer"). `false`: the narrow consumer's blocks of up to 32 rows.
    pub persistent_wide_columns: Option<bool>,
    /// Persistent engine, knob: query rows of a wide column block, 64 or 128. 128 (more than 64
    /// rows a KV head): both warpgroups on every tile, 64 of the rows each, so that each tile is
    /// read (an e4m3 one widened) once for all 128. Measured slower than two blocks of 64 on
    /// all rows but one (docs/tuning.md, "Wide consumer"). `None`: 64.
    pub persistent_wide_rows: Option<usize>,
}

/// Shared memory of one H100/H200 SM, and what the hardware reserves per resident CTA.
pub const SM_SHARED_BYTES: usize = 228 * 1024;
/// (see [`SM_SHARED_BYTES`])
pub const SHARED_BYTES_RESERVED_PER_CTA: usize = 1024;
/// Largest [`PlanOptions::resident_ctas`].
pub const MAX_RESIDENT_CTAS: usize = 3;

/// Dynamic shared memory to launch a decode CTA needing `needed` bytes with, so that at most
/// `resident` of them share an SM: one byte more than `resident + 1` CTAs could have.
pub fn resident_shared_bytes(needed: usize, resident: Option<usize>) -> usize {
    match resident {
        None => needed,
        Some(n) => {
            let crowd = SM_SHARED_BYTES / (n + 1) - SHARED_BYTES_RESERVED_PER_CTA + 1;
            needed.max(crowd.div_ceil(128) * 128)
        }
    }
}

/// Ring depths a decode kernel can be built with.
pub const SUPPORTED_STAGES: [usize; 2] = [2, STAGES];
/// Ring depths of the split engine for e4m3 caches: twice the 2-byte depths, so that a ring
/// holds the same bytes in flight ([`split_stages`]).
pub const SUPPORTED_FP8_STAGES: [usize; 2] = [2 * SUPPORTED_STAGES[0], 2 * SUPPORTED_STAGES[1]];

/// The split engine's ring depth for a cache of `kv_dtype` where a 2-byte cache takes
/// `two_byte_stages`: e4m3 tiles are half the bytes, so twice the stages.
pub fn split_stages(kv_dtype: KvDType, two_byte_stages: usize) -> usize {
    match kv_dtype {
        KvDType::AsQuery => two_byte_stages,
        KvDType::Fp8E4m3 => 2 * two_byte_stages,
    }
}

/// Groups of consumer warps for a split of `tiles_per_split` tiles with `n_tiles` head tiles:
/// two from two tiles a split on, where they fit (docs/tuning.md, `consumer_groups`).
pub fn consumer_groups(n_tiles: usize, tiles_per_split: usize) -> usize {
    if tiles_per_split >= 2 && DecodeVariant::groups_fit(n_tiles, 2) {
        2
    } else {
        1
    }
}

/// Sizes of the FP32 split workspace, in elements. Derived from the problem's maxima only, so a
/// captured graph replays safely whatever the lengths are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkspaceLayout {
    /// Unnormalised partial outputs: `[splits, batch * q_len * hq, d]` (static plan) or
    /// `[slots, block columns, d]` (device plan).
    pub o_partial: usize,
    /// Per-split maxima, one per row of `o_partial`; the denominators follow with the same size.
    pub stats: usize,
    /// Device plan: the work table, int32 `{request, item}` per decode CTA.
    pub work: usize,
    /// Device plan: int32 `{splits, first slot}` per request.
    pub request_plan: usize,
}

/// Byte offsets of the workspace arrays from its start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkspaceOffsets {
    /// Of `o_partial`.
    pub o_partial: usize,
    /// Of the maxima.
    pub m_partial: usize,
    /// Of the denominators.
    pub l_partial: usize,
    /// Of the work table.
    pub work: usize,
    /// Of the per-request plan.
    pub request_plan: usize,
}

impl WorkspaceLayout {
    /// Total bytes, each array starting on a 256-byte boundary.
    pub fn bytes(&self) -> usize {
        if self.o_partial == 0 && self.work == 0 {
            return 0;
        }
        let o = self.offsets();
        o.request_plan + align(self.request_plan * 4)
    }

    /// Byte offsets of every array from the workspace start.
    pub fn offsets(&self) -> WorkspaceOffsets {
        let m_partial = align(self.o_partial * 4);
        let l_partial = m_partial + align(self.stats * 4);
        let work = l_partial + align(self.stats * 4);
        WorkspaceOffsets {
            o_partial: 0,
            m_partial,
            l_partial,
            work,
            request_plan: work + align(self.work * 4),
        }
    }
}

/// A work partition computed on the device at every call (`plan_work.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevicePlan {
    /// Decode CTAs the partition aims for: every split streams at most total tiles / target.
    pub target: usize,
    /// Decode CTAs launched: `target + batch * units` (cluster reduction: `batch * units *
    /// cluster size`), enough for any lengths (CTAs without work leave at once).
    pub grid: usize,
    /// FP32 partial slots in the workspace (a request that would need more runs unsplit).
    pub slots: usize,
}

/// Streaming CTAs per SM the device plan aims for. Unlike the batch-1 host heuristic (half the
/// SMs), a ragged batch planned on the device is usually large: all SMs stream.
pub const DEVICE_PLAN_CTAS_PER_SM: usize = 1;

fn align(bytes: usize) -> usize {
    bytes.div_ceil(256) * 256
}

/// The decisions for one problem.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodePlan {
    /// Decode kernel variant.
    pub decode: DecodeVariant,
    /// Combine kernel variant; `None` when one split writes the output directly.
    pub combine: Option<CombineVariant>,
    /// KV splits per (request, KV head); with a device plan, the most any request may get (each
    /// request's count is chosen on the device at every call).
    pub num_splits: usize,
    /// Decode grid: (splits, hkv x column blocks, batch); with a device plan (work items, 1, 1).
    pub grid: [u32; 3],
    /// Device-side planning, when asked for ([`PlanOptions::device_plan`]).
    pub device_plan: Option<DevicePlan>,
    /// FP32 workspace needed by the combine.
    pub workspace: WorkspaceLayout,
    /// Launch with PDL.
    pub pdl: bool,
    /// L2 promotion of the K and V tensor maps.
    pub kv_promotion: crate::launch::TmaPromotion,
    /// How splits are merged (irrelevant with one split).
    pub reduction: Reduction,
    /// Dynamic shared memory of a decode CTA: the variant's, or more to cap the CTAs per SM
    /// ([`PlanOptions::resident_ctas`]).
    pub decode_shared_bytes: usize,
}

/// Device facts the plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceFacts {
    /// Streaming multiprocessors.
    pub sm_count: usize,
}

impl DeviceFacts {
    /// The H200 / H100 SXM: 132 SMs. Used for planning without a GPU (CPU tests, `kvstream plan`).
    pub const H200: DeviceFacts = DeviceFacts { sm_count: 132 };
}

/// Split count chosen by the heuristic (module docs).
pub fn heuristic_splits(problem: &DecodeProblem, device: DeviceFacts) -> usize {
    let column_blocks = DecodeVariant::for_problem(problem).column_blocks(problem);
    let ctas = problem.batch * problem.hkv * column_blocks;
    let target = if problem.q_len > 1 {
        device.sm_count * MULTI_TOKEN_CTAS_PER_SM
    } else if takes_paged_plan(problem) {
        device.sm_count * PAGED_CTAS_PER_SM
    } else if problem.kv_dtype == KvDType::Fp8E4m3 {
        device.sm_count * FP8_TARGET_CTAS_PER_SM
    } else {
        device.sm_count * TARGET_CTAS_PER_SM.0 / TARGET_CTAS_PER_SM.1
    };
    let fill = (target / ctas).max(1);
    let tiles = problem.max_len.div_ceil(tile_tokens(problem.head_dim));
    let min_tiles = if takes_paged_plan(problem) {
        PAGED_MIN_TILES_PER_SPLIT
    } else {
        MIN_TILES_PER_SPLIT
    };
    let longest_useful = (tiles / min_tiles).max(1);
    fill.min(longest_useful).clamp(1, MAX_SPLITS)
}

/// The cluster size for a wanted split count: the largest power of two not above it, at most
/// [`MAX_CLUSTER_SPLITS`].
pub fn cluster_splits(wanted: usize) -> usize {
    let capped = wanted.clamp(1, MAX_CLUSTER_SPLITS);
    1 << capped.ilog2()
}

/// Builds the plan for `problem`.
pub fn plan(
    problem: &DecodeProblem,
    device: DeviceFacts,
    options: PlanOptions,
) -> Result<DecodePlan> {
    problem.validate()?;
    if let Some(why) = persistent_only(problem) {
        return Err(Error::invalid(
            "engine",
            "split (or one of its knobs)",
            format!("the persistent engine (none, or \"persistent\"): {why}"),
        ));
    }
    if let Some(n) = options.resident_ctas {
        if !(1..=MAX_RESIDENT_CTAS).contains(&n) {
            return Err(Error::invalid(
                "resident_ctas",
                n,
                format!("1..={MAX_RESIDENT_CTAS} decode CTAs per SM"),
            ));
        }
    }
    if options.device_plan {
        return plan_on_device(problem, device, options);
    }
    let forced_reduction = options.reduction.unwrap_or_default();
    let heuristic = heuristic_splits(problem, device);
    // paged batches of 2-4 heuristic splits: two splits in a cluster unless the caller forces
    // the split count or kernel reduction
    let cluster_pair = options.num_splits.is_none()
        && options.reduction != Some(Reduction::Kernel)
        && paged_cluster_pair(problem, heuristic);
    let num_splits = match (options.num_splits, forced_reduction) {
        (Some(n), Reduction::Kernel) if (1..=MAX_SPLITS).contains(&n) => n,
        (Some(n), Reduction::Cluster) if CLUSTER_SPLITS.contains(&n) => n,
        (Some(n), Reduction::Kernel) => {
            return Err(Error::invalid(
                "num_splits",
                n,
                format!("1..={MAX_SPLITS} with kernel reduction"),
            ))
        }
        (Some(n), Reduction::Cluster) => {
            return Err(Error::invalid(
                "num_splits",
                n,
                format!("one of {CLUSTER_SPLITS:?} with cluster reduction"),
            ))
        }
        (None, _) if cluster_pair => 2,
        (None, Reduction::Kernel) => heuristic,
        (None, Reduction::Cluster) => cluster_splits(heuristic),
    };
    let tiles = problem.max_len.div_ceil(tile_tokens(problem.head_dim));
    let tiles_per_split = tiles.div_ceil(num_splits);
    let reduction = options.reduction.unwrap_or_else(|| {
        if cluster_pair {
            Reduction::Cluster
        } else {
            auto_reduction(num_splits, tiles_per_split, problem.columns())
        }
    });
    // (request, KV head, column block) units: one CTA each per split
    let units = problem.hkv * DecodeVariant::for_problem(problem).column_blocks(problem);
    let full_wave = fills_the_gpu_unsplit(problem.batch * units, num_splits, device);
    let ring = if full_wave {
        FULL_WAVE_STAGES
    } else if takes_paged_plan(problem) {
        PAGED_STAGES
    } else {
        STAGES
    };
    let decode = decode_variant(problem, options, tiles_per_split, ring)?;
    let resident = options
        .resident_ctas
        .or(full_wave.then_some(FULL_WAVE_RESIDENT_CTAS));
    let combine = (num_splits > 1 && reduction == Reduction::Kernel).then_some(CombineVariant {
        dtype: problem.dtype,
        head_dim: problem.head_dim,
    });
    let rows = problem.batch * problem.q_len * problem.hq;
    let workspace = if combine.is_some() {
        WorkspaceLayout {
            o_partial: num_splits * rows * problem.head_dim,
            stats: num_splits * rows,
            ..Default::default()
        }
    } else {
        WorkspaceLayout::default()
    };
    Ok(DecodePlan {
        decode,
        combine,
        num_splits,
        grid: [num_splits as u32, units as u32, problem.batch as u32],
        device_plan: None,
        workspace,
        pdl: !options.disable_pdl,
        kv_promotion: kv_promotion(problem, options),
        reduction,
        decode_shared_bytes: resident_shared_bytes(decode.shared_bytes(), resident),
    })
}

/// The decode kernel variant for `problem`: forced or chosen consumer groups (for splits of
/// `tiles_per_split` tiles) and the forced ring depth, else `default_stages`.
fn decode_variant(
    problem: &DecodeProblem,
    options: PlanOptions,
    tiles_per_split: usize,
    default_stages: usize,
) -> Result<DecodeVariant> {
    let mut decode = DecodeVariant::for_problem(problem);
    decode.consumer_groups = match options.consumer_groups {
        Some(g) if DecodeVariant::groups_fit(decode.n_tiles, g) => g,
        Some(g) => {
            return Err(Error::invalid(
                "consumer_groups",
                format!(
                    "{g} with {} query rows per KV head (q_len x group)",
                    problem.columns()
                ),
                "1, or 2 when there are at most 16 query rows per KV head",
            ))
        }
        None => consumer_groups(decode.n_tiles, tiles_per_split),
    };
    let supported = match problem.kv_dtype {
        KvDType::AsQuery => SUPPORTED_STAGES,
        KvDType::Fp8E4m3 => SUPPORTED_FP8_STAGES,
    };
    decode.stages = match options.stages {
        None => split_stages(problem.kv_dtype, default_stages),
        Some(s) if supported.contains(&s) => s,
        Some(s) => {
            return Err(Error::invalid(
                "stages",
                s,
                format!("{supported:?} for a {} cache", problem.kv_dtype.name()),
            ))
        }
    };
    Ok(decode)
}

/// The plan of a device-planned problem: kernel reduction, a one-dimensional grid sized from the
/// maxima, slots for the worst case (see `plan_work.cu`).
fn plan_on_device(
    problem: &DecodeProblem,
    device: DeviceFacts,
    options: PlanOptions,
) -> Result<DecodePlan> {
    if let Some(n) = options.num_splits {
        return Err(Error::invalid(
            "num_splits",
            format!("{n} with device_plan"),
            "none: the device plan chooses each request's splits from its length",
        ));
    }
    // Device-planned splits are long (total work / SMs) unless the batch is tiny. Every paged
    // cache keeps the paged ring here, whatever its page size (docs/tuning.md, `PAGED_STAGES`).
    let ring = if problem.paged.is_some() {
        PAGED_STAGES
    } else {
        STAGES
    };
    let decode = decode_variant(problem, options, 2, ring)?;
    let units = problem.hkv * decode.column_blocks(problem);
    let per_sm = if problem.paged.is_some() {
        PAGED_CTAS_PER_SM
    } else {
        DEVICE_PLAN_CTAS_PER_SM
    };
    let target = device.sm_count * per_sm;
    let cluster = (options.reduction == Some(Reduction::Cluster))
        .then(|| device_plan_cluster_size(units, target));
    let grid = match cluster {
        // worst case: every unit long, one cluster each
        Some(c) => problem.batch * units * c,
        None => target + problem.batch * units,
    };
    if grid > i32::MAX as usize {
        return Err(Error::invalid(
            "batch",
            problem.batch,
            "fewer requests (the device plan's grid overflows)",
        ));
    }
    let block_cols = decode.n_tiles * 8;
    // split requests need about target + their units slots; 3 x target covers every batch the
    // planner splits (it falls back to one split per unit beyond this); clusters need none
    let slots = if cluster.is_some() { 0 } else { 3 * target };
    Ok(DecodePlan {
        decode,
        combine: cluster.is_none().then_some(CombineVariant {
            dtype: problem.dtype,
            head_dim: problem.head_dim,
        }),
        num_splits: cluster.unwrap_or(MAX_SPLITS),
        grid: [grid as u32, 1, 1],
        device_plan: Some(DevicePlan {
            target,
            grid,
            slots,
        }),
        workspace: WorkspaceLayout {
            o_partial: slots * block_cols * problem.head_dim,
            stats: slots * block_cols,
            work: 2 * grid,
            request_plan: 2 * problem.batch,
        },
        pdl: !options.disable_pdl,
        kv_promotion: kv_promotion(problem, options),
        reduction: if cluster.is_some() {
            Reduction::Cluster
        } else {
            Reduction::Kernel
        },
        decode_shared_bytes: resident_shared_bytes(
            decode.shared_bytes(),
            options.resident_ctas.or(problem
                .paged
                .is_some()
                .then_some(DEVICE_PLAN_PAGED_RESIDENT_CTAS)),
        ),
    })
}

/// Cluster size of a device plan with cluster reduction: enough splits for one long request's
/// `units` to fill the `target` CTAs, a power of two from 2 to [`MAX_CLUSTER_SPLITS`] (32/8
/// heads: 16; 16/16: 8).
pub fn device_plan_cluster_size(units: usize, target: usize) -> usize {
    cluster_splits((target / units.max(1)).max(2))
}

/// Token range `[begin, end)` of split `split` of a request of `len` tokens; mirrors
/// `split_range` in `params.cuh` exactly: split `s` takes whole tiles
/// `[s * tiles / splits, (s + 1) * tiles / splits)`, so run lengths differ by at most one tile.
pub fn split_range(
    len: usize,
    num_splits: usize,
    split: usize,
    tile: usize,
) -> std::ops::Range<usize> {
    let tiles = len.div_ceil(tile);
    let first = split * tiles / num_splits;
    let last = (split + 1) * tiles / num_splits;
    let begin = first * tile;
    begin..len.min(last * tile).max(begin)
}

/// What the device planner (`plan_work.cu`) computes for lengths `lens`, mirrored on the host for
/// tests and reports: per request, its split count and first FP32 partial slot (meaningful when
/// it has more than one split). `units` = KV heads x column blocks, `tile` = positions per tile,
/// `target` and `slot_capacity` as in [`DevicePlan`]. (The kernel applies the slot-capacity
/// fallback per chunk of requests; the two agree whenever no request needs it, which the tests
/// show is always the case at the workspace's 3 x target slots.)
pub fn device_plan_splits(
    lens: &[usize],
    units: usize,
    tile: usize,
    target: usize,
    slot_capacity: usize,
) -> Vec<(usize, usize)> {
    let (tiles, total, fair) = fair_share(lens, units, tile, target);
    let short = tiles.iter().filter(|&&t| t <= fair).sum::<usize>() * units;
    let short_slots = short.div_ceil(fair);
    let long_slots = target.saturating_sub(short_slots).max(1);
    let long_tiles = total - short;
    let mut per_split = long_tiles.div_ceil(long_slots).max(1);
    let long_items: usize = tiles
        .iter()
        .filter(|&&t| t > fair)
        .map(|&t| t.div_ceil(per_split).clamp(1, MAX_SPLITS))
        .sum::<usize>()
        * units;
    if long_items > long_slots {
        let long_units = tiles.iter().filter(|&&t| t > fair).count() * units;
        per_split = if long_slots > long_units {
            long_tiles.div_ceil(long_slots - long_units)
        } else {
            long_tiles // one split each
        };
    }
    let mut slot_carry = 0;
    tiles
        .iter()
        .map(|&t| {
            let mut splits = if t > fair {
                t.div_ceil(per_split).clamp(1, MAX_SPLITS)
            } else {
                1
            };
            let mut slots = if splits > 1 { splits * units } else { 0 };
            if slot_carry + slots > slot_capacity {
                splits = 1;
                slots = 0;
            }
            let base = slot_carry;
            slot_carry += slots;
            (splits, base)
        })
        .collect()
}

/// Tiles per request, total unit-tiles and the fair share `ceil(total / target)` (at least 1).
fn fair_share(
    lens: &[usize],
    units: usize,
    tile: usize,
    target: usize,
) -> (Vec<usize>, usize, usize) {
    let tiles: Vec<usize> = lens.iter().map(|l| l.div_ceil(tile)).collect();
    let total = tiles.iter().sum::<usize>() * units;
    (tiles, total, total.div_ceil(target).max(1))
}

/// What the device planner computes with cluster reduction (clusters of `cluster` CTAs), in the
/// shape of [`device_plan_splits`]: a request longer than the fair share runs `cluster` splits
/// per unit (one cluster each), any other request one CTA per unit; no partial slots.
pub fn device_plan_cluster_splits(
    lens: &[usize],
    units: usize,
    tile: usize,
    target: usize,
    cluster: usize,
) -> Vec<(usize, usize)> {
    let (tiles, _, fair) = fair_share(lens, units, tile, target);
    tiles
        .iter()
        .map(|&t| (if t > fair { cluster } else { 1 }, 0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::DType;
    use proptest::prelude::*;

    fn all_variants_hold(v: PersistentVariant) -> bool {
        crate::kernels::all_variants().contains(&crate::kernels::AnyVariant::Persistent(v))
    }

    fn persistent(p: &DecodeProblem, o: PlanOptions) -> Result<PersistentPlan> {
        match choose(p, DeviceFacts::H200, o)? {
            Plan::Persistent(pp) => Ok(pp),
            Plan::Split(_) => panic!("split engine chosen for {o:?}"),
        }
    }

    #[test]
    fn engine_follows_the_batch_and_the_knobs() {
        let b1 = DecodeProblem::new(1, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let b16 = DecodeProblem::new(16, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let chosen = |p: &DecodeProblem, o: PlanOptions| {
            matches!(
                choose(p, DeviceFacts::H200, o).unwrap(),
                Plan::Persistent(_)
            )
        };
        assert!(!chosen(&b1, PlanOptions::default()));
        assert!(chosen(&b16, PlanOptions::default()));
        // a knob picks its engine
        let stages = PlanOptions {
            stages: Some(2),
            ..Default::default()
        };
        assert!(!chosen(&b16, stages));
        for o in [
            PlanOptions {
                persistent_ctas: Some(66),
                ..Default::default()
            },
            PlanOptions {
                min_tiles_per_cta: Some(4),
                ..Default::default()
            },
            PlanOptions {
                persistent_stages: Some(2),
                ..Default::default()
            },
            PlanOptions {
                persistent_groups: Some(1),
                ..Default::default()
            },
            PlanOptions {
                persistent_tile_tokens: Some(128),
                ..Default::default()
            },
        ] {
            assert!(chosen(&b1, o), "{o:?}");
        }
        // knobs of both engines, or of the other engine than the forced one: errors naming them
        let both = PlanOptions {
            num_splits: Some(4),
            persistent_ctas: Some(66),
            ..Default::default()
        };
        let msg = choose(&b1, DeviceFacts::H200, both)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("persistent_ctas") && msg.contains("num_splits"),
            "{msg}"
        );
        let wrong = PlanOptions {
            engine: Some(Engine::Split),
            min_tiles_per_cta: Some(2),
            ..Default::default()
        };
        let msg = choose(&b1, DeviceFacts::H200, wrong)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("min_tiles_per_cta"), "{msg}");
        let wrong = PlanOptions {
            engine: Some(Engine::Persistent),
            reduction: Some(Reduction::Cluster),
            ..Default::default()
        };
        let msg = choose(&b1, DeviceFacts::H200, wrong)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("reduction"), "{msg}");
    }

    #[test]
    fn every_page_pool_gets_a_producer_that_can_read_it() {
        // boxes land on 128-byte boundaries, so a pool the default plan boxes has aligned runs;
        // where neither producer can read the rows (e4m3 d 96 pairs on pages of 1), pairing is
        // refused by name and the unpaired plan reads the pool
        for d in [64, 96, 128, 256] {
            for kv in [KvDType::AsQuery, KvDType::Fp8E4m3] {
                for page in [1, 2, 4, 8, 16, 32, 64, 128, 256] {
                    let q = DecodeProblem::new(4, 16, 8, d, 4096, DType::Bf16)
                        .and_then(|p| p.with_kv_dtype(kv))
                        .and_then(|p| p.with_paged(page, 4 * 4096 / page, None))
                        .unwrap();
                    let what = format!("d {d}, {kv:?}, pages of {page}");
                    for pair in [None, Some(true)] {
                        let o = PlanOptions {
                            engine: Some(Engine::Persistent),
                            persistent_pair_heads: pair,
                            ..Default::default()
                        };
                        let plan = match persistent(&q, o) {
                            Ok(plan) => plan,
                            Err(e) => {
                                assert_eq!(pair, Some(true), "{what}: {e}");
                                assert!(!can_pair_heads(&q), "{what}: {e}");
                                let msg = e.to_string();
                                assert!(msg.contains("persistent_pair_heads"), "{what}: {msg}");
                                continue;
                            }
                        };
                        let v = &plan.variant;
                        let row = v.head_dim;
                        let elem = v.kv_dtype.size(v.dtype);
                        match v.kv_source {
                            KvSource::PagedGather => {
                                assert!(crate::kernels::gathers_rows(row, elem), "{what}")
                            }
                            KvSource::PagedBoxes => assert!(
                                crate::kernels::boxes_carry_pages(row, elem, page),
                                "{what}: {pair:?} boxes misaligned runs"
                            ),
                            KvSource::Contiguous => panic!("{what}: a pool read as contiguous"),
                        }
                    }
                }
            }
        }
        let e4m3_pairs = |page| {
            DecodeProblem::new(2, 16, 16, 96, 1500, DType::Bf16)
                .and_then(|p| p.with_kv_dtype(KvDType::Fp8E4m3))
                .and_then(|p| p.with_paged(page, 2 * 1500, None))
                .unwrap()
        };
        assert!(!can_pair_heads(&e4m3_pairs(1)));
        assert!(can_pair_heads(&e4m3_pairs(2)));
        // forced boxes on runs that cannot land aligned are refused by name
        let forced = PlanOptions {
            engine: Some(Engine::Persistent),
            persistent_paged_gather: Some(false),
            ..Default::default()
        };
        let msg = persistent(&e4m3_pairs(1), forced).unwrap_err().to_string();
        assert!(msg.contains("persistent_paged_gather"), "{msg}");
    }

    #[test]
    fn small_pages_are_gathered_unless_forced() {
        let p = DecodeProblem::new(16, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let source = |page: Option<usize>, gather| {
            let q = match page {
                Some(pg) => p.clone().with_paged(pg, 16 * 4096 / pg, None).unwrap(),
                None => p.clone(),
            };
            let o = PlanOptions {
                persistent_paged_gather: gather,
                ..Default::default()
            };
            persistent(&q, o).unwrap().variant.kv_source
        };
        assert_eq!(source(None, None), KvSource::Contiguous);
        assert_eq!(source(None, Some(true)), KvSource::Contiguous);
        for page in [1, 2, 8] {
            assert_eq!(
                source(Some(page), None),
                KvSource::PagedGather,
                "page {page}"
            );
            assert_eq!(source(Some(page), Some(false)), KvSource::PagedBoxes);
        }
        for page in [PERSISTENT_GATHER_BELOW_PAGE_D128, 64, 256] {
            assert_eq!(
                source(Some(page), None),
                KvSource::PagedBoxes,
                "page {page}"
            );
            assert_eq!(source(Some(page), Some(true)), KvSource::PagedGather);
        }
        let paged1 = p.clone().with_paged(1, 16 * 4096, None).unwrap();
        let warps = |q: &DecodeProblem, w| {
            let o = PlanOptions {
                persistent_producer_warps: w,
                ..Default::default()
            };
            persistent(q, o).map(|d| (d.variant.producer_warps, d.variant.threads()))
        };
        assert_eq!(
            warps(&paged1, None).unwrap(),
            (PERSISTENT_GATHER_WARPS, 256)
        );
        assert_eq!(warps(&paged1, Some(2)).unwrap(), (2, 192));
        for (q, w) in [(&paged1, 3), (&p, 2)] {
            let msg = warps(q, Some(w)).unwrap_err().to_string();
            assert!(msg.contains("persistent_producer_warps"), "{msg}");
        }
        assert_eq!(warps(&p, None).unwrap().0, 1);
        assert_eq!(warps(&p, Some(1)).unwrap().0, 1);
        // d 64 gathers pages of 16 too
        let d64 = DecodeProblem::new(16, 64, 8, 64, 4096, DType::Bf16).unwrap();
        let d64_source = |page: usize| {
            let q = d64
                .clone()
                .with_paged(page, 16 * 4096 / page, None)
                .unwrap();
            persistent(&q, PlanOptions::default())
                .unwrap()
                .variant
                .kv_source
        };
        assert_eq!(d64_source(16), KvSource::PagedGather);
        assert_eq!(
            d64_source(PERSISTENT_GATHER_BELOW_PAGE_D64),
            KvSource::PagedBoxes
        );
        // small pages take the persistent engine at batch 1, pages of 16 do not
        let b1_paged = |page: usize| {
            DecodeProblem::new(1, 32, 8, 128, 4096, DType::Bf16)
                .unwrap()
                .with_paged(page, 4096 / page, None)
                .unwrap()
        };
        assert!(persistent_by_default(&b1_paged(8), DeviceFacts::H200));
        assert!(!persistent_by_default(
            &b1_paged(PERSISTENT_GATHER_ALWAYS_BELOW_PAGE),
            DeviceFacts::H200
        ));
        // the knob selects the persistent engine, where the split engine would be the default
        let b1 = b1_paged(16);
        let o = PlanOptions {
            persistent_paged_gather: Some(true),
            ..Default::default()
        };
        assert!(matches!(
            choose(&b1, DeviceFacts::H200, o).unwrap(),
            Plan::Persistent(_)
        ));
    }

    #[test]
    fn d64_heads_pair_where_their_rows_leave_half_a_tile_empty() {
        use crate::problem::KvStrides;
        let d64 = |hq, hkv, q_len| {
            DecodeProblem::new(16, hq, hkv, 64, 4096, DType::Bf16)
                .and_then(|p| p.with_q_len(q_len))
                .unwrap()
        };
        // (hq, hkv, q_len) -> pairs: rows per KV head % 8 in 1..=4, at most 16, even hkv
        for (hq, hkv, q_len, want) in [
            (16, 16, 1, true),  // MHA: 1 row
            (32, 8, 1, true),   // 4 rows
            (24, 8, 1, true),   // 3 rows
            (12, 4, 4, true),   // 12 rows: 3 n8 tiles per pair instead of 4
            (32, 4, 1, false),  // 8 rows fill a tile
            (16, 16, 5, false), // 5 rows
            (32, 8, 5, false),  // 20 rows: a pair would need 40
            (15, 15, 1, false), // odd head count
            (16, 1, 1, false),  // one KV head
        ] {
            assert_eq!(
                pairs_heads(&d64(hq, hkv, q_len)),
                want,
                "{hq}/{hkv} q_len {q_len}"
            );
        }
        assert!(!pairs_heads(
            &DecodeProblem::new(16, 16, 16, 128, 4096, DType::Bf16).unwrap()
        ));
        // heads not next to each other (a [b, hkv, L, d] cache): no pairs
        let mut apart = d64(16, 16, 1);
        let s = KvStrides {
            batch: 16 * 4096 * 64,
            token: 64,
            head: 4096 * 64,
        };
        apart = apart.with_kv_strides(s, s).unwrap();
        assert!(!pairs_heads(&apart));
        // paged pools always hold their heads side by side
        assert!(pairs_heads(
            &d64(16, 16, 1).with_paged(1, 16 * 4096, None).unwrap()
        ));

        let p = d64(16, 16, 1).with_kv_dtype(KvDType::Fp8E4m3).unwrap();
        let pp = persistent(&p, PlanOptions::default()).unwrap();
        let v = pp.variant;
        assert_eq!(
            (v.heads_per_row, v.head_dim, v.n_tiles, pp.col_blocks),
            (2, 128, 1, 1)
        );
        // the d 128 ring and tile of the same cache type
        let d128 = persistent_variant(DType::Bf16, KvDType::Fp8E4m3, 128, 1, KvSource::Contiguous);
        assert_eq!(
            (v.stages, v.consumer_groups, v.tile_tokens),
            (d128.stages, d128.consumer_groups, d128.tile_tokens)
        );
        let k = pp.kernel_problem(&p);
        assert_eq!((k.hkv, k.group(), k.columns(), k.head_dim), (8, 2, 2, 128));
        assert_eq!(k.k_strides.head, 128);
        assert_eq!(k.scale(), p.scale(), "the softmax scale stays 1/sqrt(64)");
        assert!(crate::kernels::Variant::name(&v).contains(".d64x2."));
        // forced off: one head per row; forced on where it cannot pair: an error naming the knob
        let off = PlanOptions {
            persistent_pair_heads: Some(false),
            ..Default::default()
        };
        assert_eq!(persistent(&p, off).unwrap().variant.heads_per_row, 1);
        let on = PlanOptions {
            persistent_pair_heads: Some(true),
            ..Default::default()
        };
        let msg = persistent(&d64(30, 15, 1), on).unwrap_err().to_string();
        assert!(msg.contains("persistent_pair_heads"), "{msg}");
        // forced on where the default does not pair (8 rows a KV head: a pair fills two tiles)
        assert_eq!(
            persistent(&d64(32, 4, 1), on)
                .unwrap()
                .variant
                .heads_per_row,
            2
        );
        // d 96 MHA: pairs by default (d 192 rows, three whole boxes); page runs by boxes
        let phi = DecodeProblem::new(16, 32, 32, 96, 4096, DType::Bf16).unwrap();
        assert!(can_pair_heads(&phi) && pairs_heads(&phi));
        assert_eq!(persistent(&phi, off).unwrap().variant.heads_per_row, 1);
        let pp = persistent(&phi, PlanOptions::default()).unwrap();
        assert_eq!((pp.variant.heads_per_row, pp.variant.head_dim), (2, 192));
        let k = pp.kernel_problem(&phi);
        assert_eq!(
            (k.hkv, k.head_dim, k.k_strides.head, k.columns()),
            (16, 192, 192, 2)
        );
        assert!(crate::kernels::Variant::name(&pp.variant).contains(".d96x2."));
        assert_eq!(
            pp.kv_promotion,
            crate::launch::TmaPromotion::B128,
            "384-byte rows"
        );
        let paged = phi.clone().with_paged(1, 16 * 4096, None).unwrap();
        let pp = persistent(&paged, on).unwrap();
        assert_eq!(pp.variant.kv_source, KvSource::PagedBoxes);
        let gather = PlanOptions {
            persistent_paged_gather: Some(true),
            ..on
        };
        let msg = persistent(&paged, gather).unwrap_err().to_string();
        assert!(msg.contains("persistent_paged_gather"), "{msg}");
        // 12 query rows a KV head: a pair's 24 do not fit the two n8 tiles of a d 192 block
        let wide = DecodeProblem::new(2, 48, 4, 96, 512, DType::Bf16).unwrap();
        assert!(!can_pair_heads(&wide));
        // batch 1, e4m3: the persistent engine once the capacity gives each SM 64 tiles
        let b1 = |len, kv| {
            DecodeProblem::new(1, 16, 16, 64, len, DType::Bf16)
                .and_then(|p| p.with_kv_dtype(kv))
                .unwrap()
        };
        let engine = |p: &DecodeProblem| match choose(p, DeviceFacts::H200, PlanOptions::default())
            .unwrap()
        {
            Plan::Persistent(pp) => format!("persistent x{}", pp.variant.heads_per_row),
            Plan::Split(_) => "split".into(),
        };
        assert_eq!(engine(&b1(131_072, KvDType::Fp8E4m3)), "persistent x2");
        assert_eq!(engine(&b1(32_768, KvDType::Fp8E4m3)), "split");
        assert_eq!(engine(&b1(131_072, KvDType::AsQuery)), "split");
    }

    #[test]
    fn the_merge_bound_on_pieces_is_the_largest_forced_grid() {
        // merge.cuh sizes its scratch floor for this many pieces of a cut unit
        let header = crate::kernels::HEADERS
            .iter()
            .find(|(name, _)| *name == "merge.cuh")
            .map(|(_, text)| *text)
            .expect("merge.cuh among the headers");
        let value = header
            .lines()
            .find_map(|l| l.strip_prefix("constexpr int MERGE_MAX_PIECES = "))
            .and_then(|v| v.trim_end_matches(';').parse::<usize>().ok())
            .expect("MERGE_MAX_PIECES in merge.cuh");
        assert_eq!(value, PERSISTENT_MAX_FORCED_GRID);
        assert!(PERSISTENT_MAX_GRID <= value, "the MLA decode's grid too");
    }

    #[test]
    fn cluster_merges_count_their_clusters_against_the_resident_ones() {
        // e4m3 16/16 heads d 64 L 1024: the heuristic's 8 splits in clusters, 16 clusters
        let p = DecodeProblem::new(1, 16, 16, 64, 1024, DType::Bf16)
            .and_then(|p| p.with_kv_dtype(KvDType::Fp8E4m3))
            .unwrap();
        let sp = plan(&p, DeviceFacts::H200, PlanOptions::default()).unwrap();
        assert_eq!(
            (sp.reduction, sp.num_splits, sp.grid),
            (Reduction::Cluster, 8, [8, 16, 1])
        );
        assert!(clusters_fit_one_wave(&sp, 16));
        assert!(!clusters_fit_one_wave(&sp, 15));
        assert_eq!(sp.clusters(), 16);
        // the heuristic's cluster merge is checked; a forced one is the caller's
        assert!(cluster_merge_checked(&sp, &PlanOptions::default()));
        let forced = PlanOptions {
            reduction: Some(Reduction::Cluster),
            ..Default::default()
        };
        assert!(!cluster_merge_checked(
            &plan(&p, DeviceFacts::H200, forced).unwrap(),
            &forced
        ));
        // batches count every request's clusters
        let b3 = DecodeProblem::new(3, 16, 16, 64, 1024, DType::Bf16).unwrap();
        let sp = plan(&b3, DeviceFacts::H200, PlanOptions::default()).unwrap();
        let clusters = 3 * 16 * sp.grid[0] as usize / sp.num_splits;
        assert!(clusters_fit_one_wave(&sp, clusters) && !clusters_fit_one_wave(&sp, clusters - 1));
    }

    #[test]
    fn forced_grids_reach_two_ctas_per_sm() {
        let ctas = |p: &DecodeProblem, c: usize, wide: bool| {
            persistent(
                p,
                PlanOptions {
                    persistent_ctas: Some(c),
                    persistent_wide_columns: wide.then_some(true),
                    ..Default::default()
                },
            )
            .map(|pp| pp.grid)
        };
        let b16 = DecodeProblem::new(16, 32, 8, 128, 32768, DType::Bf16).unwrap();
        assert_eq!(ctas(&b16, 264, false).unwrap(), 264);
        let msg = ctas(&b16, 265, false).unwrap_err().to_string();
        assert!(
            msg.contains("persistent_ctas") && msg.contains("1..=264"),
            "{msg}"
        );
        // (whether they are resident at once is the decoder's check, with the compiled kernel)
        let mt = DecodeProblem::new(16, 64, 8, 128, 4096, DType::Bf16)
            .and_then(|p| p.with_q_len(8))
            .unwrap();
        assert_eq!(ctas(&mt, 264, true).unwrap(), 264);
        assert!(ctas(&mt, 265, true).is_err());
        // a forced grid keeps the workspace's slots at two per CTA
        let pp = persistent(
            &b16,
            PlanOptions {
                persistent_ctas: Some(264),
                ..Default::default()
            },
        )
        .unwrap();
        let (_, ml, ..) = pp.workspace_offsets(&b16);
        assert!(ml >= 2 * 264 * 8 * 128 * 4);
    }

    #[test]
    fn wide_columns_only_where_asked_and_served() {
        let mt = |hq, hkv, q_len, d| {
            DecodeProblem::new(4, hq, hkv, d, 4096, DType::Bf16)
                .and_then(|p| p.with_q_len(q_len))
                .unwrap()
        };
        let wide = PlanOptions {
            persistent_wide_columns: Some(true),
            ..Default::default()
        };
        // 64 rows a KV head: one wide block by default; `false`: narrow blocks of 32, two lanes
        let p = mt(64, 8, 8, 128);
        let off = PlanOptions {
            persistent_wide_columns: Some(false),
            ..Default::default()
        };
        let narrow = persistent(&p, off).unwrap();
        assert_eq!((narrow.variant.n_tiles, narrow.col_blocks), (4, 2));
        assert!(!narrow.variant.wide());
        let pp = persistent(&p, wide).unwrap();
        let engine = PlanOptions {
            engine: Some(Engine::Persistent),
            ..Default::default()
        };
        assert_eq!(pp.variant, persistent(&p, engine).unwrap().variant);
        let v = pp.variant;
        assert!(v.wide());
        assert_eq!((pp.col_blocks, pp.lanes), (1, 1));
        assert_eq!((v.tile_tokens, v.consumer_groups, v.stages), (64, 2, 4));
        assert!(v.shared_bytes() <= PERSISTENT_SHARED_BUDGET);
        assert!(crate::kernels::Variant::name(&v).contains(".n8.t64.s4.g2"));
        // 128 rows: two blocks of 64 in two lanes by default; asked, one block of 128 with both
        // warpgroups on every tile (one tile group, three stages); 256 rows: two in two lanes;
        // e4m3 too (two f16 copies of the tiles)
        let pp = persistent(&mt(32, 2, 8, 128), wide).unwrap();
        assert_eq!((pp.col_blocks, pp.lanes, pp.variant.n_tiles), (2, 2, 8));
        let rows128 = PlanOptions {
            persistent_wide_rows: Some(128),
            ..wide
        };
        let pp = persistent(&mt(32, 2, 8, 128), rows128).unwrap();
        let v = pp.variant;
        assert_eq!((pp.col_blocks, pp.lanes, v.n_tiles), (1, 1, 16));
        assert_eq!((v.consumer_groups, v.tile_groups(), v.stages), (2, 1, 3));
        assert!(v.shared_bytes() <= PERSISTENT_SHARED_BUDGET);
        assert!(crate::kernels::Variant::name(&v).contains(".n16.t64.s3.g2"));
        let pp = persistent(&mt(32, 1, 8, 128), rows128).unwrap();
        assert_eq!((pp.col_blocks, pp.lanes, pp.variant.n_tiles), (2, 2, 16));
        let e4m3 = mt(32, 2, 8, 128).with_kv_dtype(KvDType::Fp8E4m3).unwrap();
        let v = persistent(&e4m3, rows128).unwrap().variant;
        assert_eq!((v.n_tiles, v.kv_dtype), (16, KvDType::Fp8E4m3));
        assert!(v.shared_bytes() <= PERSISTENT_SHARED_BUDGET && all_variants_hold(v));
        let msg = persistent(&p, rows128).unwrap_err().to_string();
        assert!(
            msg.contains("persistent_wide_rows") && msg.contains("64 rows"),
            "{msg}"
        );
        let narrow_128 = PlanOptions {
            persistent_wide_columns: Some(false),
            ..rows128
        };
        let msg = persistent(&p, narrow_128).unwrap_err().to_string();
        assert!(msg.contains("persistent_wide_rows"), "{msg}");
        // d 64: eight stages of 64-row blocks, seven or more of 128-row ones
        let pp = persistent(&mt(64, 8, 8, 64), wide).unwrap();
        assert_eq!((pp.variant.stages, pp.variant.head_dim), (8, 64));
        assert!(pp.variant.shared_bytes() <= PERSISTENT_SHARED_BUDGET);
        let pp = persistent(&mt(32, 2, 8, 64), rows128).unwrap();
        assert_eq!(pp.variant.n_tiles, 16);
        assert!(pp.variant.stages >= 7 && pp.variant.shared_bytes() <= PERSISTENT_SHARED_BUDGET);
        // the wide consumer's two warpgroups: a forced group count of 1 is refused when asked
        // for, and keeps narrow blocks when not
        let g1 = PlanOptions {
            persistent_groups: Some(1),
            ..Default::default()
        };
        let msg = persistent(
            &p,
            PlanOptions {
                persistent_groups: Some(1),
                ..wide
            },
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("persistent_groups"), "{msg}");
        assert!(!persistent(&p, g1).unwrap().variant.wide());
        // every refusal names the knob: 32 rows, d 256, paired heads, a forced ring (an e4m3
        // cache is served: its tiles widened to f16 by the consumers)
        let refused = |p: &DecodeProblem, o: PlanOptions| {
            let msg = persistent(p, o).unwrap_err().to_string();
            assert!(msg.contains("persistent_wide_columns"), "{msg}");
        };
        refused(&mt(32, 8, 8, 128).with_q_len(4).unwrap(), wide);
        refused(&mt(32, 2, 8, 256), wide);
        let fp8 = persistent(
            &mt(64, 8, 8, 128).with_kv_dtype(KvDType::Fp8E4m3).unwrap(),
            wide,
        )
        .unwrap()
        .variant;
        assert!(fp8.wide() && fp8.shared_bytes() <= PERSISTENT_SHARED_BUDGET);
        assert_eq!((fp8.tile_tokens, fp8.stages), (64, 4));
        refused(
            &DecodeProblem::new(2, 16, 16, 64, 4096, DType::Bf16).unwrap(),
            PlanOptions {
                persistent_pair_heads: Some(true),
                ..wide
            },
        );
        let msg = persistent(
            &p,
            PlanOptions {
                persistent_tile_tokens: Some(128),
                ..wide
            },
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("persistent_wide_columns"), "{msg}");
        // unasked, a forced narrow tile keeps the narrow consumer; 32 rows never go wide
        let forced = PlanOptions {
            persistent_tile_tokens: Some(128),
            ..Default::default()
        };
        assert!(!persistent(&p, forced).unwrap().variant.wide());
        let q4 = mt(32, 8, 8, 128).with_q_len(4).unwrap();
        assert!(!persistent(&q4, engine).unwrap().variant.wide());
        // every wide variant the plan can choose is compiled by `kvstream kernels` and CI
        let all = crate::kernels::all_variants();
        for (d, kv) in crate::kernels::WIDE_HEAD_DIMS
            .into_iter()
            .flat_map(|d| [(d, KvDType::AsQuery), (d, KvDType::Fp8E4m3)])
        {
            for (source, hkv) in KvSource::ALL.into_iter().flat_map(|s| [(s, 8), (s, 2)]) {
                // 64 and 128 rows a KV head
                let mut q = mt(64, hkv, 8, d).with_kv_dtype(kv).unwrap();
                if source.paged() {
                    let page = if source == KvSource::PagedGather {
                        1
                    } else {
                        64
                    };
                    q = q.with_paged(page, 4 * 4096, None).unwrap();
                }
                let rows = if hkv == 2 {
                    [64, 128].as_slice()
                } else {
                    [64].as_slice()
                };
                for &r in rows {
                    let o = PlanOptions {
                        persistent_wide_rows: Some(r),
                        ..wide
                    };
                    let v = persistent(&q, o).unwrap().variant;
                    assert_eq!(v.kv_source, source);
                    assert!(
                        all.contains(&crate::kernels::AnyVariant::Persistent(v)),
                        "{v:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn column_lanes_follow_the_knob_and_the_column_blocks() {
        // 64/8 heads x 8 new tokens: 64 rows a KV head, two narrow blocks of 32
        let p = DecodeProblem::new(4, 64, 8, 128, 4096, DType::Bf16)
            .unwrap()
            .with_q_len(8)
            .unwrap();
        let narrow = PlanOptions {
            persistent_wide_columns: Some(false),
            ..Default::default()
        };
        let lanes = |p: &DecodeProblem, on: Option<bool>| {
            let o = PlanOptions {
                persistent_column_lanes: on,
                ..narrow
            };
            let plan = persistent(p, o).unwrap();
            (plan.col_blocks, plan.lanes)
        };
        assert_eq!(lanes(&p, None), (2, 2));
        assert_eq!(lanes(&p, Some(false)), (2, 1));
        assert_eq!(lanes(&p, Some(true)), (2, 2));
        // one block: nothing to deal
        let one = DecodeProblem::new(4, 32, 8, 128, 4096, DType::Bf16).unwrap();
        assert_eq!(lanes(&one, Some(true)), (1, 1));
        // head lanes: one lane per (KV head, column block), before column lanes; a lane of
        // the paired-heads kernel is a pair
        let heads = |p: &DecodeProblem, column: Option<bool>, head: Option<bool>| {
            let o = PlanOptions {
                persistent_column_lanes: column,
                persistent_head_lanes: head,
                ..narrow
            };
            let plan = persistent(p, o).unwrap();
            (plan.col_blocks, plan.lanes, plan.variant.heads_per_row)
        };
        assert_eq!(heads(&p, None, Some(true)), (2, 16, 1));
        assert_eq!(heads(&p, Some(true), Some(true)), (2, 16, 1));
        assert_eq!(heads(&p, Some(true), Some(false)), (2, 2, 1));
        assert_eq!(heads(&p, Some(false), None), (2, 1, 1));
        assert_eq!(heads(&one, None, Some(true)), (1, 8, 1));
        let mha64 = DecodeProblem::new(2, 16, 16, 64, 4096, DType::Bf16).unwrap();
        assert_eq!(heads(&mha64, None, Some(true)), (1, 8, 2));
        // more lanes than CTAs: one sequence
        let many = DecodeProblem::new(1, 128, 128, 128, 4096, DType::Bf16)
            .unwrap()
            .with_q_len(2)
            .unwrap();
        let o = PlanOptions {
            persistent_head_lanes: Some(true),
            persistent_ctas: Some(64),
            ..Default::default()
        };
        assert_eq!(persistent(&many, o).unwrap().lanes, 1);
        // the knob selects the persistent engine
        let o = PlanOptions {
            persistent_column_lanes: Some(true),
            ..Default::default()
        };
        assert!(choose(&p, DeviceFacts::H200, o).unwrap().split().is_none());
    }

    #[test]
    fn persistent_knobs_reach_the_plan() {
        let p = DecodeProblem::new(16, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let d = persistent(&p, PlanOptions::default()).unwrap();
        assert_eq!(
            (d.grid, d.min_tiles_per_cta),
            (132, PERSISTENT_MIN_TILES_PER_CTA)
        );
        assert_eq!(
            (
                d.variant.consumer_groups,
                d.variant.stages,
                d.variant.tile_tokens
            ),
            (1, 2, 64)
        );
        let o = PlanOptions {
            persistent_ctas: Some(66),
            min_tiles_per_cta: Some(8),
            ..Default::default()
        };
        let f = persistent(&p, o).unwrap();
        assert_eq!((f.grid, f.min_tiles_per_cta), (66, 8));
        let ring = |g, s, t| PlanOptions {
            persistent_groups: g,
            persistent_stages: s,
            persistent_tile_tokens: t,
            ..Default::default()
        };
        let v = |o| {
            let v = persistent(&p, o).unwrap().variant;
            (v.consumer_groups, v.stages, v.tile_tokens)
        };
        assert_eq!(v(ring(Some(1), Some(6), None)), (1, 6, 64));
        assert_eq!(v(ring(Some(2), Some(2), Some(128))), (2, 2, 128));
        // the default depth for a forced group count or stage size: the deepest up to the
        // head dim's default depth that fits
        assert_eq!(v(ring(Some(2), None, None)), (2, 2, 64));
        assert_eq!(v(ring(Some(1), None, Some(128))), (1, 2, 128));
        let d64 = DecodeProblem::new(16, 64, 8, 64, 4096, DType::Bf16).unwrap();
        let r64 = persistent(&d64, ring(Some(1), None, None)).unwrap().variant;
        assert_eq!((r64.consumer_groups, r64.stages), (1, 4));
        for (o, arg) in [
            (ring(Some(2), Some(3), None), "persistent_stages"), // not a multiple of 2 groups
            (ring(Some(2), Some(6), None), "persistent_stages"), // 6 x 32 KB + 2 groups' scratch
            (ring(None, None, Some(96)), "persistent_tile_tokens"),
            (ring(None, None, Some(512)), "persistent_tile_tokens"),
            (ring(Some(3), None, None), "persistent_groups"),
            (
                PlanOptions {
                    persistent_ctas: Some(PERSISTENT_MAX_FORCED_GRID + 1),
                    ..Default::default()
                },
                "persistent_ctas",
            ),
            (
                PlanOptions {
                    persistent_ctas: Some(0),
                    ..Default::default()
                },
                "persistent_ctas",
            ),
            (
                PlanOptions {
                    min_tiles_per_cta: Some(0),
                    ..Default::default()
                },
                "min_tiles_per_cta",
            ),
        ] {
            let msg = persistent(&p, o).unwrap_err().to_string();
            assert!(msg.contains(arg), "{o:?}: {msg}");
        }
        // two groups do not fit 32 query rows per column block
        let wide = DecodeProblem::new(16, 32, 1, 128, 4096, DType::Bf16).unwrap();
        let msg = persistent(&wide, ring(Some(2), None, None))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("persistent_groups"), "{msg}");
    }

    #[test]
    fn l2_promotion_defaults_to_128_bytes_and_the_knob_reaches_both_engines() {
        use crate::launch::TmaPromotion;
        let b16 = DecodeProblem::new(16, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let b1 = DecodeProblem::new(1, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let of = |p: &DecodeProblem, o: PlanOptions| match choose(p, DeviceFacts::H200, o).unwrap()
        {
            Plan::Persistent(pp) => pp.kv_promotion,
            Plan::Split(sp) => sp.kv_promotion,
        };
        assert_eq!(of(&b16, PlanOptions::default()), TmaPromotion::B128);
        assert_eq!(of(&b1, PlanOptions::default()), TmaPromotion::B128);
        let forced = PlanOptions {
            kv_promotion: Some(TmaPromotion::None),
            ..Default::default()
        };
        assert_eq!(of(&b16, forced), TmaPromotion::None);
        assert_eq!(of(&b1, forced), TmaPromotion::None);
        // the knob belongs to neither engine: the choice stays the default one
        assert!(matches!(
            choose(&b1, DeviceFacts::H200, forced).unwrap(),
            Plan::Split(_)
        ));
    }

    #[test]
    fn worked_example_from_the_docs() {
        let p = DecodeProblem::new(1, 16, 2, 128, 131_072, DType::Bf16).unwrap();
        let plan = plan(&p, DeviceFacts::H200, PlanOptions::default()).unwrap();
        assert_eq!(plan.num_splits, 33);
        assert_eq!(plan.grid, [33, 2, 1]);
        assert!(plan.combine.is_some());
        assert_eq!(plan.reduction, Reduction::Kernel);
    }

    #[test]
    fn automatic_reduction_follows_the_measured_rule() {
        let auto = |batch, hq, hkv, d, len| {
            let p = DecodeProblem::new(batch, hq, hkv, d, len, DType::Bf16).unwrap();
            let pl = plan(&p, DeviceFacts::H200, PlanOptions::default()).unwrap();
            (pl.num_splits, pl.reduction, pl.combine.is_some())
        };
        assert_eq!(auto(1, 16, 2, 64, 1024), (8, Reduction::Cluster, false));
        assert_eq!(auto(1, 16, 1, 64, 1024), (8, Reduction::Kernel, true)); // 16 columns
        assert_eq!(auto(1, 16, 16, 64, 1024), (4, Reduction::Cluster, false));
        assert_eq!(auto(1, 16, 16, 128, 1024), (4, Reduction::Kernel, true));
        assert_eq!(auto(1, 16, 16, 64, 65_536), (4, Reduction::Kernel, true));
        assert_eq!(auto(1, 16, 2, 128, 1024), (16, Reduction::Kernel, true));
        assert_eq!(auto(4, 32, 8, 128, 32_768), (2, Reduction::Kernel, true));
        assert_eq!(auto(128, 32, 8, 128, 4096).0, 1);
        for n in 1..=MAX_SPLITS {
            for t in 1..4 {
                for c in [1, 8, 9, 16] {
                    let cluster = auto_reduction(n, t, c) == Reduction::Cluster;
                    assert_eq!(
                        cluster,
                        [2, 4, 8].contains(&n) && t <= 2 && c <= 8,
                        "{n} splits of {t} tiles, {c} columns"
                    );
                }
            }
        }
    }

    #[test]
    fn resident_ctas_pad_shared_memory_just_enough() {
        for n in 1..=MAX_RESIDENT_CTAS {
            let b = resident_shared_bytes(10_000, Some(n));
            let per_cta = b + SHARED_BYTES_RESERVED_PER_CTA;
            assert!(n * per_cta <= SM_SHARED_BYTES, "{n} CTAs of {b} B fit");
            assert!(
                (n + 1) * per_cta > SM_SHARED_BYTES,
                "{} CTAs of {b} B do not",
                n + 1
            );
        }
        assert_eq!(resident_shared_bytes(200_000, Some(1)), 200_000);
        assert_eq!(resident_shared_bytes(5_000, None), 5_000);
        let p = DecodeProblem::new(1, 16, 2, 128, 4096, DType::Bf16).unwrap();
        let bad = PlanOptions {
            resident_ctas: Some(0),
            ..Default::default()
        };
        assert!(plan(&p, DeviceFacts::H200, bad).is_err());
    }

    #[test]
    fn full_waves_stream_one_cta_per_sm_with_two_stages() {
        let one_cta = resident_shared_bytes(0, Some(1));
        for (batch, full) in [(8, false), (16, true), (128, true)] {
            let p = DecodeProblem::new(batch, 32, 8, 128, 32768, DType::Bf16).unwrap();
            let pl = plan(&p, DeviceFacts::H200, PlanOptions::default()).unwrap();
            assert_eq!(pl.num_splits, 1);
            assert_eq!(
                pl.decode.stages,
                if full { FULL_WAVE_STAGES } else { STAGES }
            );
            let own = pl.decode.shared_bytes();
            let expected = if full { own.max(one_cta) } else { own };
            assert_eq!(pl.decode_shared_bytes, expected, "batch {batch}");
        }
        // forcing either knob wins
        let p = DecodeProblem::new(128, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let forced = PlanOptions {
            stages: Some(STAGES),
            resident_ctas: Some(2),
            ..Default::default()
        };
        let pl = plan(&p, DeviceFacts::H200, forced).unwrap();
        assert_eq!(pl.decode.stages, STAGES);
        assert_eq!(pl.decode_shared_bytes, pl.decode.shared_bytes());
    }

    #[test]
    fn device_plans_keep_the_paged_ring_for_every_page_size() {
        let p = DecodeProblem::new(16, 32, 8, 128, 8192, DType::Bf16).unwrap();
        let device = PlanOptions {
            device_plan: true,
            ..Default::default()
        };
        for page_size in [16, 64] {
            let paged = p
                .clone()
                .with_paged(page_size, 16 * 8192 / page_size, None)
                .unwrap();
            let pl = plan(&paged, DeviceFacts::H200, device).unwrap();
            assert_eq!(pl.decode.stages, PAGED_STAGES, "page {page_size}");
        }
        assert_eq!(
            plan(&p, DeviceFacts::H200, device).unwrap().decode.stages,
            STAGES
        );
    }

    #[test]
    fn small_pages_keep_four_tiles_large_pages_plan_like_contiguous() {
        let p = DecodeProblem::new(1, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let contiguous = plan(&p, DeviceFacts::H200, PlanOptions::default()).unwrap();
        assert_eq!(contiguous.num_splits, 8); // target 66 CTAs over 8 units
        let paged = p.clone().with_paged(8, 512, None).unwrap();
        let pl = plan(&paged, DeviceFacts::H200, PlanOptions::default()).unwrap();
        assert_eq!(pl.num_splits, 16); // 264 CTAs wanted, 64 tiles / 4
        assert_eq!(pl.decode.stages, PAGED_STAGES);
        // d64 tiles hold 128 positions: its pages of 64 stay on the paged plan
        let d64 = DecodeProblem::new(1, 32, 8, 64, 4096, DType::Bf16).unwrap();
        let pl = plan(
            &d64.with_paged(64, 64, None).unwrap(),
            DeviceFacts::H200,
            PlanOptions::default(),
        )
        .unwrap();
        assert_eq!(pl.decode.stages, PAGED_STAGES);
        // joined-halves pages of 16 and 32 plan like the contiguous cache
        for page_size in [16, 32] {
            let pl = plan(
                &p.clone()
                    .with_paged(page_size, 4096 / page_size, None)
                    .unwrap(),
                DeviceFacts::H200,
                PlanOptions::default(),
            )
            .unwrap();
            assert!(pl.decode.joined_halves);
            assert_eq!(
                (pl.num_splits, pl.decode.stages),
                (8, STAGES),
                "page {page_size}"
            );
        }
        // pages of a whole tile or more stream like a contiguous cache and take its plan
        let long = DecodeProblem::new(1, 32, 8, 128, 32768, DType::Bf16).unwrap();
        let contiguous = plan(&long, DeviceFacts::H200, PlanOptions::default()).unwrap();
        for page_size in [64, 256] {
            let pl = plan(
                &long.clone().with_paged(page_size, 512, None).unwrap(),
                DeviceFacts::H200,
                PlanOptions::default(),
            )
            .unwrap();
            assert_eq!(
                (pl.num_splits, pl.decode.stages),
                (contiguous.num_splits, STAGES)
            );
        }
        let pl = plan(
            &long.with_paged(8, 4096, None).unwrap(),
            DeviceFacts::H200,
            PlanOptions::default(),
        )
        .unwrap();
        assert_eq!(pl.num_splits, 33);
    }

    #[test]
    fn paged_batches_of_two_to_four_splits_take_a_cluster_pair() {
        let paged = |batch, page| {
            DecodeProblem::new(batch, 32, 8, 128, 4096, DType::Bf16)
                .unwrap()
                .with_paged(page, batch * 4096 / page, None)
                .unwrap()
        };
        let auto = |p: &DecodeProblem, options| plan(p, DeviceFacts::H200, options).unwrap();
        // b8: 64 units, the paged heuristic wants 4 splits
        let pl = auto(&paged(8, 8), PlanOptions::default());
        assert_eq!((pl.num_splits, pl.reduction), (2, Reduction::Cluster));
        assert!(pl.combine.is_none());
        // forcing cluster reduction gives the same pair, forcing kernel reduction the heuristic
        let cluster = PlanOptions {
            reduction: Some(Reduction::Cluster),
            ..Default::default()
        };
        assert_eq!(auto(&paged(8, 8), cluster).num_splits, 2);
        let kernel = PlanOptions {
            reduction: Some(Reduction::Kernel),
            ..Default::default()
        };
        assert_eq!(auto(&paged(8, 8), kernel).num_splits, 4);
        // b1 (16 splits), b32 (1 split) and pages of a tile (contiguous plan) are unchanged
        assert_eq!(
            auto(&paged(1, 8), PlanOptions::default()).reduction,
            Reduction::Kernel
        );
        assert_eq!(auto(&paged(32, 8), PlanOptions::default()).num_splits, 1);
        assert_eq!(auto(&paged(8, 64), PlanOptions::default()).num_splits, 1);
        // joined-halves pages of 16 take the contiguous plan: one split, no cluster
        let pl = auto(&paged(8, 16), PlanOptions::default());
        assert_eq!((pl.num_splits, pl.decode.stages), (1, STAGES));
        // a forced split count is kept as asked
        let forced = PlanOptions {
            num_splits: Some(4),
            ..Default::default()
        };
        assert_eq!(auto(&paged(8, 8), forced).num_splits, 4);
    }

    #[test]
    fn fp8_caches_take_the_engine_rule_of_2_byte_caches_with_twice_the_stages() {
        use crate::problem::KvDType;
        let fp8 = |batch, d, hq| {
            DecodeProblem::new(batch, hq, 8, d, 4096, DType::Bf16)
                .unwrap()
                .with_kv_dtype(KvDType::Fp8E4m3)
                .unwrap()
        };
        // batch 1: the split engine, as a 2-byte cache, with twice its ring
        let p = fp8(1, 128, 32);
        let two_byte = DecodeProblem::new(1, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let split = |p: &DecodeProblem, o| match choose(p, DeviceFacts::H200, o).unwrap() {
            Plan::Split(sp) => sp,
            Plan::Persistent(_) => panic!("persistent engine chosen for {o:?}"),
        };
        let (s8, s2) = (
            split(&p, PlanOptions::default()),
            split(&two_byte, PlanOptions::default()),
        );
        assert_eq!(s8.decode.kv_dtype, KvDType::Fp8E4m3);
        assert_eq!(s8.decode.stages, 2 * s2.decode.stages);
        // twice the CTAs: a CTA pulls half the bytes (FP8_TARGET_CTAS_PER_SM)
        assert_eq!(s8.num_splits, 2 * s2.num_splits);
        assert!(s8.decode_shared_bytes < s2.decode_shared_bytes * 2);
        let two = PlanOptions {
            num_splits: Some(2),
            ..Default::default()
        };
        assert_eq!(split(&p, two).num_splits, 2);
        let bad = PlanOptions {
            stages: Some(2),
            ..Default::default()
        };
        let msg = choose(&p, DeviceFacts::H200, bad).unwrap_err().to_string();
        assert!(msg.contains("[4, 8] for a fp8_e4m3 cache"), "{msg}");
        // a paged fp8 cache never joins halves (a d 128 position is one 128-byte row)
        let paged16 = fp8(1, 128, 32).with_paged(16, 256 + 3, None).unwrap();
        assert!(!split(&paged16, PlanOptions::default()).decode.joined_halves);
        // the persistent engine where asked for (or where the batch fills the GPU)
        let on_persistent = PlanOptions {
            engine: Some(Engine::Persistent),
            ..Default::default()
        };
        let v = persistent(&p, on_persistent).unwrap().variant;
        assert_eq!(
            (v.kv_dtype, v.consumer_groups, v.stages, v.tile_tokens),
            (KvDType::Fp8E4m3, 2, PERSISTENT_FP8_D128_STAGES, 64)
        );
        let d64 = persistent(&fp8(16, 64, 64), PlanOptions::default())
            .unwrap()
            .variant;
        assert_eq!(
            (d64.consumer_groups, d64.stages, d64.tile_tokens),
            (2, 8, 128)
        );
        // 64-byte rows promote to 64 bytes (128 read the next head's row too), 128-byte ones
        // to 128, unless forced; on both engines
        use crate::launch::TmaPromotion;
        assert_eq!(
            split(&fp8(1, 64, 32), PlanOptions::default()).kv_promotion,
            TmaPromotion::B64
        );
        assert_eq!(s8.kv_promotion, TmaPromotion::B128);
        let promotion = |p: &DecodeProblem, o| persistent(p, o).unwrap().kv_promotion;
        assert_eq!(
            promotion(&fp8(16, 64, 64), PlanOptions::default()),
            TmaPromotion::B64
        );
        // paired d 64 heads stream 128-byte rows
        assert_eq!(
            promotion(&fp8(16, 64, 32), PlanOptions::default()),
            TmaPromotion::B128
        );
        assert_eq!(
            promotion(&fp8(16, 128, 32), PlanOptions::default()),
            TmaPromotion::B128
        );
        let bf16_d64 = DecodeProblem::new(16, 64, 8, 64, 4096, DType::Bf16).unwrap();
        assert_eq!(
            promotion(&bf16_d64, PlanOptions::default()),
            TmaPromotion::B128
        );
        let forced = PlanOptions {
            kv_promotion: Some(TmaPromotion::None),
            ..Default::default()
        };
        assert_eq!(promotion(&fp8(16, 64, 32), forced), TmaPromotion::None);
        // 32 query rows per KV head: one group, the deepest ring of up to eight stages that fits
        let wide = persistent(&fp8(16, 128, 256), PlanOptions::default())
            .unwrap()
            .variant;
        assert_eq!(wide.consumer_groups, 1);
        assert!(
            (4..=PERSISTENT_FP8_D128_STAGES).contains(&wide.stages),
            "{}",
            wide.stages
        );
        // a forced tile keeps the fp8 ring
        let forced = PlanOptions {
            persistent_tile_tokens: Some(128),
            ..Default::default()
        };
        assert_eq!(persistent(&p, forced).unwrap().variant.consumer_groups, 2);
        // boxes need 128-byte page runs: pages of 1 at d 64 fp8 are gathered only
        let paged = fp8(2, 64, 64).with_paged(1, 8192 + 3, None).unwrap();
        let boxes = PlanOptions {
            persistent_paged_gather: Some(false),
            ..Default::default()
        };
        let msg = choose(&paged, DeviceFacts::H200, boxes)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("persistent_paged_gather"), "{msg}");
        assert_eq!(
            persistent(&paged, PlanOptions::default())
                .unwrap()
                .variant
                .kv_source,
            KvSource::PagedGather
        );
        // 64-byte rows gather pages below 64 (on the persistent engine; batch 2 takes the
        // split engine by default)
        let p32 = fp8(2, 64, 64).with_paged(32, 256 + 3, None).unwrap();
        assert_eq!(
            persistent(&p32, on_persistent).unwrap().variant.kv_source,
            KvSource::PagedGather
        );
    }

    #[test]
    fn softmax_slices_are_checked_against_the_tile() {
        let p = DecodeProblem::new(16, 64, 8, 64, 4096, DType::Bf16).unwrap();
        let knob = |m, tile| PlanOptions {
            persistent_softmax_slices: Some(m),
            persistent_tile_tokens: tile,
            ..Default::default()
        };
        // d 64: 128-position tiles, two m16 slices per warp
        assert_eq!(
            persistent(&p, knob(2, None))
                .unwrap()
                .variant
                .softmax_slices,
            2
        );
        assert_eq!(
            persistent(&p, PlanOptions::default())
                .unwrap()
                .variant
                .softmax_slices,
            1
        );
        for (m, tile) in [(2, Some(64)), (3, None), (0, None)] {
            let msg = choose(&p, DeviceFacts::H200, knob(m, tile))
                .unwrap_err()
                .to_string();
            assert!(msg.contains("persistent_softmax_slices"), "{msg}");
        }
        // a knob of the persistent engine: it selects that engine
        let b1 = DecodeProblem::new(1, 16, 2, 128, 4096, DType::Bf16).unwrap();
        assert!(persistent(&b1, knob(2, Some(128))).is_ok());
    }

    #[test]
    fn a_full_wave_needs_no_split_and_no_workspace() {
        let p = DecodeProblem::new(128, 32, 8, 128, 4096, DType::Bf16).unwrap();
        let plan = plan(&p, DeviceFacts::H200, PlanOptions::default()).unwrap();
        assert_eq!(plan.num_splits, 1);
        assert!(plan.combine.is_none());
        assert_eq!(plan.workspace.bytes(), 0);
    }

    #[test]
    fn consumer_groups_are_checked() {
        let p = DecodeProblem::new(1, 32, 1, 128, 4096, DType::Bf16).unwrap();
        let two = PlanOptions {
            consumer_groups: Some(2),
            ..Default::default()
        };
        let msg = plan(&p, DeviceFacts::H200, two).unwrap_err().to_string();
        assert!(msg.contains("consumer_groups"), "{msg}");
        let p = DecodeProblem::new(1, 16, 2, 128, 4096, DType::Bf16).unwrap();
        assert_eq!(
            plan(&p, DeviceFacts::H200, two)
                .unwrap()
                .decode
                .consumer_groups,
            2
        );
        let three = PlanOptions {
            consumer_groups: Some(3),
            ..Default::default()
        };
        assert!(plan(&p, DeviceFacts::H200, three).is_err());
    }

    #[test]
    fn second_consumer_group_only_with_two_tiles_per_split() {
        let groups = |hq, hkv, len| {
            let p = DecodeProblem::new(1, hq, hkv, 128, len, DType::Bf16).unwrap();
            plan(&p, DeviceFacts::H200, PlanOptions::default())
                .unwrap()
                .decode
                .consumer_groups
        };
        assert_eq!(groups(16, 2, 2048), 1); // 32 tiles over 32 splits
        assert_eq!(groups(16, 2, 4096), 2); // 64 tiles over 33 splits
        assert_eq!(groups(16, 16, 131_072), 2);
        assert_eq!(groups(32, 1, 131_072), 1); // 32 heads: does not fit twice
    }

    #[test]
    fn cluster_reduction_needs_no_combine_and_caps_splits() {
        let p = DecodeProblem::new(1, 16, 2, 128, 131_072, DType::Bf16).unwrap();
        let cluster = PlanOptions {
            reduction: Some(Reduction::Cluster),
            ..Default::default()
        };
        let pl = plan(&p, DeviceFacts::H200, cluster).unwrap();
        assert_eq!(pl.num_splits, MAX_CLUSTER_SPLITS);
        assert!(pl.combine.is_none());
        assert_eq!(pl.workspace.bytes(), 0);
        let too_many = PlanOptions {
            num_splits: Some(9),
            ..cluster
        };
        let msg = plan(&p, DeviceFacts::H200, too_many)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("num_splits") && msg.contains("[1, 2, 4, 8, 16]"),
            "{msg}"
        );
        assert!(plan(
            &p,
            DeviceFacts::H200,
            PlanOptions {
                num_splits: Some(17),
                ..cluster
            }
        )
        .is_err());
        assert_eq!(cluster_splits(33), 16);
        assert_eq!(cluster_splits(12), 8);
        assert_eq!(cluster_splits(1), 1);
    }

    #[test]
    fn device_plan_sizes_for_any_lengths() {
        let p = DecodeProblem::new(16, 32, 8, 128, 1 << 20, DType::Bf16).unwrap();
        let opts = PlanOptions {
            device_plan: true,
            ..Default::default()
        };
        let pl = plan(&p, DeviceFacts::H200, opts).unwrap();
        let dp = pl.device_plan.unwrap();
        assert_eq!(dp.target, 132);
        assert_eq!(dp.grid, 132 + 16 * 8);
        assert_eq!(pl.grid, [dp.grid as u32, 1, 1]);
        assert!(pl.combine.is_some());
        // 3 x target slots of 8 columns (one n8 tile: group 4)
        assert_eq!(pl.workspace.stats, 3 * 132 * 8);
        assert_eq!(dp.slots, 3 * 132);
        assert_eq!(pl.workspace.work, 2 * dp.grid);
        let o = pl.workspace.offsets();
        assert!(o.m_partial < o.l_partial && o.l_partial < o.work && o.work < o.request_plan);
        assert_eq!(o.request_plan % 256, 0);
        assert!(pl.workspace.bytes() >= o.request_plan + 16 * 8);
        let bad = PlanOptions {
            num_splits: Some(4),
            ..opts
        };
        assert!(plan(&p, DeviceFacts::H200, bad).is_err());
    }

    #[test]
    fn device_plan_with_cluster_reduction_needs_no_workspace_for_partials() {
        let p = DecodeProblem::new(16, 32, 8, 128, 1 << 20, DType::Bf16).unwrap();
        let opts = PlanOptions {
            device_plan: true,
            reduction: Some(Reduction::Cluster),
            ..Default::default()
        };
        let pl = plan(&p, DeviceFacts::H200, opts).unwrap();
        let dp = pl.device_plan.unwrap();
        // eight KV heads: clusters of 16 let one long request fill the 132 SMs
        assert_eq!(pl.num_splits, 16);
        assert_eq!(pl.reduction, Reduction::Cluster);
        assert!(pl.combine.is_none());
        assert_eq!(dp.grid, 16 * 8 * 16);
        assert_eq!(dp.grid % pl.num_splits, 0, "whole clusters");
        assert_eq!(
            (dp.slots, pl.workspace.o_partial, pl.workspace.stats),
            (0, 0, 0)
        );
        assert_eq!(pl.workspace.work, 2 * dp.grid);
        assert_eq!(device_plan_cluster_size(16, 132), 8);
        assert_eq!(device_plan_cluster_size(64, 132), 2);
        assert_eq!(device_plan_cluster_size(1, 264), 16);
    }

    #[test]
    fn device_plan_fills_one_wave_on_a_skewed_batch() {
        // one request of 2^20 positions and fifteen of 2048, 32/8 heads, d128 (64-row tiles)
        let mut lens = vec![2048; 16];
        lens[3] = 1 << 20;
        let plan = device_plan_splits(&lens, 8, 64, 132, 3 * 132);
        let long_ctas = plan[3].0 * 8;
        let short_ctas: usize = (0..16).filter(|&b| b != 3).map(|b| plan[b].0 * 8).sum();
        assert_eq!(short_ctas, 120);
        assert!((120..=128).contains(&long_ctas), "{long_ctas} long CTAs");
    }

    #[test]
    fn device_plan_does_not_round_a_uniform_batch_into_two_waves() {
        // eight requests of 32768 at 32/8 heads, d128: 512 tiles per unit, fair share 249 tiles;
        // rounding up would give 3 splits per unit (192 CTAs on 132 SMs)
        let plan = device_plan_splits(&[32_768; 8], 8, 64, 132, 3 * 132);
        assert!(plan.iter().all(|&(splits, _)| splits == 2), "{plan:?}");
        // 24 requests: 192 units already exceed a wave, so nothing is split
        let plan = device_plan_splits(&[32_768; 24], 8, 64, 132, 3 * 132);
        assert!(plan.iter().all(|&(splits, _)| splits == 1), "{plan:?}");
    }

    #[test]
    fn cluster_device_plan_gives_the_long_request_whole_clusters() {
        let mut lens = vec![2048; 16];
        lens[3] = 1 << 20;
        let plan = device_plan_cluster_splits(&lens, 8, 64, 132, 16);
        for (b, &(splits, slot)) in plan.iter().enumerate() {
            assert_eq!(
                (splits, slot),
                (if b == 3 { 16 } else { 1 }, 0),
                "request {b}"
            );
        }
        // no request longer than its share: every unit runs unsplit
        let plan = device_plan_cluster_splits(&[4096; 64], 8, 64, 132, 16);
        assert!(plan.iter().all(|&(splits, _)| splits == 1));
    }

    proptest! {
        /// The cluster plan fits its grid, and its long units start on cluster boundaries
        /// (long requests first, each `units * cluster` items).
        #[test]
        fn cluster_device_plan_stays_inside_its_grid(
            lens in prop::collection::vec(0usize..300_000, 1..64),
            units in 1usize..=32,
        ) {
            let cluster = device_plan_cluster_size(units, 132);
            let plan = device_plan_cluster_splits(&lens, units, 64, 132, cluster);
            let items: usize = plan.iter().map(|(s, _)| s * units).sum();
            prop_assert!(items <= lens.len() * units * cluster);
            for &(splits, _) in &plan {
                prop_assert!(splits == 1 || splits == cluster);
            }
        }

        /// A uniform batch is split into at most one wave (or not at all).
        #[test]
        fn device_plan_splits_a_uniform_batch_into_one_wave(
            batch in 1usize..64, len in 1usize..300_000, units in 1usize..=32,
        ) {
            let lens = vec![len; batch];
            let plan = device_plan_splits(&lens, units, 64, 132, 3 * 132);
            let items: usize = plan.iter().map(|(s, _)| s * units).sum();
            prop_assert!(items <= 132usize.max(batch * units), "{} items", items);
        }

        /// The planner never needs more CTAs than the grid nor more slots than the workspace,
        /// and gives every request at least one split.
        #[test]
        fn device_plan_stays_inside_its_bounds(
            lens in prop::collection::vec(0usize..300_000, 1..64),
            units in 1usize..=32,
            d in prop::sample::select(vec![64usize, 128]),
        ) {
            let target = 132;
            let plan = device_plan_splits(&lens, units, tile_tokens(d), target, 3 * target);
            // the slot fallback (a request run unsplit) is never needed at 3 x target slots
            prop_assert_eq!(&plan, &device_plan_splits(&lens, units, tile_tokens(d), target, usize::MAX));
            let items: usize = plan.iter().map(|(s, _)| s * units).sum();
            prop_assert!(items <= target + lens.len() * units, "{} items", items);
            for (b, &(splits, base)) in plan.iter().enumerate() {
                prop_assert!((1..=MAX_SPLITS).contains(&splits));
                if splits > 1 {
                    prop_assert!(base + splits * units <= 3 * target, "request {}", b);
                }
            }
        }
    }

    #[test]
    fn reduction_names_round_trip() {
        for r in [Reduction::Kernel, Reduction::Cluster] {
            assert_eq!(r.name().parse::<Reduction>().unwrap(), r);
        }
        let msg = "atomic".parse::<Reduction>().unwrap_err().to_string();
        assert!(msg.contains("reduction") && msg.contains("atomic"), "{msg}");
    }

    #[test]
    fn stages_are_checked() {
        let p = DecodeProblem::new(1, 16, 2, 128, 4096, DType::Bf16).unwrap();
        let opts = |s| PlanOptions {
            stages: Some(s),
            ..Default::default()
        };
        assert_eq!(
            plan(&p, DeviceFacts::H200, opts(2)).unwrap().decode.stages,
            2
        );
        assert!(plan(&p, DeviceFacts::H200, opts(3))
            .unwrap_err()
            .to_string()
            .contains("stages"));
    }

    #[test]
    fn forced_split_count_is_checked() {
        let p = DecodeProblem::new(1, 16, 2, 128, 4096, DType::Bf16).unwrap();
        for n in [0, MAX_SPLITS + 1] {
            let opts = PlanOptions {
                num_splits: Some(n),
                ..Default::default()
            };
            let msg = plan(&p, DeviceFacts::H200, opts).unwrap_err().to_string();
            assert!(msg.contains("num_splits"), "{msg}");
        }
    }

    proptest! {
        /// Splits tile [0, len) exactly: consecutive, disjoint, in order, whole tiles except the
        /// last non-empty one, lengths within one tile of each other.
        #[test]
        fn split_ranges_partition_the_request(len in 0usize..20_000, splits in 1usize..=MAX_SPLITS,
                                              d in prop::sample::select(vec![64usize, 128])) {
            let tile = tile_tokens(d);
            let mut next = 0;
            let tiles = len.div_ceil(tile);
            for s in 0..splits {
                let r = split_range(len, splits, s, tile);
                if r.is_empty() {
                    prop_assert!(tiles < splits, "empty split with {} tiles", tiles);
                    continue;
                }
                prop_assert_eq!(r.start, next);
                prop_assert!(r.start % tile == 0);
                prop_assert!(r.end == len || r.end % tile == 0);
                let n = r.end.div_ceil(tile) - r.start / tile;
                prop_assert!(n == tiles / splits || n == tiles / splits + 1);
                next = r.end;
            }
            prop_assert_eq!(next, len);
        }

        /// The heuristic stays in range, never splits a problem whose batch already supplies the
        /// target CTAs, and never gives a split fewer than MIN_TILES_PER_SPLIT tiles.
        #[test]
        fn heuristic_is_sane(batch in 1usize..300, hkv in prop::sample::select(vec![1usize, 2, 4, 8, 16]),
                             g in 1usize..=32, d in prop::sample::select(vec![64usize, 128]),
                             len in 1usize..300_000) {
            let p = DecodeProblem::new(batch, hkv * g, hkv, d, len, DType::Bf16).unwrap();
            let pl = plan(&p, DeviceFacts::H200, PlanOptions::default()).unwrap();
            prop_assert!((1..=MAX_SPLITS).contains(&pl.num_splits));
            if batch * hkv >= 66 { prop_assert_eq!(pl.num_splits, 1); }
            let tiles = len.div_ceil(tile_tokens(d));
            if pl.num_splits > 1 {
                prop_assert!(tiles / pl.num_splits >= MIN_TILES_PER_SPLIT);
                prop_assert_eq!(pl.reduction, auto_reduction(pl.num_splits, tiles.div_ceil(pl.num_splits), g));
                let expected = match pl.reduction {
                    Reduction::Kernel => pl.num_splits * batch * hkv * g * d,
                    Reduction::Cluster => 0,
                };
                prop_assert_eq!(pl.workspace.o_partial, expected);
                prop_assert_eq!(pl.combine.is_some(), pl.reduction == Reduction::Kernel);
            }
            prop_assert!(batch * hkv * pl.num_splits <= 132 + batch * hkv);
        }
    }
}
