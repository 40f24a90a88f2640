//! Python binding of kvstream: the native module `kvstream._native`.
//!
//! This layer takes only plain Python values (ints, floats, strings): shapes, a dtype name,
//! device pointers as integers and a raw `CUstream` as an integer. The user API on PyTorch
//! tensors, with its validation, lives in the pure-Python package `kvstream` next to it.
//!
//! Every problem is validated before the GPU is opened, so invalid shapes raise `ValueError`
//! on any machine; `kvstream::Error::InvalidArgument` maps to `ValueError`, every other error to
//! `RuntimeError`, each with the library's message. Nothing here panics across the FFI boundary:
//! the one call that may panic on a broken CUDA installation (opening the runtime) is caught.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use kvstream::plan::{choose, Engine, Reduction};
use kvstream::{
    DType, DecodeProblem, DecodeTensors, DeviceFacts, Error, KvDType, KvScale, KvScaleLayout,
    KvStrides, PlanOptions, Runtime, Window,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// kvstream's error as the Python exception the binding documents.
fn to_py(e: Error) -> PyErr {
    match e {
        Error::InvalidArgument { .. } => PyValueError::new_err(e.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

/// A size argument: a non-negative Python int (negative values name the field).
fn size(arg: &'static str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| to_py(Error::invalid(arg, v, "a non-negative integer")))
}

/// Cache strides from an optional `(batch, token, head)` tuple of element strides.
fn strides(
    arg: &'static str,
    given: Option<(i64, i64, i64)>,
    default: KvStrides,
) -> PyResult<KvStrides> {
    match given {
        None => Ok(default),
        Some((batch, token, head)) if batch > 0 && token > 0 && head > 0 => {
            Ok(KvStrides { batch, token, head })
        }
        Some(s) => Err(to_py(Error::invalid(
            arg,
            format!("{s:?}"),
            "positive element strides (batch, token, head)",
        ))),
    }
}

/// One runtime per device, opened on first use and kept for the life of the process (it holds
/// the loaded kernels, shared by every decoder of that device).
fn runtime(device: usize) -> PyResult<Arc<Runtime>> {
    static RUNTIMES: OnceLock<Mutex<HashMap<usize, Arc<Runtime>>>> = OnceLock::new();
    let map = RUNTIMES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(rt) = map.get(&device) {
        return Ok(rt.clone());
    }
    let rt = catch_unwind(|| Runtime::new(device))
        .map_err(|_| {
            PyRuntimeError::new_err(format!(
                "kvstream: opening GPU {device} failed inside the CUDA driver bindings \
                 (is the NVIDIA driver installed and working?)"
            ))
        })?
        .map_err(to_py)?;
    map.insert(device, rt.clone());
    Ok(rt)
}

/// The paging of a problem from the Python arguments: all three absent (contiguous caches), or
/// `page_size` and `num_pages` given (`table_stride` optional: `ceil(max_len / page_size)`).
fn paging(
    page_size: Option<i64>,
    num_pages: Option<i64>,
    table_stride: Option<i64>,
) -> PyResult<Option<(usize, usize, Option<usize>)>> {
    match (page_size, num_pages) {
        (None, None) if table_stride.is_none() => Ok(None),
        (Some(ps), Some(np)) => Ok(Some((
            size("page_size", ps)?,
            size("num_pages", np)?,
            table_stride
                .map(|t| size("block_table stride", t))
                .transpose()?,
        ))),
        (None, _) => Err(to_py(Error::invalid(
            "page_size",
            "None",
            "a page size whenever num_pages or table_stride is given (a paged cache)",
        ))),
        (Some(_), None) => Err(to_py(Error::invalid(
            "num_pages",
            "None",
            "the pages in each pool whenever page_size is given (a paged cache)",
        ))),
    }
}

#[allow(clippy::too_many_arguments)]
fn build_problem(
    batch: i64,
    hq: i64,
    hkv: i64,
    head_dim: i64,
    max_len: i64,
    dtype: &str,
    softmax_scale: Option<f64>,
    k_strides: Option<(i64, i64, i64)>,
    v_strides: Option<(i64, i64, i64)>,
    q_len: i64,
    page_size: Option<i64>,
    num_pages: Option<i64>,
    table_stride: Option<i64>,
    kv_dtype: Option<&str>,
    mods: ScoreMods,
) -> PyResult<DecodeProblem> {
    let dtype: DType = dtype.parse().map_err(to_py)?;
    let kv_dtype: KvDType = kv_dtype.unwrap_or("auto").parse().map_err(to_py)?;
    let mut p = DecodeProblem::new(
        size("batch", batch)?,
        size("hq", hq)?,
        size("hkv", hkv)?,
        size("head_dim", head_dim)?,
        size("max_len", max_len)?,
        dtype,
    )
    .map_err(to_py)?;
    if kv_dtype != KvDType::AsQuery {
        p = p.with_kv_dtype(kv_dtype).map_err(to_py)?;
    }
    if let Some(s) = softmax_scale {
        p = p.with_softmax_scale(s as f32).map_err(to_py)?;
    }
    let q_len = size("q_len", q_len)?;
    if q_len != 1 {
        p = p.with_q_len(q_len).map_err(to_py)?;
    }
    let paged = paging(page_size, num_pages, table_stride)?;
    if k_strides.is_some() || v_strides.is_some() {
        if paged.is_some() {
            let arg = if k_strides.is_some() {
                "k strides"
            } else {
                "v strides"
            };
            let given = k_strides.or(v_strides).unwrap_or_default();
            return Err(to_py(Error::invalid(
                arg,
                format!("{given:?}"),
                "None with a paged cache (the page pools are contiguous)",
            )));
        }
        let c = p.k_strides;
        let k = strides("k strides", k_strides, c)?;
        let v = strides("v strides", v_strides, c)?;
        p = p.with_kv_strides(k, v).map_err(to_py)?;
    }
    if let Some((page_size, num_pages, table_stride)) = paged {
        p = p
            .with_paged(page_size, num_pages, table_stride)
            .map_err(to_py)?;
    }
    let (left, right) = mods.window_size;
    p = p
        .with_window(Window::from_window_size(left, right).map_err(to_py)?)
        .and_then(|p| p.with_softcap(Some(mods.softcap as f32)))
        .and_then(|p| p.with_sinks(mods.sinks))
        .map_err(to_py)?;
    Ok(p)
}

/// The score modifiers of a decode problem as Python passes them: FlashAttention's
/// `window_size` (-1: unbounded), `softcap` (0: off), whether sinks are given at each call.
#[derive(Clone, Copy)]
struct ScoreMods {
    window_size: (i64, i64),
    softcap: f64,
    sinks: bool,
}

impl ScoreMods {
    /// Causal attention over the whole cache, no softcap, no sinks.
    const NONE: ScoreMods = ScoreMods {
        window_size: (-1, 0),
        softcap: 0.0,
        sinks: false,
    };
}

/// Plan options from the Python arguments: a split count and a reduction mode name
/// (`"kernel"` or `"cluster"`); `None` leaves each to the planner. `device_plan` plans the split
/// partition on the device at every call (the planner then rejects a forced split count and
/// cluster reduction).
fn options(
    num_splits: Option<i64>,
    reduction: Option<&str>,
    device_plan: bool,
    engine: Option<&str>,
) -> PyResult<PlanOptions> {
    Ok(PlanOptions {
        num_splits: num_splits.map(|n| size("num_splits", n)).transpose()?,
        reduction: reduction
            .map(str::parse::<Reduction>)
            .transpose()
            .map_err(to_py)?,
        device_plan,
        engine: engine
            .map(str::parse::<Engine>)
            .transpose()
            .map_err(to_py)?,
        ..Default::default()
    })
}

/// Checks a problem without opening a GPU (planned for an H200) and returns its plan as a
/// string. Raises ValueError naming the field that is out of range. `reduction` forces the
/// split reduction mode (`"kernel"` or `"cluster"`); `None` lets the planner choose. `q_len`
/// new tokens per request (1..=8); `page_size` and `num_pages` (and optionally `table_stride`)
/// describe a paged cache; `device_plan` plans the split partition on the device at each call;
/// `engine` forces `"persistent"` or `"split"` (`None`: chosen by the plan); `kv_dtype`
/// `"fp8_e4m3"` for float8 e4m3 caches (`None`: the query's dtype). Score modifiers:
/// `window_size = (left, right)` as in FlashAttention (-1: unbounded; the default `(-1, 0)` is
/// causal over the whole cache), `softcap` (0: off), `sinks` (the decoder takes `[hq]` f32 sink
/// logits at every call).
#[pyfunction]
#[pyo3(signature = (batch, hq, hkv, head_dim, max_len, dtype, softmax_scale=None, num_splits=None, reduction=None, k_strides=None, v_strides=None, q_len=1, page_size=None, num_pages=None, table_stride=None, device_plan=false, engine=None, kv_dtype=None, window_size=(-1, 0), softcap=0.0, sinks=false))]
#[allow(clippy::too_many_arguments)]
fn validate(
    batch: i64,
    hq: i64,
    hkv: i64,
    head_dim: i64,
    max_len: i64,
    dtype: &str,
    softmax_scale: Option<f64>,
    num_splits: Option<i64>,
    reduction: Option<&str>,
    k_strides: Option<(i64, i64, i64)>,
    v_strides: Option<(i64, i64, i64)>,
    q_len: i64,
    page_size: Option<i64>,
    num_pages: Option<i64>,
    table_stride: Option<i64>,
    device_plan: bool,
    engine: Option<&str>,
    kv_dtype: Option<&str>,
    window_size: (i64, i64),
    softcap: f64,
    sinks: bool,
) -> PyResult<String> {
    let p = build_problem(
        batch,
        hq,
        hkv,
        head_dim,
        max_len,
        dtype,
        softmax_scale,
        k_strides,
        v_strides,
        q_len,
        page_size,
        num_pages,
        table_stride,
        kv_dtype,
        ScoreMods {
            window_size,
            softcap,
            sinks,
        },
    )?;
    let opts = options(num_splits, reduction, device_plan, engine)?;
    let plan = choose(&p, DeviceFacts::H200, opts).map_err(to_py)?;
    Ok(format!("{plan:?}"))
}

/// A decode problem planned, compiled and allocated on one GPU (`kvstream::Decoder`).
///
/// The constructor does everything slow (plan for the given maxima, compile or load the
/// kernels, allocate the split workspace of kernel reduction); `run` only enqueues kernels on
/// the given stream, so it may be captured into a CUDA graph. One decoder must not be in flight
/// on two streams at once (it owns one workspace). `reduction` forces the split reduction mode
/// (`"kernel"` or `"cluster"`); `None` lets the planner choose. `q_len`, `page_size`,
/// `num_pages`, `table_stride`, `device_plan` and `kv_dtype` as in `validate`.
#[pyclass(module = "kvstream._native", frozen)]
struct Decoder {
    inner: kvstream::Decoder,
    device: usize,
    /// Whether the split partition is planned on the device at each call.
    device_plan: bool,
}

#[pymethods]
impl Decoder {
    #[new]
    #[pyo3(signature = (batch, hq, hkv, head_dim, max_len, dtype, softmax_scale=None, num_splits=None, reduction=None, device=0, k_strides=None, v_strides=None, q_len=1, page_size=None, num_pages=None, table_stride=None, device_plan=false, engine=None, kv_dtype=None, window_size=(-1, 0), softcap=0.0, sinks=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        batch: i64,
        hq: i64,
        hkv: i64,
        head_dim: i64,
        max_len: i64,
        dtype: &str,
        softmax_scale: Option<f64>,
        num_splits: Option<i64>,
        reduction: Option<&str>,
        device: i64,
        k_strides: Option<(i64, i64, i64)>,
        v_strides: Option<(i64, i64, i64)>,
        q_len: i64,
        page_size: Option<i64>,
        num_pages: Option<i64>,
        table_stride: Option<i64>,
        device_plan: bool,
        engine: Option<&str>,
        kv_dtype: Option<&str>,
        window_size: (i64, i64),
        softcap: f64,
        sinks: bool,
    ) -> PyResult<Self> {
        // Everything that can be checked without a GPU is checked first.
        let problem = build_problem(
            batch,
            hq,
            hkv,
            head_dim,
            max_len,
            dtype,
            softmax_scale,
            k_strides,
            v_strides,
            q_len,
            page_size,
            num_pages,
            table_stride,
            kv_dtype,
            ScoreMods {
                window_size,
                softcap,
                sinks,
            },
        )?;
        let opts = options(num_splits, reduction, device_plan, engine)?;
        choose(&problem, DeviceFacts::H200, opts).map_err(to_py)?;
        let device = size("device", device)?;
        // Compiling kernels may take seconds on a cold cache: let other threads run.
        let inner = py.detach(|| -> PyResult<kvstream::Decoder> {
            let rt = runtime(device)?;
            catch_unwind(AssertUnwindSafe(|| {
                kvstream::Decoder::new(&rt, problem, opts)
            }))
            .map_err(|_| PyRuntimeError::new_err("kvstream: creating the decoder panicked"))?
            .map_err(to_py)
        })?;
        Ok(Decoder {
            inner,
            device,
            device_plan,
        })
    }

    /// Enqueues one decode on `stream` (a raw `CUstream` as an int, e.g.
    /// `torch.cuda.current_stream().cuda_stream`). Pointers are device addresses as ints;
    /// `block_table_ptr` is the int32 `[batch, table_stride]` block table of a paged decoder
    /// (required exactly when the decoder is paged); `k_scale` and `v_scale` an fp8 decoder's
    /// f32 scale tensors as `(pointer, element count)`: 1 (per tensor), hkv (per KV head) or
    /// batch x hkv (per request and KV head); `None`: 1. `sinks_ptr`: the f32 `[hq]` sink logits
    /// of a decoder built with `sinks=True` (required exactly then).
    ///
    /// Unsafe in spirit: the caller (the `kvstream` package) guarantees that the pointers
    /// reference tensors of the decoder's shapes on its device that stay alive until the work
    /// completes.
    /// `view_len`: the caches are a view of their first `view_len` positions (the decoder was
    /// made for their capacity).
    #[pyo3(signature = (q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr=None, seqlens_ptr=None, stream=0, block_table_ptr=None, k_scale=None, v_scale=None, sinks_ptr=None, view_len=None))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        q_ptr: u64,
        k_ptr: u64,
        v_ptr: u64,
        out_ptr: u64,
        lse_ptr: Option<u64>,
        seqlens_ptr: Option<u64>,
        stream: usize,
        block_table_ptr: Option<u64>,
        k_scale: Option<(u64, usize)>,
        v_scale: Option<(u64, usize)>,
        sinks_ptr: Option<u64>,
        view_len: Option<usize>,
    ) -> PyResult<()> {
        let p = self.inner.problem();
        let tensors = DecodeTensors {
            k_scale: scale_arg("k_scale", k_scale, p)?,
            v_scale: scale_arg("v_scale", v_scale, p)?,
            q: q_ptr,
            k: k_ptr,
            v: v_ptr,
            out: out_ptr,
            lse: lse_ptr,
            seqlens: seqlens_ptr,
            block_table: block_table_ptr,
            sinks: sinks_ptr,
            view_len,
        };
        let decoder = &self.inner;
        py.detach(move || {
            let stream = stream as sys::CUstream;
            // SAFETY: the pointers are checked by the library against the driver (device
            // memory of this GPU, aligned); their sizes are guaranteed by the Python layer,
            // which checks every tensor's shape against this decoder's problem.
            unsafe { decoder.run(&tensors, stream) }
        })
        .map_err(to_py)
    }

    /// KV splits per (request, KV head) of a split-engine plan; 0 for the persistent engine
    /// (the default), which partitions the work on the device at every call.
    #[getter]
    fn num_splits(&self) -> usize {
        self.inner.plan().split().map_or(0, |p| p.num_splits)
    }

    /// How the splits of one (request, KV head) are merged: `"persistent"` (the default
    /// engine: cut pieces merged by the CTA that finishes last), or, when a split-engine option
    /// was given, `"kernel"` (FP32 partials and a combine kernel) or `"cluster"` (one
    /// thread-block cluster, merged through distributed shared memory).
    #[getter]
    fn reduction(&self) -> &'static str {
        self.inner
            .plan()
            .split()
            .map_or("persistent", |p| p.reduction.name())
    }

    /// The plan, as a string (kernel variant, splits, grid, workspace).
    #[getter]
    fn plan(&self) -> String {
        format!("{:?}", self.inner.plan())
    }

    /// The device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// New tokens per request.
    #[getter]
    fn q_len(&self) -> usize {
        self.inner.problem().q_len
    }

    /// Positions per page of a paged decoder; `None` for contiguous caches.
    #[getter]
    fn page_size(&self) -> Option<usize> {
        self.inner.problem().paged.map(|pg| pg.page_size)
    }

    /// Whether the split partition is planned on the device at each call.
    #[getter]
    fn device_plan(&self) -> bool {
        self.device_plan
    }

    /// Element type of the caches: `"as_query"` or `"fp8_e4m3"`.
    #[getter]
    fn kv_dtype(&self) -> &'static str {
        self.inner.problem().kv_dtype.name()
    }

    fn __repr__(&self) -> String {
        let p = self.inner.problem();
        let plan = self.inner.plan();
        let mut extra = String::new();
        if p.q_len != 1 {
            extra += &format!(", q_len={}", p.q_len);
        }
        if let Some(pg) = p.paged {
            extra += &format!(
                ", page_size={}, num_pages={}, table_stride={}",
                pg.page_size, pg.num_pages, pg.table_stride
            );
        }
        if self.device_plan {
            extra += ", device_plan=True";
        }
        if p.kv_dtype != KvDType::AsQuery {
            extra += &format!(", kv_dtype='{}'", p.kv_dtype.name());
        }
        format!(
            "Decoder(batch={}, hq={}, hkv={}, head_dim={}, max_len={}, dtype='{}'{extra}, \
             num_splits={}, reduction='{}')",
            p.batch,
            p.hq,
            p.hkv,
            p.head_dim,
            p.max_len,
            p.dtype.name(),
            plan.split().map_or(0, |p| p.num_splits),
            plan.split().map_or("persistent", |p| p.reduction.name())
        )
    }
}

