//! The CUDA sources embedded in the library and the variants they are compiled into.
//!
//! A variant is a source plus NVRTC `-D` defines; the plan module chooses variants, the JIT
//! compiles them, nothing else knows about defines. [`all_variants`] lists every variant the
//! library can launch, so tests and `kvstream kernels` can compile each one.

use crate::plan;
use crate::problem::{
    DType, DecodeProblem, KvDType, MAX_GROUP, SPLIT_ENGINE_HEAD_DIMS, SUPPORTED_HEAD_DIMS,
};

/// Headers the kernels include, by the name they use in `#include "..."`.
pub const HEADERS: [(&str, &str); 10] = [
    ("ptx.cuh", include_str!("../../../kernels/include/ptx.cuh")),
    (
        "kv_format.cuh",
        include_str!("../../../kernels/include/kv_format.cuh"),
    ),
    (
        "merge.cuh",
        include_str!("../../../kernels/include/merge.cuh"),
    ),
    (
        "params.cuh",
        include_str!("../../../kernels/include/params.cuh"),
    ),
    (
        "decode_params.cuh",
        include_str!("../../../kernels/include/decode_params.cuh"),
    ),
    (
        "schedule.cuh",
        include_str!("../../../kernels/include/schedule.cuh"),
    ),
    (
        "scheduler.cuh",
        include_str!("../../../kernels/include/scheduler.cuh"),
    ),
    (
        "score_mods.cuh",
        include_str!("../../../kernels/include/score_mods.cuh"),
    ),
    (
        "trace.cuh",
        include_str!("../../../kernels/include/trace.cuh"),
    ),
    (
        "wgmma.cuh",
        include_str!("../../../kernels/include/wgmma.cuh"),
    ),
];

const DECODE_SRC: &str = include_str!("../../../kernels/sm90/decode.cu");
const DECODE_GQA_SRC: &str = include_str!("../../../kernels/sm90/decode_gqa.cu");
const DECODE_MLA_SRC: &str = include_str!("../../../kernels/sm90/decode_mla.cu");
const COMBINE_SRC: &str = include_str!("../../../kernels/sm90/combine.cu");
const STREAM_READ_SRC: &str = include_str!("../../../kernels/sm90/stream_read.cu");
const PLAN_WORK_SRC: &str = include_str!("../../../kernels/sm90/plan_work.cu");
const STORE_KV_SRC: &str = include_str!("../../../kernels/sm90/store_kv.cu");
const MERGE_STATES_SRC: &str = include_str!("../../../kernels/sm90/merge_states.cu");

/// Threads per combine CTA: eight warps on one output row (combine.cu).
pub const COMBINE_THREADS: u32 = 256;
/// Most n8 tiles of query rows one decode CTA holds (32 rows: the O^T accumulators of four
/// tiles at d128 take 128 registers per thread).
pub const MAX_N_TILES: usize = 4;

/// A compiled-at-run-time kernel: where its source is and how to specialise it.
pub trait Variant {
    /// Unique, human-readable name, e.g. `decode_gqa.bf16.d128.n1.t64.s4`.
    fn name(&self) -> String;
    /// The `.cu` source.
    fn source(&self) -> &'static str;
    /// The `extern "C"` entry point.
    fn entry(&self) -> &'static str;
    /// `-D` defines that specialise the source.
    fn defines(&self) -> Vec<(String, String)>;
}

/// One specialisation of `decode_gqa.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DecodeVariant {
    /// Element type of q and out (and of the caches unless `kv_dtype` says otherwise).
    pub dtype: DType,
    /// Element type of the K and V caches.
    pub kv_dtype: KvDType,
    /// 64 or 128.
    pub head_dim: usize,
    /// ceil(group / 8).
    pub n_tiles: usize,
    /// KV positions per ring stage.
    pub tile_tokens: usize,
    /// Ring depth.
    pub stages: usize,
    /// Groups of four consumer warps working on alternate tiles (1 or 2).
    pub consumer_groups: usize,
    /// Paged cache (the producer warp streams page runs); contiguous otherwise.
    pub paged: bool,
    /// Paged d128 cache with pages of 8 positions up to a tile: one TMA box per page run holds
    /// both 64-dim halves ([`crate::launch::joined_page_map`]), half the boxes of the two-box
    /// layout; decode_gqa.cu lays the tile out to match (`kv_chunk`). 2-byte caches only. See
    /// [`Self::joins_halves`].
    pub joined_halves: bool,
}

impl DecodeVariant {
    /// The variant that serves `problem`.
    pub fn for_problem(problem: &DecodeProblem) -> Self {
        DecodeVariant {
            dtype: problem.dtype,
            kv_dtype: problem.kv_dtype,
            head_dim: problem.head_dim,
            n_tiles: problem.columns().div_ceil(8).min(MAX_N_TILES),
            tile_tokens: plan::tile_tokens(problem.head_dim),
            stages: plan::STAGES,
            consumer_groups: 1,
            paged: problem.paged.is_some(),
            joined_halves: problem.paged.is_some_and(|pg| {
                Self::joins_halves(
                    problem.head_dim,
                    problem.kv_dtype,
                    plan::tile_tokens(problem.head_dim),
                    pg.page_size,
                )
            }),
        }
    }

