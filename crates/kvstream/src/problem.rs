//! What the caller asks for: shapes, dtype, layout and options of one decode, validated.
//!
//! A [`DecodeProblem`] holds no device memory; it is checked once when built, so the layers below
//! (plan, launch) can assume a well-formed problem.

use crate::error::{Error, Result};

/// Element type of Q, K, V and the output (they always share it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// bfloat16
    Bf16,
    /// IEEE half
    F16,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        2
    }

    /// Short lowercase name (`"bf16"`, `"f16"`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        }
    }
}

impl std::str::FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            other => Err(Error::invalid("dtype", other, "bf16 or f16")),
        }
    }
}

/// Element type of the K and V caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvDType {
    /// The query's dtype (bf16 or f16).
    #[default]
    AsQuery,
    /// float8 e4m3 (`torch.float8_e4m3fn`: no infinities, largest 448) with FP32
    /// dequantisation scales ([`crate::KvScale`]): position t's K is `k_scale * k[t]`.
    Fp8E4m3,
}

impl KvDType {
    /// Short lowercase name (`"as_query"`, `"fp8_e4m3"`).
    pub const fn name(self) -> &'static str {
        match self {
            KvDType::AsQuery => "as_query",
            KvDType::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// Bytes per cache element when the query is `dtype`.
    pub const fn size(self, dtype: DType) -> usize {
        match self {
            KvDType::AsQuery => dtype.size(),
            KvDType::Fp8E4m3 => 1,
        }
    }
}

impl std::str::FromStr for KvDType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" | "as_query" | "bf16" | "f16" | "fp16" => Ok(KvDType::AsQuery),
            "fp8" | "fp8_e4m3" | "e4m3" | "float8_e4m3fn" => Ok(KvDType::Fp8E4m3),
            other => Err(Error::invalid(
                "kv_dtype",
                other,
                "fp8_e4m3 or the query's dtype (e5m2 caches are not supported)",
            )),
        }
    }
}

/// How the dequantisation scales of an fp8 cache are laid out: FP32, on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvScaleLayout {
    /// One scale for the whole cache (vLLM's `k_scale` / `v_scale`).
    PerTensor,
    /// One per KV head, `[hkv]`.
    PerKvHead,
    /// One per request and KV head, `[batch, hkv]` (FA3's `descale_k` / `descale_v`).
    PerRequestHead,
}

impl KvScaleLayout {
    /// Scales the layout holds for `batch` requests of `hkv` KV heads.
    pub fn len(self, batch: usize, hkv: usize) -> usize {
        match self {
            KvScaleLayout::PerTensor => 1,
            KvScaleLayout::PerKvHead => hkv,
            KvScaleLayout::PerRequestHead => batch * hkv,
        }
    }

    /// (request, KV head) strides of the scale index.
    pub fn strides(self, hkv: usize) -> (usize, usize) {
        match self {
            KvScaleLayout::PerTensor => (0, 0),
            KvScaleLayout::PerKvHead => (0, 1),
            KvScaleLayout::PerRequestHead => (hkv, 1),
        }
    }

    /// The layout of a scale tensor of `len` elements, if it is one.
    pub fn from_len(len: usize, batch: usize, hkv: usize) -> Option<Self> {
        [Self::PerTensor, Self::PerKvHead, Self::PerRequestHead]
            .into_iter()
            .find(|l| l.len(batch, hkv) == len)
    }

    /// [`Self::from_len`] for argument `arg`, or the error that says which lengths are allowed.
    pub fn of_tensor(arg: &'static str, len: usize, batch: usize, hkv: usize) -> Result<Self> {
        Self::from_len(len, batch, hkv).ok_or_else(|| {
            Error::invalid(
                arg,
                format!("{len} elements"),
                format!(
                    "1 (per tensor), hkv = {hkv} (per KV head) or batch x hkv = {} (per request \
                     and KV head)",
                    batch * hkv
                ),
            )
        })
    }
}

