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
    pub num_pages: i32,
    pub k_cache: u64,
    pub v_cache: u64,
    pub k_batch_stride: i64,
    pub v_batch_stride: i64,
    pub k_token_stride: i32,
    pub k_head_stride: i32,
    pub v_token_stride: i32,
    pub v_head_stride: i32,
    pub k_scale: u64,
    pub v_scale: u64,
    pub k_scale_batch_stride: i32,
    pub k_scale_head_stride: i32,
    pub v_scale_batch_stride: i32,
    pub v_scale_head_stride: i32,
}

// Same number as the static_assert in params.cuh; the tests below compare every field's offset.
const _: () = assert!(std::mem::size_of::<DecodeParams>() == 640);

/// Launch parameters of the persistent decode kernel (`decode_params.cuh`, documented there
/// field by field).
#[allow(missing_docs)]
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug)]
pub struct PersistentParams {
    pub k_map: cudarc::driver::sys::CUtensorMap,
    pub v_map: cudarc::driver::sys::CUtensorMap,
    pub q: u64,
    pub out: u64,
    pub lse: u64,
    pub seqlens: u64,
    pub block_table: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub o_partial: u64,
    pub ml_partial: u64,
    pub arrivals: u64,
    pub schedule_log: u64,
    pub q_batch_stride: i64,
    pub q_token_stride: i64,
    pub q_head_stride: i64,
    pub o_batch_stride: i64,
    pub o_token_stride: i64,
    pub o_head_stride: i64,
    pub batch: i32,
    pub hq: i32,
    pub hkv: i32,
    pub group: i32,
    pub q_len: i32,
    pub cols: i32,
    pub col_blocks: i32,
    pub max_len: i32,
    pub scale_log2: f32,
    pub page_size: i32,
    pub table_stride: i32,
    pub num_pages: i32,
    pub min_tiles_per_cta: i32,
    pub lanes: i32,
    pub k_scale: u64,
    pub v_scale: u64,
    pub k_scale_batch_stride: i32,
    pub k_scale_head_stride: i32,
    pub v_scale_batch_stride: i32,
    pub v_scale_head_stride: i32,
    pub sinks: u64,
    pub window_left: i32,
    pub window_right: i32,
    pub softcap_scale: f32,
    pub softcap_log2: f32,
    pub warm_hints: u64,
}

// Same number as the static_assert in decode_params.cuh.
const _: () = assert!(std::mem::size_of::<PersistentParams>() == 512);

/// Launch parameters of the cache write (`StoreKvParams` in `kernels/sm90/store_kv.cu`,
/// documented there field by field).
#[allow(missing_docs)]
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug, Default)]
pub struct StoreKvParams {
    pub k_new: u64,
    pub v_new: u64,
    pub slots: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub k_scale: u64,
    pub v_scale: u64,
    pub new_token_stride: i64,
    pub new_head_stride: i64,
    pub block_stride: i64,
    pub slot_stride: i64,
    pub head_stride: i64,
    pub num_slots: i64,
    pub tokens: i32,
    pub hkv: i32,
    pub block_slots: i32,
    pub k_scale_block_stride: i32,
    pub k_scale_head_stride: i32,
    pub v_scale_block_stride: i32,
    pub v_scale_head_stride: i32,
}

// Same number as the static_assert in store_kv.cu.
const _: () = assert!(std::mem::size_of::<StoreKvParams>() == 256);

/// Launch parameters of the state merge (`MergeStatesParams` in `kernels/sm90/merge_states.cu`,
/// documented there field by field).
#[allow(missing_docs)]
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug, Default)]
pub struct MergeStatesParams {
    pub parts: u64,
    pub part_lse: u64,
    pub sinks: u64,
    pub out: u64,
    pub lse: u64,
    pub part_shard_stride: i64,
    pub part_row_stride: i64,
    pub lse_shard_stride: i64,
    pub shards: i32,
    pub rows: i32,
    pub head_dim: i32,
    pub heads: i32,
}

// Same number as the static_assert in merge_states.cu.
const _: () = assert!(std::mem::size_of::<MergeStatesParams>() == 128);

/// Pieces one CTA records in the schedule log (`SCHEDULE_LOG_PIECES` in decode_params.cuh).
pub const SCHEDULE_LOG_PIECES: usize = 63;

#[cfg(test)]
mod tests {
    use super::{DecodeParams, MergeStatesParams, PersistentParams, StoreKvParams};
    use std::mem::offset_of;

    /// Every field of a params struct with its offset, in declaration order.
    macro_rules! offsets {
        ($ty:ty: $($field:ident),* $(,)?) => {
            vec![$((stringify!($field), offset_of!($ty, $field))),*]
        };
    }

    /// (name, offset) of each field of the C++ struct, laid out from params.cuh's text with the
    /// C rules (each field at the next multiple of its alignment).
    fn cuda_layout(header: &str, name: &str) -> (Vec<(String, usize)>, usize) {
        let start = header
            .find(&format!("struct alignas(128) {name} {{"))
            .unwrap_or_else(|| panic!("{name} in its header"));
        let body = &header[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("\n};").unwrap()];
        let (mut fields, mut at) = (Vec::new(), 0usize);
        for line in body.lines() {
            let code = line.split("//").next().unwrap().trim();
            let Some(decl) = code.strip_suffix(';') else {
                assert!(code.is_empty(), "unparsed line in {name}: {line:?}");
                continue;
            };
            // `type name` or `type a, b, c`: the type ends at the first declarator's last space
            // or `*`
            let mut declarators = decl.split(',');
            let first = declarators.next().unwrap().trim();
            let cut = first.rfind([' ', '*']).expect("a type and a name") + 1;
            let ty = first[..cut].trim();
            let names: Vec<&str> = std::iter::once(first[cut..].trim())
                .chain(declarators.map(str::trim))
                .collect();
            let (size, align) = match ty.trim_start_matches("const ") {
                t if t.ends_with('*') => (8, 8),
                "TensorMap" => (128, 128),
                "long long" => (8, 8),
                "int" | "float" => (4, 4),
                other => panic!("type {other:?} of {names:?}: teach this test its size"),
            };
            for name in names {
                at = at.div_ceil(align) * align;
                fields.push((name.to_string(), at));
                at += size;
            }
        }
        (fields, at.div_ceil(128) * 128)
    }

