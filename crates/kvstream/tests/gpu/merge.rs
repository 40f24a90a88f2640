//! The state merge on the GPU (`kvstream::merge`): random partial states against the f64 model
//! (empty shards holding NaN that must not be read, rows no shard has keys for, sinks, padded
//! strides, head dims up to MLA's 512), bitwise twice and under a replayed graph; and a decode
//! cut into shards of one cache (N local decodes and a merge) against the whole decode.

use super::*;
use kvstream::merge::{MergeShape, MergeTensors, StateMerger};
use kvstream::reference::merge_states;

/// One random merge: shape, host partial states (bits and widened), LSEs, sinks.
struct MergeCase<T> {
    shape: MergeShape,
    parts: Vec<T>,
    parts64: Vec<Vec<f64>>,
    lses: Vec<f32>,
    lses64: Vec<Vec<f64>>,
    sinks: Option<Vec<f32>>,
}

fn draw_merge<T: Half>(rng: &mut SplitMix64, dtype: DType) -> MergeCase<T> {
    let shards = 1 + rng.below(8);
    let (batch, q_len, heads) = (1 + rng.below(9), 1 + rng.below(4), 1 + rng.below(16));
    let head_dim = [8, 64, 96, 128, 256, 512][rng.below(6)];
    let rows = batch * q_len * heads;
    let pad_row = 8 * rng.below(3);
    let pad_shard = 8 * rng.below(5);
    let row_stride = head_dim + pad_row;
    let shard_stride = rows * row_stride + pad_shard;
    let lse_stride = rows + rng.below(3);
    let shape = MergeShape::new(shards, batch, q_len, heads, head_dim, dtype)
        .unwrap()
        .with_strides(shard_stride, row_stride, lse_stride)
        .unwrap();
    let sinks = rng.below(2) == 0;
    merge_values(rng, shape, sinks)
}

/// New random states (and sinks, if asked for) for `shape`.
fn merge_values<T: Half>(rng: &mut SplitMix64, shape: MergeShape, sinks: bool) -> MergeCase<T> {
    let (shards, rows, head_dim) = (shape.shards, shape.rows(), shape.head_dim);
    let (shard_stride, row_stride, lse_stride) = (
        shape.part_shard_stride,
        shape.part_row_stride,
        shape.lse_shard_stride,
    );
    let (mut parts, _) = T::random(rng, shape.part_elements());
    let mut lses = vec![f32::NAN; shape.lse_elements()];
    // a row every shard is empty for, where there are rows enough
    let dead_row = (rows > 2).then(|| rng.below(rows));
    for s in 0..shards {
        for r in 0..rows {
            let empty = Some(r) == dead_row || rng.below(4) == 0;
            lses[s * lse_stride + r] = if empty {
                f32::NEG_INFINITY
            } else {
                rng.symmetric() * 6.0
            };
            if empty {
                let at = s * shard_stride + r * row_stride;
                parts[at..at + head_dim].fill(T::from_raw(POISON));
            }
        }
    }
    let parts64 = (0..shards)
        .map(|s| {
            (0..rows)
                .flat_map(|r| {
                    let at = s * shard_stride + r * row_stride;
                    parts[at..at + head_dim].iter().map(|x| x.to_f64())
                })
                .collect()
        })
        .collect();
    let lses64 = (0..shards)
        .map(|s| {
            (0..rows)
                .map(|r| f64::from(lses[s * lse_stride + r]))
                .collect()
        })
        .collect();
    let sinks = sinks.then(|| random_sinks(rng, shape.heads));
    MergeCase {
        shape,
        parts,
        parts64,
        lses,
        lses64,
        sinks,
    }
}

/// Runs one merge into poisoned outputs; returns (out bits, lse).
fn run_merge<T: Half>(
    merger: &StateMerger,
    stream: &Arc<CudaStream>,
    dev: &(CudaSlice<T>, CudaSlice<f32>, Option<CudaSlice<f32>>),
    out: &mut CudaSlice<T>,
    lse: &mut CudaSlice<f32>,
) -> (Vec<T>, Vec<f32>) {
    let rows = merger.shape().rows();
    overwrite(stream, &vec![T::from_raw(POISON); out.len()], out);
    overwrite(stream, &vec![f32::NAN; rows], lse);
    merger
        .run_slices(stream, &dev.0, &dev.1, out, Some(lse), dev.2.as_ref())
        .unwrap_or_else(|e| panic!("merge {:?}: {e}", merger.shape()));
    (download(stream, out), download(stream, lse))
}

