//! `kvstream demo`: one decode on the GPU, checked against the f64 reference and timed the way
//! the benchmark method prescribes (CUDA graph over a rotating pool of >= 512 MiB of KV, median
//! of rounds). Without a GPU it says so and runs the CPU reference instead.
//!
//! The problem may have several new tokens per request (`q_len`: q, out and the LSE carry
//! `batch * q_len * hq` rows, all checked) and a paged cache: the demo then scatters the
//! contiguous caches it generates into page pools in a shuffled order and passes the block
//! table. Every request has the full `max_len` tokens.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use kvstream::plan::{heuristic_splits, split_range, tile_tokens};
use kvstream::reference::{
    combine_partials, decode_reference, decode_reference_with, random_bf16, random_e4m3,
    random_f16, relative_error, split_partial, RefScoreMods, RefShape, SplitMix64,
};
use kvstream::{
    DType, DecodeProblem, DecodeTensors, Decoder, DeviceFacts, Element, Error, KvDType, KvScale,
    KvScaleLayout, PagedKv, Runtime,
};

use crate::timing::{self, alloc, driver};
use crate::ShapeArgs;

/// Relative error a bf16/f16 decode must stay under.
const TOLERANCE: f64 = 1e-2;

pub fn run(shape: &ShapeArgs, rounds: usize) -> kvstream::Result<()> {
    let (problem, opts) = shape.problem()?;
    match Runtime::new(0) {
        Ok(rt) => match (problem.dtype, problem.kv_dtype) {
            (DType::Bf16, KvDType::AsQuery) => {
                gpu_demo(&rt, problem, opts, rounds, random_bf16, random_bf16)
            }
            (DType::F16, KvDType::AsQuery) => {
                gpu_demo(&rt, problem, opts, rounds, random_f16, random_f16)
            }
            (DType::Bf16, KvDType::Fp8E4m3) => {
                gpu_demo(&rt, problem, opts, rounds, random_bf16, random_e4m3)
            }
            (DType::F16, KvDType::Fp8E4m3) => {
                gpu_demo(&rt, problem, opts, rounds, random_f16, random_e4m3)
            }
        },
        Err(e @ (Error::DriverUnavailable(_) | Error::NoSuitableDevice(_))) => {
            println!("No usable GPU: {e}.");
            println!("kvstream's kernels need an NVIDIA H100/H200 (sm_90). Running the f64 CPU reference instead.\n");
            cpu_demo(&problem)
        }
        Err(e) => Err(e),
    }
}

/// Positions the CPU demo's reference takes at most (an f64 reference over a long cache takes
/// seconds a request).
const CPU_MAX_LEN: usize = 8192;

