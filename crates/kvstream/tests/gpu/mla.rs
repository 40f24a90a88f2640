//! MLA decode (`kvstream::mla`) on the GPU against the f64 reference of the absorbed form
//! (`reference::mla_reference`):
//!
//! - `mla_cases_match_reference`: seeded random cases over q dtypes, bf16/f16 and e4m3 caches
//!   (scale per cache or per request), 8-128 heads, 1-8 new tokens, contiguous caches and
//!   pools of pages of 1-256 positions in shuffled order, ragged and zero lengths, short
//!   units and units cut into up to 132 pieces; outputs poisoned before every run, cache
//!   positions past a length NaN, every case twice and bitwise equal.
//! - `mla_graph_replays_with_skewed_lengths`: one graph captured once, replayed with uniform,
//!   one-long-many-short, ragged, all-zero and at-capacity lengths (and new scales), each
//!   replay equal to an eager call bit for bit and to the reference.
//! - `mla_bad_inputs_are_rejected`: wrong dtypes, short buffers, a missing or misplaced scale,
//!   a missing block table: refused by name, nothing written.

use super::*;
use kvstream::mla::{MlaDecoder, MlaProblem, MlaTensors, MLA_DIM, MLA_V_DIM};
use kvstream::reference::mla_reference;

/// One problem's host data: q, the cache's bytes (NaN past each length), its scales, and the
/// values the reference sees.
struct MlaInputs<T> {
    q: Vec<T>,
    q32: Vec<f32>,
    cache: Vec<u8>,
    cache32: Vec<f32>,
    scale: Vec<f32>,
}

fn mla_inputs<T: Half>(
    rng: &mut SplitMix64,
    p: &MlaProblem,
    lens: &[usize],
    scale_len: usize,
) -> MlaInputs<T> {
    let (q, q32) = T::random(rng, p.batch * p.q_len * p.hq * MLA_DIM);
    let scale: Vec<f32> = (0..scale_len)
        .map(|_| (1.0 + rng.symmetric().abs() * 7.0) / 32.0)
        .collect();
    let mut cache = Vec::with_capacity(p.batch * p.max_len * MLA_DIM * p.kv_elem_bytes());
    let mut cache32 = Vec::with_capacity(p.batch * p.max_len * MLA_DIM);
    for (b, &len) in lens.iter().enumerate() {
        let n = len * MLA_DIM;
        let tail = (p.max_len - len) * MLA_DIM;
        match p.kv_dtype {
            KvDType::AsQuery => {
                let (bits, wide) = T::random(rng, n);
                cache.extend(bits.iter().flat_map(|x| x.raw().to_le_bytes()));
                cache32.extend(wide);
                cache.extend(std::iter::repeat(POISON.to_le_bytes()).take(tail).flatten());
            }
            KvDType::Fp8E4m3 => {
                let s = scale[if scale_len == 1 { 0 } else { b }];
                for _ in 0..n {
                    // log-uniform magnitudes reach the subnormals and 448
                    let mag = 2f32.powf(rng.symmetric() * 9.0 - 0.5).min(448.0);
                    let e = E4m3::from_f32(if rng.below(2) == 0 { mag } else { -mag });
                    cache.push(e.0);
                    cache32.push(e.to_f32() * s);
                }
                cache.extend(std::iter::repeat(E4M3_POISON.0).take(tail));
            }
        }
        cache32.extend(std::iter::repeat(f32::NAN).take(tail));
    }
    MlaInputs {
        q,
        q32,
        cache,
        cache32,
        scale,
    }
}

/// The contiguous cache's rows scattered into a shuffled pool of `p`'s pages (spare pages
/// between them); table entries past a request's pages point at other requests' pages.
fn mla_pages(rng: &mut SplitMix64, p: &MlaProblem, cache: &[u8]) -> (Vec<u8>, Vec<i32>) {
    let pg = p.paged.expect("a paged problem");
    let row = MLA_DIM * p.kv_elem_bytes();
    let per_page = pg.page_size * row;
    let pages_per_request = p.max_len.div_ceil(pg.page_size);
    let mut order: Vec<usize> = (0..pg.num_pages).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut pool = vec![0xFFu8; pg.num_pages * per_page];
    let mut table = vec![0i32; p.batch * pg.table_stride];
    for b in 0..p.batch {
        for j in 0..pg.table_stride {
            let slot = b * pg.table_stride + j;
            if j < pages_per_request {
                let page = order[b * pages_per_request + j];
                table[slot] = page as i32;
                let first = j * pg.page_size;
                let n = pg.page_size.min(p.max_len - first) * row;
                let src = (b * p.max_len + first) * row;
                pool[page * per_page..page * per_page + n].copy_from_slice(&cache[src..src + n]);
            } else {
                table[slot] = order[rng.below(p.batch * pages_per_request)] as i32;
            }
        }
    }
    (pool, table)
}