    /// Whether pages of `page_size` positions are read with joined halves: d128 2-byte caches
    /// (two 64-dim halves per position; an e4m3 position is one 128-byte row already) and pages
    /// of at least 8 positions (one swizzle phase) but smaller than a tile (larger pages already
    /// take one box per half and tile).
    pub fn joins_halves(
        head_dim: usize,
        kv_dtype: KvDType,
        tile_tokens: usize,
        page_size: usize,
    ) -> bool {
        head_dim == 128 && kv_dtype == KvDType::AsQuery && (8..tile_tokens).contains(&page_size)
    }

    /// CTAs along the query rows of one KV head: the rows (q_len x group) in blocks of at most
    /// [`MAX_N_TILES`] n8 tiles.
    pub fn column_blocks(&self, problem: &DecodeProblem) -> usize {
        problem.columns().div_ceil(8 * self.n_tiles)
    }

    /// Producer warps: joined-halves pages stream K and V from a warp each, every other variant
    /// from one. Passed to the kernel as `KVS_PRODUCER_WARPS`, so the launch's thread count and
    /// the kernel's warp roles come from this one place (decode_gqa.cu asserts the rule).
    pub fn producer_warps(&self) -> usize {
        if self.joined_halves {
            2
        } else {
            1
        }
    }

    /// Threads per CTA: the consumer warps and the producer warp(s) (decode_gqa.cu).
    pub fn threads(&self) -> u32 {
        ((self.consumer_groups * 4 + self.producer_warps()) * 32) as u32
    }

    /// Whether `consumer_groups` groups fit the register file with this group size: every
    /// thread of the one CTA per SM holds its O^T accumulators (32 registers per n8 tile at
    /// d128); with 288 threads ptxas caps a thread at 168 registers, and three tiles spill.
    pub fn groups_fit(n_tiles: usize, consumer_groups: usize) -> bool {
        consumer_groups == 1 || (consumer_groups == 2 && n_tiles <= 2)
    }

    /// Dynamic shared memory of one CTA; mirrors `SharedPlan` in decode_gqa.cu (plus the slack
    /// that lets the kernel align its base to 1024 bytes).
    pub fn shared_bytes(&self) -> usize {
        let kv_bytes = match self.kv_dtype {
            KvDType::AsQuery => 2,
            KvDType::Fp8E4m3 => 1,
        };
        let ring = self.stages * 2 * self.tile_tokens * self.head_dim * kv_bytes;
        let merge = self.consumer_groups * 4 * self.n_tiles * 8 * (self.head_dim + 4) * 4;
        let ring_region = ring.max(merge).div_ceil(128) * 128;
        let q = self.n_tiles * 8 * (self.head_dim * 2 + 16);
        let barriers = 3 * 8 * self.stages; // K full, V full, empty per stage
        let stats = 2 * 4 * (4 * self.consumer_groups) * self.n_tiles * 8;
        // what cluster peers push (m, l per rank and head; O of this CTA's head-dim slice)
        let cluster_inbox = 4 * self.n_tiles * 8 * (2 * plan::MAX_CLUSTER_SPLITS + self.head_dim);
        // per-column tables: Q and output offsets, output row (8 bytes each), visible length
        let columns = 28 * self.n_tiles * 8;
        1024 + ring_region + q + barriers + stats + cluster_inbox + columns
    }

    /// TMA box of one K or V load: 64 head dims x `tile_tokens` positions.
    pub fn box_tokens(&self) -> usize {
        self.tile_tokens
    }
}

impl Variant for DecodeVariant {
    fn name(&self) -> String {
        format!(
            "decode_gqa.{}{}.d{}.n{}.t{}.s{}.g{}{}",
            self.dtype.name(),
            match self.kv_dtype {
                KvDType::AsQuery => "",
                KvDType::Fp8E4m3 => ".kv_e4m3",
            },
            self.head_dim,
            self.n_tiles,
            self.tile_tokens,
            self.stages,
            self.consumer_groups,
            match (self.paged, self.joined_halves) {
                (false, _) => "",
                (true, false) => ".paged",
                (true, true) => ".paged.joined",
            }
        )
    }
    fn source(&self) -> &'static str {
        DECODE_GQA_SRC
    }
    fn entry(&self) -> &'static str {
        "kvs_decode_gqa"
    }
    fn defines(&self) -> Vec<(String, String)> {
        let mut d = mainloop_defines(
            self.dtype,
            self.head_dim,
            self.n_tiles,
            self.tile_tokens,
            self.stages,
            self.consumer_groups,
            self.paged,
        );
        d.extend([
            (
                "KVS_KV_FP8".into(),
                u8::from(self.kv_dtype == KvDType::Fp8E4m3).to_string(),
            ),
            (
                "KVS_JOINED_HALVES".into(),
                u8::from(self.joined_halves).to_string(),
            ),
            (
                "KVS_PRODUCER_WARPS".into(),
                self.producer_warps().to_string(),
            ),
            // the launch's dynamic shared memory (before any residency padding), which the
            // kernel checks its layout against
            ("KVS_SHARED_BYTES".into(), self.shared_bytes().to_string()),
        ]);
        d
    }
}