/// The reference on the user's heads, head dim and dtype (one request of at most CPU_MAX_LEN
/// positions, one new token), once directly and once through the split + combine model the GPU
/// path uses, so the demo still shows the math end to end.
fn cpu_demo(user: &DecodeProblem) -> kvstream::Result<()> {
    let len = user.max_len.min(CPU_MAX_LEN);
    let problem = DecodeProblem::new(1, user.hq, user.hkv, user.head_dim, len, user.dtype)?;
    if user.batch > 1
        || user.max_len > len
        || user.q_len > 1
        || user.paged.is_some()
        || user.kv_dtype != KvDType::AsQuery
        || user.has_score_mods()
    {
        println!(
            "(the CPU reference runs one request of at most {CPU_MAX_LEN} positions, one new token, \
             a contiguous {} cache: --batch, --q-len, --page-size, --kv-dtype, --window, \
             --softcap and --sinks apply on a GPU)",
            problem.dtype.name()
        );
    }
    let shape = RefShape::from(&problem);
    let mut rng = SplitMix64::new(7);
    // (the values the reference sees: rounded to the dtype, as f32)
    let dtype = problem.dtype;
    let mut random = |n: usize| match dtype {
        DType::Bf16 => random_bf16(&mut rng, n, 1.0).1,
        DType::F16 => random_f16(&mut rng, n, 1.0).1,
    };
    let q = random(problem.hq * problem.head_dim);
    let kv_len = problem.max_len * problem.hkv * problem.head_dim;
    let k = random(kv_len);
    let v = random(kv_len);
    let lens = [problem.max_len];
    let t = Instant::now();
    let full = decode_reference(&shape, &q, &k, &v, &lens);
    let ref_time = t.elapsed();

    // the split count an H200 would use (the split model is the math of every engine's merge)
    let num_splits = heuristic_splits(&problem, DeviceFacts::H200);
    let tile = tile_tokens(problem.head_dim);
    let mut split_out = Vec::with_capacity(full.out.len());
    for h in 0..problem.hq {
        let partials: Vec<_> = (0..num_splits)
            .map(|s| {
                let r = split_range(problem.max_len, num_splits, s, tile);
                split_partial(&shape, &q, &k, &v, 0, 0, h, r)
            })
            .collect();
        split_out.extend(combine_partials(&partials, problem.head_dim).0);
    }
    let err = relative_error(&split_out, &full.out);
    println!(
        "CPU reference: batch 1, {}/{} heads, d {}, L {}, {}: {:.1} ms; lse[0] = {:.4}",
        problem.hq,
        problem.hkv,
        problem.head_dim,
        problem.max_len,
        problem.dtype.name(),
        ref_time.as_secs_f64() * 1e3,
        full.lse[0]
    );
    println!(
        "split model ({num_splits} splits of {tile}-token tiles, FP32-style combine) vs reference: rel err {err:.2e}"
    );
    if err > 1e-12 {
        return Err(Error::invalid(
            "split model",
            format!("rel err {err:e}"),
            "<= 1e-12",
        ));
    }
    Ok(())
}

type RandomFn<T> = fn(&mut SplitMix64, usize, f32) -> (Vec<T>, Vec<f32>);

/// Paged copies of contiguous `[batch, max_len, hkv, d]` caches: pools
/// `[num_pages, page_size, hkv, d]` and the block table `[batch, table_stride]`.
struct PagedCopy<T> {
    k: Vec<T>,
    v: Vec<T>,
    table: Vec<i32>,
}

/// Scatters the contiguous caches `k` and `v` of `p` into page pools of `pg`: every request
/// gets its own pages, in a shuffled order across the pool; pages nobody owns and the rows past
/// `max_len` in a request's last page are zero. Table entries past a request's last page name
/// pages of other requests (never reached: every position is below `max_len`).
fn page_caches<T: Copy + Default>(
    rng: &mut SplitMix64,
    p: &DecodeProblem,
    pg: PagedKv,
    k: &[T],
    v: &[T],
) -> kvstream::Result<PagedCopy<T>> {
    let per_request = p.max_len.div_ceil(pg.page_size);
    let needed = p.batch * per_request;
    if pg.num_pages < needed {
        return Err(Error::invalid(
            "num_pages",
            pg.num_pages,
            format!(
                "at least batch x ceil(len / page_size) = {needed} (the demo gives every request \
                 its own pages)"
            ),
        ));
    }
    let per_token = p.hkv * p.head_dim;
    let per_page = pg.page_size * per_token;
    let mut order: Vec<usize> = (0..pg.num_pages).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut pools = (
        vec![T::default(); pg.num_pages * per_page],
        vec![T::default(); pg.num_pages * per_page],
    );
    let mut table = vec![0i32; p.batch * pg.table_stride];
    for b in 0..p.batch {
        for j in 0..pg.table_stride {
            let page = if j < per_request {
                let page = order[b * per_request + j];
                let first = j * pg.page_size;
                let rows = pg.page_size.min(p.max_len - first);
                let src = (b * p.max_len + first) * per_token;
                let (dst, n) = (page * per_page, rows * per_token);
                pools.0[dst..dst + n].copy_from_slice(&k[src..src + n]);
                pools.1[dst..dst + n].copy_from_slice(&v[src..src + n]);
                page
            } else {
                order[rng.below(needed)]
            };
            table[b * pg.table_stride + j] = page as i32;
        }
    }
    Ok(PagedCopy {
        k: pools.0,
        v: pools.1,
        table,
    })
}