/// The cache write of one cache layout (`kvstream::KvWriter`): the problem arguments describe
/// the caches as for `Decoder` (a decoder of the same arguments reads what it writes).
#[pyclass(module = "kvstream._native", frozen)]
struct KvWriter {
    inner: kvstream::KvWriter,
}

#[pymethods]
impl KvWriter {
    #[new]
    #[pyo3(signature = (batch, hkv, head_dim, max_len, dtype, device=0, k_strides=None, page_size=None, num_pages=None, kv_dtype=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        batch: i64,
        hkv: i64,
        head_dim: i64,
        max_len: i64,
        dtype: &str,
        device: i64,
        k_strides: Option<(i64, i64, i64)>,
        page_size: Option<i64>,
        num_pages: Option<i64>,
        kv_dtype: Option<&str>,
    ) -> PyResult<Self> {
        let problem = build_problem(
            batch,
            hkv,
            hkv,
            head_dim,
            max_len,
            dtype,
            None,
            k_strides,
            k_strides,
            1,
            page_size,
            num_pages,
            None,
            kv_dtype,
            ScoreMods::NONE,
        )?;
        let device = size("device", device)?;
        let inner = py.detach(|| -> PyResult<kvstream::KvWriter> {
            let rt = runtime(device)?;
            catch_unwind(AssertUnwindSafe(|| kvstream::KvWriter::new(&rt, &problem)))
                .map_err(|_| PyRuntimeError::new_err("kvstream: creating the writer panicked"))?
                .map_err(to_py)
        })?;
        Ok(KvWriter { inner })
    }

    /// Enqueues the write of `tokens` rows on `stream`; scales as `(pointer, element count)`.
    #[pyo3(signature = (tokens, k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, stream=0, k_scale=None, v_scale=None))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        tokens: usize,
        k_ptr: u64,
        v_ptr: u64,
        slots_ptr: u64,
        k_cache_ptr: u64,
        v_cache_ptr: u64,
        stream: usize,
        k_scale: Option<(u64, usize)>,
        v_scale: Option<(u64, usize)>,
    ) -> PyResult<()> {
        let p = self.inner.problem();
        let t = kvstream::StoreTensors {
            tokens,
            k_new: k_ptr,
            v_new: v_ptr,
            slots: slots_ptr,
            k_cache: k_cache_ptr,
            v_cache: v_cache_ptr,
            k_scale: scale_arg("k_scale", k_scale, p)?,
            v_scale: scale_arg("v_scale", v_scale, p)?,
        };
        let writer = &self.inner;
        py.detach(move || {
            // SAFETY: the Python layer checks every tensor's shape, dtype and device against
            // this writer's problem; the library checks the pointers against the driver.
            unsafe { writer.run(&t, stream as sys::CUstream) }
        })
        .map_err(to_py)
    }
}

