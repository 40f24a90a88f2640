//! What the popular decoder models need, on the GPU: head dims 96 and 256, sliding windows
//! (FlashAttention's `window_size`), logit softcap and attention sinks, alone and combined with
//! paged caches, ragged lengths (zero, shorter than the window), multi-token decode, e4m3 caches
//! and LSE; each case against the f64 reference, run twice for the same bits, with the schedule
//! the kernel recorded compared with the CPU model (a window streams only its own tiles).

use super::*;
use kvstream::Window;

/// One random case of the model-coverage test.
#[derive(Clone, Debug)]
struct ModelCase {
    dtype: DType,
    fp8: bool,
    head_dim: usize,
    hq: usize,
    hkv: usize,
    q_len: usize,
    max_len: usize,
    lens: Vec<usize>,
    page_size: Option<usize>,
    window: Window,
    softcap: Option<f32>,
    sinks: bool,
    /// Column lanes ([`PlanOptions::persistent_column_lanes`]) where a KV head has several
    /// column blocks.
    lanes: bool,
    /// Head lanes ([`PlanOptions::persistent_head_lanes`]): one lane per (KV head, column block).
    head_lanes: bool,
    /// The wide consumer ([`PlanOptions::persistent_wide_columns`]): blocks of 64 rows.
    wide: bool,
    /// Rows of its blocks where not 64 ([`PlanOptions::persistent_wide_rows`]).
    wide_rows: Option<usize>,
    data_seed: u64,
}

const HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];

impl ModelCase {
    /// A large multi-token group: 64/8 heads x 8 new tokens (64 query rows a KV head), d 128,
    /// bf16, ragged lengths with a zero; no modifier, no lanes.
    fn multi_token(data_seed: u64) -> ModelCase {
        ModelCase {
            dtype: DType::Bf16,
            fp8: false,
            head_dim: 128,
            hq: 64,
            hkv: 8,
            q_len: 8,
            max_len: 1500,
            lens: vec![1500, 0, 9, 777],
            page_size: None,
            window: Window::CAUSAL,
            softcap: None,
            sinks: false,
            lanes: false,
            head_lanes: false,
            wide: false,
            wide_rows: None,
            data_seed,
        }
    }

    /// Case 0 is the combination the features must survive together (window + sinks +
    /// softcap + pages + e4m3 + four new tokens, lengths zero, inside and beyond the window);
    /// the others are drawn, every head dim in turn.
    fn draw(index: usize, rng: &mut SplitMix64) -> ModelCase {
        if index == 0 {
            return ModelCase {
                dtype: DType::Bf16,
                fp8: true,
                head_dim: 128,
                hq: 32,
                hkv: 4,
                q_len: 4,
                max_len: 700,
                lens: vec![0, 3, 90, 700, 517],
                page_size: Some(16),
                window: Window {
                    left: Some(100),
                    right: Some(0),
                },
                softcap: Some(20.0),
                sinks: true,
                lanes: false,
                head_lanes: false,
                wide: false,
                wide_rows: None,
                data_seed: 0x5EED,
            };
        }
        let pick = |rng: &mut SplitMix64, xs: &[usize]| xs[rng.below(xs.len())];
        let head_dim = HEAD_DIMS[index % HEAD_DIMS.len()];
        let hkv = pick(rng, &[1, 2, 4]);
        let group = pick(rng, &[1, 2, 4, 8, 16]);
        let q_len = 1 + rng.below(4);
        let batch = 1 + rng.below(4);
        let max_len = pick(rng, &[1, 37, 64, 200, 513, 1500]);
        let lens = (0..batch)
            .map(|b| match (b, rng.below(4)) {
                (0, _) => max_len,
                (_, 0) => 0,
                _ => rng.below(max_len + 1),
            })
            .collect();
        let window = match index % 5 {
            0 => Window::CAUSAL,
            _ => Window {
                left: [
                    None,
                    Some(0),
                    Some(5),
                    Some(63),
                    Some(64),
                    Some(100),
                    Some(300),
                ][rng.below(7)],
                right: [Some(0), Some(0), None, Some(2)][rng.below(4)],
            },
        };
        ModelCase {
            dtype: if (index / 4) % 2 == 0 {
                DType::Bf16
            } else {
                DType::F16
            },
            fp8: index % 3 == 2,
            head_dim,
            hq: hkv * group,
            hkv,
            q_len,
            max_len,
            lens,
            page_size: [None, Some(1), Some(16), Some(64)][rng.below(4)],
            window,
            softcap: [None, None, Some(1.5), Some(20.0)][rng.below(4)],
            sinks: rng.below(2) == 0,
            lanes: false,
            head_lanes: false,
            wide: false,
            wide_rows: None,
            data_seed: rng.next_u64(),
        }
    }