/// The defines both decode kernels take for their shared mainloop configuration.
fn mainloop_defines(
    dtype: DType,
    head_dim: usize,
    n_tiles: usize,
    tile_tokens: usize,
    stages: usize,
    consumer_groups: usize,
    paged: bool,
) -> Vec<(String, String)> {
    vec![
        (
            "KVS_IS_F16".into(),
            u8::from(dtype == DType::F16).to_string(),
        ),
        ("KVS_HEAD_DIM".into(), head_dim.to_string()),
        ("KVS_N_TILES".into(), n_tiles.to_string()),
        ("KVS_TILE_TOKENS".into(), tile_tokens.to_string()),
        ("KVS_STAGES".into(), stages.to_string()),
        ("KVS_CONSUMER_GROUPS".into(), consumer_groups.to_string()),
        ("KVS_PAGED".into(), u8::from(paged).to_string()),
    ]
}

/// L2 eviction priority of the persistent decode's K and V loads (`KVS_KV_L2`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum L2Hint {
    /// `evict_first`: read once, leave L2 first.
    #[default]
    EvictFirst,
    /// `evict_normal`.
    EvictNormal,
    /// `evict_last`.
    EvictLast,
}

impl L2Hint {
    /// The value of `KVS_KV_L2` and of the `l` part of a bench ring.
    pub fn code(self) -> u8 {
        self as u8
    }
    /// From [`Self::code`].
    pub fn from_code(code: usize) -> Option<Self> {
        [Self::EvictFirst, Self::EvictNormal, Self::EvictLast]
            .get(code)
            .copied()
    }
}

/// Bytes of one TMA box row of a K or V tile (kv_format.cuh): 128, 64 dims of a 2-byte cache
/// (the last row of a d 96 head padded), or for e4m3 caches 128 where the head dim is a multiple
/// of 128 and 64 otherwise (d 64; d 96, padded; MLA's 576).
pub fn kv_box_row_bytes(head_dim: usize, kv_elem_bytes: usize) -> usize {
    if kv_elem_bytes == 2 || head_dim % 128 == 0 {
        128
    } else {
        64
    }
}

/// Bytes one position of a K or V tile takes in shared memory: whole box rows
/// ([`kv_box_row_bytes`]).
pub fn kv_tile_row_bytes(head_dim: usize, kv_elem_bytes: usize) -> usize {
    let row = kv_box_row_bytes(head_dim, kv_elem_bytes);
    (head_dim * kv_elem_bytes).div_ceil(row) * row
}

/// Whether TMA boxes can carry a paged cache's page runs of `page_size` positions of rows of
/// `head_dim` elements of `kv_elem_bytes`: a run of a box lands `run x box row` bytes into its
/// tile (`run` = the page, at most a tile), and a box's shared-memory destination must be
/// 128-byte aligned, so one-position runs of 64-byte box rows (e4m3 at d 64, d 96 or paired
/// d 96) cannot go by boxes.
pub fn boxes_carry_pages(head_dim: usize, kv_elem_bytes: usize, page_size: usize) -> bool {
    page_size * kv_box_row_bytes(head_dim, kv_elem_bytes) % 128 == 0
}

/// Whether the persistent decode's gathering producer can copy rows of `head_dim` elements of
/// `kv_elem_bytes`: a warp copies whole rows of 16-byte chunks, so a row's chunks must divide
/// 32 (not so for the 24 or 12 chunks of paired d 96 heads, whose page runs go by boxes).
pub fn gathers_rows(head_dim: usize, kv_elem_bytes: usize) -> bool {
    32 % (kv_tile_row_bytes(head_dim, kv_elem_bytes) / 16) == 0
}

/// Most n8 column tiles of the persistent decode at `head_dim`: [`MAX_N_TILES`], two at d 256
/// (its O^T accumulators take 64 registers per n8 tile).
pub fn max_n_tiles(head_dim: usize) -> usize {
    if head_dim > 128 {
        2
    } else {
        MAX_N_TILES
    }
}

/// Query-row buffers of the persistent decode (`Q_BUFFERS` in decode.cu).
const PERSISTENT_Q_BUFFERS: usize = 3;

/// n8 tiles of the persistent decode's wide column blocks (decode.cu, "wide consumer"): 64
/// query rows on the M dimension of the warpgroup MMA, for head dims of [`WIDE_HEAD_DIMS`]
/// (2-byte caches, or e4m3 widened to f16 by the consumers), two warpgroups on alternate tiles
/// of [`WIDE_TILE_TOKENS`] positions.
pub const WIDE_N_TILES: usize = 8;
/// n8 tiles of the wide consumer's blocks of 128 query rows: both warpgroups on every tile, 64
/// of the rows each, so that a tile is read (an e4m3 one widened) once for all of them.
pub const WIDE_SPLIT_N_TILES: usize = 16;
/// Every wide block's n8 tiles.
pub const WIDE_BLOCK_N_TILES: [usize; 2] = [WIDE_N_TILES, WIDE_SPLIT_N_TILES];
/// Head dims of the wide consumer.
pub const WIDE_HEAD_DIMS: [usize; 2] = [64, 128];
/// Positions per ring stage of the wide consumer (the N of its S = Q K^T product).
pub const WIDE_TILE_TOKENS: usize = 64;