/// Head dimensions the kernels are built for (K and V of the same head dim).
pub const SUPPORTED_HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];
/// Head dimensions the split engine is built for (the persistent engine takes every one of
/// [`SUPPORTED_HEAD_DIMS`]).
pub const SPLIT_ENGINE_HEAD_DIMS: [usize; 2] = [64, 128];
/// Largest query-head group (hq / hkv) one CTA handles: four n8 MMA tiles.
pub const MAX_GROUP: usize = 32;
/// Most new tokens per request (speculative-decoding verification, multi-token prediction).
pub const MAX_Q_LEN: usize = 8;
/// Page sizes of a paged KV cache.
pub const SUPPORTED_PAGE_SIZES: [usize; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

/// A paged KV cache: K and V are pools `[num_pages, page_size, hkv, d]` (contiguous) and request
/// b's position t lives in page `block_table[b][t / page_size]`, row `t % page_size`. Pages of a
/// request may sit anywhere in the pool, in any order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedKv {
    /// Positions per page: one of [`SUPPORTED_PAGE_SIZES`].
    pub page_size: usize,
    /// Pages in each pool.
    pub num_pages: usize,
    /// Entries per block-table row (int32 `[batch, table_stride]`); at least
    /// `ceil(max_len / page_size)`.
    pub table_stride: usize,
}

impl PagedKv {
    /// Checks the page size, the pool and the block-table stride for caches of `max_len`
    /// positions per request.
    pub fn validate(&self, max_len: usize) -> Result<()> {
        if !SUPPORTED_PAGE_SIZES.contains(&self.page_size) {
            return Err(Error::invalid(
                "page_size",
                self.page_size,
                format!("{SUPPORTED_PAGE_SIZES:?}"),
            ));
        }
        if self.num_pages == 0 || self.num_pages > i32::MAX as usize {
            return Err(Error::invalid("num_pages", self.num_pages, "1..=2^31-1"));
        }
        let needed = max_len.div_ceil(self.page_size);
        if self.table_stride < needed || self.table_stride > i32::MAX as usize {
            return Err(Error::invalid(
                "block_table stride",
                self.table_stride,
                format!("at least ceil(max_len / page_size) = {needed} entries per request"),
            ));
        }
        Ok(())
    }
}

/// Element strides of one KV cache tensor `[batch, max_len, hkv, d]`; the head dim is contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvStrides {
    /// Between consecutive requests.
    pub batch: i64,
    /// Between consecutive positions of one request.
    pub token: i64,
    /// Between consecutive KV heads.
    pub head: i64,
}

impl KvStrides {
    /// Strides of a contiguous `[batch, max_len, hkv, d]` tensor (the FA3 / vLLM layout).
    pub fn contiguous(max_len: usize, hkv: usize, d: usize) -> Self {
        KvStrides {
            batch: (max_len * hkv * d) as i64,
            token: (hkv * d) as i64,
            head: d as i64,
        }
    }
}

/// Which cache positions a query sees: FlashAttention's `window_size = (left, right)`. The query
/// at cache position t (new token i of a request of `len` positions sits at t = len - q_len + i)
/// sees positions `[t - left, t + right]` clipped to `[0, len)`; `None` is unbounded on that
/// side. The default, `left: None, right: Some(0)`, is causal attention over the whole cache.
///
/// ```
/// use kvstream::Window;
/// let w = Window::from_window_size(128, 0)?; // the last 128 positions and the query's own
/// assert_eq!(w, Window { left: Some(128), right: Some(0) });
/// assert_eq!(Window::from_window_size(-1, -1)?.right, None); // new tokens see each other
/// assert!(Window::from_window_size(-2, 0).is_err());
/// # Ok::<(), kvstream::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Window {
    /// Positions before the query's own it also sees (`None`: all of them).
    pub left: Option<usize>,
    /// Positions after the query's own it also sees, among the new tokens (`None`: all).
    pub right: Option<usize>,
}

impl Default for Window {
    fn default() -> Self {
        Window::CAUSAL
    }
}

impl Window {
    /// Every earlier position and the query's own.
    pub const CAUSAL: Window = Window {
        left: None,
        right: Some(0),
    };