/// One problem's device buffers and outputs.
struct MlaDevice<T> {
    q: CudaSlice<T>,
    cache: CudaSlice<u8>,
    scale: Option<CudaSlice<f32>>,
    seqlens: CudaSlice<i32>,
    table: Option<CudaSlice<i32>>,
    out: CudaSlice<T>,
    lse: CudaSlice<f32>,
}

impl<T: Half> MlaDevice<T> {
    fn upload(
        stream: &Arc<CudaStream>,
        rng: &mut SplitMix64,
        p: &MlaProblem,
        x: &MlaInputs<T>,
        lens: &[usize],
    ) -> Self {
        let (cache, table) = match p.paged {
            Some(_) => {
                let (pool, table) = mla_pages(rng, p, &x.cache);
                (upload(stream, &pool), Some(upload(stream, &table)))
            }
            None => (upload(stream, &x.cache), None),
        };
        let rows = p.batch * p.q_len * p.hq;
        MlaDevice {
            q: upload(stream, &x.q),
            cache,
            scale: (p.kv_dtype == KvDType::Fp8E4m3).then(|| upload(stream, &x.scale)),
            seqlens: upload(stream, &lens_i32(lens)),
            table,
            out: upload(stream, &vec![T::from_raw(POISON); rows * MLA_V_DIM]),
            lse: upload(stream, &vec![f32::NAN; rows]),
        }
    }

    fn tensors(&mut self, stream: &Arc<CudaStream>) -> MlaTensors {
        let layout = match self.scale.as_ref().map(|s| s.len()) {
            Some(1) => KvScaleLayout::PerTensor,
            _ => KvScaleLayout::PerRequestHead,
        };
        MlaTensors {
            q: self.q.device_ptr(stream).0,
            kv: self.cache.device_ptr(stream).0,
            out: self.out.device_ptr_mut(stream).0,
            lse: Some(self.lse.device_ptr_mut(stream).0),
            seqlens: Some(self.seqlens.device_ptr(stream).0),
            block_table: self.table.as_ref().map(|t| t.device_ptr(stream).0),
            kv_scale: self.scale.as_ref().map(|s| KvScale {
                ptr: s.device_ptr(stream).0,
                layout,
            }),
        }
    }

    fn poison(&mut self, stream: &Arc<CudaStream>) {
        let rows = self.lse.len();
        overwrite(
            stream,
            &vec![T::from_raw(POISON); rows * MLA_V_DIM],
            &mut self.out,
        );
        overwrite(stream, &vec![f32::NAN; rows], &mut self.lse);
    }

    /// Poisons the outputs, runs through the raw API, waits, reads them back.
    fn run(
        &mut self,
        stream: &Arc<CudaStream>,
        dec: &MlaDecoder,
    ) -> Result<(Vec<u16>, Vec<f32>), String> {
        self.poison(stream);
        let t = self.tensors(stream);
        // SAFETY: every pointer is a live allocation of the sizes the problem implies.
        unsafe { dec.run(&t, stream.cu_stream()) }.map_err(|e| format!("run refused: {e}"))?;
        stream
            .synchronize()
            .map_err(|e| format!("the MLA decode failed on the GPU: {e}"))?;
        Ok(self.read(stream))
    }

    fn read(&self, stream: &Arc<CudaStream>) -> (Vec<u16>, Vec<f32>) {
        let out = download(stream, &self.out)
            .iter()
            .map(|x| x.raw())
            .collect();
        (out, download(stream, &self.lse))
    }
}