/// One specialisation of the persistent decode, `decode.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PersistentVariant {
    /// Element type of q and out.
    pub dtype: DType,
    /// Element type of K and V.
    pub kv_dtype: KvDType,
    /// 64, 96, 128 or 256 (192 for paired d 96 heads): the width of one K / V row the kernel
    /// streams.
    pub head_dim: usize,
    /// KV heads side by side in one row (`KVS_HEADS_PER_ROW`): 1, or 2 where two adjacent
    /// d 64 (d 96) heads are streamed as one d 128 (d 192) row ([`crate::plan::can_pair_heads`]).
    pub heads_per_row: usize,
    /// n8 tiles of query rows per column block (1..=[`MAX_N_TILES`], or [`WIDE_N_TILES`] /
    /// [`WIDE_SPLIT_N_TILES`]).
    pub n_tiles: usize,
    /// KV positions per ring stage.
    pub tile_tokens: usize,
    /// Ring depth (a multiple of [`Self::tile_groups`]).
    pub stages: usize,
    /// Groups of four consumer warps working on alternate tiles (1 or 2).
    pub consumer_groups: usize,
    /// Where the producer reads K and V from.
    pub kv_source: KvSource,
    /// Producer warps (`KVS_PRODUCER_WARPS`): 1, or 1, 2 or 4 gathering pages.
    pub producer_warps: usize,
    /// L2 eviction priority of the K and V loads.
    pub kv_l2: L2Hint,
    /// m16 slices of a warp's rows per online-softmax step (`KVS_SOFTMAX_SLICES`: 1 or 2).
    pub softmax_slices: usize,
}

/// How the persistent decode's producer brings K and V into the ring (`KVS_PAGED`,
/// `KVS_GATHER`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvSource {
    /// A contiguous (strided) cache: one TMA box per 64 head dims per tile.
    Contiguous,
    /// A paged pool, one TMA box per page run and 64 head dims.
    PagedBoxes,
    /// A paged pool, gathered by 16-byte copies from every producer lane (pages smaller than
    /// a box makes worth its descriptor).
    PagedGather,
}

impl KvSource {
    /// Every source.
    pub const ALL: [KvSource; 3] = [Self::Contiguous, Self::PagedBoxes, Self::PagedGather];

    /// Reads a paged pool.
    pub fn paged(self) -> bool {
        self != Self::Contiguous
    }
}

impl PersistentVariant {
    /// Column blocks per KV head.
    pub fn column_blocks(&self, problem: &DecodeProblem) -> usize {
        problem.columns().div_ceil(8 * self.n_tiles)
    }

    /// Whether the variant runs the wide consumer ([`WIDE_N_TILES`], [`WIDE_SPLIT_N_TILES`]).
    pub fn wide(&self) -> bool {
        WIDE_BLOCK_N_TILES.contains(&self.n_tiles)
    }

    /// Consumer groups that take alternate tiles (`TILE_GROUPS` in decode.cu): every group, but
    /// one where the wide consumer's warpgroups split a block's 128 rows on every tile.
    pub fn tile_groups(&self) -> usize {
        if self.n_tiles == WIDE_SPLIT_N_TILES {
            self.consumer_groups / 2
        } else {
            self.consumer_groups
        }
    }

    /// Softmax states per column the epilogue merges: a warp's, or a wide tile group's.
    fn epilogue_parts(&self) -> usize {
        if self.wide() {
            self.tile_groups()
        } else {
            self.consumer_groups * 4
        }
    }

    /// Floats of the epilogue scratch (`MERGE_FLOATS` in decode.cu): each epilogue part's
    /// rescaled O of every column.
    fn merge_floats(&self) -> usize {
        self.epilogue_parts() * self.n_tiles * 8 * (self.head_dim + 4)
    }

    /// Threads per CTA: the consumer warps and the producer warps.
    pub fn threads(&self) -> u32 {
        ((self.consumer_groups * 4 + self.producer_warps) * 32) as u32
    }

    /// Dynamic shared memory of one CTA with `stages` stages; mirrors `SharedPlan` in
    /// decode.cu (plus the slack that lets the kernel align its base to 1024 bytes).
    pub fn shared_bytes_with(&self, stages: usize) -> usize {
        let columns = self.n_tiles * 8;
        let parts = self.epilogue_parts();
        let row = kv_tile_row_bytes(self.head_dim, self.kv_dtype.size(self.dtype));
        let ring = stages * 2 * self.tile_tokens * row;
        let q = if self.wide() {
            columns * self.head_dim * 2
        } else {
            PERSISTENT_Q_BUFFERS * columns * (self.head_dim * 2 + 16)
        };
        let merge = self.merge_floats() * 4;
        // the wide consumer with an e4m3 cache: each warpgroup's f16 K and V tiles
        let staging = if self.wide() && self.kv_dtype == KvDType::Fp8E4m3 {
            self.consumer_groups * 2 * self.tile_tokens * self.head_dim * 2
        } else {
            0
        };
        let barriers = 3 * 8 * stages + 2 * 8 * PERSISTENT_Q_BUFFERS;
        let stats = 2 * 4 * parts * columns;
        // per column: output offset and row (8 bytes each), visible positions (4 + 4)
        let tables = 24 * columns;
        // gather: each producer warp's copy of one chunk of page ids (one per position of a
        // tile), and the pool rows of one tile
        let page_ids = if self.kv_source == KvSource::PagedGather {
            4 * self.tile_tokens * (self.producer_warps + 1)
        } else {
            0
        };
        // the schedule's start (64 bytes), then the CTA's two cut pieces (48 bytes each)
        1024 + ring + staging + q + merge + barriers + stats + tables + 64 + 2 * 48 + page_ids
    }

