//! CPU reference for decode attention, used as the ground truth that the GPU kernels are tested
//! against.
//!
//! Everything here favours being obviously right over being fast: inputs are widened to `f64`,
//! every accumulation happens in `f64`, and loops follow the tensor layouts in their natural
//! order. The GPU kernels accumulate in `f32` with bf16/f16 inputs, so an `f64` reference puts
//! all of the observable error on the kernel side and lets tests use tight, meaningful
//! tolerances.
//!
//! Besides the full [`decode_reference`], the module mirrors the split-KV pipeline piece by piece
//! ([`split_partial`] and [`combine_partials`]) in the kernel's base-2 convention, so a failing
//! GPU test can tell whether the partial pass or the combine pass is wrong. It also holds the
//! helpers that every test and demo needs: a relative-error metric that cannot be fooled by NaN,
//! and a small deterministic generator for bf16/f16 test data.

use crate::fp8::E4m3;
use crate::problem::Window;
use half::{bf16, f16};
use std::ops::Range;

/// Shape of one decode problem as the reference sees it. Layouts are contiguous:
/// q `[batch, q_len, hq, d]`, k and v `[batch, max_len, hkv, d]`, out `[batch, q_len, hq, d]`,
/// lse `[batch, q_len, hq]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RefShape {
    /// Number of requests.
    pub batch: usize,
    /// New tokens per request (1 for plain decode, more for speculative / multi-token decode).
    pub q_len: usize,
    /// Query heads; must be a multiple of `hkv`.
    pub hq: usize,
    /// Key/value heads.
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
    /// Capacity of the KV cache per request, in positions (the stride of the `batch` axis).
    pub max_len: usize,
    /// Multiplier applied to `q . k` before the softmax (usually `1 / sqrt(d)`).
    pub softmax_scale: f64,
}

impl From<&crate::DecodeProblem> for RefShape {
    /// The reference view of a decode problem (contiguous caches; a paged problem's pages are
    /// the same positions, gathered), with the f32 scale the kernels get widened to f64 (so the
    /// reference computes exactly what was asked of the GPU).
    fn from(p: &crate::DecodeProblem) -> Self {
        RefShape {
            batch: p.batch,
            q_len: p.q_len,
            hq: p.hq,
            hkv: p.hkv,
            d: p.head_dim,
            max_len: p.max_len,
            softmax_scale: f64::from(p.scale()),
        }
    }
}

impl RefShape {
    fn group(&self) -> usize {
        assert!(self.hkv > 0, "hkv must be positive");
        assert!(
            self.hq % self.hkv == 0,
            "hq ({}) must be a multiple of hkv ({})",
            self.hq,
            self.hkv
        );
        self.hq / self.hkv
    }

    fn q_offset(&self, b: usize, qi: usize, h: usize) -> usize {
        ((b * self.q_len + qi) * self.hq + h) * self.d
    }

    fn kv_offset(&self, b: usize, pos: usize, kvh: usize) -> usize {
        ((b * self.max_len + pos) * self.hkv + kvh) * self.d
    }

    fn check_inputs(&self, q: &[f32], k: &[f32], v: &[f32]) {
        let q_elems = self.batch * self.q_len * self.hq * self.d;
        let kv_elems = self.batch * self.max_len * self.hkv * self.d;
        assert_eq!(q.len(), q_elems, "q has the wrong length for {self:?}");
        assert_eq!(k.len(), kv_elems, "k has the wrong length for {self:?}");
        assert_eq!(v.len(), kv_elems, "v has the wrong length for {self:?}");
    }
}

/// The cache positions `[low, high)` query row `qi` attends to under `window`: the row sits at
/// position t = seqlen - q_len + qi and sees `[t - left, t + right]` within `[0, seqlen)`
/// (causal: `[0, t]`); empty when high <= low.
fn visible_range(seqlen: usize, q_len: usize, qi: usize, window: Window) -> Range<usize> {
    let t = seqlen as i64 - q_len as i64 + qi as i64;
    let high = window
        .right
        .map_or(seqlen as i64, |r| (t + 1 + r as i64).min(seqlen as i64));
    let low = window.left.map_or(0, |l| (t - l as i64).max(0));
    let high = high.max(low);
    low as usize..high as usize
}

/// The score modifiers of [`decode_reference_with`]: a sliding window, a logit softcap, and
/// attention sinks (one logit per query head, joining the softmax denominator).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RefScoreMods {
    /// The positions each row sees ([`Window::CAUSAL`] by default).
    pub window: Window,
    /// Scaled scores s become `c * tanh(s / c)`.
    pub softcap: Option<f64>,
    /// `[hq]` logits on the scaled scores' scale.
    pub sinks: Option<Vec<f64>>,
}

/// Output of the reference: `out` in `f64` and natural-log LSE (`f64::NEG_INFINITY` for a
/// zero-length request).
#[derive(Clone, Debug, PartialEq)]
pub struct RefOutput {
    /// Attention output, layout `[batch, q_len, hq, d]`.
    pub out: Vec<f64>,
    /// Natural-log sum of exponentiated scaled scores, layout `[batch, q_len, hq]`.
    pub lse: Vec<f64>,
}

/// Full decode attention in `f64`. `seqlens[b]` <= `max_len` is request b's cache length.
///
/// Query head h uses kv head `h / (hq / hkv)`. Multi-token (`q_len > 1`): query row i of request
/// b sees cache positions `[0, seqlens[b] - q_len + i]` inclusive (causal among the new tokens;
/// if that bound is < 0 the row sees nothing). A row that sees no position gives out = 0 and
/// lse = -inf (never NaN).
pub fn decode_reference(
    shape: &RefShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seqlens: &[usize],
) -> RefOutput {
    decode_reference_with(shape, &RefScoreMods::default(), q, k, v, seqlens)
}