/// Every row against the reference: written (no poison left), within [`REL_TOL`], LSE within
/// [`LSE_TOL`]; rows that see nothing exactly 0 with LSE -inf. Returns the largest errors.
fn check_mla<T: Half>(
    p: &MlaProblem,
    lens: &[usize],
    (out, lse): &(Vec<u16>, Vec<f32>),
    want: &RefOutput,
) -> Result<Errors, String> {
    let mut worst = Errors { rel: 0.0, lse: 0.0 };
    for (b, &len) in lens.iter().enumerate() {
        for qi in 0..p.q_len {
            let visible = (len + qi + 1).saturating_sub(p.q_len);
            for h in 0..p.hq {
                let r = (b * p.q_len + qi) * p.hq + h;
                let got: Vec<f64> = out[r * MLA_V_DIM..(r + 1) * MLA_V_DIM]
                    .iter()
                    .map(|&x| T::from_raw(x).to_f64())
                    .collect();
                let at = format!("request {b} (len {len}), token {qi}, head {h}");
                if visible == 0 {
                    if got.iter().any(|&x| x != 0.0) || lse[r] != f32::NEG_INFINITY {
                        return Err(format!(
                            "{at}: sees nothing but got {:?}.. / lse {}",
                            &got[..4],
                            lse[r]
                        ));
                    }
                    continue;
                }
                let rel = relative_error(&got, &want.out[r * MLA_V_DIM..(r + 1) * MLA_V_DIM]);
                let lse_err = (f64::from(lse[r]) - want.lse[r]).abs();
                // (NaN fails: it is not below anything)
                let within = rel <= REL_TOL && lse_err <= LSE_TOL;
                if !within {
                    return Err(format!("{at}: rel err {rel:.3e}, lse err {lse_err:.3e}"));
                }
                worst.rel = worst.rel.max(rel);
                worst.lse = worst.lse.max(lse_err);
            }
        }
    }
    Ok(worst)
}

fn mla_want<T>(p: &MlaProblem, x: &MlaInputs<T>, lens: &[usize]) -> RefOutput {
    mla_reference(&RefShape::from(p), &x.q32, &x.cache32, lens)
}

fn mla_case<T: Half>(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    rng: &mut SplitMix64,
    p: &MlaProblem,
    lens: &[usize],
    per_request_scale: bool,
) -> Result<Errors, String> {
    let scale_len = if per_request_scale { p.batch } else { 1 };
    let x = mla_inputs::<T>(rng, p, lens, scale_len);
    let want = mla_want(p, &x, lens);
    let mut dev = MlaDevice::upload(stream, rng, p, &x, lens);
    let options = PlanOptions {
        record_schedule: true,
        ..PlanOptions::default()
    };
    let dec =
        MlaDecoder::new(rt, p.clone(), options).map_err(|e| format!("MlaDecoder::new: {e}"))?;
    let first = dev.run(stream, &dec)?;
    let errors = check_mla::<T>(p, lens, &first, &want)?;
    // the pieces each CTA streamed are the model's, in its lanes
    let plan = dec.plan();
    let clamped: Vec<usize> = lens.iter().map(|&l| l.min(p.max_len)).collect();
    let (_, model) = kvstream::schedule::pieces_in_lanes(
        &clamped,
        kvstream::schedule::TileWindow::NONE,
        plan.col_blocks,
        plan.lanes,
        plan.variant.tile_tokens,
        plan.grid,
        plan.min_tiles_per_cta,
    );
    let recorded = dec
        .last_schedule(stream)
        .map_err(|e| e.to_string())?
        .ok_or("no schedule recorded")?;
    same_schedule(&recorded, &model, lens)?;
    let second = dev.run(stream, &dec)?;
    if first != second {
        return Err("two runs differ".into());
    }
    Ok(errors)
}