    /// [`Self::shared_bytes_with`] its own ring depth.
    pub fn shared_bytes(&self) -> usize {
        self.shared_bytes_with(self.stages)
    }
}

impl Variant for PersistentVariant {
    fn name(&self) -> String {
        format!(
            "decode.{}{}.d{}{}.n{}.t{}.s{}.g{}{}{}{}",
            self.dtype.name(),
            match self.kv_dtype {
                KvDType::AsQuery => "",
                KvDType::Fp8E4m3 => ".kv_e4m3",
            },
            // paired heads: `d64x2`
            self.head_dim / self.heads_per_row,
            if self.heads_per_row == 1 { "" } else { "x2" },
            self.n_tiles,
            self.tile_tokens,
            self.stages,
            self.consumer_groups,
            match self.kv_l2 {
                L2Hint::EvictFirst => "",
                L2Hint::EvictNormal => ".l2normal",
                L2Hint::EvictLast => ".l2last",
            },
            match self.kv_source {
                KvSource::Contiguous => "",
                KvSource::PagedBoxes => ".paged",
                KvSource::PagedGather => ".paged.gather",
            },
            if self.producer_warps == 1 {
                String::new()
            } else {
                format!(".w{}", self.producer_warps)
            },
        ) + &if self.softmax_slices == 1 {
            String::new()
        } else {
            format!(".sm{}", self.softmax_slices)
        }
    }
    fn source(&self) -> &'static str {
        DECODE_SRC
    }
    fn entry(&self) -> &'static str {
        "kvs_decode"
    }
    fn defines(&self) -> Vec<(String, String)> {
        let mut d = mainloop_defines(
            self.dtype,
            self.head_dim,
            self.n_tiles,
            self.tile_tokens,
            self.stages,
            self.consumer_groups,
            self.kv_source.paged(),
        );
        d.push((
            "KVS_KV_FP8".into(),
            u8::from(self.kv_dtype == KvDType::Fp8E4m3).to_string(),
        ));
        d.push(("KVS_KV_L2".into(), self.kv_l2.code().to_string()));
        d.push((
            "KVS_GATHER".into(),
            u8::from(self.kv_source == KvSource::PagedGather).to_string(),
        ));
        d.push(("KVS_PRODUCER_WARPS".into(), self.producer_warps.to_string()));
        d.push(("KVS_SOFTMAX_SLICES".into(), self.softmax_slices.to_string()));
        d.push(("KVS_HEADS_PER_ROW".into(), self.heads_per_row.to_string()));
        // the launch's dynamic shared memory, which the kernel checks its layout against
        d.push(("KVS_SHARED_BYTES".into(), self.shared_bytes().to_string()));
        d
    }
}

/// Consumer warps of the MLA decode, and its producer warpgroup (decode_mla.cu).
const MLA_CONSUMER_WARPS: usize = 8;
const MLA_PRODUCER_WARPS: usize = 4;

/// One specialisation of the MLA decode, `decode_mla.cu` (a cached row of
/// [`crate::mla::MLA_DIM`] elements serves as K, its first [`crate::mla::MLA_V_DIM`] as V).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MlaVariant {
    /// Element type of q and out.
    pub dtype: DType,
    /// Element type of the cache.
    pub kv_dtype: KvDType,
    /// n8 tiles of query rows per column block: 2 or 4 (the narrow consumer: each warp scores
    /// half), or 8 (the wide consumer: 64 rows on the warpgroup MMA; 2-byte caches only).
    pub n_tiles: usize,
    /// Positions per ring stage (16 per slice of four consumer warps).
    pub tile_tokens: usize,
    /// Ring depth.
    pub stages: usize,
    /// A page pool instead of a contiguous cache.
    pub paged: bool,
}

impl MlaVariant {
    /// Threads per CTA: the consumer warps and the producer warpgroup.
    pub fn threads(&self) -> u32 {
        ((MLA_CONSUMER_WARPS + MLA_PRODUCER_WARPS) * 32) as u32
    }

    /// Dynamic shared memory of one CTA; mirrors `SharedPlan` in decode_mla.cu (plus the slack
    /// that lets the kernel align its base to 1024 bytes).
    pub fn shared_bytes(&self) -> usize {
        let columns = self.n_tiles * 8;
        let ring =
            self.stages * self.tile_tokens * crate::mla::MLA_DIM * self.kv_dtype.size(self.dtype);
        if self.is_wide() {
            // `WideShared`: ring, the e4m3 staging tile, query rows and P (128-byte swizzle),
            // three row vectors
            let staging = match self.kv_dtype {
                KvDType::Fp8E4m3 => self.tile_tokens * crate::mla::MLA_DIM * 2,
                KvDType::AsQuery => 0,
            };
            let q = staging + columns * crate::mla::MLA_DIM * 2;
            let p = columns * self.tile_tokens * 2;
            let rows = 3 * 4 * columns;
            // a full barrier a box of 64 dims (`FULL_PARTS`), an empty one a stage
            let boxes = crate::mla::MLA_DIM / 64;
            let barriers = 8 * self.stages * (boxes + 1) + 2 * 8 * self.q_buffers();
            return 1024 + ring + q + p + rows + barriers + 64;
        }
        let q = self.q_buffers() * columns * (crate::mla::MLA_DIM * 2 + 16);
        let p = columns * (self.tile_tokens * 2 + 16);
        let slices = self.tile_tokens / 16;
        let stats = 2 * 4 * slices * columns;
        // (eight slices: each warp scores all the dims of its positions, no partials swapped)
        let partial_scores = if slices < MLA_CONSUMER_WARPS {
            16 * slices * self.n_tiles * 32
        } else {
            0
        };
        let barriers = 2 * 8 * self.stages + 2 * 8 * self.q_buffers();
        1024 + ring + q + p + stats + partial_scores + barriers + 64
    }

