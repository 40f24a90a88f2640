"""API tests that need neither PyTorch nor a GPU: import, signature, every validation path.

Tensors are faked with a small class exposing the attributes kvstream reads; validation must
reject each bad input before anything reaches the native layer or imports torch.
"""

import inspect
import math
import sys

import pytest

import kvstream
from kvstream import _native


from fakes import BF16, E4M3, E5M2, F16, F32, I32, I64, FakeDevice, FakeDType, FakeTensor  # noqa: F401


B, L, HQ, HKV, D = 2, 256, 16, 2, 128


def good(**over):
    args = dict(
        q=FakeTensor((B, 1, HQ, D)),
        k_cache=FakeTensor((B, L, HKV, D)),
        v_cache=FakeTensor((B, L, HKV, D)),
    )
    args.update(over)
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    return (q, k, v), args


def fails(exc, *words, **over):
    pos, kw = good(**over)
    with pytest.raises(exc) as e:
        kvstream.decode(*pos, **kw)
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


def test_import_needs_no_torch():
    assert kvstream.__version__
    assert hasattr(_native, "Decoder")
    # importing kvstream must not import torch (in a fresh interpreter: this one may have it)
    import subprocess

    code = "import sys, kvstream; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


# Makes torch unimportable in a fresh interpreter (CI installs torch for the op tests).
_BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r} (blocked)")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def test_works_without_torch():
    # where torch cannot be imported: kvstream imports, checks arguments, and says what is missing
    import subprocess

    code = _BLOCK_TORCH + """
import kvstream
try:
    kvstream.decode(None, None, None)
except TypeError as e:
    assert "q must be a CUDA torch.Tensor" in str(e), e
try:
    kvstream.self_test()
except RuntimeError as e:
    assert "PyTorch is not importable" in str(e), e
print("ok", "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok False", out


def test_decode_signature():
    sig = inspect.signature(kvstream.decode)
    P = inspect.Parameter
    expected = [
        ("q", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("k_cache", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("v_cache", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("cache_seqlens", P.KEYWORD_ONLY, None),
        ("block_table", P.KEYWORD_ONLY, None),
        ("softmax_scale", P.KEYWORD_ONLY, None),
        ("window_size", P.KEYWORD_ONLY, (-1, 0)),
        ("softcap", P.KEYWORD_ONLY, 0.0),
        ("sinks", P.KEYWORD_ONLY, None),
        ("num_splits", P.KEYWORD_ONLY, None),
        ("reduction", P.KEYWORD_ONLY, None),
        ("device_plan", P.KEYWORD_ONLY, False),
        ("engine", P.KEYWORD_ONLY, None),
        ("k_scale", P.KEYWORD_ONLY, None),
        ("v_scale", P.KEYWORD_ONLY, None),
        ("return_lse", P.KEYWORD_ONLY, False),
        ("out", P.KEYWORD_ONLY, None),
    ]
    got = [(p.name, p.kind, p.default) for p in sig.parameters.values()]
    assert got == expected
    assert "Example" in kvstream.decode.__doc__
    assert "graph" in kvstream.__doc__


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache"])
@pytest.mark.parametrize("bad", [None, 3, [1, 2], "tensor"])
def test_non_tensor(name, bad):
    fails(TypeError, name, **{name: bad})


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache"])
def test_cpu_tensor(name):
    pos, _ = good()
    shape = dict(zip(["q", "k_cache", "v_cache"], pos))[name].shape
    fails(ValueError, name, "cpu", **{name: FakeTensor(shape, device=FakeDevice("cpu", None))})


def test_unsupported_dtype():
    fails(TypeError, "q", "torch.float32", "torch.bfloat16", q=FakeTensor((B, 1, HQ, D), F32))


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_mismatched_cache_dtype(name):
    fails(TypeError, name, "torch.float16", "torch.bfloat16", **{name: FakeTensor((B, L, HKV, D), F16)})


def test_fp16_everywhere_is_accepted_by_validation():
    # All fp16: passes validation, then needs torch to launch (absent or not, not a TypeError).
    pos, _ = good(
        q=FakeTensor((B, 1, HQ, D), F16),
        k_cache=FakeTensor((B, L, HKV, D), F16),
        v_cache=FakeTensor((B, L, HKV, D), F16),
    )
    passes_validation(*pos)


def test_out_dtype():
    fails(TypeError, "out", "torch.float16", out=FakeTensor((B, 1, HQ, D), F16))


@pytest.mark.parametrize("dt", [I64, F32, BF16])
def test_seqlens_dtype(dt):
    fails(TypeError, "cache_seqlens", str(dt), "torch.int32", cache_seqlens=FakeTensor((B,), dt))


def test_seqlens_shape_device_cpu_type():
    fails(ValueError, "cache_seqlens", "[3]", cache_seqlens=FakeTensor((3,), I32))
    fails(ValueError, "cache_seqlens", cache_seqlens=FakeTensor((B, 1), I32))
    fails(ValueError, "cache_seqlens", "cpu", cache_seqlens=FakeTensor((B,), I32, FakeDevice("cpu", None)))
    fails(ValueError, "cache_seqlens", "cuda:1", cache_seqlens=FakeTensor((B,), I32, FakeDevice("cuda", 1)))
    fails(TypeError, "cache_seqlens", cache_seqlens=[1, 2])


@pytest.mark.parametrize(
    "name,shape",
    [("q", (B, 1, 1, HQ, D)), ("q", (HQ, D)), ("k_cache", (B, L, HKV)), ("v_cache", (B, L, HKV, D, 1))],
)
def test_wrong_rank(name, shape):
    fails(ValueError, name, "4 dimensions", **{name: FakeTensor(shape)})


def passes_validation(*pos, **kw):
    """A valid call: decode's checks pass (torch or not); without torch the call then stops at
    importing it (never a validation error)."""
    bound = inspect.signature(kvstream.decode).bind(*pos, **kw)
    bound.apply_defaults()
    kvstream._check_decode(**bound.arguments)
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            kvstream.decode(*pos, **kw)


@pytest.mark.parametrize("q_len", [0, 9, 16])
def test_q_len_range(q_len):
    msg = fails(ValueError, "q", "q_len", str(q_len), "1..8", q=FakeTensor((B, q_len, HQ, D)))
    assert f"[{B}, {q_len}, {HQ}, {D}]" in msg, msg


@pytest.mark.parametrize("q_len", [1, 2, 5, 8])
def test_multi_token_q_passes_validation(q_len):
    pos, _ = good(q=FakeTensor((B, q_len, HQ, D)))
    passes_validation(*pos, out=FakeTensor((B, q_len, HQ, D)), cache_seqlens=FakeTensor((B,), I32))


def test_three_dim_q():
    pos, _ = good(q=FakeTensor((B, HQ, D)))
    passes_validation(*pos, out=FakeTensor((B, HQ, D)))
    # out keeps q's rank
    fails(ValueError, "out", "shape", f"[{B}, {HQ}, {D}]", q=FakeTensor((B, HQ, D)),
          out=FakeTensor((B, 1, HQ, D)))
    fails(ValueError, "q", "head_dim", "80", q=FakeTensor((B, HQ, 80)))
    fails(ValueError, "hq", "hkv", q=FakeTensor((B, 12, D)), k_cache=FakeTensor((B, L, 5, D)),
          v_cache=FakeTensor((B, L, 5, D)))
    fails(ValueError, "k_cache", "batch", q=FakeTensor((3, HQ, D)))
    fails(ValueError, "q", "contiguous", q=FakeTensor((B, HQ, D), strides=(HQ * D, 1, HQ)))


def test_heads_not_a_multiple():
    fails(ValueError, "hq", "hkv", q=FakeTensor((B, 1, 12, D)),
          k_cache=FakeTensor((B, L, 5, D)), v_cache=FakeTensor((B, L, 5, D)))


def test_group_too_large():
    fails(ValueError, "hq / hkv", "33", "1..32", q=FakeTensor((B, 1, 66, D)))


@pytest.mark.parametrize("d", [32, 80, 192, 512])
def test_head_dim(d):
    fails(ValueError, "head_dim", str(d), "64, 96, 128 or 256", q=FakeTensor((B, 1, HQ, d)),
          k_cache=FakeTensor((B, L, HKV, d)), v_cache=FakeTensor((B, L, HKV, d)))


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("q_len", [1, 4])
def test_every_head_dim_passes_validation(d, q_len):
    passes_validation(FakeTensor((B, q_len, HQ, d)), FakeTensor((B, L, HKV, d)),
                      FakeTensor((B, L, HKV, d)), cache_seqlens=FakeTensor((B,), I32))


def test_cache_shape_mismatches():
    fails(ValueError, "k_cache", "head_dim", k_cache=FakeTensor((B, L, HKV, 64)), v_cache=FakeTensor((B, L, HKV, 64)))
    fails(ValueError, "k_cache", "batch", k_cache=FakeTensor((3, L, HKV, D)), v_cache=FakeTensor((3, L, HKV, D)))
    fails(ValueError, "v_cache", "shape of k_cache", v_cache=FakeTensor((B, L + 1, HKV, D)))
    fails(ValueError, "L", k_cache=FakeTensor((B, 0, HKV, D)), v_cache=FakeTensor((B, 0, HKV, D)))
    fails(ValueError, "q", "batch", q=FakeTensor((0, 1, HQ, D)), k_cache=FakeTensor((0, L, HKV, D)),
          v_cache=FakeTensor((0, L, HKV, D)))


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "cache_seqlens", "out"])
def test_different_device(name):
    shapes = {"k_cache": ((B, L, HKV, D), BF16), "v_cache": ((B, L, HKV, D), BF16),
              "cache_seqlens": ((B,), I32), "out": ((B, 1, HQ, D), BF16)}
    shape, dt = shapes[name]
    fails(ValueError, name, "cuda:1", "cuda:0", **{name: FakeTensor(shape, dt, FakeDevice("cuda", 1))})


def test_non_contiguous_q_and_out():
    # q transposed in its (hq, d) dims
    fails(ValueError, "q", "contiguous", q=FakeTensor((B, 1, HQ, D), strides=(HQ * D, HQ * D, 1, HQ)))
    fails(ValueError, "out", "contiguous", out=FakeTensor((B, 1, HQ, D), strides=(2 * HQ * D, HQ * D, D, 1)))


def test_cache_strides():
    # A slice along L of a larger cache: larger batch stride, accepted by validation.
    sliced = FakeTensor((B, L, HKV, D), strides=(2 * L * HKV * D, HKV * D, D, 1))
    assert kvstream._cache_strides("k_cache", sliced, sliced.shape) == (2 * L * HKV * D, HKV * D, D)
    # Last dim not contiguous.
    fails(ValueError, "k_cache", "strides", k_cache=FakeTensor((B, L, HKV, D), strides=(L * HKV * D, HKV * D, 1, HKV)))
    # Strides not multiples of 8 elements.
    fails(ValueError, "v_cache", "multiples of 8", v_cache=FakeTensor((B, L, HKV, D), strides=(L * HKV * (D + 4), HKV * (D + 4), D + 4, 1)))


def test_misaligned_pointer():
    fails(ValueError, "q", "16-byte", q=FakeTensor((B, 1, HQ, D), ptr=(1 << 20) + 2))
    fails(ValueError, "k_cache", "16-byte", k_cache=FakeTensor((B, L, HKV, D), ptr=(1 << 20) + 8))


def test_out_shape():
    fails(ValueError, "out", "shape", out=FakeTensor((B, 1, HQ, 64)))
    fails(ValueError, "out", "cpu", out=FakeTensor((B, 1, HQ, D), device=FakeDevice("cpu", None)))
    fails(TypeError, "out", out=object())


def test_scalar_options():
    fails(TypeError, "softmax_scale", softmax_scale="0.1")
    fails(ValueError, "softmax_scale", softmax_scale=-1.0)
    fails(ValueError, "softmax_scale", softmax_scale=math.nan)
    fails(TypeError, "num_splits", num_splits=2.0)
    fails(TypeError, "num_splits", num_splits=True)
    fails(ValueError, "num_splits", "1..128", num_splits=0)
    fails(ValueError, "num_splits", num_splits=129)
    fails(TypeError, "return_lse", return_lse=1)


@pytest.mark.parametrize("bad", [1, b"cluster", ["kernel"], True])
def test_reduction_type(bad):
    fails(TypeError, "reduction", repr(bad), "'kernel' or 'cluster' or None", reduction=bad)


@pytest.mark.parametrize("bad", ["atomic", "Cluster", "", "kernel "])
def test_reduction_value(bad):
    fails(ValueError, "reduction", repr(bad), "'kernel' or 'cluster' or None", reduction=bad)


@pytest.mark.parametrize("splits", [3, 5, 32, 128])
def test_cluster_reduction_split_counts(splits):
    msg = fails(ValueError, "num_splits", str(splits), "cluster", "1, 2, 4, 8, 16",
                reduction="cluster", num_splits=splits)
    assert "reduction" in msg, msg


@pytest.mark.parametrize(
    "over",
    [dict(reduction="kernel"), dict(reduction="kernel", num_splits=3),
     dict(reduction="cluster"), dict(reduction="cluster", num_splits=16)],
)
def test_valid_reduction_passes_validation(over):
    pos, _ = good()
    passes_validation(*pos, **over)


def test_reduction_constants():
    assert kvstream.REDUCTIONS == ("kernel", "cluster")
    assert kvstream.CLUSTER_SPLITS == (1, 2, 4, 8, 16)
    assert all(n <= kvstream.MAX_SPLITS for n in kvstream.CLUSTER_SPLITS)


def test_multi_token_and_paging_constants():
    assert kvstream.MAX_Q_LEN == 8
    assert kvstream.SUPPORTED_PAGE_SIZES == tuple(1 << i for i in range(10))
    assert {"MAX_Q_LEN", "SUPPORTED_PAGE_SIZES"} <= set(kvstream.__all__)


# ---- paged caches: pools [num_pages, page_size, hkv, d] and an int32 block table ----

NP, PS, MP = 40, 16, 16  # pages in the pools, page size, pages per request (capacity 256)


def paged(**over):
    """Arguments of a valid paged call (a dict of keyword arguments plus q, k_cache, v_cache)."""
    args = dict(
        q=FakeTensor((B, 1, HQ, D)),
        k_cache=FakeTensor((NP, PS, HKV, D)),
        v_cache=FakeTensor((NP, PS, HKV, D)),
        block_table=FakeTensor((B, MP), I32),
    )
    args.update(over)
    return args


def paged_fails(exc, *words, **over):
    args = paged(**over)
    with pytest.raises(exc) as e:
        kvstream.decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


@pytest.mark.parametrize("ps", [1, 16, 64, 256, 512])
@pytest.mark.parametrize("q_len", [1, 3])
def test_paged_passes_validation(ps, q_len):
    # The pool's page count is independent of the batch.
    args = paged(q=FakeTensor((B, q_len, HQ, D)), k_cache=FakeTensor((7, ps, HKV, D)),
                 v_cache=FakeTensor((7, ps, HKV, D)), cache_seqlens=FakeTensor((B,), I32))
    passes_validation(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


@pytest.mark.parametrize("ps", [0, 3, 24, 1024])
def test_paged_page_size(ps):
    shape = (NP, ps, HKV, D)
    paged_fails(ValueError, "k_cache", "page_size", str(ps), "1, 2, 4", "512", "block_table",
                k_cache=FakeTensor(shape), v_cache=FakeTensor(shape))


def test_paged_pool_shapes():
    paged_fails(ValueError, "k_cache", "num_pages", k_cache=FakeTensor((0, PS, HKV, D)),
                v_cache=FakeTensor((0, PS, HKV, D)))
    paged_fails(ValueError, "v_cache", "shape of k_cache", v_cache=FakeTensor((NP + 1, PS, HKV, D)))
    paged_fails(ValueError, "k_cache", "4 dimensions", "num_pages, page_size",
                k_cache=FakeTensor((NP * PS, HKV, D)))
    paged_fails(ValueError, "k_cache", "head_dim", k_cache=FakeTensor((NP, PS, HKV, 64)),
                v_cache=FakeTensor((NP, PS, HKV, 64)))
    paged_fails(ValueError, "hq", "hkv", k_cache=FakeTensor((NP, PS, 3, D)), v_cache=FakeTensor((NP, PS, 3, D)))
    paged_fails(TypeError, "v_cache", "torch.float16", v_cache=FakeTensor((NP, PS, HKV, D), F16))
    paged_fails(ValueError, "v_cache", "cuda:1", v_cache=FakeTensor((NP, PS, HKV, D), device=FakeDevice("cuda", 1)))


def test_paged_pools_must_be_contiguous():
    # A slice of a larger pool along the page axis is contiguous; one along the rows is not.
    rows = (2 * PS * HKV * D, HKV * D, D, 1)
    paged_fails(ValueError, "k_cache", "contiguous", k_cache=FakeTensor((NP, PS, HKV, D), strides=rows))
    paged_fails(ValueError, "v_cache", "contiguous", v_cache=FakeTensor((NP, PS, HKV, D), strides=rows))


@pytest.mark.parametrize("dt", [I64, F32, BF16])
def test_block_table_dtype(dt):
    paged_fails(TypeError, "block_table", str(dt), "torch.int32", block_table=FakeTensor((B, MP), dt))


def test_block_table_shape_device_layout():
    paged_fails(TypeError, "block_table", block_table=[[0, 1], [2, 3]])
    paged_fails(ValueError, "block_table", "2 dimensions", "[batch, max_pages]",
                block_table=FakeTensor((B * MP,), I32))
    paged_fails(ValueError, "block_table", f"[3, {MP}]", f"[{B}, max_pages]",
                block_table=FakeTensor((3, MP), I32))
    paged_fails(ValueError, "block_table", "max_pages >= 1", block_table=FakeTensor((B, 0), I32))
    paged_fails(ValueError, "block_table", "cpu",
                block_table=FakeTensor((B, MP), I32, FakeDevice("cpu", None)))
    paged_fails(ValueError, "block_table", "cuda:1", "cuda:0",
                block_table=FakeTensor((B, MP), I32, FakeDevice("cuda", 1)))
    paged_fails(ValueError, "block_table", "contiguous",
                block_table=FakeTensor((B, MP), I32, strides=(1, B)))


def test_block_table_capacity():
    # 2^23 pages of 512 positions: a capacity of 2^32 positions, past int32.
    msg = paged_fails(ValueError, "block_table", "2^31-1", k_cache=FakeTensor((NP, 512, HKV, D)),
                      v_cache=FakeTensor((NP, 512, HKV, D)), block_table=FakeTensor((B, 1 << 23), I32))
    assert str(1 << 32) in msg, msg


def test_paged_seqlens_and_out():
    paged_fails(ValueError, "cache_seqlens", f"[{B}]", cache_seqlens=FakeTensor((NP,), I32))
    paged_fails(ValueError, "out", "shape", out=FakeTensor((NP, 1, HQ, D)))


@pytest.mark.parametrize("bad", [1, 0, None, "yes"])
def test_device_plan_type(bad):
    fails(TypeError, "device_plan", repr(bad), "bool", device_plan=bad)


def test_device_plan_takes_no_split_count():
    fails(ValueError, "num_splits", "8", "device_plan", "None", device_plan=True, num_splits=8)
    pos, _ = good()
    passes_validation(*pos, device_plan=True)
    passes_validation(*pos, device_plan=True, reduction="kernel", cache_seqlens=FakeTensor((B,), I32))
    passes_validation(*pos, device_plan=False, reduction="cluster", num_splits=8)
    passes_validation(*pos, device_plan=True, reduction="cluster")
    args = paged(q=FakeTensor((B, 4, HQ, D)), device_plan=True)
    passes_validation(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


# ---- native layer: plain values, validated before any GPU is opened ----

@pytest.mark.parametrize(
    "over,field",
    [
        (dict(batch=0), "batch"),
        (dict(batch=-1), "batch"),
        (dict(hkv=0), "hkv"),
        (dict(hq=12, hkv=5), "hq"),
        (dict(hq=66, hkv=2), "hq / hkv"),
        (dict(head_dim=80), "head_dim"),
        (dict(head_dim=512), "head_dim"),
        (dict(window_size=(-2, 0)), "window_size[0] (left)"),
        (dict(window_size=(0, -3)), "window_size[1] (right)"),
        (dict(window_size=(2**31 - 1, 0)), "window_size[0] (left)"),
        (dict(softcap=-1.0), "softcap"),
        (dict(softcap=math.inf), "softcap"),
        (dict(softcap=math.nan), "softcap"),
        (dict(window_size=(128, 0), engine="split"), "engine"),
        (dict(softcap=30.0, num_splits=4), "engine"),
        (dict(sinks=True, reduction="kernel"), "engine"),
        (dict(head_dim=256, device_plan=True), "engine"),
        (dict(max_len=0), "max_len"),
        (dict(dtype="fp8"), "dtype"),
        (dict(softmax_scale=-1.0), "softmax_scale"),
        (dict(num_splits=0), "num_splits"),
        (dict(num_splits=500), "num_splits"),
        (dict(reduction="atomic"), "reduction"),
        (dict(reduction="Cluster"), "reduction"),
        (dict(reduction="cluster", num_splits=3), "num_splits"),
        (dict(reduction="cluster", num_splits=32), "num_splits"),
        (dict(k_strides=(8, 12, 8)), "k strides"),
        (dict(v_strides=(0, 8, 8)), "v strides"),
        (dict(q_len=0), "q_len"),
        (dict(q_len=9), "q_len"),
        (dict(q_len=-1), "q_len"),
        (dict(page_size=3, num_pages=100), "page_size"),
        (dict(page_size=1024, num_pages=100), "page_size"),
        (dict(page_size=16, num_pages=0), "num_pages"),
        (dict(page_size=16, num_pages=100, table_stride=255), "block_table stride"),
        (dict(page_size=16, num_pages=100, table_stride=-1), "block_table stride"),
        (dict(page_size=16), "num_pages"),
        (dict(num_pages=100), "page_size"),
        (dict(table_stride=256), "page_size"),
        (dict(page_size=16, num_pages=100, k_strides=(4096 * 256, 256, 128)), "k strides"),
        (dict(page_size=16, num_pages=100, v_strides=(4096 * 256, 256, 128)), "v strides"),
        (dict(device_plan=True, num_splits=4), "num_splits"),
    ],
)
def test_native_decoder_rejects_fields(over, field):
    args = dict(batch=1, hq=16, hkv=2, head_dim=128, max_len=4096, dtype="bf16")
    args.update(over)
    for fn in (_native.Decoder, _native.validate):
        with pytest.raises(ValueError) as e:
            fn(**args)
        assert f"invalid {field}:" in str(e.value), str(e.value)


def test_native_validate_returns_plan():
    # a batch that fills the GPU: the persistent engine, one CTA per SM of the H200
    plan = _native.validate(16, 32, 8, 128, 4096, "bf16")
    assert plan.startswith("Persistent(") and "grid: 132" in plan, plan
    # one request: the split engine, the worked example of plan.rs (16/2 heads, L 131072 -> 33
    # splits), also with a split-engine knob given
    for kw in ({}, dict(reduction="kernel")):
        plan = _native.validate(1, 16, 2, 128, 131072, "bf16", **kw)
        assert "num_splits: 33" in plan and "grid: [33, 2, 1]" in plan, plan
    assert "num_splits: 1," in _native.validate(1, 16, 2, 128, 131072, "f16", num_splits=1)


def test_native_validate_reduction():
    args = (1, 16, 2, 128, 4096, "bf16")
    cluster = _native.validate(*args, num_splits=4, reduction="cluster")
    assert "Cluster" in cluster and "num_splits: 4," in cluster, cluster
    kernel = _native.validate(*args, num_splits=4, reduction="kernel")
    assert "Kernel" in kernel and "num_splits: 4," in kernel, kernel
    # cluster reduction without a split count: a cluster size the planner picks itself
    assert "Cluster" in _native.validate(*args, reduction="cluster")
    # a device plan with cluster reduction: clusters of 16 (two KV heads fill 132 SMs), no combine
    dp = _native.validate(*args, reduction="cluster", device_plan=True)
    assert "Cluster" in dp and "combine: None" in dp and "num_splits: 16," in dp, dp
    # kernel reduction takes any split count up to MAX_SPLITS
    assert "num_splits: 3," in _native.validate(*args, num_splits=3, reduction="kernel")
    # positional order: ..., softmax_scale, num_splits, reduction
    assert "Cluster" in _native.validate(*args, None, 2, "cluster")
    with pytest.raises(ValueError) as e:
        _native.validate(*args, reduction="atomic")
    msg = str(e.value)
    assert "reduction" in msg and "atomic" in msg and "'kernel' or 'cluster'" in msg, msg
    with pytest.raises(TypeError):
        _native.validate(*args, reduction=1)


def test_native_validate_multi_token_paged_device_plan():
    args = (4, 32, 8, 128, 4096, "bf16")
    # positional callers of the old signature are unaffected by the new trailing arguments
    assert "num_splits: 2," in _native.validate(*args, None, 2, "kernel", None, None)
    assert "num_splits: 2," in _native.validate(*args, None, 2, "kernel", None, None, 4)
    for q_len in range(1, 9):
        assert "Persistent" in _native.validate(16, *args[1:], q_len=q_len)
        assert "num_splits" in _native.validate(*args, q_len=q_len)
        assert "num_splits" in _native.validate(16, *args[1:], q_len=q_len, reduction="kernel")
    for ps in kvstream.SUPPORTED_PAGE_SIZES:
        pages = 4 * (4096 // ps)
        plan = _native.validate(*args, page_size=ps, num_pages=pages)
        # pages below 16 take the persistent engine's gathering producer at any batch
        assert ("kv_source: PagedGather" if ps < 16 else "paged: true") in plan, (ps, plan)
        assert "num_splits" in _native.validate(*args, page_size=ps, num_pages=1,
                                                table_stride=4096 // ps + 5, q_len=3,
                                                reduction="kernel")
    # the device plan takes kernel reduction, also where the planner would pick a cluster
    assert "Cluster" in _native.validate(1, 16, 2, 64, 1024, "bf16", num_splits=8)
    assert "Kernel" in _native.validate(1, 16, 2, 64, 1024, "bf16", device_plan=True)
    assert "Kernel" in _native.validate(*args, reduction="kernel", device_plan=True)
    assert "Kernel" in _native.validate(*args, q_len=8, page_size=64, num_pages=256,
                                        device_plan=True)
    with pytest.raises(ValueError) as e:
        _native.validate(*args, page_size=16, num_pages=10, table_stride=100)
    msg = str(e.value)
    assert "block_table stride" in msg and "100" in msg and "256" in msg, msg


def test_native_decoder_without_gpu_is_a_runtime_error():
    try:
        d = _native.Decoder(1, 16, 2, 128, 4096, "bf16", None, None, None, 0)
    except RuntimeError as e:
        msg = str(e)
        assert any(w in msg for w in ("driver", "GPU", "NVRTC")), msg
    else:  # a machine with a suitable GPU
        assert d.num_splits >= 1 and "num_splits" in d.plan
        assert d.reduction in ("kernel", "cluster") and f"reduction='{d.reduction}'" in repr(d)
        assert d.q_len == 1 and d.page_size is None and d.device_plan is False
        pytest.skip("a GPU is present: the no-GPU error path is not reachable here")


def test_native_decoder_new_arguments_without_gpu():
    kw = dict(q_len=4, page_size=16, num_pages=600, table_stride=300, device_plan=True)
    try:
        d = _native.Decoder(2, 16, 2, 128, 4096, "bf16", None, None, None, 0, None, None, **kw)
    except RuntimeError as e:
        msg = str(e)
        assert any(w in msg for w in ("driver", "GPU", "NVRTC")), msg
    else:  # a machine with a suitable GPU
        assert d.q_len == 4 and d.page_size == 16 and d.device_plan is True
        r = repr(d)
        assert "q_len=4" in r and "page_size=16" in r and "table_stride=300" in r, r
        assert "device_plan=True" in r and d.reduction == "kernel", r
        pytest.skip("a GPU is present: the no-GPU error path is not reachable here")


@pytest.mark.parametrize("bad", ["Persistent", "atomic", ""])
def test_engine_value(bad):
    fails(ValueError, "engine", repr(bad), "'persistent' or 'split' or None", engine=bad)


def test_engine_type():
    fails(TypeError, "engine", "'persistent' or 'split' or None", engine=1)


@pytest.mark.parametrize("over", [dict(num_splits=4), dict(reduction="kernel"),
                                  dict(device_plan=True)])
def test_persistent_engine_takes_no_split_knobs(over):
    fails(ValueError, "engine", "persistent", engine="persistent", **over)


def test_native_validate_engine():
    args = (1, 16, 2, 128, 4096, "bf16")
    assert _native.validate(*args).startswith("Split(")
    assert _native.validate(*args, engine="persistent").startswith("Persistent(")
    assert _native.validate(16, 32, 8, 128, 4096, "bf16", engine="split").startswith("Split(")
    with pytest.raises(ValueError) as e:
        _native.validate(*args, engine="fast")
    msg = str(e.value)
    assert "engine" in msg and "fast" in msg and "persistent" in msg, msg
    with pytest.raises(ValueError) as e:
        _native.validate(*args, engine="persistent", num_splits=4)
    assert "engine" in str(e.value), str(e.value)


def fp8_caches(**over):
    caches = dict(k_cache=FakeTensor((B, L, HKV, D), E4M3), v_cache=FakeTensor((B, L, HKV, D), E4M3))
    return {**caches, **over}


def test_fp8_cache_needs_matching_caches_and_no_e5m2():
    fails(TypeError, "v_cache", "float8_e4m3fn", k_cache=FakeTensor((B, L, HKV, D), E4M3))
    fails(TypeError, "e5m2", k_cache=FakeTensor((B, L, HKV, D), E5M2),
          v_cache=FakeTensor((B, L, HKV, D), E5M2))


@pytest.mark.parametrize("shape", [(3,), (B, HKV, 1), (B * HKV,), (1, 1, 1)])
def test_fp8_scale_shapes(shape):
    fails(ValueError, "k_scale", "per KV head", **fp8_caches(k_scale=FakeTensor(shape, F32)))


def test_fp8_scale_dtype_device_and_bf16_caches():
    fails(TypeError, "v_scale", "torch.float32", **fp8_caches(v_scale=FakeTensor((1,), F16)))
    fails(ValueError, "k_scale", "cpu",
          **fp8_caches(k_scale=FakeTensor((1,), F32, device=FakeDevice("cpu", None))))
    fails(ValueError, "k_scale", "scales belong to", k_scale=FakeTensor((1,), F32))


def test_fp8_cache_strides_are_16_bytes():
    # a head stride of 136 elements: fine for a 2-byte cache, not 16 bytes for an fp8 one
    strided = FakeTensor((B, L, HKV, D), E4M3, strides=(L * HKV * 136, HKV * 136, 136, 1))
    fails(ValueError, "k_cache", "multiples of 16 elements", **fp8_caches(k_cache=strided))


def test_fp8_validates_through_the_native_layer():
    # the engine rule of 2-byte caches: 32 units on 132 SMs take the split engine, 128 the
    # persistent one; either engine's knobs apply
    plan = _native.validate(4, 32, 8, 128, 4096, "bf16", kv_dtype="fp8_e4m3")
    assert "Fp8E4m3" in plan and plan.startswith("Split("), plan
    plan = _native.validate(16, 32, 8, 128, 4096, "bf16", kv_dtype="fp8_e4m3")
    assert "Fp8E4m3" in plan and plan.startswith("Persistent("), plan
    plan = _native.validate(4, 32, 8, 128, 4096, "bf16", num_splits=2, kv_dtype="fp8_e4m3")
    assert "num_splits: 2" in plan, plan
    plan = _native.validate(4, 32, 8, 128, 4096, "bf16", engine="persistent", kv_dtype="fp8_e4m3")
    assert plan.startswith("Persistent("), plan
    with pytest.raises(ValueError, match="kv_dtype"):
        _native.validate(4, 32, 8, 128, 4096, "bf16", kv_dtype="e5m2")


# ---- score modifiers: window_size, softcap, sinks (the persistent engine only) ----

def sinks_tensor(shape=(HQ,), dtype=F32, **kw):
    return FakeTensor(shape, dtype, **kw)


def test_score_mod_constants():
    assert kvstream.SUPPORTED_HEAD_DIMS == (64, 96, 128, 256)
    assert kvstream.SPLIT_ENGINE_HEAD_DIMS == (64, 128)
    assert {"SUPPORTED_HEAD_DIMS", "SPLIT_ENGINE_HEAD_DIMS"} <= set(kvstream.__all__)
    doc = kvstream.decode.__doc__
    for word in ("window_size", "softcap", "sinks", "(-1, -1)", "includes", "s_aux"):
        assert word in doc, word


@pytest.mark.parametrize("bad", [128, "128, 0", None, (1.0, 0), (128, None), (True, 0),
                                 (128, 0.0), {128: 0}])
def test_window_size_type(bad):
    fails(TypeError, "window_size", repr(bad), "pair (left, right) of ints", window_size=bad)


@pytest.mark.parametrize("bad", [(-2, 0), (0, -2), (-1, -100), (2**31 - 1, 0), (0, 2**63),
                                 (1, 2, 3), (5,), ()])
def test_window_size_value(bad):
    fails(ValueError, "window_size", str(bad), "-1 (unbounded)", window_size=bad)


@pytest.mark.parametrize("bad", ["30", None, True, [30.0], 1j])
def test_softcap_type(bad):
    fails(TypeError, "softcap", repr(bad), "0.0 (off) or a finite positive number", softcap=bad)


@pytest.mark.parametrize("bad", [-1.0, -1e-9, -30, math.nan, math.inf, -math.inf, 1e39, 10**400])
def test_softcap_value(bad):
    fails(ValueError, "softcap", "0.0 (off) or a finite positive number", softcap=bad)


@pytest.mark.parametrize("shape", [(HQ + 1,), (HKV,), (1, HQ), (HQ, 1), (), (B, HQ)])
def test_sinks_shape(shape):
    fails(ValueError, "sinks", f"[{HQ}]", "per query head", sinks=sinks_tensor(shape))


@pytest.mark.parametrize("dt", [BF16, F16, I32, E4M3])
def test_sinks_dtype(dt):
    fails(TypeError, "sinks", str(dt), "torch.float32", sinks=sinks_tensor(dtype=dt))


def test_sinks_device_layout_and_type():
    fails(ValueError, "sinks", "cpu", sinks=sinks_tensor(device=FakeDevice("cpu", None)))
    fails(ValueError, "sinks", "cuda:1", "cuda:0", sinks=sinks_tensor(device=FakeDevice("cuda", 1)))
    fails(ValueError, "sinks", "contiguous", sinks=sinks_tensor(strides=(2,)))
    fails(TypeError, "sinks", "list", sinks=[0.0] * HQ)
    fails(TypeError, "sinks", "bool", sinks=True)


@pytest.mark.parametrize(
    "over",
    [
        dict(window_size=(128, 0)),
        dict(window_size=[128, 0]),
        dict(window_size=(-1, -1)),
        dict(window_size=(0, 0)),
        dict(window_size=(2**31 - 2, 2**31 - 2)),
        dict(softcap=30.0),
        dict(softcap=50),
        dict(softcap=0),
        dict(sinks=sinks_tensor()),
        dict(window_size=(127, 0), softcap=30.0, sinks=sinks_tensor(), engine="persistent"),
        dict(window_size=(128, 0), sinks=sinks_tensor(), return_lse=True,
             out=FakeTensor((B, 1, HQ, D)), cache_seqlens=FakeTensor((B,), I32)),
    ],
)
def test_score_mods_pass_validation(over):
    pos, _ = good()
    passes_validation(*pos, **over)


@pytest.mark.parametrize("d", [96, 256])
@pytest.mark.parametrize("q_len", [1, 4])
def test_score_mods_with_new_head_dims_paged_and_fp8_pass_validation(d, q_len):
    mods = dict(window_size=(128, 0), softcap=30.0, sinks=sinks_tensor(),
                cache_seqlens=FakeTensor((B,), I32), return_lse=True)
    q = FakeTensor((B, q_len, HQ, d))
    passes_validation(q, FakeTensor((NP, PS, HKV, d)), FakeTensor((NP, PS, HKV, d)),
                      block_table=FakeTensor((B, MP), I32), **mods)
    passes_validation(q, FakeTensor((B, L, HKV, d), E4M3), FakeTensor((B, L, HKV, d), E4M3),
                      k_scale=FakeTensor((HKV,), F32), v_scale=FakeTensor((1,), F32), **mods)


SPLIT_KNOBS = [dict(engine="split"), dict(num_splits=4), dict(reduction="kernel"),
               dict(reduction="cluster"), dict(device_plan=True)]


@pytest.mark.parametrize("knob", SPLIT_KNOBS)
@pytest.mark.parametrize(
    "feature,words",
    [
        (dict(window_size=(128, 0)), ("window_size", "(128, 0)", "(-1, 0)")),
        (dict(window_size=(-1, -1), q=FakeTensor((B, 4, HQ, D))), ("window_size", "(-1, -1)")),
        (dict(softcap=30.0), ("softcap", "30.0")),
        (dict(sinks=sinks_tensor()), ("sinks", "None")),
        (dict(q=FakeTensor((B, 1, HQ, 96)), k_cache=FakeTensor((B, L, HKV, 96)),
              v_cache=FakeTensor((B, L, HKV, 96))), ("head_dim", "96", "64 or 128")),
        (dict(q=FakeTensor((B, HQ, 256)), k_cache=FakeTensor((B, L, HKV, 256)),
              v_cache=FakeTensor((B, L, HKV, 256))), ("head_dim", "256", "64 or 128")),
    ],
)
def test_split_engine_refuses_score_mods_and_new_head_dims(knob, feature, words):
    name = next(iter(knob))
    msg = fails(ValueError, *words, name, "persistent engine", **feature, **knob)
    assert "split engine" in msg, msg


def test_windows_that_bound_nothing_keep_the_split_engine():
    # one new token: the right side reaches nothing; a left side of capacity - 1 or more
    # reaches position 0 from anywhere: the default's window, so the split knobs apply
    pos, _ = good()
    for window in ((-1, -1), (-1, 5), (L - 1, 0), (L + 100, -1)):
        passes_validation(*pos, window_size=window, num_splits=4)
    # four new tokens: a right side of 3 or more sees every later new token, as -1 does
    q4 = FakeTensor((B, 4, HQ, D))
    fails(ValueError, "window_size", "(-1, 3)", q=q4, window_size=(-1, 3), num_splits=4)
    fails(ValueError, "window_size", "(-1, 2)", q=q4, window_size=(-1, 2), num_splits=4)
    fails(ValueError, "window_size", "(254, 0)", window_size=(254, 0), num_splits=4)
    # a paged cache's capacity is max_pages * page_size
    args = paged(window_size=(MP * PS - 1, 0), num_splits=4)
    passes_validation(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
    paged_fails(ValueError, "window_size", window_size=(MP * PS - 2, 0), num_splits=4)


def test_native_validate_score_mods():
    args = (1, 16, 2, 128, 4096, "bf16")  # one request: the split engine by default
    assert _native.validate(*args).startswith("Split(")
    assert _native.validate(*args, window_size=(-1, 0), softcap=0.0, sinks=False).startswith(
        "Split(")
    # any score modifier or a new head dim takes the persistent engine
    for kw in (dict(window_size=(128, 0)), dict(window_size=(-1, -1), q_len=4),
               dict(softcap=30.0), dict(sinks=True), dict(head_dim=96), dict(head_dim=256),
               dict(head_dim=256, q_len=4, window_size=(128, 0), softcap=30.0, sinks=True,
                    page_size=16, num_pages=300),
               dict(head_dim=96, kv_dtype="fp8_e4m3", window_size=(128, 0), sinks=True)):
        a = dict(zip(("batch", "hq", "hkv", "head_dim", "max_len", "dtype"), args))
        a.update(kw)
        plan = _native.validate(**a)
        assert plan.startswith("Persistent("), (kw, plan)
    # the split engine names what it does not serve
    for kw, why in ((dict(window_size=(128, 0)), "window_size (128, 0)"),
                    (dict(softcap=30.0), "softcap"), (dict(sinks=True), "sinks"),
                    (dict(head_dim=96), "head dim 96")):
        a = dict(zip(("batch", "hq", "hkv", "head_dim", "max_len", "dtype"), args))
        a.update(kw)
        for knob in SPLIT_KNOBS:
            with pytest.raises(ValueError) as e:
                _native.validate(**a, **knob)
            msg = str(e.value)
            assert "engine" in msg and why in msg and "persistent" in msg, (knob, msg)


def store_args(**over):
    args = dict(
        k=FakeTensor((5, HKV, D)), v=FakeTensor((5, HKV, D)),
        k_cache=FakeTensor((B, L, HKV, D), E4M3), v_cache=FakeTensor((B, L, HKV, D), E4M3),
        slot_mapping=FakeTensor((5,), I64),
    )
    args.update(over)
    return args


def store_fails(exc, *words, **over):
    a = store_args(**over)
    with pytest.raises(exc) as e:
        kvstream.store_kv(a.pop("k"), a.pop("v"), a.pop("k_cache"), a.pop("v_cache"),
                          a.pop("slot_mapping"), **a)
    for w in words:
        assert w in str(e.value), f"{w!r} not in {str(e.value)!r}"


def test_store_kv_validation():
    store_fails(TypeError, "slot_mapping", "torch.int64", slot_mapping=FakeTensor((5,), I32))
    store_fails(ValueError, "slot_mapping", "[5]", slot_mapping=FakeTensor((4,), I64))
    store_fails(ValueError, "v has shape", v=FakeTensor((4, HKV, D)))
    store_fails(ValueError, "k_cache", "[blocks, block_size", k_cache=FakeTensor((B, L, HKV + 1, D), E4M3),
                v_cache=FakeTensor((B, L, HKV + 1, D), E4M3))
    store_fails(TypeError, "k_cache", "float8_e4m3fn", k_cache=FakeTensor((B, L, HKV, D), F32),
                v_cache=FakeTensor((B, L, HKV, D), F32))
    store_fails(ValueError, "k_scale", "scales belong to", k_cache=FakeTensor((B, L, HKV, D)),
                v_cache=FakeTensor((B, L, HKV, D)), k_scale=FakeTensor((1,), F32))
    store_fails(ValueError, "v_scale", "per KV head", v_scale=FakeTensor((3,), F32))
    store_fails(ValueError, "head_dim", "64, 96, 128 or 256", k=FakeTensor((5, HKV, 80)),
                v=FakeTensor((5, HKV, 80)))


def test_store_kv_signature():
    sig = inspect.signature(kvstream.store_kv)
    assert list(sig.parameters) == ["k", "v", "k_cache", "v_cache", "slot_mapping", "k_scale",
                                    "v_scale"]
    assert "store_kv" in kvstream.__all__ and "fp8_scales" in kvstream.__all__


# ---- MLA decode ------------------------------------------------------------------------------

def mla_fails(exc, *words, **over):
    args = dict(
        q=FakeTensor((B, 1, 16, 576)),
        kv_cache=FakeTensor((B, L, 576)),
        softmax_scale=0.0722,
    )
    args.update(over)
    q, kv = args.pop("q"), args.pop("kv_cache")
    with pytest.raises(exc) as e:
        kvstream.mla_decode(q, kv, **args)
    msg = str(e.value)
    assert "kvstream.mla_decode" in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_mla_signature_and_constants():
    sig = inspect.signature(kvstream.mla_decode)
    names = [p.name for p in sig.parameters.values()]
    assert names == ["q", "kv_cache", "softmax_scale", "cache_seqlens", "block_table",
                     "kv_scale", "return_lse", "out"]
    assert sig.parameters["softmax_scale"].default is inspect.Parameter.empty
    assert (kvstream.MLA_DIM, kvstream.MLA_V_DIM) == (576, 512)
    assert "Example" in kvstream.mla_decode.__doc__
    assert hasattr(_native, "MlaDecoder")


def test_mla_shapes_are_checked():
    mla_fails(ValueError, "q", "576", q=FakeTensor((B, 1, 16, 512)))
    mla_fails(ValueError, "q_len", q=FakeTensor((B, 9, 16, 576)))
    mla_fails(ValueError, "hq", q=FakeTensor((B, 1, 129, 576)))
    mla_fails(ValueError, "kv_cache", kv_cache=FakeTensor((B, L, 2, 576)))
    mla_fails(ValueError, "kv_cache", "batch", kv_cache=FakeTensor((B + 1, L, 576)))
    mla_fails(ValueError, "page_size", kv_cache=FakeTensor((64, 48, 576)),
              block_table=FakeTensor((B, 4), dtype=I32))
    mla_fails(ValueError, "block_table", kv_cache=FakeTensor((64, 64, 576)),
              block_table=FakeTensor((B + 1, 4), dtype=I32))
    mla_fails(ValueError, "cache_seqlens", cache_seqlens=FakeTensor((B + 1,), dtype=I32))
    mla_fails(ValueError, "out", out=FakeTensor((B, 1, 16, 576)))


def test_mla_dtypes_and_scales_are_checked():
    mla_fails(TypeError, "kv_cache", kv_cache=FakeTensor((B, L, 576), dtype=F16))
    mla_fails(TypeError, "kv_cache", kv_cache=FakeTensor((B, L, 576), dtype=E5M2))
    # an e4m3 cache needs its scale; a bf16 one takes none
    mla_fails(ValueError, "kv_scale", kv_cache=FakeTensor((B, L, 576), dtype=E4M3))
    mla_fails(ValueError, "kv_scale", kv_scale=FakeTensor((1,), dtype=F32))
    mla_fails(ValueError, "kv_scale", "per request", kv_cache=FakeTensor((B, L, 576), dtype=E4M3),
              kv_scale=FakeTensor((B + 1,), dtype=F32))
    # an e4m3 page of one row is refused
    mla_fails(ValueError, "page_size", kv_cache=FakeTensor((64, 1, 576), dtype=E4M3),
              block_table=FakeTensor((B, 4), dtype=I32), kv_scale=FakeTensor((1,), dtype=F32))


@pytest.mark.parametrize("scale", [None, 0.0, -1.0, float("inf"), "0.1", True])
def test_mla_softmax_scale_is_required_and_checked(scale):
    mla_fails((TypeError, ValueError), "softmax_scale", softmax_scale=scale)


def test_native_mla_decoder_rejects_fields():
    for kw, field in [(dict(hq=200), "hq"), (dict(q_len=9), "q_len"),
                      (dict(softmax_scale=0.0), "softmax_scale")]:
        args = dict(batch=1, hq=16, q_len=1, max_len=4096, dtype="bf16", softmax_scale=0.07)
        args.update(kw)
        with pytest.raises(ValueError, match=field):
            _native.MlaDecoder(**args)


# ---- the decoder cache (pure Python: fake decoders and streams) ----


class FakeStream:
    def __init__(self):
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1


@pytest.fixture
def decoder_cache():
    """An empty decoder cache of capacity 3, restored afterwards."""
    kvstream.clear_cache(include_captured=True)
    kvstream.set_decoder_cache_size(3)
    yield kvstream
    kvstream.clear_cache(include_captured=True)
    kvstream.set_decoder_cache_size(kvstream.DEFAULT_DECODER_CACHE_SIZE)


def _get(key, capturing=False):
    return kvstream._decoder_for(key, lambda: f"decoder {key}", capturing)


def test_decoder_cache_drops_the_least_recently_used(decoder_cache):
    streams = {}
    for key in ("a", "b", "c"):
        c = _get(key)
        c.stream = streams[key] = FakeStream()
    assert _get("a").decoder == "decoder a"  # a is now the most recently used
    _get("d")
    assert decoder_cache.decoder_cache_info() == {"size": 3, "captured": 0, "capacity": 3}
    assert list(kvstream._decoders) == ["c", "a", "d"]
    # b was dropped after its stream's work, the others were not waited for
    assert (streams["a"].syncs, streams["b"].syncs, streams["c"].syncs) == (0, 1, 0)
    made = []
    kvstream._decoder_for("b", lambda: made.append(1) or "new b", False)
    assert made == [1]  # made again


def test_decoder_cache_keeps_what_a_graph_captured(decoder_cache):
    _get("a")
    _get("a", capturing=True)  # a graph captured it after the warm-up
    for key in ("b", "c", "d", "e"):
        _get(key)
    assert list(kvstream._decoders) == ["a", "d", "e"]
    assert decoder_cache.decoder_cache_info()["captured"] == 1
    decoder_cache.set_decoder_cache_size(1)
    assert list(kvstream._decoders) == ["a"]  # over capacity, but captured
    decoder_cache.clear_cache()
    assert list(kvstream._decoders) == ["a"]
    decoder_cache.clear_cache(include_captured=True)
    assert decoder_cache.decoder_cache_info() == {"size": 0, "captured": 0, "capacity": 1}


def test_decoder_cache_keeps_a_warm_up_next_to_captured_decoders(decoder_cache):
    # every slot held by captured decoders: a warm-up's decoder stays for the capture after it
    decoder_cache.set_decoder_cache_size(1)
    _get("a")
    _get("a", capturing=True)
    _get("b")  # warm-up
    assert _get("b", capturing=True).decoder == "decoder b"
    assert decoder_cache.decoder_cache_info() == {"size": 2, "captured": 2, "capacity": 1}
    _get("c")  # the uncaptured ones still go, beyond the newest
    assert list(kvstream._decoders) == ["a", "b", "c"]
    _get("d")
    assert list(kvstream._decoders) == ["a", "b", "d"]


def test_decoder_cache_makes_nothing_while_capturing(decoder_cache):
    with pytest.raises(RuntimeError, match="warm-up"):
        _get("never warmed up", capturing=True)
    assert decoder_cache.decoder_cache_info()["size"] == 0


@pytest.mark.parametrize("bad", [0, -4])
def test_decoder_cache_size_value(bad):
    with pytest.raises(ValueError, match=rf"size is {bad}, allowed: size >= 1"):
        kvstream.set_decoder_cache_size(bad)


@pytest.mark.parametrize("bad", [2.0, "8", True, None])
def test_decoder_cache_size_type(bad):
    with pytest.raises(TypeError, match="size must be an int"):
        kvstream.set_decoder_cache_size(bad)


def test_clear_cache_argument_type():
    with pytest.raises(TypeError, match="include_captured must be a bool"):
        kvstream.clear_cache(include_captured=1)


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda_visible(), reason="a GPU is visible: test_gpu.py runs the self-test")
def test_self_test_says_what_is_missing():
    # without a GPU (usually without torch too) it must say which of the two it lacks, not crash
    with pytest.raises(RuntimeError, match="PyTorch is not importable|torch sees no CUDA device"):
        kvstream.self_test()


def test_views_of_a_growing_cache_share_one_decoder():
    # cache[:, :n] of a [b, Lmax, hkv, d] cache: one decoder for each power of two of n (at
    # least 256), capped by the memory behind the view, which then reads the first n positions
    b, Lmax, hkv, d, hq = 3, 1000, 2, 128, 16

    def spec(n, batch=b, lmax=Lmax, contiguous_storage=True):
        row = hkv * d
        q = FakeTensor((batch, 1, hq, d))
        strides = (lmax * row, row, d, 1) if batch > 1 else None
        k = FakeTensor((batch, n, hkv, d), strides=strides, storage_elems=batch * lmax * row)
        return kvstream._check_decode(q, k, k, None, None, None, (-1, 0), 0.0, None, None,
                                      None, False, None, None, None, False, None)

    first = spec(300)
    assert first.view_len == 300 and first.key[4] == 512
    for n in (257, 400, 511, 512):
        s = spec(n)
        assert s.key == first.key and s.view_len == (n if n < 512 else None), n
    assert spec(513).key[4] == 1000 and spec(513).view_len == 513  # the buffer ends at 1000
    assert spec(1000).view_len is None and spec(1000).key[4] == 1000
    assert spec(10).key[4] == 256 and spec(10).view_len == 10
    # one request: the view is contiguous, its batch stride meaningless
    ones = {spec(n, batch=1).key for n in (300, 301, 480, 512)}
    assert len(ones) == 1
    # a cache whose storage ends with the view: read as it is
    exact = FakeTensor((b, 300, hkv, d))
    s = kvstream._check_decode(FakeTensor((b, 1, hq, d)), exact, exact, None, None, None,
                               (-1, 0), 0.0, None, None, None, False, None, None, None, False,
                               None)
    assert s.view_len is None and s.key[4] == 300