/// Dequantisation scales of the demo's fp8 caches (per tensor): the cache values times these
/// are the K and V the reference sees.
const FP8_SCALES: (f32, f32) = (0.25, 0.125);

fn gpu_demo<T: Element + Copy + Default, K: cudarc::driver::DeviceRepr + Copy + Default>(
    rt: &Arc<Runtime>,
    problem: DecodeProblem,
    opts: kvstream::PlanOptions,
    rounds: usize,
    random: RandomFn<T>,
    random_kv: RandomFn<K>,
) -> kvstream::Result<()> {
    let ctx = rt.context();
    // One stream, raw pointers inside the captured graph: cudarc's cross-stream event tracking
    // is not needed and would add event waits to the capture.
    // SAFETY: everything below runs on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = driver("creating a stream", ctx.new_stream())?;
    let t = Instant::now();
    let decoder = Decoder::new(rt, problem.clone(), opts)?;
    let setup = t.elapsed();
    let p = &problem;
    let rows = p.batch * p.q_len * p.hq; // q, out: [batch, q_len, hq, d]; lse: [batch, q_len, hq]
    let q_elems = rows * p.head_dim;
    let cache_elems = p.batch * p.max_len * p.hkv * p.head_dim;
    // one set's K (or V) on the device: the contiguous cache, or the page pool
    let kv_elems = match p.paged {
        Some(pg) => pg.num_pages * pg.page_size * p.hkv * p.head_dim,
        None => cache_elems,
    };
    let kv_set_bytes = 2 * kv_elems * p.kv_elem_bytes();
    let sets = timing::pool_sets(kv_set_bytes);

    let mut rng = SplitMix64::new(2024);
    let (q_h, q_f) = random(&mut rng, q_elems, 1.0);
    // fp8: values over the e4m3 range, scaled back to about 1 (what the reference sees)
    let fp8 = p.kv_dtype == KvDType::Fp8E4m3;
    let (kv_range, (k_scale, v_scale)) = if fp8 {
        (4.0, FP8_SCALES)
    } else {
        (1.0, (1.0, 1.0))
    };
    let (k_h, mut k_f) = random_kv(&mut rng, cache_elems, kv_range);
    let (v_h, mut v_f) = random_kv(&mut rng, cache_elems, kv_range);
    k_f.iter_mut().for_each(|x| *x *= k_scale);
    v_f.iter_mut().for_each(|x| *x *= v_scale);
    // Paged: every set's pools hold the same pages at the same places, so one table serves all.
    let paged = match p.paged {
        Some(pg) => Some(page_caches(&mut rng, p, pg, &k_h, &v_h)?),
        None => None,
    };
    let (k_up, v_up) = match &paged {
        Some(pc) => (&pc.k, &pc.v),
        None => (&k_h, &v_h),
    };
    let mut q = alloc::<T>(&stream, sets * q_elems, "q")?;
    let mut k = alloc::<K>(&stream, sets * kv_elems, "k")?;
    let mut v = alloc::<K>(&stream, sets * kv_elems, "v")?;
    let scales = if fp8 {
        Some(driver(
            "uploading the scales",
            stream.clone_htod(&[k_scale, v_scale]),
        )?)
    } else {
        None
    };
    let mut out = alloc::<T>(&stream, sets * q_elems, "out")?;
    let mut lse = alloc::<f32>(&stream, rows, "lse")?;
    // sinks: one logit per query head, of the order of the scores
    let sinks_h: Option<Vec<f32>> = p
        .sinks
        .then(|| (0..p.hq).map(|_| rng.symmetric() * 3.0).collect());
    let sinks = match &sinks_h {
        Some(h) => Some(driver("uploading the sinks", stream.clone_htod(h))?),
        None => None,
    };
    let sinks_ptr = sinks.as_ref().map(|s| s.device_ptr(&stream).0);
    let table = match &paged {
        Some(pc) => {
            let mut t = alloc::<i32>(&stream, pc.table.len(), "block_table")?;
            driver(
                "uploading block_table",
                stream.memcpy_htod(&pc.table, &mut t),
            )?;
            Some(t)
        }
        None => None,
    };
    for s in 0..sets {
        driver(
            "uploading q",
            stream.memcpy_htod(&q_h, &mut q.slice_mut(s * q_elems..(s + 1) * q_elems)),
        )?;
        driver(
            "uploading k",
            stream.memcpy_htod(k_up, &mut k.slice_mut(s * kv_elems..(s + 1) * kv_elems)),
        )?;
        driver(
            "uploading v",
            stream.memcpy_htod(v_up, &mut v.slice_mut(s * kv_elems..(s + 1) * kv_elems)),
        )?;
    }
    let elem = p.dtype.size() as u64;
    let kv_elem = p.kv_elem_bytes() as u64;
    let qb = q.device_ptr(&stream).0;
    let (kb, vb) = (k.device_ptr(&stream).0, v.device_ptr(&stream).0);
    let scale_at = |i: u64| {
        scales.as_ref().map(|sc| KvScale {
            ptr: sc.device_ptr(&stream).0 + 4 * i,
            layout: KvScaleLayout::PerTensor,
        })
    };
    let (k_scale_t, v_scale_t) = (scale_at(0), scale_at(1));
    let ob = out.device_ptr_mut(&stream).0;
    let lse_ptr = lse.device_ptr_mut(&stream).0;
    let table_ptr = table.as_ref().map(|t| t.device_ptr(&stream).0);
    let tensors = |s: usize, with_lse: bool| DecodeTensors {
        q: qb + (s * q_elems) as u64 * elem,
        k: kb + (s * kv_elems) as u64 * kv_elem,
        v: vb + (s * kv_elems) as u64 * kv_elem,
        out: ob + (s * q_elems) as u64 * elem,
        lse: with_lse.then_some(lse_ptr),
        seqlens: None,
        block_table: table_ptr,
        k_scale: k_scale_t,
        v_scale: v_scale_t,
        sinks: sinks_ptr,
        view_len: None,
    };

    // ---- check set 0 against the f64 reference ----
    // SAFETY: the pointers cover the sizes the problem implies (allocated above).
    unsafe { decoder.run(&tensors(0, true), stream.cu_stream())? };
    let got: Vec<T> = driver("downloading out", stream.clone_dtoh(&out.slice(0..q_elems)))?;
    let got_lse: Vec<f32> = driver("downloading lse", stream.clone_dtoh(&lse))?;
    let got: Vec<f64> = got.iter().map(|&x| x.to_f64()).collect();
    let mods = RefScoreMods {
        window: p.window,
        softcap: p.softcap.map(f64::from),
        sinks: sinks_h
            .as_ref()
            .map(|s| s.iter().map(|&x| f64::from(x)).collect()),
    };
    let reference = decode_reference_with(
        &RefShape::from(p),
        &mods,
        &q_f,
        &k_f,
        &v_f,
        &vec![p.max_len; p.batch],
    );
    // every row: batch x q_len x hq outputs of d values (relative_error insists on equal
    // lengths) and as many LSEs
    let err = relative_error(&got, &reference.out);
    let lse_err = got_lse
        .iter()
        .zip(&reference.lse)
        .map(|(&a, &b)| lse_distance(a as f64, b))
        .fold(0.0, f64::max);

    // ---- time: one graph = one call per pool set ----
    let timing = if rounds == 0 {
        None
    } else {
        Some(time_graph(&decoder, &stream, sets, rounds, &tensors)?)
    };
    // a window reads only its own positions
    let io = p.io_bytes(p.batch * p.read_positions(p.max_len)) as f64;

    let pl = decoder.plan();
    let layout = match p.paged {
        Some(pg) => format!(
            ", paged ({} pages of {}, table stride {}, shuffled)",
            pg.num_pages, pg.page_size, pg.table_stride
        ),
        None => String::new(),
    };
    let kv = if fp8 {
        format!(
            ", {} cache (scales {k_scale}, {v_scale})",
            p.kv_dtype.name()
        )
    } else {
        String::new()
    };
    let mut mods_text = String::new();
    if p.window != kvstream::Window::CAUSAL {
        let (l, r) = p.window.to_window_size();
        mods_text += &format!(", window ({l}, {r})");
    }
    if let Some(c) = p.softcap {
        mods_text += &format!(", softcap {c}");
    }
    if p.sinks {
        mods_text += ", sinks";
    }
    println!(
        "kvstream decode on {}: batch {}, q_len {}, {}/{} heads, d {}, L {}, {}{kv}{layout}{mods_text}",
        ctx.name().unwrap_or_default(),
        p.batch,
        p.q_len,
        p.hq,
        p.hkv,
        p.head_dim,
        p.max_len,
        p.dtype.name()
    );
    match pl {
        kvstream::plan::Plan::Persistent(pp) => println!(
            "  plan: persistent, {} CTAs scheduled on the device, kernel {} ({} regs); setup {:.0} ms",
            pp.grid,
            kvstream::kernels::Variant::name(&pp.variant),
            decoder.decode_registers(),
            setup.as_secs_f64() * 1e3
        ),
        kvstream::plan::Plan::Split(pl) => {
            let splits = match pl.device_plan {
                Some(dp) => format!("device-planned splits ({} CTAs aimed at)", dp.target),
                None => format!("{} split(s)", pl.num_splits),
            };
            println!(
                "  plan: {splits}, grid {:?}, {}, kernel {} ({} regs); setup {:.0} ms",
                pl.grid,
                if pl.combine.is_some() {
                    "decode + combine (PDL)"
                } else {
                    "single kernel"
                },
                kvstream::kernels::Variant::name(&pl.decode),
                decoder.decode_registers(),
                setup.as_secs_f64() * 1e3
            );
        }
    }
    println!("  check vs f64 reference ({rows} rows): rel err {err:.2e} (limit {TOLERANCE:.0e}), max |lse err| {lse_err:.2e}");
    if let Some((median, min, n)) = timing {
        println!(
            "  time: {median:.2} us median ({min:.2} us min) over {n} rounds of {sets} calls; {:.0} GB/s ({:.1} MB moved per call)",
            io / median / 1e3,
            io / 1e6
        );
        // ids of plain single-token contiguous problems are unchanged
        let mut variant = String::new();
        if p.q_len != 1 {
            variant += &format!("-q{}", p.q_len);
        }
        if let Some(pg) = p.paged {
            variant += &format!("-p{}", pg.page_size);
        }
        if fp8 {
            variant += "-fp8";
        }
        if pl.split().is_some_and(|s| s.device_plan.is_some()) {
            variant += "-dp";
        }
        if let Some(left) = p.window.left {
            variant += &format!("-w{left}");
        }
        if let Some(c) = p.softcap {
            variant += &format!("-cap{c}");
        }
        if p.sinks {
            variant += "-sinks";
        }
        println!(
            "RESULT id=b{}-h{}-{}-d{}-L{}{variant} us={median:.3} GBps={:.1} mode={} rel_err={err:.3e}",
            p.batch,
            p.hq,
            p.hkv,
            p.head_dim,
            p.max_len,
            io / median / 1e3,
            pl.mode()
        );
    }
    if err > TOLERANCE || lse_err > 1e-3 {
        return Err(Error::invalid(
            "decode result",
            format!("rel err {err:.3e}, lse err {lse_err:.3e}"),
            format!("rel err <= {TOLERANCE:e} and lse err <= 1e-3"),
        ));
    }
    Ok(())
}