    fn problem(&self) -> Result<DecodeProblem, String> {
        let mut p = DecodeProblem::new(
            self.lens.len(),
            self.hq,
            self.hkv,
            self.head_dim,
            self.max_len,
            self.dtype,
        )
        .and_then(|p| p.with_q_len(self.q_len))
        .and_then(|p| p.with_window(self.window))
        .and_then(|p| p.with_softcap(self.softcap))
        .and_then(|p| p.with_sinks(self.sinks))
        .map_err(|e| format!("problem: {e}"))?;
        if self.fp8 {
            p = p
                .with_kv_dtype(KvDType::Fp8E4m3)
                .map_err(|e| format!("problem: {e}"))?;
        }
        if let Some(ps) = self.page_size {
            let pages = pool_pages(p.batch, p.max_len, ps);
            p = p
                .with_paged(ps, pages, None)
                .map_err(|e| format!("problem: {e}"))?;
        }
        Ok(p)
    }
}

fn run_model_case(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    c: &ModelCase,
) -> Result<Errors, String> {
    match c.dtype {
        DType::Bf16 => run_model_case_as::<bf16>(rt, stream, c),
        DType::F16 => run_model_case_as::<f16>(rt, stream, c),
    }
}

fn run_model_case_as<T: Half>(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    c: &ModelCase,
) -> Result<Errors, String> {
    let p = c.problem()?;
    let opts = PlanOptions {
        engine: Some(kvstream::Engine::Persistent),
        record_schedule: true,
        persistent_column_lanes: c.lanes.then_some(true),
        persistent_head_lanes: c.head_lanes.then_some(true),
        persistent_wide_columns: c.wide.then_some(true),
        persistent_wide_rows: c.wide_rows,
        ..Default::default()
    };
    let dec = Decoder::new(rt, p.clone(), opts).map_err(|e| format!("Decoder::new: {e}"))?;
    let mut rng = SplitMix64::new(c.data_seed);
    let mut o = Outputs::<T>::new(stream, &p, true);
    let (first, second, want) = if c.fp8 {
        let x = fp8_inputs::<T>(&mut rng, &p, &c.lens, KvScaleLayout::PerKvHead);
        let want = decode_reference_with(
            &RefShape::from(&p),
            &ref_mods(&p, x.sinks.as_deref()),
            &x.q32,
            &x.k32,
            &x.v32,
            &c.lens,
        );
        let dev = Fp8Device::upload(stream, &mut rng, &p, &x, &c.lens, KvScaleLayout::PerKvHead);
        let first = run_fp8(stream, &dec, &dev, &mut o)?;
        (first, run_fp8(stream, &dec, &dev, &mut o)?, want)
    } else {
        let x = make_inputs::<T>(&mut rng, &p, &c.lens);
        let dev = match p.paged {
            None => DeviceInputs::upload(stream, &x, Some(&c.lens)),
            Some(_) => DeviceInputs::upload_paged(
                stream,
                &x,
                &page_inputs(&mut rng, &p, &x),
                Some(&c.lens),
            ),
        };
        let first = run_poisoned(stream, &dec, &dev, &mut o)?;
        (
            first,
            run_poisoned(stream, &dec, &dev, &mut o)?,
            reference(&p, &x, &c.lens),
        )
    };
    let errors = check_output(&p, &first, &want)?;
    same_bits(&first, &second, "second run vs first")?;
    check_schedule(stream, &dec, &p, &c.lens)?;
    Ok(errors)
}