    /// The wide consumer (64 rows on the warpgroup MMA) rather than the narrow one.
    pub fn is_wide(&self) -> bool {
        self.n_tiles == plan::MLA_WIDE_N_TILES
    }

    /// Query-row buffers (`Q_BUFFERS` in decode_mla.cu): two for 16 rows, one for 32 or 64.
    pub fn q_buffers(&self) -> usize {
        if self.n_tiles <= 2 {
            2
        } else {
            1
        }
    }
}

impl Variant for MlaVariant {
    fn name(&self) -> String {
        format!(
            "decode_mla.{}{}.n{}.t{}.s{}{}",
            self.dtype.name(),
            match self.kv_dtype {
                KvDType::AsQuery => "",
                KvDType::Fp8E4m3 => ".kv_e4m3",
            },
            self.n_tiles,
            self.tile_tokens,
            self.stages,
            if self.paged { ".paged" } else { "" },
        )
    }
    fn source(&self) -> &'static str {
        DECODE_MLA_SRC
    }
    fn entry(&self) -> &'static str {
        "kvs_decode_mla"
    }
    fn defines(&self) -> Vec<(String, String)> {
        vec![
            (
                "KVS_IS_F16".into(),
                u8::from(self.dtype == DType::F16).to_string(),
            ),
            (
                "KVS_KV_FP8".into(),
                u8::from(self.kv_dtype == KvDType::Fp8E4m3).to_string(),
            ),
            ("KVS_N_TILES".into(), self.n_tiles.to_string()),
            ("KVS_TILE_TOKENS".into(), self.tile_tokens.to_string()),
            ("KVS_STAGES".into(), self.stages.to_string()),
            ("KVS_PAGED".into(), u8::from(self.paged).to_string()),
            // the launch's dynamic shared memory, which the kernel checks its layout against
            ("KVS_SHARED_BYTES".into(), self.shared_bytes().to_string()),
        ]
    }
}

/// One specialisation of `combine.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CombineVariant {
    /// Output element type.
    pub dtype: DType,
    /// 64 or 128.
    pub head_dim: usize,
}

impl Variant for CombineVariant {
    fn name(&self) -> String {
        format!("combine.{}.d{}", self.dtype.name(), self.head_dim)
    }
    fn source(&self) -> &'static str {
        COMBINE_SRC
    }
    fn entry(&self) -> &'static str {
        "kvs_combine"
    }
    fn defines(&self) -> Vec<(String, String)> {
        vec![
            (
                "KVS_IS_F16".into(),
                u8::from(self.dtype == DType::F16).to_string(),
            ),
            ("KVS_HEAD_DIM".into(), self.head_dim.to_string()),
            ("KVS_MAX_SPLITS".into(), plan::MAX_SPLITS.to_string()),
        ]
    }
}

/// The device-side work planner of `plan_work.cu` (one CTA of [`PlanWorkVariant::THREADS`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PlanWorkVariant;

impl PlanWorkVariant {
    /// Threads of its one CTA.
    pub const THREADS: u32 = 512;
}

impl Variant for PlanWorkVariant {
    fn name(&self) -> String {
        format!("plan_work.s{}", plan::MAX_SPLITS)
    }
    fn source(&self) -> &'static str {
        PLAN_WORK_SRC
    }
    fn entry(&self) -> &'static str {
        "kvs_plan_work"
    }
    fn defines(&self) -> Vec<(String, String)> {
        vec![("KVS_MAX_SPLITS".into(), plan::MAX_SPLITS.to_string())]
    }
}

/// The streaming-read kernel of `stream_read.cu`: the byte floor and read ceiling that
/// `kvstream bench` measures next to the decode (docs/benchmarking.md). Not used by decode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamReadVariant;

impl StreamReadVariant {
    /// Largest block it may be launched with (any multiple of 32 up to this).
    pub const MAX_THREADS: u32 = 512;
    /// Independent 16-byte loads in flight per thread.
    pub const UNROLL: u32 = 8;
}

impl Variant for StreamReadVariant {
    fn name(&self) -> String {
        format!("stream_read.t{}.u{}", Self::MAX_THREADS, Self::UNROLL)
    }
    fn source(&self) -> &'static str {
        STREAM_READ_SRC
    }
    fn entry(&self) -> &'static str {
        "kvs_stream_read"
    }
    fn defines(&self) -> Vec<(String, String)> {
        vec![
            ("KVS_MAX_THREADS".into(), Self::MAX_THREADS.to_string()),
            ("KVS_UNROLL".into(), Self::UNROLL.to_string()),
        ]
    }
}

