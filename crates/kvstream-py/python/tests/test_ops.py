"""The torch custom ops behind kvstream.decode, mla_decode and store_kv, without a GPU.

Registration on first use, the schemas, the fake implementations (output shapes and dtypes, the
same argument errors as eager) under FakeTensorMode with CUDA fake tensors, and tracing:
make_fx, torch.compile(fullgraph=True) with a graph-recording backend (also through AOT
functionalization and dynamic shapes) and torch.export. Skipped where torch (>= 2.4, for
torch.library.register_fake) is not importable; test_gpu.py runs the ops on a GPU.
"""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "register_fake"):
    pytest.skip(f"torch {torch.__version__} has no torch.library.register_fake",
                allow_module_level=True)

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import kvstream  # noqa: E402
from kvstream import _ops  # noqa: E402  (registers the ops)

OPS = ("decode", "decode_out", "mla_decode", "mla_decode_out", "store_kv", "merge_states",
       "merge_states_out")
B, L, HQ, HKV, D = 2, 256, 16, 2, 128
BF16 = torch.bfloat16


def run(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_registered_at_first_call_with_torch_tensors():
    # a fresh interpreter: neither importing kvstream nor torch registers them; the first call
    # with torch tensors does (here one that fails its checks: CPU tensors)
    out = run(
        "import sys, torch, kvstream\n"
        "print(hasattr(torch.ops.kvstream, 'decode'), 'kvstream._ops' in sys.modules)\n"
        "q = torch.zeros(2, 1, 16, 128, dtype=torch.bfloat16)\n"
        "k = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)\n"
        "try:\n"
        "    kvstream.decode(q, k, k)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "print(*(hasattr(torch.ops.kvstream, n) for n in %r))\n" % (OPS,)
    )
    assert out.splitlines() == [
        "False False",
        "kvstream.decode: q must be on a CUDA device, got a tensor on cpu",
        " ".join(["True"] * len(OPS)),
    ], out


def test_register_returns_the_namespace():
    assert _ops.register() is torch.ops.kvstream
    for name in OPS:
        assert hasattr(torch.ops.kvstream, name)
    # importing the module again (a reload) registers nothing twice
    import importlib

    lib = kvstream._torch_library
    importlib.reload(_ops)
    assert _ops.register() is torch.ops.kvstream and kvstream._torch_library is lib


DECODE_OPT = (
    "Tensor? cache_seqlens=None, Tensor? block_table=None, float? softmax_scale=None, "
    "int[] window_size=[-1, 0], float softcap=0., Tensor? sinks=None, int? num_splits=None, "
    "str? reduction=None, bool device_plan=False, str? engine=None, Tensor? k_scale=None, "
    "Tensor? v_scale=None"
)
MLA_OPT = "Tensor? cache_seqlens=None, Tensor? block_table=None, Tensor? kv_scale=None"
EXPECTED_SCHEMAS = {
    "decode": "kvstream::decode(Tensor q, Tensor k_cache, Tensor v_cache, " + DECODE_OPT
    + ", bool return_lse=False) -> (Tensor, Tensor)",
    "decode_out": "kvstream::decode_out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, "
    "Tensor(b!)? lse=None, " + DECODE_OPT + ") -> ()",
    "mla_decode": "kvstream::mla_decode(Tensor q, Tensor kv_cache, float softmax_scale, " + MLA_OPT
    + ", bool return_lse=False) -> (Tensor, Tensor)",
    "mla_decode_out": "kvstream::mla_decode_out(Tensor q, Tensor kv_cache, float softmax_scale, "
    "Tensor(a!) out, Tensor(b!)? lse=None, " + MLA_OPT + ") -> ()",
    "store_kv": "kvstream::store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()",
    "merge_states": "kvstream::merge_states(Tensor outputs, Tensor lses, Tensor? sinks=None, "
    "bool return_lse=True) -> (Tensor, Tensor)",
    "merge_states_out": "kvstream::merge_states_out(Tensor outputs, Tensor lses, Tensor(a!) out, "
    "Tensor(b!)? lse=None, Tensor? sinks=None) -> ()",
}


@pytest.mark.parametrize("name", OPS)
def test_schema(name):
    op = getattr(torch.ops.kvstream, name).default
    assert str(op._schema) == EXPECTED_SCHEMAS[name]
    written = {a.name for a in op._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"decode": set(), "decode_out": {"out", "lse"}, "mla_decode": set(),
                       "mla_decode_out": {"out", "lse"}, "store_kv": {"k_cache", "v_cache"},
                       "merge_states": set(), "merge_states_out": {"out", "lse"}}[name]
    # the Python functions keep their own signatures (test_api checks them); the ops' argument
    # names are theirs
    fn = getattr(kvstream, name.replace("_out", ""))
    import inspect

    params = set(inspect.signature(fn).parameters) | {"out", "lse"}
    assert {a.name for a in op._schema.arguments} <= params
    assert _ops.SCHEMAS[name] in str(op._schema)


def test_ops_take_every_device_and_check_like_the_functions():
    # a direct op call with CPU tensors gets kvstream's error, as the function does
    q = torch.zeros(B, 1, HQ, D, dtype=BF16)
    k = torch.zeros(B, L, HKV, D, dtype=BF16)
    for call in (lambda: kvstream.decode(q, k, k), lambda: torch.ops.kvstream.decode(q, k, k),
                 lambda: torch.ops.kvstream.decode_out(q, k, k, torch.empty_like(q))):
        with pytest.raises(ValueError, match="kvstream.decode: q must be on a CUDA device"):
            call()
    kv = torch.zeros(B, L, 576, dtype=BF16)
    with pytest.raises(ValueError, match="kvstream.mla_decode: q must be on a CUDA device"):
        torch.ops.kvstream.mla_decode(torch.zeros(B, 1, 16, 576, dtype=BF16), kv, 0.07)
    with pytest.raises(ValueError, match="kvstream.store_kv: k must be on a CUDA device"):
        rows = torch.zeros(3, HKV, D, dtype=BF16)
        torch.ops.kvstream.store_kv(rows, rows, k, k, torch.zeros(3, dtype=torch.int64))


# ---- fake tensors: CUDA tensors without a GPU ----

@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def cuda(*shape, dtype=BF16):
    return torch.empty(*shape, device="cuda", dtype=dtype)


def test_fake_cuda_tensors_need_no_gpu(fake):
    x = cuda(2, 3)
    assert x.is_cuda and str(x.device) == "cuda:0"


@pytest.mark.parametrize("q_shape", [(B, 1, HQ, D), (B, 4, HQ, D), (B, HQ, D)])
@pytest.mark.parametrize("return_lse", [False, True])
def test_fake_decode_shapes(fake, q_shape, return_lse):
    q, k, v = cuda(*q_shape), cuda(B, L, HKV, D), cuda(B, L, HKV, D)
    lens = cuda(B, dtype=torch.int32)
    res = kvstream.decode(q, k, v, cache_seqlens=lens, return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    assert out.shape == q.shape and out.dtype == BF16 and out.is_cuda
    if return_lse:
        assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32 and lse.is_cuda
    # the op itself: always (out, lse), lse empty unless asked for
    o, l2 = torch.ops.kvstream.decode(q, k, v, lens, return_lse=return_lse)
    assert o.shape == q.shape and l2.dtype == torch.float32
    assert l2.shape == (q.shape[:-1] if return_lse else (0,))


def test_fake_decode_out_returns_out(fake):
    q, k = cuda(B, 1, HQ, D), cuda(B, L, HKV, D)
    out = torch.empty_like(q)
    assert kvstream.decode(q, k, k, out=out) is out
    res, lse = kvstream.decode(q, k, k, out=out, return_lse=True)
    assert res is out and lse.shape == (B, 1, HQ) and lse.dtype == torch.float32
    assert torch.ops.kvstream.decode_out(q, k, k, out, torch.empty(B, 1, HQ, device="cuda")) is None


def test_fake_decode_paged_fp8_and_score_mods(fake):
    q = cuda(B, 3, HQ, 256)
    pool = cuda(40, 16, HKV, 256, dtype=torch.float8_e4m3fn)
    table = cuda(B, 16, dtype=torch.int32)
    scale = cuda(HKV, dtype=torch.float32)
    sinks = cuda(HQ, dtype=torch.float32)
    out, lse = kvstream.decode(q, pool, pool, cache_seqlens=cuda(B, dtype=torch.int32),
                               block_table=table, k_scale=scale, v_scale=scale,
                               window_size=(127, 0), softcap=30.0, sinks=sinks, return_lse=True)
    assert out.shape == q.shape and out.dtype == BF16 and lse.shape == (B, 3, HQ)


@pytest.mark.parametrize("q_shape", [(B, 2, 16, 576), (B, 16, 576)])
def test_fake_mla_shapes(fake, q_shape):
    q, kv = cuda(*q_shape), cuda(B, L, 576)
    out, lse = kvstream.mla_decode(q, kv, softmax_scale=0.07, return_lse=True)
    assert out.shape == q_shape[:-1] + (512,) and out.dtype == BF16
    assert lse.shape == q_shape[:-1] and lse.dtype == torch.float32
    out2 = cuda(*q_shape[:-1], 512)
    assert kvstream.mla_decode(q, kv, softmax_scale=0.07, out=out2) is out2


def test_fake_store_kv(fake):
    k = cuda(5, HKV, D)
    cache = cuda(B, L, HKV, D)
    assert kvstream.store_kv(k, k, cache, cache, cuda(5, dtype=torch.int64)) is None


@pytest.mark.parametrize("rows", [(B, 1, HQ), (B, HQ), (3, 2, 4, 8)])
def test_fake_merge_states_shapes(fake, rows):
    n, d = 4, 512
    outputs, lses = cuda(n, *rows, d), cuda(n, *rows, dtype=torch.float32)
    out, lse = kvstream.merge_states(outputs, lses, sinks=cuda(rows[-1], dtype=torch.float32))
    assert out.shape == (*rows, d) and out.dtype == BF16 and lse.shape == rows
    assert lse.dtype == torch.float32
    given = cuda(*rows, d)
    assert kvstream.merge_states(outputs, lses, out=given, return_lse=False) is given
    o, l2 = torch.ops.kvstream.merge_states(outputs, lses, return_lse=False)
    assert o.shape == (*rows, d) and l2.shape == (0,)
    # an all-gathered buffer with padding between the shards, and a strided row dimension
    gathered = cuda(n, B * HQ * 128 + 64)[:, : B * HQ * 128].view(n, B, HQ, 128)
    assert kvstream.merge_states(gathered, cuda(n, B, HQ, dtype=torch.float32))[0].shape == (
        B, HQ, 128)
    spaced = cuda(n, B, HQ, 2 * 128)[..., :128]
    assert kvstream.merge_states(spaced, cuda(n, B, HQ, dtype=torch.float32))[0].shape == (
        B, HQ, 128)


def test_fake_merge_states_errors(fake):
    n = 3
    outputs, lses = cuda(n, B, HQ, D), cuda(n, B, HQ, dtype=torch.float32)
    cases = [
        (ValueError, "kvstream.merge_states: lses has shape [3, 2, 8], allowed: [3, 2, 16]",
         lambda: kvstream.merge_states(outputs, cuda(n, B, 8, dtype=torch.float32))),
        (TypeError, "kvstream.merge_states: lses has dtype torch.bfloat16",
         lambda: kvstream.merge_states(outputs, cuda(n, B, HQ))),
        (TypeError, "kvstream.merge_states: outputs has dtype torch.float32",
         lambda: kvstream.merge_states(cuda(n, B, HQ, D, dtype=torch.float32), lses)),
        (ValueError, "a last dimension that is a multiple of 8",
         lambda: kvstream.merge_states(cuda(n, B, HQ, 100), lses)),
        (ValueError, "at least 3 dimensions",
         lambda: kvstream.merge_states(cuda(n, D), cuda(n, dtype=torch.float32))),
        (ValueError, "kvstream.merge_states: outputs has strides",
         lambda: kvstream.merge_states(cuda(n, HQ, B, D).transpose(1, 2), lses)),
        (ValueError, "kvstream.merge_states: lses has strides",
         lambda: kvstream.merge_states(outputs, cuda(n, HQ, B, dtype=torch.float32)
                                       .transpose(1, 2))),
        (ValueError, "kvstream.merge_states: sinks has shape [2], allowed: [16]",
         lambda: kvstream.merge_states(outputs, lses, sinks=cuda(2, dtype=torch.float32))),
        (ValueError, "kvstream.merge_states: out has shape [2, 16, 64], allowed: [2, 16, 128]",
         lambda: kvstream.merge_states(outputs, lses, out=cuda(B, HQ, 64))),
        (ValueError, "kvstream.merge_states: lse has shape [2, 8], allowed: [2, 16]",
         lambda: torch.ops.kvstream.merge_states_out(outputs, lses, cuda(B, HQ, D),
                                                     cuda(B, 8, dtype=torch.float32))),
    ]
    for exc, text, call in cases:
        with pytest.raises(exc, match=text.replace("[", r"\[").replace("]", r"\]")):
            call()


def test_fake_errors_are_the_eager_ones(fake):
    # checked on the fake tensors' shapes and dtypes, with decode's messages
    q, k = cuda(B, 1, HQ, D), cuda(B, L, HKV, D)
    cases = [
        (ValueError, "kvstream.decode: cache_seqlens has shape [3], allowed: [2]",
         lambda: torch.ops.kvstream.decode(q, k, k, cuda(3, dtype=torch.int32))),
        (TypeError, "kvstream.decode: cache_seqlens has dtype torch.int64",
         lambda: kvstream.decode(q, k, k, cache_seqlens=cuda(B, dtype=torch.int64))),
        (ValueError, "q_len = 9",
         lambda: torch.ops.kvstream.decode(cuda(B, 9, HQ, D), k, k)),
        (ValueError, "window_size is (128, 0) with num_splits=4",
         lambda: torch.ops.kvstream.decode(q, k, k, window_size=[128, 0], num_splits=4)),
        (ValueError, "kvstream.decode: out has shape",
         lambda: torch.ops.kvstream.decode_out(q, k, k, cuda(B, 1, HQ, 64))),
        (ValueError, "kvstream.decode: lse has shape [2, 16], allowed: [2, 1, 16]",
         lambda: torch.ops.kvstream.decode_out(q, k, k, torch.empty_like(q),
                                              cuda(B, HQ, dtype=torch.float32))),
        (TypeError, "kvstream.decode: lse has dtype torch.bfloat16",
         lambda: torch.ops.kvstream.decode_out(q, k, k, torch.empty_like(q), cuda(B, 1, HQ))),
        (ValueError, "kvstream.mla_decode: kv_scale is None",
         lambda: torch.ops.kvstream.mla_decode(cuda(B, 1, 16, 576),
                                               cuda(B, L, 576, dtype=torch.float8_e4m3fn), 0.07)),
        (ValueError, "kvstream.store_kv: slot_mapping has shape [4], allowed: [5]",
         lambda: torch.ops.kvstream.store_kv(cuda(5, HKV, D), cuda(5, HKV, D), k, k,
                                             cuda(4, dtype=torch.int64))),
    ]
    for exc, words, call in cases:
        with pytest.raises(exc) as e:
            call()
        assert words in str(e.value), (words, str(e.value))


def test_meta_tensors_give_shapes_only():
    # meta tensors (shape propagation): outputs of the right shapes, no device check
    q = torch.empty(B, 1, HQ, D, device="meta", dtype=BF16)
    k = torch.empty(B, L, HKV, D, device="meta", dtype=BF16)
    out, lse = torch.ops.kvstream.decode(q, k, k, return_lse=True)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (B, 1, HQ)
    m, _ = torch.ops.kvstream.mla_decode(torch.empty(B, 1, 8, 576, device="meta", dtype=BF16),
                                         torch.empty(B, L, 576, device="meta", dtype=BF16), 0.07)
    assert m.shape == (B, 1, 8, 512)


# ---- the checked spec handed from the function to its op ----

def test_spec_is_reused_only_for_the_same_arguments():
    calls = []

    def check(*args):
        calls.append(args)
        return "checked"

    a, b = torch.zeros(1), torch.zeros(1)
    spec = kvstream._Spec("decode", ("cuda", 0), (), None, (), (), None, (a, (-1, 0), 30, None))
    for args, reused in [((a, [-1, 0], 30.0, None), True), ((b, [-1, 0], 30.0, None), False),
                         ((a, [-1, 1], 30.0, None), False), ((a, [-1, 0], 30.0, b), False)]:
        _ops._handoff.spec = spec
        got, handed = _ops._spec(check, args)
        assert handed is reused and (got is spec) is reused, args
        assert _ops._handoff.spec is None  # taken at most once
    assert len(calls) == 3
    # nothing handed over: checked
    assert _ops._spec(check, (a,)) == ("checked", False)
    # bools are not ints here
    assert not _ops._same((True,), (1,))


# ---- tracing ----

def decode_layer(q, k, v, lens, out, kc, vc, kn, slots):
    """A decode step as a model writes it: append to a cache, attend (functional and out=),
    then MLA."""
    kvstream.store_kv(kn, kn, kc, vc, slots)
    o, lse = kvstream.decode(q, k, v, cache_seqlens=lens, window_size=(127, 0), softcap=30.0,
                             return_lse=True)
    r = kvstream.decode(q, kc, vc, cache_seqlens=lens, out=out)
    m = kvstream.mla_decode(q.new_zeros(B, 1, 16, 576), k.new_zeros(B, 64, 576), softmax_scale=0.07)
    return o * 2, lse, r, m


def layer_inputs():
    q, k = cuda(B, 1, HQ, D), cuda(B, L, HKV, D)
    return (q, k, torch.empty_like(k), cuda(B, dtype=torch.int32), torch.empty_like(q),
            torch.empty_like(k), torch.empty_like(k), cuda(B, HKV, D),
            cuda(B, dtype=torch.int64))


def kvstream_calls(gm):
    return sorted(str(n.target) for n in gm.graph.nodes
                  if n.op == "call_function" and "kvstream" in str(n.target))


def test_make_fx_records_the_ops(fake):
    gm = make_fx(decode_layer)(*layer_inputs())
    calls = kvstream_calls(gm)
    assert calls == ["kvstream.decode.default", "kvstream.decode_out.default",
                     "kvstream.mla_decode.default", "kvstream.store_kv.default"], calls


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_traces_through(fake, dynamic):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(decode_layer, fullgraph=True, backend=backend, dynamic=dynamic)
    inputs = layer_inputs()
    o, lse, r, m = compiled(*inputs)
    assert o.shape == (B, 1, HQ, D) and lse.shape == (B, 1, HQ) and m.shape == (B, 1, 16, 512)
    assert len(graphs) == 1
    # no graph inputs but the tensors (and, with dynamic shapes, their sizes): the scalars of
    # the calls are constants
    inputs_seen = [n.name for n in graphs[0].graph.nodes if n.op == "placeholder"]
    assert all(n.startswith(("L_", "l_", "s")) for n in inputs_seen), inputs_seen
    assert kvstream_calls(graphs[0]) == [
        "kvstream.decode.default", "kvstream.decode_out.default", "kvstream.mla_decode.default",
        "kvstream.store_kv.default"]


def test_torch_compile_functionalizes_the_mutations(fake):
    # through AOTAutograd (what inductor compiles): store_kv and decode_out become
    # auto_functionalized, whose outputs feed the next op
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def fw(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(decode_layer, fullgraph=True, backend=aot_autograd(fw_compiler=fw))
    compiled(*layer_inputs())
    text = graphs[0].code
    assert text.count("auto_functionalized") >= 2, text
    for name in ("store_kv", "decode_out", "decode.default", "mla_decode"):
        assert f"torch.ops.kvstream.{name}" in text, name


def test_torch_compile_first_call_in_a_fresh_interpreter():
    # the very first kvstream call is traced (the ops are registered during tracing)
    out = run(
        "import sys, torch, kvstream\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "graphs = []\n"
        "def backend(gm, ex):\n"
        "    graphs.append(gm)\n"
        "    return gm.forward\n"
        "@torch.compile(fullgraph=True, backend=backend)\n"
        "def f(q, k, lens):\n"
        "    return kvstream.decode(q, k, k, cache_seqlens=lens) + 1\n"
        "with FakeTensorMode():\n"
        "    q = torch.empty(2, 1, 16, 128, device='cuda', dtype=torch.bfloat16)\n"
        "    k = torch.empty(2, 64, 2, 128, device='cuda', dtype=torch.bfloat16)\n"
        "    lens = torch.empty(2, device='cuda', dtype=torch.int32)\n"
        "    print(tuple(f(q, k, lens).shape))\n"
        "print('torch.ops.kvstream.decode.default' in graphs[0].code)\n"
    )
    assert out.splitlines()[-2:] == ["(2, 1, 16, 128)", "True"], out


def test_torch_compile_reports_check_errors(fake):
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, lens):
        return kvstream.decode(q, k, k, cache_seqlens=lens)

    with pytest.raises(Exception) as e:
        f(cuda(B, 1, HQ, D), cuda(B, L, HKV, D), cuda(B + 1, dtype=torch.int32))
    assert "kvstream.decode: cache_seqlens has shape [3], allowed: [2]" in str(e.value)


def test_export_strict(fake):
    class Layer(torch.nn.Module):
        def forward(self, *args):
            return decode_layer(*args)

    ep = torch.export.export(Layer(), layer_inputs(), strict=True)
    text = ep.graph_module.code
    for name in ("store_kv", "decode", "decode_out", "mla_decode"):
        assert f"torch.ops.kvstream.{name}.default" in text, name


# ---- the ops run: CPU tensors, the CUDA launches replaced by torch stand-ins ----
#
# The checks refuse CPU tensors and the launches need a GPU; replacing both (in kvstream, which
# the Python functions call, and in kvstream._ops, which the op implementations call) runs
# everything else as on a GPU: the function, the op, its implementation, the spec handed over,
# out= and lse, and what torch.compile (inductor) makes of the ops and their mutations.

class StandIn:
    def __init__(self):
        self.checks = {"function": 0, "op": 0}
        self.launches = []

    def check(self, where, kind):
        def check(*args, fake=False):
            if not fake:
                self.checks[where] += 1
            q = args[0]
            qs = tuple(q.shape)
            out_shape = qs[:-1] + (512,) if kind == "mla" else qs
            return kvstream._Spec(kind, ("cpu", None), (), None, out_shape, qs[:-1], None, args)
        return check

    def decode(self, spec, q, k_cache, v_cache, cache_seqlens, block_table, sinks, out, lse):
        self.launches.append("decode")
        out.copy_(q * 2 + k_cache.sum() + v_cache.sum())
        if lse is not None:
            lse.copy_(q.float().sum(-1))

    def mla(self, spec, q, kv_cache, cache_seqlens, block_table, out, lse):
        self.launches.append("mla_decode")
        out.copy_(q[..., :512] * 3)
        if lse is not None:
            lse.copy_(q.float().sum(-1))

    def store(self, spec, k, v, k_cache, v_cache, slot_mapping):
        self.launches.append("store_kv")
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


@pytest.fixture
def stand_in(monkeypatch):
    s = StandIn()
    for kind, name in (("decode", "_check_decode"), ("mla", "_check_mla"),
                       ("store", "_check_store")):
        monkeypatch.setattr(kvstream, name, s.check("function", kind))
        monkeypatch.setattr(_ops, name, s.check("op", kind))
    monkeypatch.setattr(_ops, "_check_lse", lambda *a, **kw: None)
    monkeypatch.setattr(_ops, "_launch_decode", s.decode)
    monkeypatch.setattr(_ops, "_launch_mla", s.mla)
    monkeypatch.setattr(_ops, "_launch_store", s.store)
    return s


def cpu_inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g).to(BF16)  # noqa: E731
    return dict(q=r(B, 1, HQ, D), k_cache=r(B, 8, HKV, D), v_cache=r(B, 8, HKV, D),
                k_new=r(B, HKV, D), v_new=r(B, HKV, D), slots=torch.tensor([3, 8 + 5]),
                lens=torch.tensor([4, 6], dtype=torch.int32),
                out=torch.empty(B, 1, HQ, D, dtype=BF16),
                qm=r(B, 1, 16, 576), kv=r(B, 8, 576))


def step(q, k_cache, v_cache, k_new, v_new, slots, lens, out, qm, kv):
    kvstream.store_kv(k_new, v_new, k_cache, v_cache, slots)
    o, lse = kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, return_lse=True)
    r = kvstream.decode(q, k_cache, v_cache, cache_seqlens=lens, window_size=(3, 0), out=out)
    m = kvstream.mla_decode(qm, kv, softmax_scale=0.07, cache_seqlens=lens)
    return o.float() * 2, lse, r.clone(), m