    /// From FlashAttention's integers: `-1` is unbounded, other values are positions (at most
    /// 2^31 - 2).
    pub fn from_window_size(left: i64, right: i64) -> Result<Self> {
        let side = |arg: &'static str, v: i64| -> Result<Option<usize>> {
            match v {
                -1 => Ok(None),
                0..=0x7fff_fffe => Ok(Some(v as usize)),
                _ => Err(Error::invalid(
                    arg,
                    v,
                    "-1 (unbounded) or a number of positions 0..=2^31-2",
                )),
            }
        };
        Ok(Window {
            left: side("window_size[0] (left)", left)?,
            right: side("window_size[1] (right)", right)?,
        })
    }

    /// FlashAttention's integers (`-1`: unbounded).
    pub fn to_window_size(self) -> (i64, i64) {
        let int = |v: Option<usize>| v.map_or(-1, |v| v as i64);
        (int(self.left), int(self.right))
    }
}

/// One decode call: a single new query token per request attending to a cached K/V.
///
/// ```
/// use kvstream::{DecodeProblem, DType};
/// // 16 query heads sharing 2 KV heads, head dim 128, caches of up to 4096 tokens
/// let p = DecodeProblem::new(1, 16, 2, 128, 4096, DType::Bf16).unwrap();
/// assert_eq!(p.group(), 8);
/// assert!(DecodeProblem::new(1, 12, 5, 128, 4096, DType::Bf16).is_err()); // 12 % 5 != 0
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeProblem {
    /// Requests in the batch.
    pub batch: usize,
    /// Query heads.
    pub hq: usize,
    /// KV heads (hq is a multiple).
    pub hkv: usize,
    /// Head dimension (64 or 128).
    pub head_dim: usize,
    /// Cache capacity per request (L); per-request lengths, when given, are at most this.
    pub max_len: usize,
    /// Element type of q and out (and of K and V unless `kv_dtype` says otherwise).
    pub dtype: DType,
    /// Element type of the K and V caches.
    pub kv_dtype: KvDType,
    /// Softmax scale; `None` means 1/sqrt(head_dim).
    pub softmax_scale: Option<f32>,
    /// Strides of the K cache.
    pub k_strides: KvStrides,
    /// Strides of the V cache (contiguous caches only).
    pub v_strides: KvStrides,
    /// New tokens per request (1..=[`MAX_Q_LEN`]); token i of request b sees cache positions
    /// `[0, len_b - q_len + i]`. Q and out are `[batch, q_len, hq, d]`, LSE `[batch, q_len, hq]`.
    pub q_len: usize,
    /// A paged cache instead of contiguous `[batch, max_len, hkv, d]` tensors.
    pub paged: Option<PagedKv>,
    /// The positions each query sees ([`Window::CAUSAL`] unless a sliding window is set).
    pub window: Window,
    /// Logit softcap c (Gemma 2): scaled scores s become `c * tanh(s / c)` before the softmax.
    pub softcap: Option<f32>,
    /// Attention sinks (gpt-oss): an f32 logit per query head (`[hq]`, on the scaled scores'
    /// scale) joins each row's softmax denominator and adds no value; the LSE includes it. The
    /// tensor is given at every call ([`crate::DecodeTensors::sinks`]).
    pub sinks: bool,
}

impl DecodeProblem {
    /// A problem with contiguous `[batch, max_len, hkv, d]` caches and the default scale.
    pub fn new(
        batch: usize,
        hq: usize,
        hkv: usize,
        head_dim: usize,
        max_len: usize,
        dtype: DType,
    ) -> Result<Self> {
        let strides = KvStrides::contiguous(max_len, hkv.max(1), head_dim);
        let p = DecodeProblem {
            batch,
            hq,
            hkv,
            head_dim,
            max_len,
            dtype,
            kv_dtype: KvDType::AsQuery,
            softmax_scale: None,
            k_strides: strides,
            v_strides: strides,
            q_len: 1,
            paged: None,
            window: Window::CAUSAL,
            softcap: None,
            sinks: false,
        };
        p.validate()?;
        Ok(p)
    }