/// One specialisation of `store_kv.cu`: the cache write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StoreKvVariant {
    /// Element type of the new rows (and of a 2-byte cache).
    pub dtype: DType,
    /// Element type of the cache.
    pub kv_dtype: KvDType,
    /// 64 or 128.
    pub head_dim: usize,
}

impl StoreKvVariant {
    /// Threads per CTA (one per 8 head dims of a row).
    pub const THREADS: u32 = 256;
    /// Head dims one thread writes.
    pub const CHUNK: usize = 8;
}

impl Variant for StoreKvVariant {
    fn name(&self) -> String {
        format!(
            "store_kv.{}{}.d{}",
            self.dtype.name(),
            match self.kv_dtype {
                KvDType::AsQuery => "",
                KvDType::Fp8E4m3 => ".kv_e4m3",
            },
            self.head_dim
        )
    }
    fn source(&self) -> &'static str {
        STORE_KV_SRC
    }
    fn entry(&self) -> &'static str {
        "kvs_store_kv"
    }
    fn defines(&self) -> Vec<(String, String)> {
        vec![
            (
                "KVS_IS_F16".into(),
                u8::from(self.dtype == DType::F16).to_string(),
            ),
            ("KVS_HEAD_DIM".into(), self.head_dim.to_string()),
            (
                "KVS_KV_FP8".into(),
                u8::from(self.kv_dtype == KvDType::Fp8E4m3).to_string(),
            ),
        ]
    }
}

/// One specialisation of `merge_states.cu`: the merge of partial attention states by their
/// log-sum-exps ([`crate::merge`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MergeStatesVariant {
    /// Element type of the partial and merged outputs.
    pub dtype: DType,
}

impl MergeStatesVariant {
    /// Threads per CTA (one per 8 elements of an output row).
    pub const THREADS: u32 = 256;
    /// Elements of a row one thread merges.
    pub const CHUNK: usize = 8;
}

impl Variant for MergeStatesVariant {
    fn name(&self) -> String {
        format!("merge_states.{}", self.dtype.name())
    }
    fn source(&self) -> &'static str {
        MERGE_STATES_SRC
    }
    fn entry(&self) -> &'static str {
        "kvs_merge_states"
    }
    fn defines(&self) -> Vec<(String, String)> {
        vec![(
            "KVS_IS_F16".into(),
            u8::from(self.dtype == DType::F16).to_string(),
        )]
    }
}

/// Launch parameters of the streaming-read kernel, mirrored field for field from
/// `StreamReadParams` in `stream_read.cu` (both sides assert the size).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamReadParams {
    /// Device address of the data: `n_vec` 16-byte vectors, 16-byte aligned.
    pub src: u64,
    /// Device address of `sink_mask + 1` u32 words; each CTA writes one.
    pub sink: u64,
    /// 16-byte vectors to read.
    pub n_vec: u64,
    /// Words in the sink minus one (a power of two minus one).
    pub sink_mask: u32,
    /// Zero.
    pub reserved: u32,
}

// Same number as the static_assert in stream_read.cu.
const _: () = assert!(std::mem::size_of::<StreamReadParams>() == 32);

/// Any kernel variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AnyVariant {
    /// The persistent decode kernel.
    Persistent(PersistentVariant),
    /// The MLA decode kernel.
    Mla(MlaVariant),
    /// A decode kernel of the split engine.
    Decode(DecodeVariant),
    /// A combine kernel.
    Combine(CombineVariant),
    /// The streaming-read kernel (benchmark floor).
    StreamRead(StreamReadVariant),
    /// The device-side work planner.
    PlanWork(PlanWorkVariant),
    /// The cache write.
    StoreKv(StoreKvVariant),
    /// The state merge.
    MergeStates(MergeStatesVariant),
}

impl AnyVariant {
    /// The variant as a trait object.
    pub fn as_variant(&self) -> &dyn Variant {
        match self {
            AnyVariant::Persistent(v) => v,
            AnyVariant::Mla(v) => v,
            AnyVariant::Decode(v) => v,
            AnyVariant::Combine(v) => v,
            AnyVariant::StreamRead(v) => v,
            AnyVariant::PlanWork(v) => v,
            AnyVariant::StoreKv(v) => v,
            AnyVariant::MergeStates(v) => v,
        }
    }
}