/// Captures one call per pool set into a CUDA graph and times its replays (docs/benchmarking.md):
/// (median, min) microseconds per call and the number of rounds.
fn time_graph(
    decoder: &Decoder,
    stream: &Arc<CudaStream>,
    sets: usize,
    rounds: usize,
    tensors: &dyn Fn(usize, bool) -> DecodeTensors,
) -> kvstream::Result<(f64, f64, usize)> {
    let graph = timing::capture(stream, sets, &mut |s| {
        // SAFETY: the caller's pointers cover every pool set.
        unsafe { decoder.run(&tensors(s, false), stream.cu_stream()) }
    })?;
    let t = timing::time_graphs(stream, &[(&graph, sets)], rounds)?[0];
    Ok((t.median_us, t.min_us, t.rounds))
}

/// |a - b|, 0 when both are the same infinity, +inf when either is NaN (so NaN never passes).
fn lse_distance(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        let d = (a - b).abs();
        if d.is_nan() {
            f64::INFINITY
        } else {
            d
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gathering the pages back through the table gives the contiguous caches; every request
    /// owns distinct pages; entries past a request's pages are valid page ids.
    #[test]
    fn paged_copy_round_trips() {
        for (len, page_size, extra) in [(100, 16, 0), (64, 1, 3), (37, 64, 2), (512, 512, 0)] {
            let p = DecodeProblem::new(3, 4, 2, 64, len, DType::Bf16)
                .unwrap()
                .with_q_len(2)
                .unwrap();
            let per_request = len.div_ceil(page_size);
            let p = p
                .with_paged(page_size, 3 * per_request + 5, Some(per_request + extra))
                .unwrap();
            let pg = p.paged.unwrap();
            let per_token = p.hkv * p.head_dim;
            let n = p.batch * len * per_token;
            let k: Vec<u32> = (0..n as u32).map(|x| x + 1).collect();
            let v: Vec<u32> = k.iter().map(|x| x * 3).collect();
            let pc = page_caches(&mut SplitMix64::new(1), &p, pg, &k, &v).unwrap();
            assert_eq!(pc.k.len(), pg.num_pages * page_size * per_token);
            assert_eq!(pc.table.len(), p.batch * pg.table_stride);
            let mut owned = std::collections::HashSet::new();
            for b in 0..p.batch {
                let row = &pc.table[b * pg.table_stride..(b + 1) * pg.table_stride];
                for t in 0..len {
                    let page = row[t / page_size] as usize;
                    let at = (page * page_size + t % page_size) * per_token;
                    let src = (b * len + t) * per_token;
                    assert_eq!(pc.k[at..at + per_token], k[src..src + per_token]);
                    assert_eq!(pc.v[at..at + per_token], v[src..src + per_token]);
                }
                for &page in &row[..per_request] {
                    assert!(owned.insert(page), "page {page} owned twice");
                }
                assert!(row.iter().all(|&x| (x as usize) < pg.num_pages));
            }
        }
    }

    #[test]
    fn paged_copy_needs_a_page_per_request_page() {
        let p = DecodeProblem::new(2, 4, 2, 64, 64, DType::F16)
            .unwrap()
            .with_paged(16, 7, None)
            .unwrap();
        let n = 2 * 64 * 2 * 64;
        let (k, v) = (vec![0u16; n], vec![0u16; n]);
        let msg = page_caches(&mut SplitMix64::new(1), &p, p.paged.unwrap(), &k, &v)
            .err()
            .unwrap()
            .to_string();
        assert!(msg.contains("num_pages") && msg.contains("8"), "{msg}");
    }
}