/// The merge of partial attention states (`kvstream::merge::StateMerger`): `shards` partial
/// outputs of `batch x q_len x heads` rows of `head_dim` with their LSEs, strides in elements.
#[pyclass(module = "kvstream._native", frozen)]
struct StateMerger {
    inner: kvstream::merge::StateMerger,
}

#[pymethods]
impl StateMerger {
    #[new]
    #[pyo3(signature = (shards, batch, q_len, heads, head_dim, dtype, device=0, strides=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        shards: i64,
        batch: i64,
        q_len: i64,
        heads: i64,
        head_dim: i64,
        dtype: &str,
        device: i64,
        strides: Option<(i64, i64, i64)>,
    ) -> PyResult<Self> {
        let dtype: DType = dtype.parse().map_err(to_py)?;
        let mut shape = kvstream::merge::MergeShape::new(
            size("shards", shards)?,
            size("batch", batch)?,
            size("q_len", q_len)?,
            size("heads", heads)?,
            size("head_dim", head_dim)?,
            dtype,
        )
        .map_err(to_py)?;
        if let Some((part_shard, part_row, lse_shard)) = strides {
            shape = shape
                .with_strides(
                    size("part_shard_stride", part_shard)?,
                    size("part_row_stride", part_row)?,
                    size("lse_shard_stride", lse_shard)?,
                )
                .map_err(to_py)?;
        }
        let device = size("device", device)?;
        let inner = py.detach(|| -> PyResult<kvstream::merge::StateMerger> {
            let rt = runtime(device)?;
            catch_unwind(AssertUnwindSafe(|| {
                kvstream::merge::StateMerger::new(&rt, shape)
            }))
            .map_err(|_| PyRuntimeError::new_err("kvstream: creating the merger panicked"))?
            .map_err(to_py)
        })?;
        Ok(StateMerger { inner })
    }

    /// Enqueues the merge on `stream`.
    #[pyo3(signature = (parts_ptr, part_lse_ptr, out_ptr, lse_ptr=None, sinks_ptr=None, stream=0))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        parts_ptr: u64,
        part_lse_ptr: u64,
        out_ptr: u64,
        lse_ptr: Option<u64>,
        sinks_ptr: Option<u64>,
        stream: usize,
    ) -> PyResult<()> {
        let t = kvstream::merge::MergeTensors {
            parts: parts_ptr,
            part_lse: part_lse_ptr,
            out: out_ptr,
            lse: lse_ptr,
            sinks: sinks_ptr,
        };
        let merger = &self.inner;
        py.detach(move || {
            // SAFETY: the Python layer checks every tensor's shape, dtype and device against
            // this merge's shape; the library checks the pointers against the driver.
            unsafe { merger.run(&t, stream as sys::CUstream) }
        })
        .map_err(to_py)
    }
}