/// Every variant the planner can choose: all dtypes x head dims x group tiles, and the combines;
/// then the streaming-read kernel of the benchmark.
pub fn all_variants() -> Vec<AnyVariant> {
    let mut out = Vec::new();
    for dtype in [DType::Bf16, DType::F16] {
        for head_dim in SUPPORTED_HEAD_DIMS {
            for n_tiles in 1..=max_n_tiles(head_dim) {
                for source in KvSource::ALL {
                    for kv_dtype in [KvDType::AsQuery, KvDType::Fp8E4m3] {
                        out.push(AnyVariant::Persistent(plan::persistent_variant(
                            dtype, kv_dtype, head_dim, n_tiles, source,
                        )));
                        if n_tiles == 1 && WIDE_HEAD_DIMS.contains(&head_dim) {
                            // the wide consumer: blocks of 64 and of 128 rows
                            for n_tiles in [WIDE_N_TILES, WIDE_SPLIT_N_TILES] {
                                out.push(AnyVariant::Persistent(plan::persistent_variant(
                                    dtype, kv_dtype, head_dim, n_tiles, source,
                                )));
                            }
                        }
                        let row = 2 * head_dim;
                        if plan::PAIRED_HEAD_DIMS.contains(&head_dim)
                            && n_tiles <= max_n_tiles(row)
                            && (source != KvSource::PagedGather
                                || gathers_rows(row, kv_dtype.size(dtype)))
                        {
                            out.push(AnyVariant::Persistent(plan::persistent_paired_variant(
                                dtype, kv_dtype, head_dim, n_tiles, source,
                            )));
                        }
                    }
                }
            }
            // the split engine's variants: its head dims only
            let split_n_tiles = if SPLIT_ENGINE_HEAD_DIMS.contains(&head_dim) {
                MAX_GROUP / 8
            } else {
                0
            };
            for n_tiles in 1..=split_n_tiles {
                for consumer_groups in [1, 2] {
                    if !DecodeVariant::groups_fit(n_tiles, consumer_groups) {
                        continue;
                    }
                    for two_byte_stages in plan::SUPPORTED_STAGES {
                        // contiguous, paged, and paged with joined halves where it applies
                        for (paged, joined_halves, kv_dtype) in [
                            (false, false, KvDType::AsQuery),
                            (true, false, KvDType::AsQuery),
                            (true, true, KvDType::AsQuery),
                            (false, false, KvDType::Fp8E4m3),
                            (true, false, KvDType::Fp8E4m3),
                        ] {
                            if joined_halves && head_dim != 128 {
                                continue;
                            }
                            let stages = plan::split_stages(kv_dtype, two_byte_stages);
                            out.push(AnyVariant::Decode(DecodeVariant {
                                dtype,
                                kv_dtype,
                                head_dim,
                                n_tiles,
                                tile_tokens: plan::tile_tokens(head_dim),
                                stages,
                                consumer_groups,
                                paged,
                                joined_halves,
                            }));
                        }
                    }
                }
            }
            if split_n_tiles > 0 {
                out.push(AnyVariant::Combine(CombineVariant { dtype, head_dim }));
            }
            for kv_dtype in [KvDType::AsQuery, KvDType::Fp8E4m3] {
                out.push(AnyVariant::StoreKv(StoreKvVariant {
                    dtype,
                    kv_dtype,
                    head_dim,
                }));
            }
        }
    }
    for dtype in [DType::Bf16, DType::F16] {
        for kv_dtype in [KvDType::AsQuery, KvDType::Fp8E4m3] {
            for n_tiles in plan::MLA_N_TILES {
                for paged in [false, true] {
                    out.push(AnyVariant::Mla(plan::mla_variant(
                        dtype, kv_dtype, n_tiles, paged,
                    )));
                }
            }
        }
    }
    for dtype in [DType::Bf16, DType::F16] {
        out.push(AnyVariant::MergeStates(MergeStatesVariant { dtype }));
    }
    out.push(AnyVariant::StreamRead(StreamReadVariant));
    out.push(AnyVariant::PlanWork(PlanWorkVariant));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joined_halves_only_for_d128_pages_of_8_up_to_a_tile() {
        use crate::problem::SUPPORTED_PAGE_SIZES;
        let joined = |head_dim| -> Vec<usize> {
            SUPPORTED_PAGE_SIZES
                .into_iter()
                .filter(|&s| {
                    let p = DecodeProblem::new(1, 8, 1, head_dim, 1024, DType::Bf16)
                        .unwrap()
                        .with_paged(s, 1024 / s + 1, None)
                        .unwrap();
                    DecodeVariant::for_problem(&p).joined_halves
                })
                .collect()
        };
        assert_eq!(joined(128), [8, 16, 32]);
        assert!(joined(64).is_empty());
        let contiguous = DecodeProblem::new(1, 8, 1, 128, 1024, DType::Bf16).unwrap();
        assert!(!DecodeVariant::for_problem(&contiguous).joined_halves);
    }

    #[test]
    fn every_header_is_embedded() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels/include");
        for entry in std::fs::read_dir(dir).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".cuh") {
                assert!(
                    HEADERS.iter().any(|(h, _)| *h == name),
                    "kernels/include/{name} is not in HEADERS: NVRTC would not find it"
                );
            }
        }
    }

    #[test]
    fn every_planned_variant_is_listed() {
        let all = all_variants();
        for g in 1..=MAX_GROUP {
            for d in SPLIT_ENGINE_HEAD_DIMS {
                for dt in [DType::Bf16, DType::F16] {
                    let p = DecodeProblem::new(1, g, 1, d, 8, dt).unwrap();
                    let mut v = DecodeVariant::for_problem(&p);
                    for groups in [1, 2] {
                        v.consumer_groups = groups;
                        let fits = DecodeVariant::groups_fit(v.n_tiles, groups);
                        assert_eq!(all.contains(&AnyVariant::Decode(v)), fits, "{}", v.name());
                    }
                }
            }
        }
        let mut names: Vec<_> = all.iter().map(|v| v.as_variant().name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len(), "variant names must be unique");
    }

    #[test]
    fn decode_shared_memory_fits_one_cta_per_sm() {
        for v in all_variants() {
            if let AnyVariant::Decode(d) = v {
                assert!(
                    d.shared_bytes() <= 227 * 1024,
                    "{}: {}",
                    d.name(),
                    d.shared_bytes()
                );
            }
        }
    }
}