    /// Same problem with a sliding window ([`Window`]).
    ///
    /// ```
    /// use kvstream::{DecodeProblem, DType, Window};
    /// // Mistral-style: each query sees its own position and the 4095 before it
    /// let p = DecodeProblem::new(8, 32, 8, 128, 32_768, DType::Bf16)?
    ///     .with_window(Window { left: Some(4095), right: Some(0) })?;
    /// assert!(p.has_score_mods());
    /// # Ok::<(), kvstream::Error>(())
    /// ```
    pub fn with_window(mut self, window: Window) -> Result<Self> {
        self.window = window;
        self.validate()?;
        Ok(self)
    }

    /// Same problem with a logit softcap (`None` or 0: off).
    pub fn with_softcap(mut self, softcap: Option<f32>) -> Result<Self> {
        self.softcap = softcap.filter(|&c| c != 0.0);
        self.validate()?;
        Ok(self)
    }

    /// Same problem with attention sinks given at every call (one f32 logit per query head).
    pub fn with_sinks(mut self, sinks: bool) -> Result<Self> {
        self.sinks = sinks;
        self.validate()?;
        Ok(self)
    }

    /// Whether a window other than [`Window::CAUSAL`], a softcap or sinks are set (features of
    /// the persistent engine only).
    pub fn has_score_mods(&self) -> bool {
        self.window != Window::CAUSAL || self.softcap.is_some() || self.sinks
    }

    /// Same problem with caches of another element type.
    ///
    /// ```
    /// use kvstream::{DecodeProblem, DType, KvDType};
    /// let p = DecodeProblem::new(8, 32, 8, 128, 32_768, DType::Bf16)?.with_kv_dtype(KvDType::Fp8E4m3)?;
    /// assert_eq!(p.kv_elem_bytes(), 1);
    /// # Ok::<(), kvstream::Error>(())
    /// ```
    pub fn with_kv_dtype(mut self, kv_dtype: KvDType) -> Result<Self> {
        self.kv_dtype = kv_dtype;
        self.validate()?;
        Ok(self)
    }

    /// Bytes per K or V element.
    pub fn kv_elem_bytes(&self) -> usize {
        self.kv_dtype.size(self.dtype)
    }

    /// `Ok` unless a scale tensor `arg` is given for caches that take none (2-byte ones).
    pub fn check_scale_given(&self, arg: &'static str, given: bool) -> Result<()> {
        if given && self.kv_dtype == KvDType::AsQuery {
            return Err(Error::invalid(
                arg,
                "a scale tensor",
                format!(
                    "none: the caches are {} (scales belong to fp8 caches)",
                    self.dtype.name()
                ),
            ));
        }
        Ok(())
    }

    /// Same problem with an explicit softmax scale.
    pub fn with_softmax_scale(mut self, scale: f32) -> Result<Self> {
        self.softmax_scale = Some(scale);
        self.validate()?;
        Ok(self)
    }

    /// Same problem with other cache strides (e.g. a cache allocated for more requests).
    pub fn with_kv_strides(mut self, k: KvStrides, v: KvStrides) -> Result<Self> {
        self.k_strides = k;
        self.v_strides = v;
        self.validate()?;
        Ok(self)
    }

    /// Same problem with `q_len` new tokens per request (multi-token decode).
    ///
    /// ```
    /// use kvstream::{DecodeProblem, DType};
    /// let p = DecodeProblem::new(8, 32, 8, 128, 32_768, DType::Bf16)?.with_q_len(4)?;
    /// assert_eq!(p.columns(), 16); // 4 tokens x 4 query heads per KV head
    /// # Ok::<(), kvstream::Error>(())
    /// ```
    pub fn with_q_len(mut self, q_len: usize) -> Result<Self> {
        self.q_len = q_len;
        self.validate()?;
        Ok(self)
    }

    /// Same problem on a paged cache: pools of `num_pages` pages of `page_size` positions, block
    /// tables with `table_stride` entries per request (`None`: `ceil(max_len / page_size)`).
    ///
    /// ```
    /// use kvstream::{DecodeProblem, DType};
    /// let p = DecodeProblem::new(4, 16, 2, 128, 4096, DType::Bf16)?.with_paged(16, 1024, None)?;
    /// assert_eq!(p.paged.unwrap().table_stride, 256);
    /// # Ok::<(), kvstream::Error>(())
    /// ```
    pub fn with_paged(
        mut self,
        page_size: usize,
        num_pages: usize,
        table_stride: Option<usize>,
    ) -> Result<Self> {
        let table_stride = table_stride.unwrap_or_else(|| self.max_len.div_ceil(page_size.max(1)));
        self.paged = Some(PagedKv {
            page_size,
            num_pages,
            table_stride,
        });
        self.validate()?;
        Ok(self)
    }