/// [`decode_reference`] with score modifiers: row (token i) sees the positions its window gives
/// ([`Window`]); scores are capped, then the row's sink joins the denominator (it adds no value),
/// so a row that sees nothing gives out = 0 and lse = its sink (-inf without sinks).
pub fn decode_reference_with(
    shape: &RefShape,
    mods: &RefScoreMods,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seqlens: &[usize],
) -> RefOutput {
    if let Some(s) = &mods.sinks {
        assert_eq!(s.len(), shape.hq, "one sink per query head");
    }
    shape.check_inputs(q, k, v);
    assert_eq!(seqlens.len(), shape.batch, "one seqlen per request");
    for (b, &seqlen) in seqlens.iter().enumerate() {
        assert!(
            seqlen <= shape.max_len,
            "seqlens[{b}] = {seqlen} exceeds max_len {}",
            shape.max_len
        );
    }
    // one unit a (request, new token): its rows [hq, d] are contiguous in `out`; large problems
    // (the GPU demos and benchmarks check GB-sized caches) spread the units over the cores
    let units: Vec<(usize, usize)> = (0..shape.batch)
        .flat_map(|b| (0..shape.q_len).map(move |qi| (b, qi)))
        .collect();
    let work = units.len() * shape.hq * shape.max_len * shape.d;
    let threads = if work < REFERENCE_PARALLEL_WORK {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    };
    let unit = |&(b, qi): &(usize, usize)| reference_unit(shape, mods, q, k, v, b, qi, seqlens[b]);
    let rows = if threads == 1 {
        units.iter().map(unit).collect()
    } else {
        crate::jit::par_map(&units, threads, unit)
    };
    let mut out = Vec::with_capacity(shape.batch * shape.q_len * shape.hq * shape.d);
    let mut lse = Vec::with_capacity(shape.batch * shape.q_len * shape.hq);
    for (o, l) in rows {
        out.extend(o);
        lse.extend(l);
    }
    RefOutput { out, lse }
}

/// Multiply-adds below which [`decode_reference_with`] runs on the calling thread.
const REFERENCE_PARALLEL_WORK: usize = 1 << 24;

/// The rows `[hq, d]` and LSEs `[hq]` of request `b`'s new token `qi` (of length `seqlen`).
#[allow(clippy::too_many_arguments)]
fn reference_unit(
    shape: &RefShape,
    mods: &RefScoreMods,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    b: usize,
    qi: usize,
    seqlen: usize,
) -> (Vec<f64>, Vec<f64>) {
    let group = shape.group();
    let d = shape.d;
    let mut out = vec![0.0f64; shape.hq * d];
    let mut lse = vec![f64::NEG_INFINITY; shape.hq];
    // scratch reused by every row of the unit
    let mut scores = vec![0.0f64; seqlen];
    let mut q_row = vec![0.0f64; d];
    let mut acc = vec![0.0f64; d];
    let seen = visible_range(seqlen, shape.q_len, qi, mods.window);
    for h in 0..shape.hq {
        let kvh = h / group;
        let sink = mods.sinks.as_ref().map_or(f64::NEG_INFINITY, |s| s[h]);
        if seen.is_empty() {
            // out stays zero: the sink alone (if any) takes the whole weight
            lse[h] = sink;
            continue;
        }
        let qo = shape.q_offset(b, qi, h);
        for (dst, &src) in q_row.iter_mut().zip(&q[qo..qo + d]) {
            *dst = f64::from(src);
        }

        // Two passes (max, then exponentials) keep exp() in range for any scores.
        let mut m = sink;
        for (j, s) in seen.clone().zip(scores.iter_mut()) {
            let ko = shape.kv_offset(b, j, kvh);
            *s = dot(&q_row, &k[ko..ko + d]) * shape.softmax_scale;
            if let Some(c) = mods.softcap {
                *s = c * (*s / c).tanh();
            }
            m = m.max(*s);
        }

        acc.fill(0.0);
        let mut l = if sink > f64::NEG_INFINITY {
            (sink - m).exp()
        } else {
            0.0
        };
        for (j, &s) in seen.clone().zip(scores.iter()) {
            let p = (s - m).exp();
            l += p;
            let vo = shape.kv_offset(b, j, kvh);
            axpy(&mut acc, p, &v[vo..vo + d]);
        }

        let row = &mut out[h * d..(h + 1) * d];
        for (o, &a) in row.iter_mut().zip(&acc) {
            *o = a / l;
        }
        lse[h] = m + l.ln();
    }
    (out, lse)
}

/// MLA decode (absorbed form) in `f64`: every query head attends to the one latent cache
/// `kv [batch, max_len, 576]` (scores over all 576 columns, values its first 512), with the
/// causal multi-token rule of [`decode_reference`]. `shape` is the scores' view (one KV head
/// of `d` = 576, e.g. `RefShape::from(&mla_problem)`); q is `[batch, q_len, hq, 576]`, `out`
/// comes back as `[batch, q_len, hq, 512]`.
pub fn mla_reference(shape: &RefShape, q: &[f32], kv: &[f32], seqlens: &[usize]) -> RefOutput {
    use crate::mla::{MLA_DIM, MLA_V_DIM};
    assert!(
        shape.hkv == 1 && shape.d == MLA_DIM,
        "MLA has one latent KV head of {MLA_DIM} dims: {shape:?}"
    );
    // V is K's first 512 columns: attend with V = K, then keep those columns of each row
    let full = decode_reference(shape, q, kv, kv, seqlens);
    let out = full
        .out
        .chunks(MLA_DIM)
        .flat_map(|row| row[..MLA_V_DIM].iter().copied())
        .collect();
    RefOutput { out, lse: full.lse }
}

impl From<&crate::mla::MlaProblem> for RefShape {
    /// The scores' view of an MLA problem: one KV head of 576 dims, the f32 scale widened.
    fn from(p: &crate::mla::MlaProblem) -> Self {
        RefShape {
            batch: p.batch,
            q_len: p.q_len,
            hq: p.hq,
            hkv: 1,
            d: crate::mla::MLA_DIM,
            max_len: p.max_len,
            softmax_scale: f64::from(p.softmax_scale),
        }
    }
}

fn dot(q: &[f64], k: &[f32]) -> f64 {
    q.iter().zip(k).map(|(&a, &b)| a * f64::from(b)).sum()
}

fn axpy(acc: &mut [f64], p: f64, v: &[f32]) {
    for (a, &x) in acc.iter_mut().zip(v) {
        *a += p * f64::from(x);
    }
}