fn check_merge<T: Half>(case: &MergeCase<T>, out: &[T], lse: &[f32], label: &str) {
    let s = &case.shape;
    let sinks64: Option<Vec<f64>> = case
        .sinks
        .as_ref()
        .map(|v| v.iter().map(|&x| f64::from(x)).collect());
    let want = merge_states(&case.parts64, &case.lses64, s.head_dim, sinks64.as_deref());
    let d = s.head_dim;
    for r in 0..s.rows() {
        let got: Vec<f64> = out[r * d..(r + 1) * d].iter().map(|x| x.to_f64()).collect();
        let err = relative_error_above(&got, &want.out[r * d..(r + 1) * d], T::MIN_NORMAL);
        // bf16 rounding of the merged row, and of each partial's weight product: ~4e-3
        assert!(err <= REL_TOL, "{label}: row {r} rel err {err:.2e}");
        let (a, b) = (f64::from(lse[r]), want.lse[r]);
        assert!(
            a == b || (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{label}: row {r} lse {a} vs {b}"
        );
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn states_match_reference() {
    let (rt, stream) = open_gpu();
    let mut rng = SplitMix64::new(env_u64("KVSTREAM_GPU_SEED", DEFAULT_SEED) ^ 0x6d65_7267);
    let cases = env_u64("KVSTREAM_GPU_CASES", 60).min(60) as usize;
    for i in 0..cases {
        if i % 2 == 0 {
            merge_case::<bf16>(&rt, &stream, &mut rng, DType::Bf16, i);
        } else {
            merge_case::<f16>(&rt, &stream, &mut rng, DType::F16, i);
        }
    }
    println!("merge_states: {cases} random merges match the f64 model, bitwise twice");
}

fn merge_case<T: Half>(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    rng: &mut SplitMix64,
    dtype: DType,
    index: usize,
) {
    let case = draw_merge::<T>(rng, dtype);
    let label = format!(
        "case {index} {:?} sinks {}",
        case.shape,
        case.sinks.is_some()
    );
    let merger = StateMerger::new(rt, case.shape).unwrap_or_else(|e| panic!("{label}: {e}"));
    let dev = (
        upload(stream, &case.parts),
        upload(stream, &case.lses),
        case.sinks.as_ref().map(|s| upload(stream, s)),
    );
    let rows = case.shape.rows();
    let mut out = upload(
        stream,
        &vec![T::from_raw(POISON); rows * case.shape.head_dim],
    );
    let mut lse = upload(stream, &vec![f32::NAN; rows]);
    let (o1, l1) = run_merge(&merger, stream, &dev, &mut out, &mut lse);
    check_merge(&case, &o1, &l1, &label);
    let (o2, l2) = run_merge(&merger, stream, &dev, &mut out, &mut lse);
    assert!(
        o1.iter().zip(&o2).all(|(a, b)| a.raw() == b.raw())
            && l1.iter().zip(&l2).all(|(a, b)| a.to_bits() == b.to_bits()),
        "{label}: two runs differ"
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn graph_replays_with_new_states() {
    let (rt, stream) = open_gpu_own_stream();
    let mut rng = SplitMix64::new(17);
    let shape = draw_merge::<bf16>(&mut rng, DType::Bf16).shape;
    let first = merge_values::<bf16>(&mut rng, shape, false);
    let merger = StateMerger::new(&rt, shape).unwrap();
    let mut parts = upload(&stream, &first.parts);
    let mut lses = upload(&stream, &first.lses);
    let rows = shape.rows();
    let mut out = upload(
        &stream,
        &vec![bf16::from_raw(POISON); rows * shape.head_dim],
    );
    let mut lse = upload(&stream, &vec![f32::NAN; rows]);
    let graph = {
        let (pp, _g1) = parts.device_ptr(&stream);
        let (lp, _g2) = lses.device_ptr(&stream);
        let (op, _g3) = out.device_ptr_mut(&stream);
        let (sp, _g4) = lse.device_ptr_mut(&stream);
        let t = MergeTensors {
            parts: pp,
            part_lse: lp,
            out: op,
            lse: Some(sp),
            sinks: None,
        };
        // SAFETY: the buffers have the shape's sizes and outlive the graph.
        capture_graph(&stream, || unsafe { merger.run(&t, stream.cu_stream()) }).unwrap()
    };
    for round in 0..3 {
        let case = merge_values::<bf16>(&mut SplitMix64::new(100 + round), shape, false);
        overwrite(&stream, &case.parts, &mut parts);
        overwrite(&stream, &case.lses, &mut lses);
        overwrite(
            &stream,
            &vec![bf16::from_raw(POISON); rows * shape.head_dim],
            &mut out,
        );
        graph.launch().unwrap();
        stream.synchronize().unwrap();
        check_merge(
            &case,
            &download(&stream, &out),
            &download(&stream, &lse),
            "replay",
        );
    }
    println!("merge_states: a captured merge replayed with new states matches the model");
}

/// A decode of one contiguous cache cut into `shards` chunks of positions: each shard a decoder
/// over its chunk (the same strides, the chunk's first position as the base address, its own
/// lengths), writing its output and LSE into one `[shards, ...]` buffer; then the merge with
/// the sinks. Equals the whole decode's reference (and its GPU result within tolerance).
#[test]
#[ignore = "needs an H100/H200"]
fn sharded_decode_equals_whole() {
    let (rt, stream) = open_gpu();
    let mut rng = SplitMix64::new(23);
    for (shards, batch, hq, hkv, d, chunk) in [
        (2, 3, 32, 8, 128, 1024),
        (4, 2, 8, 8, 64, 300),
        (8, 4, 64, 8, 64, 512),
        (3, 1, 16, 2, 128, 4096),
    ] {
        let max_len = shards * chunk;
        let lens: Vec<usize> = (0..batch)
            .map(|b| match b {
                0 => max_len,
                1 => chunk / 2, // only the first shard holds anything
                _ => rng.below(max_len + 1),
            })
            .collect();
        let whole = DecodeProblem::new(batch, hq, hkv, d, max_len, DType::Bf16)
            .unwrap()
            .with_sinks(true)
            .unwrap();
        let x: Inputs<bf16> = make_inputs(&mut rng, &whole, &lens);
        let want = reference(&whole, &x, &lens);
        let strides = whole.k_strides;
        let shard = DecodeProblem::new(batch, hq, hkv, d, chunk, DType::Bf16)
            .unwrap()
            .with_kv_strides(strides, strides)
            .unwrap();
        let decoder = make_decoder(&rt, &shard, PlanOptions::default());
        let rows = batch * hq;
        let merger = StateMerger::new(
            &rt,
            MergeShape::new(shards, batch, 1, hq, d, DType::Bf16).unwrap(),
        )
        .unwrap();
        let q = upload(&stream, &x.q);
        let k = upload(&stream, &x.k);
        let v = upload(&stream, &x.v);
        let sinks = upload(&stream, x.sinks.as_ref().unwrap());
        let mut parts = upload(&stream, &vec![bf16::from_raw(POISON); shards * rows * d]);
        let mut part_lse = upload(&stream, &vec![f32::NAN; shards * rows]);
        let mut out = upload(&stream, &vec![bf16::from_raw(POISON); rows * d]);
        let mut lse = upload(&stream, &vec![f32::NAN; rows]);
        let shard_lens: Vec<CudaSlice<i32>> = (0..shards)
            .map(|s| {
                let local: Vec<i32> = lens
                    .iter()
                    .map(|&n| n.saturating_sub(s * chunk).min(chunk) as i32)
                    .collect();
                upload(&stream, &local)
            })
            .collect();
        {
            let (qp, _g1) = q.device_ptr(&stream);
            let (kp, _g2) = k.device_ptr(&stream);
            let (vp, _g3) = v.device_ptr(&stream);
            let (pp, _g4) = parts.device_ptr_mut(&stream);
            let (lp, _g5) = part_lse.device_ptr_mut(&stream);
            for (s, sl) in shard_lens.iter().enumerate() {
                let (slp, _g6) = sl.device_ptr(&stream);
                let offset = (s * chunk) as u64 * strides.token as u64 * 2;
                let t = DecodeTensors {
                    q: qp,
                    k: kp + offset,
                    v: vp + offset,
                    out: pp + (s * rows * d * 2) as u64,
                    lse: Some(lp + (s * rows * 4) as u64),
                    seqlens: Some(slp),
                    block_table: None,
                    k_scale: None,
                    v_scale: None,
                    sinks: None,
                    view_len: None,
                };
                // SAFETY: every pointer lies inside the buffers above, which outlive the sync.
                unsafe { decoder.run(&t, stream.cu_stream()) }.unwrap();
            }
        }
        merger
            .run_slices(
                &stream,
                &parts,
                &part_lse,
                &mut out,
                Some(&mut lse),
                Some(&sinks),
            )
            .unwrap();
        let got: Vec<f64> = download(&stream, &out).iter().map(|x| x.to_f64()).collect();
        let got_lse = download(&stream, &lse);
        let label = format!("{shards} shards of {chunk}, {batch}x{hq}/{hkv} d{d}, lens {lens:?}");
        for r in 0..rows {
            let err = relative_error_above(
                &got[r * d..(r + 1) * d],
                &want.out[r * d..(r + 1) * d],
                bf16::MIN_NORMAL,
            );
            assert!(err <= REL_TOL, "{label}: row {r} rel err {err:.2e}");
            let (a, b) = (f64::from(got_lse[r]), want.lse[r]);
            assert!((a - b).abs() <= LSE_TOL, "{label}: row {r} lse {a} vs {b}");
        }
        println!("sharded decode: {label} equals the whole decode");
    }
}