def test_eager_call_goes_through_the_op_checked_once(stand_in):
    x = cpu_inputs()
    q, k, v, lens = x["q"], x["k_cache"], x["v_cache"], x["lens"]
    out, lse = kvstream.decode(q, k, v, cache_seqlens=lens, return_lse=True)
    want = q * 2 + k.sum() + v.sum()
    assert torch.equal(out, want) and torch.equal(lse, q.float().sum(-1))
    assert stand_in.checks == {"function": 1, "op": 0}  # the op took the function's spec
    # out=: written in place and returned, with and without lse
    o = torch.empty_like(q)
    assert kvstream.decode(q, k, v, out=o) is o and torch.equal(o, want)
    o2, lse2 = kvstream.decode(q, k, v, out=torch.empty_like(q), return_lse=True)
    assert torch.equal(o2, want) and lse2.shape == (B, 1, HQ)
    assert kvstream.decode(q[:, 0], k, v).shape == (B, HQ, D)
    assert stand_in.checks == {"function": 4, "op": 0}
    # the op called directly checks for itself
    torch.ops.kvstream.decode(q, k, v, lens)
    torch.ops.kvstream.decode_out(q, k, v, o)
    assert stand_in.checks == {"function": 4, "op": 2}
    m, mlse = kvstream.mla_decode(x["qm"], x["kv"], softmax_scale=0.07, return_lse=True)
    assert torch.equal(m, x["qm"][..., :512] * 3) and mlse.shape == (B, 1, 16)
    kvstream.store_kv(x["k_new"], x["v_new"], k, v, x["slots"])
    assert torch.equal(k[0, 3], x["k_new"][0]) and torch.equal(v[1, 5], x["v_new"][1])
    assert stand_in.launches == ["decode"] * 6 + ["mla_decode", "store_kv"]