/// Split-KV partial state of one query row over one KV range, in the kernel's base-2 convention:
/// scores are `s_j = (q . k_j) * softmax_scale * log2(e)`; `m = max_j s_j` (`NEG_INFINITY` when
/// empty), `l = sum_j 2^(s_j - m)` (0 when empty), `o[i] = sum_j 2^(s_j - m) v_j[i]`
/// (unnormalised; all zero when empty).
#[derive(Clone, Debug, PartialEq)]
pub struct SplitPartial {
    /// Running maximum of the base-2 scores.
    pub m: f64,
    /// Sum of `2^(s_j - m)`.
    pub l: f64,
    /// Unnormalised output accumulator, length `d`.
    pub o: Vec<f64>,
}

/// Partial for one (request `b`, query row `qi`, query head `h`) over cache positions `range`
/// (already clipped by the caller to what the row may see; may be empty).
// The argument list mirrors the kernel's indexing one to one; bundling it would only hide that.
#[allow(clippy::too_many_arguments)]
pub fn split_partial(
    shape: &RefShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    b: usize,
    qi: usize,
    h: usize,
    range: Range<usize>,
) -> SplitPartial {
    let group = shape.group();
    shape.check_inputs(q, k, v);
    assert!(
        b < shape.batch && qi < shape.q_len && h < shape.hq,
        "row (b {b}, qi {qi}, h {h}) outside {shape:?}"
    );
    assert!(
        range.end <= shape.max_len,
        "range {range:?} exceeds max_len {}",
        shape.max_len
    );
    let d = shape.d;
    let kvh = h / group;
    let qo = shape.q_offset(b, qi, h);
    let q_row: Vec<f64> = q[qo..qo + d].iter().map(|&x| f64::from(x)).collect();
    let scale2 = shape.softmax_scale * std::f64::consts::LOG2_E;

    let mut m = f64::NEG_INFINITY;
    for j in range.clone() {
        let ko = shape.kv_offset(b, j, kvh);
        m = m.max(dot(&q_row, &k[ko..ko + d]) * scale2);
    }

    let mut l = 0.0f64;
    let mut o = vec![0.0f64; d];
    // An empty range skips this loop, so m = -inf never meets exp2(-inf - -inf) = NaN.
    for j in range {
        let ko = shape.kv_offset(b, j, kvh);
        let p = (dot(&q_row, &k[ko..ko + d]) * scale2 - m).exp2();
        l += p;
        let vo = shape.kv_offset(b, j, kvh);
        axpy(&mut o, p, &v[vo..vo + d]);
    }
    SplitPartial { m, l, o }
}

/// Merge partials in the given (fixed) order, exactly like the GPU combine kernel:
/// `M = max m_s` over non-empty splits; `w_s = 2^(m_s - M)`;
/// `out = sum_s w_s o_s / sum_s w_s l_s`; lse (natural log) `= (M + log2(sum_s w_s l_s)) * ln 2`.
///
/// Empty partials (`m = -inf`) are skipped without reading `o`. All empty -> out zeros, lse -inf.
/// Returns `(out, lse)` with `out` of length `d`.
pub fn combine_partials(partials: &[SplitPartial], d: usize) -> (Vec<f64>, f64) {
    let is_empty = |p: &SplitPartial| p.m == f64::NEG_INFINITY;
    let big_m = partials
        .iter()
        .filter(|p| !is_empty(p))
        .map(|p| p.m)
        .fold(f64::NEG_INFINITY, f64::max);
    let mut out = vec![0.0f64; d];
    if big_m == f64::NEG_INFINITY {
        return (out, f64::NEG_INFINITY);
    }

    let mut l = 0.0f64;
    for p in partials.iter().filter(|p| !is_empty(p)) {
        assert_eq!(p.o.len(), d, "partial accumulator length differs from d");
        let w = (p.m - big_m).exp2();
        l += w * p.l;
        for (acc, &x) in out.iter_mut().zip(&p.o) {
            *acc += w * x;
        }
    }
    for x in &mut out {
        *x /= l;
    }
    let lse = (big_m + l.log2()) * std::f64::consts::LN_2;
    (out, lse)
}

/// f64 model of [`crate::merge`]: merges the partial states `parts[s]` (`[rows, d]`) with their
/// natural-log LSEs `lses[s]` (`[rows]`) in shard order; shards with LSE -inf are skipped
/// without reading their output (a row without keys gives zeros and -inf). `sinks` (`[heads]`,
/// row r is head `r % heads`) then join each row's denominator once.
pub fn merge_states(
    parts: &[Vec<f64>],
    lses: &[Vec<f64>],
    d: usize,
    sinks: Option<&[f64]>,
) -> RefOutput {
    assert_eq!(parts.len(), lses.len(), "one LSE vector per shard");
    let rows = lses.first().map_or(0, |l| l.len());
    let mut out = vec![0.0f64; rows * d];
    let mut lse = vec![f64::NEG_INFINITY; rows];
    for r in 0..rows {
        let m = lses.iter().map(|l| l[r]).fold(f64::NEG_INFINITY, f64::max);
        let row = &mut out[r * d..(r + 1) * d];
        if m > f64::NEG_INFINITY {
            let mut total = 0.0;
            for (part, l) in parts.iter().zip(lses) {
                if l[r] == f64::NEG_INFINITY {
                    continue;
                }
                let w = (l[r] - m).exp();
                total += w;
                for (acc, &x) in row.iter_mut().zip(&part[r * d..(r + 1) * d]) {
                    *acc += w * x;
                }
            }
            row.iter_mut().for_each(|x| *x /= total);
            lse[r] = m + total.ln();
        }
        if let Some(sinks) = sinks {
            let sink = sinks[r % sinks.len()];
            if lse[r] == f64::NEG_INFINITY {
                lse[r] = sink;
            } else {
                let top = lse[r].max(sink);
                let joined = top + ((lse[r] - top).exp() + (sink - top).exp()).ln();
                let keep = (lse[r] - joined).exp();
                row.iter_mut().for_each(|x| *x *= keep);
                lse[r] = joined;
            }
        }
    }
    RefOutput { out, lse }
}