    /// Query rows per KV head: `q_len * group`; they sit on the MMA N dimension.
    pub fn columns(&self) -> usize {
        self.q_len * self.group()
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.hq / self.hkv
    }

    /// The softmax scale actually used.
    pub fn scale(&self) -> f32 {
        self.softmax_scale
            .unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// Cache positions a request of `len` positions must read: the last `left + q_len` with a
    /// sliding window of `left` (its first new token's window and the new tokens), else all.
    ///
    /// ```
    /// use kvstream::{DecodeProblem, DType, Window};
    /// let p = DecodeProblem::new(1, 64, 8, 64, 32_768, DType::Bf16)?
    ///     .with_window(Window { left: Some(128), right: Some(0) })?;
    /// assert_eq!(p.read_positions(32_768), 129);
    /// assert_eq!(p.read_positions(100), 100);
    /// # Ok::<(), kvstream::Error>(())
    /// ```
    pub fn read_positions(&self, len: usize) -> usize {
        match self.window.left {
            Some(left) => len.min(left + self.q_len),
            None => len,
        }
    }

    /// Bytes one call must move at least when every request has `len` tokens: Q, K, V and out,
    /// each once. The denominator of every GB/s figure kvstream prints.
    pub fn io_bytes(&self, total_tokens: usize) -> usize {
        let e = self.dtype.size();
        let qo = 2 * self.batch * self.q_len * self.hq * self.head_dim * e;
        qo + 2 * total_tokens * self.hkv * self.head_dim * self.kv_elem_bytes()
    }

    /// Checks every field; called by the constructors.
    pub fn validate(&self) -> Result<()> {
        if self.batch == 0 || self.batch > 65_535 {
            return Err(Error::invalid("batch", self.batch, "1..=65535"));
        }
        if self.hkv == 0 || self.hkv > 65_535 {
            return Err(Error::invalid("hkv", self.hkv, "1..=65535"));
        }
        if self.hq == 0 || self.hq % self.hkv != 0 {
            return Err(Error::invalid(
                "hq",
                format!("{} with hkv = {}", self.hq, self.hkv),
                "a positive multiple of hkv",
            ));
        }
        if self.group() > MAX_GROUP {
            return Err(Error::invalid(
                "hq / hkv",
                self.group(),
                format!("1..={MAX_GROUP} query heads per KV head"),
            ));
        }
        if !SUPPORTED_HEAD_DIMS.contains(&self.head_dim) {
            return Err(Error::invalid(
                "head_dim",
                self.head_dim,
                format!("{SUPPORTED_HEAD_DIMS:?}"),
            ));
        }
        if self.max_len == 0 || self.max_len > i32::MAX as usize {
            return Err(Error::invalid("max_len", self.max_len, "1..=2^31-1"));
        }
        if !(1..=MAX_Q_LEN).contains(&self.q_len) {
            return Err(Error::invalid(
                "q_len",
                self.q_len,
                format!("1..={MAX_Q_LEN}"),
            ));
        }
        if let Some(pg) = self.paged {
            pg.validate(self.max_len)?;
        }
        if let Some(c) = self.softcap {
            if !c.is_finite() || c <= 0.0 {
                return Err(Error::invalid(
                    "softcap",
                    c,
                    "a finite positive number, or 0 / None (off)",
                ));
            }
        }
        for (arg, side) in [
            ("window_size[0] (left)", self.window.left),
            ("window_size[1] (right)", self.window.right),
        ] {
            if side.is_some_and(|v| v > 0x7fff_fffe) {
                return Err(Error::invalid(
                    arg,
                    side.unwrap_or(0),
                    "-1 (unbounded) or a number of positions 0..=2^31-2",
                ));
            }
        }
        if let Some(s) = self.softmax_scale {
            if !s.is_finite() || s <= 0.0 {
                return Err(Error::invalid(
                    "softmax_scale",
                    s,
                    "a finite positive number",
                ));
            }
        }
        // Rows are moved by bulk copies: 16-byte aligned starts.
        let align = 16 / self.kv_elem_bytes() as i64;
        for (arg, st) in [("k strides", self.k_strides), ("v strides", self.v_strides)] {
            let ok = [st.batch, st.token, st.head]
                .iter()
                .all(|&x| x > 0 && x % align == 0);
            if !ok {
                return Err(Error::invalid(
                    arg,
                    format!("{st:?}"),
                    format!("positive multiples of {align} elements (16 bytes)"),
                ));
            }
        }
        Ok(())
    }

    /// Checks per-request lengths known on the host against the problem.
    pub fn validate_seqlens(&self, seqlens: &[i32]) -> Result<()> {
        if seqlens.len() != self.batch {
            return Err(Error::invalid(
                "cache_seqlens",
                format!("{} entries", seqlens.len()),
                format!("one per request ({})", self.batch),
            ));
        }
        if let Some((b, &len)) = seqlens
            .iter()
            .enumerate()
            .find(|(_, &l)| l < 0 || l as usize > self.max_len)
        {
            return Err(Error::invalid(
                "cache_seqlens",
                format!("{len} at request {b}"),
                format!("0..={} (the cache capacity)", self.max_len),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arg_of(e: Error) -> &'static str {
        match e {
            Error::InvalidArgument { arg, .. } => arg,
            other => panic!("expected InvalidArgument, got {other}"),
        }
    }

    #[test]
    fn accepts_every_supported_group() {
        for g in 1..=MAX_GROUP {
            for d in SUPPORTED_HEAD_DIMS {
                for dt in [DType::Bf16, DType::F16] {
                    let p = DecodeProblem::new(3, 2 * g, 2, d, 100, dt).unwrap();
                    assert_eq!(p.group(), g);
                }
            }
        }
    }

    #[test]
    fn rejects_each_bad_field_by_name() {
        let e = |r: Result<DecodeProblem>| arg_of(r.unwrap_err());
        assert_eq!(
            e(DecodeProblem::new(0, 16, 2, 128, 64, DType::Bf16)),
            "batch"
        );
        assert_eq!(e(DecodeProblem::new(1, 16, 0, 128, 64, DType::Bf16)), "hkv");
        assert_eq!(e(DecodeProblem::new(1, 12, 5, 128, 64, DType::Bf16)), "hq");
        assert_eq!(
            e(DecodeProblem::new(1, 66, 2, 128, 64, DType::Bf16)),
            "hq / hkv"
        );
        assert_eq!(
            e(DecodeProblem::new(1, 16, 2, 80, 64, DType::Bf16)),
            "head_dim"
        );
        assert_eq!(
            e(DecodeProblem::new(1, 16, 2, 128, 0, DType::Bf16)),
            "max_len"
        );
        let p = DecodeProblem::new(1, 16, 2, 128, 64, DType::Bf16).unwrap();
        assert_eq!(e(p.clone().with_softmax_scale(f32::NAN)), "softmax_scale");
        assert_eq!(e(p.clone().with_softmax_scale(-1.0)), "softmax_scale");
        let odd = KvStrides {
            batch: 8,
            token: 12,
            head: 8,
        };
        assert_eq!(e(p.clone().with_kv_strides(odd, odd)), "k strides");
        let good = KvStrides::contiguous(64, 2, 128);
        assert_eq!(e(p.clone().with_kv_strides(good, odd)), "v strides");
        assert_eq!(arg_of("fp8".parse::<DType>().unwrap_err()), "dtype");
    }

    #[test]
    fn fp8_caches_parse_validate_and_lay_out_their_scales() {
        for name in ["fp8", "fp8_e4m3", "float8_e4m3fn"] {
            assert_eq!(name.parse::<KvDType>().unwrap(), KvDType::Fp8E4m3);
        }
        assert_eq!("auto".parse::<KvDType>().unwrap(), KvDType::AsQuery);
        let msg = "fp8_e5m2".parse::<KvDType>().unwrap_err().to_string();
        assert!(msg.contains("kv_dtype") && msg.contains("e5m2"), "{msg}");
        let p = DecodeProblem::new(4, 32, 8, 128, 1024, DType::Bf16)
            .unwrap()
            .with_kv_dtype(KvDType::Fp8E4m3)
            .unwrap();
        assert_eq!(p.kv_elem_bytes(), 1);
        // Q and out stay bf16, K and V one byte
        assert_eq!(p.io_bytes(1024), 2 * 4 * 32 * 128 * 2 + 2 * 1024 * 8 * 128);
        // fp8 strides must be 16 bytes: 8 elements are not
        let s8 = KvStrides {
            batch: 1024 * 8 * 136,
            token: 8 * 136,
            head: 136,
        };
        assert_eq!(
            arg_of(p.clone().with_kv_strides(s8, s8).unwrap_err()),
            "k strides"
        );
        let bf16 = DecodeProblem::new(4, 32, 8, 128, 1024, DType::Bf16).unwrap();
        assert!(bf16.with_kv_strides(s8, s8).is_ok());
        use KvScaleLayout::*;
        assert_eq!(KvScaleLayout::from_len(1, 4, 8), Some(PerTensor));
        assert_eq!(KvScaleLayout::from_len(8, 4, 8), Some(PerKvHead));
        assert_eq!(KvScaleLayout::from_len(32, 4, 8), Some(PerRequestHead));
        assert_eq!(KvScaleLayout::from_len(5, 4, 8), None);
        assert_eq!(PerRequestHead.strides(8), (8, 1));
        assert_eq!(PerKvHead.strides(8), (0, 1));
        assert_eq!(PerTensor.strides(8), (0, 0));
    }

    #[test]
    fn seqlens_are_checked_against_capacity() {
        let p = DecodeProblem::new(2, 16, 2, 128, 64, DType::F16).unwrap();
        assert!(p.validate_seqlens(&[0, 64]).is_ok());
        let msg = p.validate_seqlens(&[3, 65]).unwrap_err().to_string();
        assert!(
            msg.contains("65 at request 1") && msg.contains("0..=64"),
            "{msg}"
        );
        assert!(p.validate_seqlens(&[-1, 3]).is_err());
        assert!(p.validate_seqlens(&[1]).is_err());
    }

    #[test]
    fn error_message_names_argument_value_and_allowed() {
        let msg = DecodeProblem::new(1, 16, 2, 80, 64, DType::Bf16)
            .unwrap_err()
            .to_string();
        assert_eq!(msg, "invalid head_dim: got 80, allowed: [64, 96, 128, 256]");
    }

    #[test]
    fn score_mods_validate_and_name_their_argument() {
        let p = DecodeProblem::new(2, 64, 8, 64, 4096, DType::Bf16).unwrap();
        assert!(!p.has_score_mods());
        assert_eq!(
            arg_of(p.clone().with_softcap(Some(-1.0)).unwrap_err()),
            "softcap"
        );
        assert_eq!(
            arg_of(p.clone().with_softcap(Some(f32::INFINITY)).unwrap_err()),
            "softcap"
        );
        assert_eq!(p.clone().with_softcap(Some(0.0)).unwrap().softcap, None);
        assert!(p.clone().with_softcap(Some(50.0)).unwrap().has_score_mods());
        assert!(p.clone().with_sinks(true).unwrap().has_score_mods());
        let w = Window::from_window_size(128, 0).unwrap();
        assert!(p.clone().with_window(w).unwrap().has_score_mods());
        assert_eq!(w.to_window_size(), (128, 0));
        assert_eq!(Window::from_window_size(-1, 0).unwrap(), Window::CAUSAL);
        let msg = Window::from_window_size(0, -3).unwrap_err().to_string();
        assert!(
            msg.contains("window_size[1] (right)") && msg.contains("-3"),
            "{msg}"
        );
        assert_eq!(
            arg_of(Window::from_window_size(-5, 0).unwrap_err()),
            "window_size[0] (left)"
        );
    }
}
