//! Kernel parameter block, mirrored field for field from `kernels/include/params.cuh`.
//!
//! Passed by value as the kernels' only argument (`__grid_constant__`), so a launch is one
//! pointer to this struct; the TMA tensor maps travel inside it, where the kernel's copies can
//! address them. Strides are in elements.

/// Launch parameters of the decode and combine kernels.
///
/// Each field is documented once, with its shape, in `params.cuh`; repeating the comments here
/// would let the two copies drift.
#[allow(missing_docs)]
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug)]
pub struct DecodeParams {
    pub k_map: cudarc::driver::sys::CUtensorMap,
    pub v_map: cudarc::driver::sys::CUtensorMap,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub lse: u64,
    pub seqlens: u64,
    pub o_partial: u64,
    pub m_partial: u64,
    pub l_partial: u64,
    pub block_table: u64,
    pub q_batch_stride: i64,
    pub q_token_stride: i64,
    pub q_head_stride: i64,
    pub k_batch_stride: i64,
    pub k_token_stride: i64,
    pub k_head_stride: i64,
    pub v_batch_stride: i64,
    pub v_token_stride: i64,
    pub v_head_stride: i64,
    pub o_batch_stride: i64,
    pub o_token_stride: i64,
    pub o_head_stride: i64,
    pub batch: i32,
    pub hq: i32,
    pub hkv: i32,
    pub group: i32,
    pub max_len: i32,
    pub num_splits: i32,
    pub scale_log2: f32,
    pub cluster_splits: i32,
    pub q_len: i32,
    pub cols: i32,
    pub col_blocks: i32,
    pub page_size: i32,
    pub table_stride: i32,
    pub work: u64,
    pub request_plan: u64,
    pub plan_grid: i32,
    pub plan_target: i32,
    pub plan_tile: i32,
    pub block_cols: i32,
    pub plan_slots: i32,
}

// Same number as the static_assert in params.cuh.
const _: () = assert!(std::mem::size_of::<DecodeParams>() == 640);