def test_profiler_names_the_ops(stand_in):
    x = cpu_inputs()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(**x)
    names = {e.name for e in prof.events()}
    for op in ("kvstream::decode", "kvstream::decode_out", "kvstream::mla_decode",
               "kvstream::store_kv"):
        assert op in names, (op, sorted(n for n in names if "kvstream" in n))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_runs_the_ops_as_eager(stand_in, backend):
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for rnd in range(2):
        a, b = cpu_inputs(), cpu_inputs()
        a["lens"] += rnd
        b["lens"] += rnd
        want = step(**a)
        got = compiled(**b)
        for i, (w, g) in enumerate(zip(want, got)):
            assert torch.equal(w, g), (rnd, i)
        # the mutations reached the caller's tensors: the appended rows, and out=
        for name in ("k_cache", "v_cache", "out"):
            assert torch.equal(a[name], b[name]), (rnd, name)
    # at run time the compiled graph calls the ops, whose implementations check the arguments
    assert stand_in.checks["op"] >= 2 * 4


OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck(stand_in):
    # torch.library.opcheck: the schemas' mutation and aliasing claims, the fake
    # implementations against the real ones, and AOT dispatch with dynamic shapes
    x = cpu_inputs()
    q, k, v, lens = x["q"], x["k_cache"], x["v_cache"], x["lens"]
    lse = torch.empty(B, 1, HQ)
    cases = [
        (torch.ops.kvstream.decode.default, (q, k, v), dict(cache_seqlens=lens, return_lse=True)),
        (torch.ops.kvstream.decode.default, (q[:, 0], k, v), dict(cache_seqlens=lens)),
        (torch.ops.kvstream.decode_out.default, (q, k, v, x["out"], lse), dict(cache_seqlens=lens)),
        (torch.ops.kvstream.mla_decode.default, (x["qm"], x["kv"], 0.07), dict(return_lse=True)),
        (torch.ops.kvstream.mla_decode_out.default,
         (x["qm"], x["kv"], 0.07, torch.empty(B, 1, 16, 512, dtype=BF16)), {}),
        (torch.ops.kvstream.store_kv.default, (x["k_new"], x["v_new"], k, v, x["slots"]), {}),
    ]
    for op, args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)