/// Expected run time: under a minute.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn score_mods_and_head_dims_match_reference() {
    let (rt, stream) = open_gpu();
    let cases = env_u64(
        "KVSTREAM_MODEL_CASES",
        env_u64("KVSTREAM_GPU_CASES", 96).min(96),
    ) as usize;
    let mut rng = SplitMix64::new(env_u64("KVSTREAM_MODEL_SEED", 0x6D6F_6465_6C73));
    let (mut max_rel, mut max_lse, mut failures) = (0f64, 0f64, Vec::new());
    let mut by_dim = BTreeMap::<usize, usize>::new();
    let (mut windows, mut capped, mut sunk, mut fp8, mut paged) = (0, 0, 0, 0, 0);
    for index in 0..cases {
        let c = ModelCase::draw(index, &mut rng);
        match catch_unwind(AssertUnwindSafe(|| run_model_case(&rt, &stream, &c))) {
            Ok(Ok(e)) => {
                max_rel = max_rel.max(e.rel);
                max_lse = max_lse.max(e.lse);
                *by_dim.entry(c.head_dim).or_default() += 1;
                windows += usize::from(c.window != Window::CAUSAL);
                capped += usize::from(c.softcap.is_some());
                sunk += usize::from(c.sinks);
                fp8 += usize::from(c.fp8);
                paged += usize::from(c.page_size.is_some());
            }
            Ok(Err(e)) => failures.push(format!("case {index} {c:?}: {e}")),
            Err(panic) => failures.push(format!(
                "case {index} {c:?}: panic: {}",
                panic_message(panic)
            )),
        }
    }
    println!(
        "score_mods_and_head_dims_match_reference: {} of {cases} cases passed; max rel err \
         {max_rel:.3e}, max lse err {max_lse:.3e}; by head dim {by_dim:?}; windows {windows}, \
         softcap {capped}, sinks {sunk}, e4m3 {fp8}, paged {paged}",
        cases - failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Large multi-token groups (more than 32 query rows a KV head: several column blocks) with
/// column lanes, each lane streaming the same tiles for its block, and head lanes (a lane per
/// KV head and block): equal to the reference and the schedule model with lanes, bitwise
/// reproducible; with windows, sinks, pages, e4m3.
/// Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn column_lanes_match_reference() {
    let (rt, stream) = open_gpu();
    let base = ModelCase {
        lanes: true,
        ..ModelCase::multi_token(0x1A4E5)
    };
    let cases = [
        base.clone(),
        // 128 query rows a KV head: four lanes
        ModelCase {
            hq: 32,
            hkv: 2,
            ..base.clone()
        },
        ModelCase {
            head_dim: 64,
            q_len: 4,
            window: Window {
                left: Some(100),
                right: Some(0),
            },
            sinks: true,
            page_size: Some(16),
            ..base.clone()
        },
        // d 256: blocks of 16 rows, 32 rows a KV head
        ModelCase {
            head_dim: 256,
            hq: 16,
            hkv: 1,
            q_len: 2,
            page_size: Some(64),
            ..base.clone()
        },
        ModelCase {
            fp8: true,
            dtype: DType::F16,
            softcap: Some(20.0),
            ..base.clone()
        },
        ModelCase {
            head_dim: 96,
            q_len: 5,
            lens: vec![1, 1500, 3, 64],
            ..base.clone()
        },
        // head lanes: one lane per (KV head, column block), on pools of 1 (gathered) and 16,
        // a contiguous cache, e4m3, paired d 64 heads (a lane a pair), MHA, two blocks a head
        ModelCase {
            hq: 32,
            q_len: 1,
            page_size: Some(1),
            lens: vec![1500, 0, 1499, 377, 64, 1],
            head_lanes: true,
            ..base.clone()
        },
        ModelCase {
            hq: 32,
            q_len: 2,
            page_size: Some(16),
            fp8: true,
            head_lanes: true,
            ..base.clone()
        },
        ModelCase {
            head_dim: 64,
            hq: 16,
            hkv: 16,
            q_len: 1,
            window: Window {
                left: Some(200),
                right: Some(0),
            },
            sinks: true,
            head_lanes: true,
            ..base.clone()
        },
        ModelCase {
            head_lanes: true,
            ..base.clone()
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        let errors =
            run_model_case(&rt, &stream, c).unwrap_or_else(|e| panic!("case {i} {c:?}: {e}"));
        println!(
            "{} lanes, case {i} (d {}, {} rows a KV head): max rel err {:.3e}, max lse err {:.3e}",
            if c.head_lanes { "head" } else { "column" },
            c.head_dim,
            c.q_len * c.hq / c.hkv,
            errors.rel,
            errors.lse
        );
    }
}

/// The wide consumer (blocks of 64 or 128 query rows on the warpgroup MMA): one block a KV
/// head, two (with column lanes), a partial block, contiguous, paged by boxes and gathered, d 64
/// and 128, bf16 and f16, 2-byte and e4m3 caches, windows, sinks and softcap, zero lengths and
/// lengths inside one tile; equal to the reference and the schedule model, bitwise
/// reproducible; then graphs of it (blocks of 64 and of 128) replayed with new lengths.
/// Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn wide_columns_match_reference() {
    let (rt, stream) = open_gpu();
    let base = ModelCase {
        wide: true,
        ..ModelCase::multi_token(0x51DE)
    };
    // 16/1 heads x 5 new tokens: 80 rows a KV head
    let eighty_rows = |page_size, wide_rows| ModelCase {
        hq: 16,
        hkv: 1,
        q_len: 5,
        lens: vec![1, 1500, 3, 64],
        page_size,
        wide_rows,
        ..base.clone()
    };
    let cases = [
        base.clone(),
        // 128 rows a KV head: two blocks of 64 in two lanes; one block of 128, both warpgroups
        // on every tile
        ModelCase {
            hq: 32,
            hkv: 2,
            ..base.clone()
        },
        ModelCase {
            hq: 32,
            hkv: 2,
            wide_rows: Some(128),
            ..base.clone()
        },
        // blocks of 128 at d 64, f16, pages of 16: a window (masked tiles: both warpgroups clear
        // V rows, then both read them), softcap, sinks
        ModelCase {
            wide_rows: Some(128),
            dtype: DType::F16,
            head_dim: 64,
            hq: 32,
            hkv: 2,
            page_size: Some(16),
            window: Window {
                left: Some(150),
                right: Some(0),
            },
            softcap: Some(25.0),
            sinks: true,
            ..base.clone()
        },
        // 256 rows: two blocks of 128 in two lanes; gathered pages of 1, ragged lengths
        ModelCase {
            wide_rows: Some(128),
            hq: 32,
            hkv: 1,
            lens: vec![700, 1, 0, 1500],
            page_size: Some(1),
            ..base.clone()
        },
        ModelCase {
            dtype: DType::F16,
            head_dim: 64,
            page_size: Some(16),
            window: Window {
                left: Some(100),
                right: Some(0),
            },
            softcap: Some(20.0),
            sinks: true,
            ..base.clone()
        },
        // 80 rows: a whole block of 64 and one of 16; gathered pages of 1
        eighty_rows(Some(1), None),
        // 80 rows in one block of 128, 48 of its rows empty (the second warpgroup's partly);
        // pages of 64 by boxes
        eighty_rows(Some(64), Some(128)),
        // 48 rows: one block, 16 of its rows empty; pages of 64 by boxes
        ModelCase {
            hq: 24,
            hkv: 2,
            q_len: 4,
            lens: vec![0, 65, 1500, 1],
            page_size: Some(64),
            ..base.clone()
        },
        // e4m3 caches (tiles widened to f16 by the warpgroups): bf16 queries (converted to f16),
        // 128 rows as two blocks of 64, a window with sinks; f16 at d 64, gathered pages of 1
        ModelCase {
            fp8: true,
            hq: 32,
            hkv: 2,
            window: Window {
                left: Some(300),
                right: Some(0),
            },
            sinks: true,
            ..base.clone()
        },
        ModelCase {
            fp8: true,
            dtype: DType::F16,
            head_dim: 64,
            page_size: Some(1),
            softcap: Some(30.0),
            ..base.clone()
        },
        ModelCase {
            fp8: true,
            page_size: Some(16),
            lens: vec![64, 1, 0, 1499],
            ..base.clone()
        },
        // e4m3 blocks of 128 (both warpgroups widen each tile into one of two f16 copies): a
        // window with sinks, pages of 16; d 64 f16, gathered pages of 1, 256 rows in two lanes
        ModelCase {
            fp8: true,
            wide_rows: Some(128),
            hq: 32,
            hkv: 2,
            page_size: Some(16),
            window: Window {
                left: Some(200),
                right: Some(0),
            },
            sinks: true,
            ..base.clone()
        },
        ModelCase {
            fp8: true,
            wide_rows: Some(128),
            dtype: DType::F16,
            head_dim: 64,
            hq: 32,
            hkv: 1,
            page_size: Some(1),
            lens: vec![700, 1, 0, 1500],
            ..base.clone()
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        let errors =
            run_model_case(&rt, &stream, c).unwrap_or_else(|e| panic!("case {i} {c:?}: {e}"));
        println!(
            "wide, case {i} (d {}, {} rows a KV head): max rel err {:.3e}, max lse err {:.3e}",
            c.head_dim,
            c.q_len * c.hq / c.hkv,
            errors.rel,
            errors.lse
        );
    }
    let sets = vec![
        vec![2048, 1, 0, 700],
        vec![5, 2048, 64, 0],
        vec![0, 0, 0, 0],
        vec![2048, 2048, 2048, 2048],
    ];
    let wide = PlanOptions {
        persistent_wide_columns: Some(true),
        ..Default::default()
    };
    // blocks of 64 rows and of 128
    for (q_len, rows) in [(4, None), (8, Some(128))] {
        let p = DecodeProblem::new(4, 32, 2, 128, 2048, DType::Bf16)
            .and_then(|p| p.with_q_len(q_len))
            .unwrap();
        let o = PlanOptions {
            persistent_wide_rows: rows,
            ..wide
        };
        graph_replay_case(&p, o, &sets);
    }
}

/// A graph captured once, replayed with new lengths, equals eager calls and the reference, for
/// a windowed, capped, sunk multi-token problem at d 256 (paged) and at d 96.
/// Expected run time: a few seconds.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn score_mods_graph_replays_with_new_lengths() {
    let window = Window {
        left: Some(300),
        right: Some(0),
    };
    let sets = vec![
        vec![2048, 1, 0, 700],
        vec![5, 2048, 301, 0],
        vec![0, 0, 0, 0],
        vec![2048, 2048, 2048, 2048],
    ];
    let d256 = DecodeProblem::new(4, 16, 8, 256, 2048, DType::Bf16)
        .and_then(|p| p.with_q_len(2))
        .and_then(|p| p.with_window(window))
        .and_then(|p| p.with_softcap(Some(30.0)))
        .and_then(|p| p.with_sinks(true))
        .and_then(|p| p.with_paged(64, pool_pages(4, 2048, 64), None))
        .unwrap();
    graph_replay_case(&d256, PlanOptions::default(), &sets);
    let d96 = DecodeProblem::new(4, 32, 32, 96, 2048, DType::Bf16)
        .and_then(|p| p.with_window(window))
        .and_then(|p| p.with_sinks(true))
        .unwrap();
    graph_replay_case(&d96, PlanOptions::default(), &sets);
}

/// The split engine serves none of these: asking for it names the reason.
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn split_engine_refuses_what_only_the_persistent_engine_serves() {
    let (rt, _) = open_gpu();
    let p = DecodeProblem::new(1, 8, 1, 256, 1024, DType::Bf16).unwrap();
    let opts = PlanOptions {
        engine: Some(kvstream::Engine::Split),
        ..Default::default()
    };
    let msg = Decoder::new(&rt, p, opts)
        .err()
        .expect("refused")
        .to_string();
    assert!(msg.contains("head dim 256"), "{msg}");
}