/// Relative error `||a - b||_2 / ||b||_2` (returns `||a||_2` when `||b|| == 0`; NaN anywhere
/// gives `f64::INFINITY` so a NaN never passes a tolerance check).
///
/// Panics if the lengths differ, since comparing misaligned tensors is always a test bug.
pub fn relative_error(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(
        a.len(),
        b.len(),
        "relative_error on slices of different length"
    );
    let mut diff2 = 0.0f64;
    let mut b2 = 0.0f64;
    let mut a2 = 0.0f64;
    for (&x, &y) in a.iter().zip(b) {
        diff2 += (x - y) * (x - y);
        b2 += y * y;
        a2 += x * x;
    }
    // NaN inputs, and inf - inf, all surface as a NaN somewhere in these sums.
    if diff2.is_nan() || b2.is_nan() || a2.is_nan() {
        return f64::INFINITY;
    }
    let err = if b2 == 0.0 {
        a2.sqrt()
    } else {
        diff2.sqrt() / b2.sqrt()
    };
    if err.is_nan() {
        f64::INFINITY
    } else {
        err
    }
}

/// Small deterministic generator for test and demo data (SplitMix64). Never produces all-zero
/// data: unlike xorshift-style generators it has no absorbing zero state, so every seed
/// (including 0) is fine.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// Generator seeded with `seed`; equal seeds give equal streams on every platform.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[-1, 1)`, on a grid of `2^-23` so every value is exact in `f32`.
    pub fn symmetric(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 23) as f32) - 1.0
    }

    /// Uniform integer in `[0, n)`; panics when `n == 0`.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "SplitMix64::below(0) has no valid result");
        // Multiply-shift instead of `%`: no modulo bias worth mentioning and no division.
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// Random bf16 tensor of `n` values uniform in `[-scale, scale)` (rounded to nearest bf16):
/// returns (bits for upload, the same values widened to f32 for the reference).
pub fn random_bf16(rng: &mut SplitMix64, n: usize, scale: f32) -> (Vec<bf16>, Vec<f32>) {
    let bits: Vec<bf16> = (0..n)
        .map(|_| bf16::from_f32(rng.symmetric() * scale))
        .collect();
    // Widen the rounded values, not the originals, so the reference sees what the GPU sees.
    let wide = bits.iter().map(|x| x.to_f32()).collect();
    (bits, wide)
}

/// Random f16 tensor of `n` values uniform in `[-scale, scale)` (rounded to nearest f16):
/// returns (bits for upload, the same values widened to f32 for the reference).
pub fn random_f16(rng: &mut SplitMix64, n: usize, scale: f32) -> (Vec<f16>, Vec<f32>) {
    let bits: Vec<f16> = (0..n)
        .map(|_| f16::from_f32(rng.symmetric() * scale))
        .collect();
    let wide = bits.iter().map(|x| x.to_f32()).collect();
    (bits, wide)
}