/// An MLA decoder (`kvstream::mla`): one latent cache of 576-wide rows shared by every head.
#[pyclass(module = "kvstream._native", frozen)]
struct MlaDecoder {
    inner: kvstream::mla::MlaDecoder,
}

#[pymethods]
impl MlaDecoder {
    #[new]
    #[pyo3(signature = (batch, hq, q_len, max_len, dtype, softmax_scale, device=0, page_size=None, num_pages=None, table_stride=None, kv_dtype=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        batch: i64,
        hq: i64,
        q_len: i64,
        max_len: i64,
        dtype: &str,
        softmax_scale: f64,
        device: i64,
        page_size: Option<i64>,
        num_pages: Option<i64>,
        table_stride: Option<i64>,
        kv_dtype: Option<&str>,
    ) -> PyResult<Self> {
        use kvstream::mla::MlaProblem;
        let dtype: DType = dtype.parse().map_err(to_py)?;
        let mut problem = MlaProblem::new(
            size("batch", batch)?,
            size("hq", hq)?,
            size("max_len", max_len)?,
            dtype,
            softmax_scale as f32,
        )
        .and_then(|p| p.with_q_len(q_len.max(0) as usize))
        .map_err(to_py)?;
        if let Some(kv) = kv_dtype {
            problem = problem
                .with_kv_dtype(kv.parse().map_err(to_py)?)
                .map_err(to_py)?;
        }
        if let Some((ps, np, ts)) = paging(page_size, num_pages, table_stride)? {
            problem = problem.with_paged(ps, np, ts).map_err(to_py)?;
        }
        kvstream::plan::plan_mla(&problem, DeviceFacts::H200, PlanOptions::default())
            .map_err(to_py)?;
        let device = size("device", device)?;
        let inner = py.detach(|| -> PyResult<kvstream::mla::MlaDecoder> {
            let rt = runtime(device)?;
            catch_unwind(AssertUnwindSafe(|| {
                kvstream::mla::MlaDecoder::new(&rt, problem, PlanOptions::default())
            }))
            .map_err(|_| PyRuntimeError::new_err("kvstream: creating the MLA decoder panicked"))?
            .map_err(to_py)
        })?;
        Ok(MlaDecoder { inner })
    }

    /// Enqueues one MLA decode on `stream` (a raw `CUstream` as an int). `kv_scale` is an e4m3
    /// decoder's f32 scale tensor as `(pointer, element count)`: 1 (per cache) or batch (per
    /// request). Unsafe in spirit, as `Decoder.run`: the `kvstream` package guarantees the
    /// tensors' shapes and lifetimes.
    #[pyo3(signature = (q_ptr, kv_ptr, out_ptr, lse_ptr=None, seqlens_ptr=None, stream=0, block_table_ptr=None, kv_scale=None))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        q_ptr: u64,
        kv_ptr: u64,
        out_ptr: u64,
        lse_ptr: Option<u64>,
        seqlens_ptr: Option<u64>,
        stream: usize,
        block_table_ptr: Option<u64>,
        kv_scale: Option<(u64, usize)>,
    ) -> PyResult<()> {
        let p = self.inner.problem();
        let kv_scale = match kv_scale {
            Some((ptr, len)) => Some(KvScale {
                ptr,
                layout: p.check_scale("kv_scale", len).map_err(to_py)?,
            }),
            None => None,
        };
        let tensors = kvstream::mla::MlaTensors {
            q: q_ptr,
            kv: kv_ptr,
            out: out_ptr,
            lse: lse_ptr,
            seqlens: seqlens_ptr,
            block_table: block_table_ptr,
            kv_scale,
        };
        let decoder = &self.inner;
        py.detach(move || {
            // SAFETY: as `Decoder.run`: pointers checked against the driver by the library,
            // sizes by the Python layer.
            unsafe { decoder.run(&tensors, stream as sys::CUstream) }
        })
        .map_err(to_py)
    }

    /// The kernel variant and grid.
    #[getter]
    fn plan(&self) -> String {
        let pl = self.inner.plan();
        format!(
            "{} x {} CTAs, {} column block(s)",
            kvstream::kernels::Variant::name(&pl.variant),
            pl.grid,
            pl.col_blocks
        )
    }
}