/// Expected run time: under a minute (the f64 reference dominates).
#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn mla_cases_match_reference() {
    let (rt, stream) = open_gpu();
    let cases = env_u64("KVSTREAM_GPU_CASES", 48).min(48) as usize;
    let mut rng = SplitMix64::new(0x4D4C41);
    // 2-byte cases (even i) meet heads 16, 8, 64 and 24 at 1, 2 or 8 new tokens: narrow blocks
    // and wide ones (more than 32 rows: 48, 64, 128, 192), whole and partial
    let heads = [16, 12, 8, 32, 64, 128, 24, 16];
    let pages = [
        None,
        Some(64),
        Some(32),
        Some(1),
        Some(16),
        Some(256),
        Some(2),
    ];
    let (mut worst, mut failed) = (Errors { rel: 0.0, lse: 0.0 }, Vec::new());
    for i in 0..cases {
        let hq = heads[i % heads.len()];
        let q_len = [1, 1, 2, 4, 8, 3][i % 6].min(if hq >= 64 { 1 } else { 8 });
        let kv = if i % 2 == 0 {
            KvDType::AsQuery
        } else {
            KvDType::Fp8E4m3
        };
        // (an e4m3 page of one row is refused by the plan: pages of two instead)
        let page =
            pages[i % pages.len()].map(|s| if kv == KvDType::Fp8E4m3 { s.max(2) } else { s });
        // long requests only with few heads: the reference is single-threaded f64
        // (a short run, as under compute-sanitizer, skips them)
        let max_len = match (i % 5, hq <= 16 && cases >= 24) {
            (0, true) => 40_000,
            (1, _) => 97,
            (2, _) => 1500,
            _ => 5000,
        };
        let batch = [1, 3, 2, 5, 1, 4][i % 6];
        let lens: Vec<usize> = (0..batch)
            .map(|b| match (b + i) % 5 {
                0 => max_len,
                1 => 0,
                2 => rng.below(3) + 1,
                _ => rng.below(max_len + 1),
            })
            .collect();
        let scale = 1.0 / (192f32).sqrt() * (1.0 + 0.5 * rng.uniform() as f32);
        let mut p = MlaProblem::new(batch, hq, max_len, DType::Bf16, scale)
            .and_then(|p| p.with_q_len(q_len))
            .and_then(|p| p.with_kv_dtype(kv))
            .expect("a valid problem");
        if let Some(page) = page {
            let pool = batch * max_len.div_ceil(page) + 3;
            p = p
                .with_paged(page, pool, None)
                .expect("a valid paged problem");
        }
        let f16_q = i % 3 == 2;
        let name = format!(
            "{} q, {} cache, b {batch}, hq {hq}, q_len {q_len}, L {max_len}, page {page:?}, lens {lens:?}",
            if f16_q { "f16" } else { "bf16" },
            kv.name()
        );
        // (with --nocapture, a case that never returns is named by the last line)
        eprintln!("MLA case {i}: {name}");
        let r = if f16_q {
            p.dtype = DType::F16;
            mla_case::<f16>(&rt, &stream, &mut rng, &p, &lens, i % 4 == 1)
        } else {
            mla_case::<bf16>(&rt, &stream, &mut rng, &p, &lens, i % 4 == 1)
        };
        match r {
            Ok(e) => {
                worst.rel = worst.rel.max(e.rel);
                worst.lse = worst.lse.max(e.lse);
            }
            Err(e) => failed.push(format!("{name}: {e}")),
        }
    }
    println!(
        "MLA: {} cases, {} failed, max rel err {:.3e}, max lse err {:.3e}",
        cases,
        failed.len(),
        worst.rel,
        worst.lse
    );
    assert!(
        failed.is_empty(),
        "failing MLA cases:\n{}",
        failed.join("\n")
    );
}

#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn mla_graph_replays_with_skewed_lengths() {
    let (rt, stream) = open_gpu_own_stream();
    let ctx = rt.context().clone();
    // (the last: 64 rows a request, the wide consumer)
    for (kv, page, hq) in [
        (KvDType::Fp8E4m3, None, 16),
        (KvDType::AsQuery, Some(64), 16),
        (KvDType::AsQuery, Some(32), 64),
    ] {
        let (batch, max_len) = (16, if hq > 16 { 2048 } else { 8192 });
        let mut p = MlaProblem::new(batch, hq, max_len, DType::Bf16, 0.0722)
            .and_then(|p| p.with_kv_dtype(kv))
            .expect("a valid problem");
        if let Some(page) = page {
            p = p
                .with_paged(page, batch * max_len / page + 3, None)
                .expect("a valid paged problem");
        }
        let dec = MlaDecoder::new(&rt, p.clone(), PlanOptions::default())
            .unwrap_or_else(|e| panic!("MlaDecoder::new: {e}"));
        ctx.synchronize()
            .expect("synchronising after MlaDecoder::new");
        let full = vec![max_len; batch];
        let mut rng = SplitMix64::new(0x6D6C61);
        let mut x = mla_inputs::<bf16>(&mut rng, &p, &full, batch);
        let mut dev = MlaDevice::upload(&stream, &mut rng, &p, &x, &full);
        stream.synchronize().expect("uploads");
        let tensors = dev.tensors(&stream);
        // SAFETY: every pointer is a live allocation of the sizes the problem implies.
        let graph = capture_graph(&stream, || unsafe { dec.run(&tensors, stream.cu_stream()) })
            .unwrap_or_else(|e| panic!("{e}"));
        let mut skew = vec![300; batch];
        skew[5] = max_len;
        let ragged: Vec<usize> = (0..batch).map(|_| rng.below(max_len + 1)).collect();
        let mut short = vec![0; batch];
        short[0] = 70;
        let mut previous_factor = 1.0f32;
        for (round, lens) in [full.clone(), skew, ragged, vec![0; batch], short, full]
            .iter()
            .enumerate()
        {
            if kv == KvDType::Fp8E4m3 {
                // new scales (the first ones times 1.25, 1.5, ...): the dequantised values
                // change with them
                let factor = (1.0 + 0.25 * (round as f32 + 1.0)) / previous_factor;
                previous_factor *= factor;
                for v in x.cache32.iter_mut() {
                    *v *= factor;
                }
                for s in x.scale.iter_mut() {
                    *s *= factor;
                }
                overwrite(&stream, &x.scale, dev.scale.as_mut().expect("an fp8 scale"));
            }
            overwrite(&stream, &lens_i32(lens), &mut dev.seqlens);
            dev.poison(&stream);
            graph.launch().expect("launching the graph");
            stream
                .synchronize()
                .expect("graph replay failed on the GPU");
            let replayed = dev.read(&stream);
            let eager = dev.run(&stream, &dec).unwrap_or_else(|e| panic!("{e}"));
            let what = format!(
                "MLA graph, {} cache, page {page:?}, round {round}",
                kv.name()
            );
            assert!(
                replayed == eager,
                "{what}: the replay differs from an eager call"
            );
            // the cache past each length is NaN in the reference's copy: fine, it never looks
            let want = mla_want(&p, &x, lens);
            let e = check_mla::<bf16>(&p, lens, &replayed, &want)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            println!(
                "{what}: max rel err {:.3e}, max lse err {:.3e}",
                e.rel, e.lse
            );
        }
    }
}