    #[test]
    fn rust_mirror_has_the_cuda_layout() {
        let rust = offsets!(DecodeParams:
            k_map,
            v_map,
            q,
            out,
            lse,
            seqlens,
            o_partial,
            m_partial,
            l_partial,
            block_table,
            q_batch_stride,
            q_token_stride,
            q_head_stride,
            o_batch_stride,
            o_token_stride,
            o_head_stride,
            batch,
            hq,
            hkv,
            group,
            max_len,
            num_splits,
            scale_log2,
            cluster_splits,
            q_len,
            cols,
            col_blocks,
            page_size,
            table_stride,
            work,
            request_plan,
            plan_grid,
            plan_target,
            plan_tile,
            block_cols,
            plan_slots,
            num_pages,
            k_cache,
            v_cache,
            k_batch_stride,
            v_batch_stride,
            k_token_stride,
            k_head_stride,
            v_token_stride,
            v_head_stride,
            k_scale,
            v_scale,
            k_scale_batch_stride,
            k_scale_head_stride,
            v_scale_batch_stride,
            v_scale_head_stride,
        );
        let header = include_str!("../../../kernels/include/params.cuh");
        let (cuda, size) = cuda_layout(header, "DecodeParams");
        let rust: Vec<(String, usize)> =
            rust.into_iter().map(|(n, o)| (n.to_string(), o)).collect();
        assert_eq!(rust, cuda, "field names and offsets, Rust vs params.cuh");
        assert_eq!(std::mem::size_of::<DecodeParams>(), size);
    }

    #[test]
    fn store_kv_mirror_has_the_cuda_layout() {
        let rust = offsets!(StoreKvParams:
            k_new, v_new, slots, k_cache, v_cache, k_scale, v_scale, new_token_stride,
            new_head_stride, block_stride, slot_stride, head_stride, num_slots, tokens, hkv,
            block_slots, k_scale_block_stride, k_scale_head_stride, v_scale_block_stride,
            v_scale_head_stride,
        );
        let source = include_str!("../../../kernels/sm90/store_kv.cu");
        let (cuda, size) = cuda_layout(source, "StoreKvParams");
        let rust: Vec<(String, usize)> =
            rust.into_iter().map(|(n, o)| (n.to_string(), o)).collect();
        assert_eq!(rust, cuda, "field names and offsets, Rust vs store_kv.cu");
        assert_eq!(std::mem::size_of::<StoreKvParams>(), size);
    }

    #[test]
    fn merge_states_mirror_has_the_cuda_layout() {
        let rust = offsets!(MergeStatesParams:
            parts, part_lse, sinks, out, lse, part_shard_stride, part_row_stride,
            lse_shard_stride, shards, rows, head_dim, heads,
        );
        let source = include_str!("../../../kernels/sm90/merge_states.cu");
        let (cuda, size) = cuda_layout(source, "MergeStatesParams");
        let rust: Vec<(String, usize)> =
            rust.into_iter().map(|(n, o)| (n.to_string(), o)).collect();
        assert_eq!(
            rust, cuda,
            "field names and offsets, Rust vs merge_states.cu"
        );
        assert_eq!(std::mem::size_of::<MergeStatesParams>(), size);
    }

    #[test]
    fn persistent_mirror_has_the_cuda_layout() {
        let rust = offsets!(PersistentParams:
            k_map, v_map, q, out, lse, seqlens, block_table, k_cache, v_cache, o_partial,
            ml_partial, arrivals,
            schedule_log, q_batch_stride, q_token_stride, q_head_stride, o_batch_stride,
            o_token_stride, o_head_stride, batch, hq, hkv, group, q_len, cols, col_blocks,
            max_len, scale_log2, page_size, table_stride, num_pages, min_tiles_per_cta, lanes, k_scale,
            v_scale, k_scale_batch_stride, k_scale_head_stride, v_scale_batch_stride,
            v_scale_head_stride, sinks, window_left, window_right, softcap_scale, softcap_log2,
            warm_hints,
        );
        let header = include_str!("../../../kernels/include/decode_params.cuh");
        let (cuda, size) = cuda_layout(header, "PersistentParams");
        let rust: Vec<(String, usize)> =
            rust.into_iter().map(|(n, o)| (n.to_string(), o)).collect();
        assert_eq!(
            rust, cuda,
            "field names and offsets, Rust vs decode_params.cuh"
        );
        assert_eq!(std::mem::size_of::<PersistentParams>(), size);
        let log = header
            .split("constexpr int SCHEDULE_LOG_PIECES = ")
            .nth(1)
            .and_then(|rest| rest.split(';').next())
            .expect("SCHEDULE_LOG_PIECES in decode_params.cuh");
        assert_eq!(
            log.trim().parse::<usize>().unwrap(),
            super::SCHEDULE_LOG_PIECES
        );
    }
}