/// A scale tensor given as `(pointer, element count)`, its layout told by the count.
fn scale_arg(
    arg: &'static str,
    given: Option<(u64, usize)>,
    p: &DecodeProblem,
) -> PyResult<Option<KvScale>> {
    let Some((ptr, len)) = given else {
        return Ok(None);
    };
    let layout = KvScaleLayout::of_tensor(arg, len, p.batch, p.hkv).map_err(to_py)?;
    Ok(Some(KvScale { ptr, layout }))
}

/// `(held, all_len, right or -1, first_row, run)` of one request ([`rank_shares`]).
type ShareTuple = (usize, usize, i64, usize, usize);

/// The context-parallel rule (`kvstream::context`) for each length in `lens`: `(held, all_len,
/// right, first_row, run)` of `rank` of `world`, `right` -1 where the rank holds none of the
/// request's last `q_len - 1` positions. `sharding` is "chunks" or "pages", `unit` the chunk
/// length or page size. (kvstream.distributed runs the rule on the GPU; its tests compare.)
#[pyfunction]
fn rank_shares(
    lens: Vec<i64>,
    rank: i64,
    world: i64,
    sharding: &str,
    unit: i64,
    q_len: i64,
) -> PyResult<Vec<ShareTuple>> {
    let unit = size("unit", unit)?;
    let rule = match sharding {
        "chunks" => kvstream::context::Sharding::Chunks(unit),
        "pages" => kvstream::context::Sharding::Pages(unit),
        other => {
            return Err(to_py(Error::invalid(
                "sharding",
                format!("{other:?}"),
                "\"chunks\" or \"pages\"",
            )))
        }
    };
    let (rank, world, q_len) = (
        size("rank", rank)?,
        size("world", world)?,
        size("q_len", q_len)?,
    );
    lens.into_iter()
        .map(|n| {
            let s = rule
                .share(rank, world, size("lens", n)?, q_len)
                .map_err(to_py)?;
            Ok(match s.tail {
                None => (s.held, s.all_len, -1, 0, 0),
                Some(t) => (s.held, s.all_len, t.right as i64, t.first_row, t.run),
            })
        })
        .collect()
}

/// Native layer of kvstream; use the `kvstream` package instead.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Decoder>()?;
    m.add_class::<KvWriter>()?;
    m.add_class::<MlaDecoder>()?;
    m.add_class::<StateMerger>()?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(rank_shares, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