#[test]
#[ignore = "needs an H100/H200 GPU: run with --ignored"]
fn mla_bad_inputs_are_rejected() {
    let (rt, stream) = open_gpu();
    let p = MlaProblem::new(2, 16, 256, DType::Bf16, 0.07)
        .and_then(|p| p.with_kv_dtype(KvDType::Fp8E4m3))
        .expect("a valid problem");
    let dec = MlaDecoder::new(&rt, p.clone(), PlanOptions::default()).expect("a decoder");
    let rows = p.batch * p.hq;
    let q = upload(&stream, &vec![bf16::ONE; rows * MLA_DIM]);
    let kv = upload(&stream, &vec![E4m3(0x38); p.cache_elements()]);
    let kv2 = upload(&stream, &vec![bf16::ONE; p.cache_elements()]);
    let mut out = upload(&stream, &vec![bf16::from_bits(POISON); rows * MLA_V_DIM]);
    let scale = upload(&stream, &[1.0f32]);
    let three = upload(&stream, &[1.0f32; 3]);
    let short_q = upload(&stream, &vec![bf16::ONE; rows * MLA_DIM - 1]);
    let message = |r: kvstream::Result<()>| r.expect_err("must be refused").to_string();
    let m = message(dec.run_slices(&stream, &q, &kv, &mut out, None, None, None, None));
    assert!(m.contains("kv_scale"), "{m}");
    let m = message(dec.run_slices(&stream, &q, &kv, &mut out, None, None, None, Some(&three)));
    assert!(m.contains("kv_scale") && m.contains("per request"), "{m}");
    let m = message(dec.run_slices(&stream, &q, &kv2, &mut out, None, None, None, Some(&scale)));
    assert!(m.contains("kv_cache"), "{m}");
    let m = message(dec.run_slices(
        &stream,
        &short_q,
        &kv,
        &mut out,
        None,
        None,
        None,
        Some(&scale),
    ));
    assert!(m.contains("q"), "{m}");
    let table = upload(&stream, &[0i32; 2]);
    let m = message(dec.run_slices(
        &stream,
        &q,
        &kv,
        &mut out,
        None,
        None,
        Some(&table),
        Some(&scale),
    ));
    assert!(m.contains("block_table"), "{m}");
    stream.synchronize().expect("nothing was launched");
    assert!(
        download(&stream, &out)
            .iter()
            .all(|x| x.to_bits() == POISON),
        "a refused call wrote the output"
    );
    // and a well-formed call goes through
    dec.run_slices(&stream, &q, &kv, &mut out, None, None, None, Some(&scale))
        .expect("a valid call");
    stream.synchronize().expect("the MLA decode");
}