/// Random e4m3 tensor of `n` values uniform in `[-scale, scale)` (rounded to nearest e4m3,
/// saturating): returns (bits for upload, the same values widened to f32 for the reference).
pub fn random_e4m3(rng: &mut SplitMix64, n: usize, scale: f32) -> (Vec<E4m3>, Vec<f32>) {
    let bits: Vec<E4m3> = (0..n)
        .map(|_| E4m3::from_f32(rng.symmetric() * scale))
        .collect();
    let wide = bits.iter().map(|x| x.to_f32()).collect();
    (bits, wide)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Positions row qi sees in plain causal decode: `[0, visible_len)`.
    fn visible_len(seqlen: usize, q_len: usize, qi: usize) -> usize {
        visible_range(seqlen, q_len, qi, Window::CAUSAL).end
    }

    #[test]
    fn the_threaded_reference_keeps_every_row_in_place() {
        // above REFERENCE_PARALLEL_WORK: the units run on every core, each row where the
        // single-threaded order puts it (bitwise: each row is one unit's arithmetic)
        let p = make_problem(11, 3, 16, 2, 128, &[3000, 0, 1, 2999, 1500]);
        let s = &p.shape;
        assert!(s.batch * s.q_len * s.hq * s.max_len * s.d >= REFERENCE_PARALLEL_WORK);
        let mods = RefScoreMods {
            window: Window {
                left: Some(700),
                right: Some(0),
            },
            ..Default::default()
        };
        let all = decode_reference_with(s, &mods, &p.q, &p.k, &p.v, &p.seqlens);
        for b in 0..s.batch {
            for qi in 0..s.q_len {
                let (out, lse) = reference_unit(s, &mods, &p.q, &p.k, &p.v, b, qi, p.seqlens[b]);
                let at = (b * s.q_len + qi) * s.hq;
                assert_eq!(
                    &all.out[at * s.d..(at + s.hq) * s.d],
                    &out[..],
                    "request {b} token {qi}"
                );
                assert_eq!(&all.lse[at..at + s.hq], &lse[..], "request {b} token {qi}");
            }
        }
    }

    #[test]
    fn score_mods_follow_their_definitions() {
        let p = make_problem(7, 2, 8, 2, 64, &[40, 1, 0, 33]);
        let s = &p.shape;
        let plain = decode_reference(s, &p.q, &p.k, &p.v, &p.seqlens);
        let with =
            |mods: RefScoreMods| decode_reference_with(s, &mods, &p.q, &p.k, &p.v, &p.seqlens);
        // a cap far above every score changes nothing measurable
        let loose = with(RefScoreMods {
            softcap: Some(1e9),
            ..Default::default()
        });
        assert!(relative_error(&loose.out, &plain.out) < 1e-12);
        // a tight cap changes the output
        let tight = with(RefScoreMods {
            softcap: Some(0.5),
            ..Default::default()
        });
        assert!(relative_error(&tight.out, &plain.out) > 1e-3);
        // a sink scales each row by exp(lse) / (exp(lse) + exp(sink)); lse becomes logaddexp
        let sinks: Vec<f64> = (0..s.hq).map(|h| h as f64 * 0.7 - 2.0).collect();
        let sunk = with(RefScoreMods {
            sinks: Some(sinks.clone()),
            ..Default::default()
        });
        for (r, (&lse, &lse_sunk)) in plain.lse.iter().zip(&sunk.lse).enumerate() {
            let sink = sinks[r % s.hq];
            let want = if lse == f64::NEG_INFINITY {
                sink
            } else {
                lse.max(sink) + ((lse - lse.max(sink)).exp() + (sink - lse.max(sink)).exp()).ln()
            };
            assert!(
                (lse_sunk - want).abs() < 1e-12,
                "row {r}: {lse_sunk} vs {want}"
            );
            let keep = if lse == f64::NEG_INFINITY {
                0.0
            } else {
                (lse - want).exp()
            };
            for i in 0..s.d {
                let (a, b) = (sunk.out[r * s.d + i], plain.out[r * s.d + i] * keep);
                assert!((a - b).abs() < 1e-12, "row {r} dim {i}: {a} vs {b}");
            }
        }
        // a window of 5 back: row qi of request 0 (length 40) sees [37 + qi - 5, 38 + qi)
        let windowed = with(RefScoreMods {
            window: Window {
                left: Some(5),
                right: Some(0),
            },
            ..Default::default()
        });
        assert_eq!(
            visible_range(
                40,
                2,
                1,
                Window {
                    left: Some(5),
                    right: Some(0)
                }
            ),
            34..40
        );
        assert_eq!(
            visible_range(
                40,
                2,
                0,
                Window {
                    left: None,
                    right: None
                }
            ),
            0..40
        );
        assert_eq!(visible_range(1, 2, 0, Window::CAUSAL), 0..0);
        // the same rows computed as plain decode over the window's positions only
        for qi in 0..2 {
            let seen = visible_range(40, 2, qi, windowed_window());
            let one = RefShape {
                batch: 1,
                q_len: 1,
                max_len: seen.len(),
                ..*s
            };
            let kv_slice = |x: &[f32]| -> Vec<f32> {
                seen.clone()
                    .flat_map(|t| {
                        x[s.kv_offset(0, t, 0)..s.kv_offset(0, t, 0) + s.hkv * s.d].to_vec()
                    })
                    .collect()
            };
            let q0: Vec<f32> =
                p.q[s.q_offset(0, qi, 0)..s.q_offset(0, qi, 0) + s.hq * s.d].to_vec();
            let r = decode_reference(&one, &q0, &kv_slice(&p.k), &kv_slice(&p.v), &[seen.len()]);
            let o = s.q_offset(0, qi, 0);
            assert!(
                relative_error(&windowed.out[o..o + s.hq * s.d], &r.out) < 1e-12,
                "qi {qi}"
            );
        }
    }

    fn windowed_window() -> Window {
        Window {
            left: Some(5),
            right: Some(0),
        }
    }
    use proptest::prelude::*;

    const TOL: f64 = 1e-12;

    struct Problem {
        shape: RefShape,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        seqlens: Vec<usize>,
    }

    fn make_problem(
        seed: u64,
        q_len: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        seqlens: &[usize],
    ) -> Problem {
        let batch = seqlens.len();
        // Leave slack past the longest request so a wrong stride reads data that does not match.
        let max_len = seqlens.iter().copied().max().unwrap_or(0) + 3;
        let shape = RefShape {
            batch,
            q_len,
            hq,
            hkv,
            d,
            max_len,
            softmax_scale: 1.0 / (d as f64).sqrt(),
        };
        let mut rng = SplitMix64::new(seed);
        // A larger q scale makes the softmax peaky, which exercises the max subtraction.
        let (_, q) = random_bf16(&mut rng, batch * q_len * hq * d, 3.0);
        let (_, k) = random_bf16(&mut rng, batch * max_len * hkv * d, 1.0);
        let (_, v) = random_f16(&mut rng, batch * max_len * hkv * d, 1.0);
        Problem {
            shape,
            q,
            k,
            v,
            seqlens: seqlens.to_vec(),
        }
    }

    /// Textbook attention with no tricks: materialise exp(score) for every visible position,
    /// normalise, and take the weighted sum. Independent indexing so layout bugs show up.
    fn naive(p: &Problem) -> RefOutput {
        let s = &p.shape;
        let mut out = Vec::new();
        let mut lse = Vec::new();
        for b in 0..s.batch {
            for qi in 0..s.q_len {
                for h in 0..s.hq {
                    let kvh = h / (s.hq / s.hkv);
                    let last = p.seqlens[b] as i64 - s.q_len as i64 + qi as i64;
                    let qv = |i: usize| f64::from(p.q[((b * s.q_len + qi) * s.hq + h) * s.d + i]);
                    let at = |t: &[f32], j: usize, i: usize| {
                        f64::from(t[((b * s.max_len + j) * s.hkv + kvh) * s.d + i])
                    };
                    let mut e = Vec::new();
                    let mut j = 0i64;
                    while j <= last {
                        let sc: f64 = (0..s.d).map(|i| qv(i) * at(&p.k, j as usize, i)).sum();
                        e.push((sc * s.softmax_scale).exp());
                        j += 1;
                    }
                    let total: f64 = e.iter().sum();
                    for i in 0..s.d {
                        let num: f64 = e.iter().enumerate().map(|(j, w)| w * at(&p.v, j, i)).sum();
                        out.push(if e.is_empty() { 0.0 } else { num / total });
                    }
                    lse.push(total.ln());
                }
            }
        }
        RefOutput { out, lse }
    }

    fn assert_lse_close(got: f64, want: f64, what: &str) {
        if want == f64::NEG_INFINITY {
            assert_eq!(got, f64::NEG_INFINITY, "{what}: lse {got} should be -inf");
        } else {
            assert!(
                (got - want).abs() <= TOL * want.abs().max(1.0),
                "{what}: lse {got} vs {want}"
            );
        }
    }

    fn assert_matches(got: &RefOutput, want: &RefOutput, what: &str) {
        assert_eq!(got.out.len(), want.out.len(), "{what}: out length");
        assert_eq!(got.lse.len(), want.lse.len(), "{what}: lse length");
        let err = relative_error(&got.out, &want.out);
        assert!(err <= TOL, "{what}: relative error {err}");
        for (i, (&g, &w)) in got.lse.iter().zip(&want.lse).enumerate() {
            assert_lse_close(g, w, &format!("{what} row {i}"));
        }
    }

    // (q_len, hq, hkv, d, seqlens): group sizes 1, 2, 5, 8 and MQA, ragged lengths including 0
    // and lengths shorter than q_len.
    const CASES: &[(usize, usize, usize, usize, &[usize])] = &[
        (1, 4, 4, 64, &[0, 17, 33]),
        (3, 4, 4, 128, &[9, 2, 0]),
        (1, 8, 4, 128, &[40, 1]),
        (3, 8, 4, 64, &[5, 1, 40]),
        (1, 10, 2, 64, &[29, 0]),
        (3, 10, 2, 128, &[3, 31]),
        (1, 16, 2, 128, &[64, 2, 0, 3]),
        (3, 16, 2, 64, &[64, 2, 0, 3]),
        (1, 6, 1, 64, &[50, 7]),
        (3, 8, 1, 128, &[50, 7, 0]),
    ];

    #[test]
    fn decode_reference_matches_naive_formula() {
        for (n, &(q_len, hq, hkv, d, seqlens)) in CASES.iter().enumerate() {
            let p = make_problem(100 + n as u64, q_len, hq, hkv, d, seqlens);
            let got = decode_reference(&p.shape, &p.q, &p.k, &p.v, &p.seqlens);
            assert_matches(&got, &naive(&p), &format!("case {n}"));
        }
    }

    #[test]
    fn decode_reference_matches_naive_with_unusual_scale() {
        let mut p = make_problem(7, 3, 8, 2, 64, &[20, 3, 11]);
        p.shape.softmax_scale = 0.3;
        let got = decode_reference(&p.shape, &p.q, &p.k, &p.v, &p.seqlens);
        assert_matches(&got, &naive(&p), "scale 0.3");
    }

    #[test]
    fn zero_length_request_gives_zero_and_neg_inf() {
        for q_len in [1, 3] {
            let p = make_problem(11, q_len, 8, 2, 64, &[0, 12, 0]);
            let r = decode_reference(&p.shape, &p.q, &p.k, &p.v, &p.seqlens);
            assert!(r.out.iter().all(|x| !x.is_nan()));
            assert!(r.lse.iter().all(|x| !x.is_nan()));
            let row = p.shape.q_len * p.shape.hq;
            for b in [0, 2] {
                assert!(r.out[b * row * 64..(b + 1) * row * 64]
                    .iter()
                    .all(|&x| x == 0.0));
                assert!(r.lse[b * row..(b + 1) * row]
                    .iter()
                    .all(|&x| x == f64::NEG_INFINITY));
            }
            assert!(r.lse[row..2 * row].iter().all(|x| x.is_finite()));
        }
    }

    #[test]
    fn rows_before_the_cache_start_see_nothing() {
        // seqlen 1 with q_len 3: rows 0 and 1 have a negative bound, row 2 sees position 0 only.
        let p = make_problem(12, 3, 2, 1, 64, &[1]);
        let r = decode_reference(&p.shape, &p.q, &p.k, &p.v, &p.seqlens);
        for qi in 0..2 {
            for h in 0..2 {
                assert_eq!(r.lse[qi * 2 + h], f64::NEG_INFINITY);
                let o = (qi * 2 + h) * 64;
                assert!(r.out[o..o + 64].iter().all(|&x| x == 0.0));
            }
        }
        for h in 0..2 {
            let o = (2 * 2 + h) * 64;
            let want: Vec<f64> = p.v[h / 2 * 64..h / 2 * 64 + 64]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            assert_eq!(
                r.out[o..o + 64],
                want[..],
                "one visible position: out = v_0"
            );
        }
    }

    /// Splits `[0, n)` at the given cut points (clamped and sorted) into consecutive ranges.
    fn ranges_from_cuts(n: usize, cuts: &[usize]) -> Vec<Range<usize>> {
        let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(n)).collect();
        cuts.sort_unstable();
        let mut bounds = vec![0];
        bounds.extend(cuts);
        bounds.push(n);
        bounds.windows(2).map(|w| w[0]..w[1]).collect()
    }

    fn combine_row(p: &Problem, b: usize, qi: usize, h: usize, ranges: &[Range<usize>]) {
        let s = &p.shape;
        let n = visible_len(p.seqlens[b], s.q_len, qi);
        assert_eq!(ranges.first().map(|r| r.start), Some(0));
        assert_eq!(ranges.last().map(|r| r.end), Some(n));
        let partials: Vec<SplitPartial> = ranges
            .iter()
            .map(|r| split_partial(s, &p.q, &p.k, &p.v, b, qi, h, r.clone()))
            .collect();
        let (out, lse) = combine_partials(&partials, s.d);
        let reference = decode_reference(s, &p.q, &p.k, &p.v, &p.seqlens);
        let o = ((b * s.q_len + qi) * s.hq + h) * s.d;
        let what = format!("b {b} qi {qi} h {h} ranges {ranges:?}");
        let err = relative_error(&out, &reference.out[o..o + s.d]);
        assert!(err <= TOL, "{what}: relative error {err}");
        assert_lse_close(lse, reference.lse[o / s.d], &what);
    }

    #[test]
    fn combine_of_random_partitions_matches_reference() {
        let mut rng = SplitMix64::new(0xC0FFEE);
        for (n, &(q_len, hq, hkv, d, seqlens)) in CASES.iter().enumerate() {
            let p = make_problem(200 + n as u64, q_len, hq, hkv, d, seqlens);
            for b in 0..p.shape.batch {
                for qi in 0..q_len {
                    let len = visible_len(p.seqlens[b], q_len, qi);
                    for h in [0, hq / 2, hq - 1] {
                        let splits = 1 + rng.below(64);
                        let mut cuts: Vec<usize> =
                            (0..splits - 1).map(|_| rng.below(len + 1)).collect();
                        // Force an empty first and last split whenever there is room for both.
                        if splits >= 3 {
                            cuts[0] = 0;
                            cuts[1] = len;
                        }
                        combine_row(&p, b, qi, h, &ranges_from_cuts(len, &cuts));
                    }
                }
            }
        }
    }

    #[test]
    fn combine_with_leading_and_trailing_empty_splits() {
        let p = make_problem(5, 1, 4, 2, 128, &[37]);
        let ranges = [0..0, 0..0, 0..10, 10..10, 10..37, 37..37, 37..37];
        for h in 0..4 {
            combine_row(&p, 0, 0, h, &ranges);
        }
    }

    #[test]
    fn combine_of_all_empty_is_zero_and_neg_inf() {
        let p = make_problem(6, 1, 2, 1, 64, &[10]);
        let partials: Vec<SplitPartial> = (0..5)
            .map(|i| split_partial(&p.shape, &p.q, &p.k, &p.v, 0, 0, 1, i * 2..i * 2))
            .collect();
        for part in &partials {
            assert_eq!(part.m, f64::NEG_INFINITY);
            assert_eq!(part.l, 0.0);
            assert!(part.o.iter().all(|&x| x == 0.0));
        }
        let (out, lse) = combine_partials(&partials, 64);
        assert_eq!(out, vec![0.0; 64]);
        assert_eq!(lse, f64::NEG_INFINITY);

        let (out, lse) = combine_partials(&[], 64);
        assert_eq!(out, vec![0.0; 64]);
        assert_eq!(lse, f64::NEG_INFINITY);
    }

    #[test]
    fn combine_never_reads_o_of_empty_partials() {
        // The GPU combine kernel may leave an empty split's accumulator uninitialised.
        let poisoned = SplitPartial {
            m: f64::NEG_INFINITY,
            l: 0.0,
            o: vec![f64::NAN; 4],
        };
        let real = SplitPartial {
            m: 1.5,
            l: 2.0,
            o: vec![2.0, -4.0, 6.0, 0.0],
        };
        let (out, lse) = combine_partials(&[poisoned.clone(), real, poisoned], 4);
        assert_eq!(out, vec![1.0, -2.0, 3.0, 0.0]);
        assert!((lse - (1.5 + 1.0) * std::f64::consts::LN_2).abs() < 1e-15);
    }

    #[test]
    fn split_partial_uses_base_two_scores() {
        let p = make_problem(8, 1, 2, 1, 64, &[4]);
        let part = split_partial(&p.shape, &p.q, &p.k, &p.v, 0, 0, 1, 2..3);
        let qk: f64 = (0..64)
            .map(|i| f64::from(p.q[64 + i]) * f64::from(p.k[2 * 64 + i]))
            .sum();
        let want_m = qk * p.shape.softmax_scale * std::f64::consts::LOG2_E;
        assert!((part.m - want_m).abs() <= 1e-14 * want_m.abs().max(1.0));
        assert_eq!(part.l, 1.0);
        let v2: Vec<f64> = p.v[2 * 64..3 * 64].iter().map(|&x| f64::from(x)).collect();
        assert_eq!(part.o, v2);
    }

    proptest! {
        #[test]
        fn prop_combine_equals_reference(
            len in 0usize..300,
            cuts in prop::collection::vec(0usize..300, 0..39),
            q_len in 1usize..=3,
            seed in any::<u64>(),
        ) {
            let p = make_problem(seed, q_len, 4, 2, 64, &[len]);
            let reference = decode_reference(&p.shape, &p.q, &p.k, &p.v, &p.seqlens);
            for qi in 0..q_len {
                let n = visible_len(len, q_len, qi);
                for h in 0..4 {
                    let ranges = ranges_from_cuts(n, &cuts);
                    let partials: Vec<SplitPartial> = ranges
                        .iter()
                        .map(|r| split_partial(&p.shape, &p.q, &p.k, &p.v, 0, qi, h, r.clone()))
                        .collect();
                    let (out, lse) = combine_partials(&partials, 64);
                    let row = qi * 4 + h;
                    let err = relative_error(&out, &reference.out[row * 64..(row + 1) * 64]);
                    prop_assert!(err <= TOL, "relative error {}", err);
                    let want = reference.lse[row];
                    if want == f64::NEG_INFINITY {
                        prop_assert_eq!(lse, f64::NEG_INFINITY);
                    } else {
                        prop_assert!((lse - want).abs() <= TOL * want.abs().max(1.0));
                    }
                }
            }
        }
    }

    #[test]
    fn relative_error_edge_cases() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(relative_error(&[], &[]), 0.0);
        assert_eq!(relative_error(&[3.0, 4.0], &[0.0, 0.0]), 5.0);
        assert_eq!(relative_error(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
        assert_eq!(relative_error(&[0.0, 3.0], &[0.0, 4.0]), 0.25);
        assert_eq!(relative_error(&[f64::NAN, 1.0], &[1.0, 1.0]), f64::INFINITY);
        assert_eq!(relative_error(&[1.0, 1.0], &[1.0, f64::NAN]), f64::INFINITY);
        assert_eq!(relative_error(&[f64::NAN], &[0.0]), f64::INFINITY);
        assert_eq!(
            relative_error(&[f64::INFINITY], &[f64::INFINITY]),
            f64::INFINITY
        );
        assert_eq!(relative_error(&[f64::INFINITY], &[1.0]), f64::INFINITY);
    }

    #[test]
    #[should_panic(expected = "different length")]
    fn relative_error_rejects_length_mismatch() {
        relative_error(&[1.0], &[1.0, 2.0]);
    }

    #[test]
    fn splitmix64_matches_published_sequence_and_ranges() {
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(rng.next_u64(), 0x06C4_5D18_8009_454F);

        let mut rng = SplitMix64::new(42);
        for _ in 0..10_000 {
            let u = rng.uniform();
            assert!((0.0..1.0).contains(&u));
            let s = rng.symmetric();
            assert!((-1.0..1.0).contains(&s));
            assert!(rng.below(7) < 7);
        }
        assert_eq!(rng.below(1), 0);
    }

    #[test]
    fn random_tensors_widen_exactly_and_are_not_all_zero() {
        let mut rng = SplitMix64::new(0);
        let (bits, wide) = random_bf16(&mut rng, 1000, 2.0);
        assert!(bits.iter().zip(&wide).all(|(b, &w)| b.to_f32() == w));
        // Rounding to the nearest representable value may land exactly on the bound.
        assert!(wide.iter().all(|x| (-2.0..=2.0).contains(x)));
        assert!(wide.iter().any(|&x| x != 0.0));

        let (bits, wide) = random_f16(&mut rng, 1000, 0.5);
        assert!(bits.iter().zip(&wide).all(|(b, &w)| b.to_f32() == w));
        assert!(wide.iter().all(|x| (-0.5..=0.5).contains(x)));
        assert!(wide.iter().any(|&x| x != 0.0));
    }

    /// Global positions (ascending, below `len`) that `rank` holds.
    fn held(
        sharding: crate::context::Sharding,
        rank: usize,
        world: usize,
        len: usize,
    ) -> Vec<usize> {
        (0..len)
            .filter(|&g| sharding.holds(rank, world, g))
            .collect()
    }

    #[test]
    fn context_parallel_shards_merge_into_the_whole_decode() {
        use crate::context::{RankShare, Sharding, TailShare};
        let mut cases = 0;
        for (seed, q_len, world, sharding, lens) in [
            (1, 1, 2, Sharding::Chunks(24), vec![40, 0, 7, 48]),
            (2, 1, 4, Sharding::Pages(4), vec![33, 1, 0, 16]),
            (3, 3, 3, Sharding::Chunks(11), vec![33, 12, 22, 2, 23]),
            (4, 4, 2, Sharding::Pages(3), vec![30, 13, 14, 15, 3, 0]),
            (5, 4, 3, Sharding::Pages(8), vec![47, 24, 25, 9, 1]),
            (6, 2, 1, Sharding::Chunks(64), vec![19, 2]),
            (7, 8, 4, Sharding::Pages(7), vec![57, 29, 8, 5]),
        ] {
            let p = make_problem(seed, q_len, 8, 2, 64, &lens);
            let s = &p.shape;
            let sinks: Vec<f64> = (0..s.hq).map(|h| h as f64 * 0.3 - 1.0).collect();
            let mods = RefScoreMods {
                softcap: Some(8.0),
                ..Default::default()
            };
            let whole = decode_reference_with(
                s,
                &RefScoreMods {
                    sinks: Some(sinks.clone()),
                    ..mods.clone()
                },
                &p.q,
                &p.k,
                &p.v,
                &p.seqlens,
            );
            let (mut parts, mut lses) = (Vec::new(), Vec::new());
            for rank in 0..world {
                let held: Vec<Vec<usize>> = lens
                    .iter()
                    .map(|&n| held(sharding, rank, world, n))
                    .collect();
                let local_len = held.iter().map(Vec::len).max().unwrap() + 2;
                let local = RefShape {
                    max_len: local_len,
                    ..*s
                };
                let row = s.hkv * s.d;
                let (mut k, mut v) = (
                    vec![f32::NAN; s.batch * local_len * row],
                    vec![f32::NAN; s.batch * local_len * row],
                );
                for (b, positions) in held.iter().enumerate() {
                    for (j, &g) in positions.iter().enumerate() {
                        let (from, to) = ((b * s.max_len + g) * row, (b * local_len + j) * row);
                        k[to..to + row].copy_from_slice(&p.k[from..from + row]);
                        v[to..to + row].copy_from_slice(&p.v[from..from + row]);
                    }
                }
                for (b, positions) in held.iter().enumerate() {
                    if positions.is_empty() {
                        continue;
                    }
                    k[b * local_len * row..][..positions.len() * row]
                        .iter()
                        .for_each(|x| assert!(!x.is_nan()));
                }
                let shares: Vec<RankShare> = lens
                    .iter()
                    .map(|&n| sharding.share(rank, world, n, q_len).unwrap())
                    .collect();
                // one unbounded decode and one per right side that occurs; the other requests'
                // lengths 0, the rows another decode holds masked (LSE -inf)
                let mut rights: Vec<Option<usize>> = vec![None];
                rights.extend(
                    shares
                        .iter()
                        .filter_map(|sh| sh.tail.map(|t| Some(t.right))),
                );
                rights.sort();
                rights.dedup();
                for right in rights {
                    let seqlens: Vec<usize> = shares
                        .iter()
                        .map(|sh| match (right, sh.tail) {
                            (None, _) => sh.all_len,
                            (Some(r), Some(t)) if r == t.right => sh.held,
                            _ => 0,
                        })
                        .collect();
                    let window = Window { left: None, right };
                    let mut part = decode_reference_with(
                        &local,
                        &RefScoreMods {
                            window,
                            ..mods.clone()
                        },
                        &p.q,
                        &k,
                        &v,
                        &seqlens,
                    );
                    for (b, sh) in shares.iter().enumerate() {
                        let Some(TailShare { first_row, .. }) = sh.tail else {
                            continue;
                        };
                        for qi in 0..q_len {
                            if right.is_none() == (qi >= first_row) {
                                let row = (b * q_len + qi) * s.hq;
                                part.lse[row..row + s.hq].fill(f64::NEG_INFINITY);
                            }
                        }
                    }
                    parts.push(part.out);
                    lses.push(part.lse);
                }
            }
            let merged = merge_states(&parts, &lses, s.d, Some(&sinks));
            assert!(
                relative_error(&merged.out, &whole.out) < 1e-12,
                "seed {seed}: {}",
                relative_error(&merged.out, &whole.out)
            );
            for (r, (&a, &b)) in merged.lse.iter().zip(&whole.lse).enumerate() {
                assert!(
                    a == b || (a - b).abs() < 1e-12,
                    "seed {seed} row {r}: {a} vs {b}"
                );
            }
            cases += parts.len();
        }
        assert!(cases > 30, "{cases} partial states");
    }

    #[test]
    fn merge_skips_empty_shards_and_never_gives_nan() {
        let d = 8;
        let good: Vec<f64> = (0..2 * d).map(|i| i as f64 * 0.25 - 1.0).collect();
        let junk = vec![f64::NAN; 2 * d];
        let merged = merge_states(
            &[junk.clone(), good.clone(), junk],
            &[
                vec![f64::NEG_INFINITY, f64::NEG_INFINITY],
                vec![0.5, f64::NEG_INFINITY],
                vec![f64::NEG_INFINITY, f64::NEG_INFINITY],
            ],
            d,
            None,
        );
        assert_eq!(&merged.out[..d], &good[..d]);
        assert_eq!(merged.lse[0], 0.5);
        assert!(merged.out[d..].iter().all(|&x| x == 0.0));
        assert_eq!(merged.lse[1], f64::NEG_INFINITY);
        // a sink alone: zeros and the sink's logit
        let sunk = merge_states(&[good], &[vec![f64::NEG_INFINITY; 2]], d, Some(&[1.5]));
        assert!(sunk.out.iter().all(|&x| x == 0.0));
        assert_eq!(sunk.lse, vec![1.5, 1.5]);
    }
}
