"""kvstream.integrations.transformers without a GPU.

Registration (the name in transformers' AttentionInterface and AttentionMaskInterface,
idempotent, importing the module imports neither torch nor transformers), models built with
attn_implementation="kvstream" on the CPU, where every call falls back to transformers' own
attention (sdpa; eager for gpt-oss's sinks) with the same results, the routing rules of
fallback_reason on CUDA fake tensors (and the kvstream.decode call they make, through the op's
fake implementation), the cache lengths read from the mask, and the whole decode path on the CPU
with a float32 stand-in for kvstream.decode: small random Llama-, Qwen2- (sliding window) and
gpt-oss-style (sliding window, sinks, MoE) models generating with a StaticCache against sdpa /
eager, per step, plus steps of four tokens over a full sliding window, and padded batches falling
back. Skipped where torch or transformers 5.x is not importable; test_transformers_gpu.py runs
the same models on kvstream's kernels.
"""

import copy
import inspect
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"transformers {transformers.__version__} (the integration needs 5.x)",
                allow_module_level=True)

from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig, Qwen2Config  # noqa: E402
from transformers import StaticCache  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import kvstream  # noqa: E402
import kvstream.integrations.transformers as kvt  # noqa: E402

BF16 = torch.bfloat16
VOCAB = 256
PROMPT = 12
NEW = 16


def run(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


# ---- small random models (shared with test_transformers_gpu.py) ----


def llama_config(head_dim=128):
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=512, initializer_range=0.1,
    )


def qwen2_config(window=8):
    # hidden 256 on 4 heads: head_dim 64; layer 0 slides, layer 1 is full
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
        sliding_window=window, max_window_layers=2,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        initializer_range=0.1,
    )


def gpt_oss_config(window=8):
    # every token routed to all 4 experts: no top-k choice that rounding differences could flip
    return GptOssConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=4, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        initializer_range=0.1,
    )


#: name -> (config factory, the reference attn_implementation: gpt-oss has no sdpa, its sinks
#: need eager)
MODELS = {
    "llama": (llama_config, "sdpa"),
    "qwen2": (qwen2_config, "sdpa"),
    "gpt_oss": (gpt_oss_config, "eager"),
}


def model_pair(name, device="cpu", dtype=BF16, seed=0):
    """(reference, kvstream) models of MODELS[name] with the same random weights (gpt-oss's
    sinks drawn from N(0, 1), so that they matter). Each model gets its own config: from_config
    writes the attn_implementation into the config it is given."""
    make, ref_impl = MODELS[name]
    cfg = make()
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=ref_impl,
                                           dtype=dtype)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):
                m.sinks.normal_(0.0, 1.0)
    ref = ref.to(device).eval()
    kv = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=kvt.NAME,
                                          dtype=dtype)
    kv.load_state_dict(ref.state_dict())
    for m in (ref, kv):  # no end-of-sequence token: every run generates all its tokens
        m.generation_config.eos_token_id = None
    return ref, kv.to(device).eval()


def generate(model, ids, new=NEW, attention_mask=None, **kw):
    """Greedy generation with a StaticCache (not compiled unless kw says so): the sequences and
    the logits of every step, float32 [new, b, vocab]."""
    if attention_mask is None:
        attention_mask = torch.ones_like(ids)
    kw.setdefault("disable_compile", True)
    out = model.generate(
        ids, attention_mask=attention_mask, max_new_tokens=new,
        do_sample=False, cache_implementation="static", output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, **kw,
    )
    return out.sequences, torch.stack(out.logits).float()


def teacher_forced(model, seq, prompt):
    """The model's logits for each generated position of ``seq`` in one forward (no cache),
    [new, b, vocab] float32."""
    with torch.no_grad():
        logits = model(seq[:, :-1]).logits.float()
    return logits[:, prompt - 1:].transpose(0, 1)


def assert_same_generation(ref_gen, kv_gen, tf, prompt, rel=0.05, tie=None):
    """The kvstream run against the reference run (same prompt) and the reference's
    teacher-forced logits over the kvstream run's tokens.

    Up to the first step where the tokens differ, the logits must agree within ``rel`` of the
    largest logit; a difference is allowed only where the reference's own logits tie within
    ``tie`` (bf16 logits of a random model do tie). Every step's logits must agree with the
    teacher-forced ones within ``rel``, and each kvstream token must be a reference argmax within
    ``tie``.
    """
    (rs, rl), (ks, kl) = ref_gen, kv_gen
    scale = rl.abs().max().item()
    atol = rel * scale
    tie = 2 * atol if tie is None else tie
    new = rl.shape[0]
    for i in range(new):
        diff = (kl[i] - rl[i]).abs().max().item()
        assert diff <= atol, f"step {i}: logits differ by {diff:.4f} (allowed {atol:.4f})"
        rt, kt = rs[:, prompt + i], ks[:, prompt + i]
        if not torch.equal(rt, kt):
            for r in range(rt.shape[0]):
                gap = (rl[i, r, rt[r]] - rl[i, r, kt[r]]).item()
                assert gap <= tie, (
                    f"step {i}, request {r}: token {kt[r].item()} instead of {rt[r].item()}, "
                    f"whose logit is higher by {gap:.4f} (a tie allows {tie:.4f})"
                )
            break
    tdiff = (kl - tf).abs().amax(dim=(1, 2))
    assert tdiff.max().item() <= atol, (
        f"logits differ from the teacher-forced reference by {tdiff.tolist()} (allowed {atol:.4f})"
    )
    for i in range(new):
        tok = ks[:, prompt + i]
        best = tf[i].max(dim=-1).values
        chosen = tf[i].gather(-1, tok[:, None])[:, 0]
        assert bool((best - chosen <= tie).all()), f"step {i}: token not a reference argmax"


def cache_kwarg(model):
    """The forward's name for the cache: ``cache`` (transformers >= 5.2x) or
    ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def chunked_steps(model, ids, chunks, max_len):
    """Prefill ``ids`` into a StaticCache, then feed each of ``chunks`` (a [b, n] tensor of new
    tokens, n <= 8: speculative verification) as one step; the logits of each chunk."""
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    key = cache_kwarg(model)
    out = []
    with torch.no_grad():
        model(ids, use_cache=True, **{key: cache})
        for c in chunks:
            out.append(model(c, use_cache=True, **{key: cache}).logits.float())
    return out


# ---- a float32 stand-in for kvstream.decode (the CPU runs of the decode path) ----


def reference_decode(q, k_cache, v_cache, *, cache_seqlens=None, softmax_scale=None,
                     window_size=(-1, 0), softcap=0.0, sinks=None, **unused):
    """kvstream.decode's semantics in float32 torch: q [b, s, hq, d], caches [b, L, hkv, d]
    (views), token i of request r at position t = len_r - s + i seeing t - left .. t."""
    assert not unused, unused
    b, s, hq, d = q.shape
    L, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    lens = (torch.full((b,), L) if cache_seqlens is None else cache_seqlens).long().to(q.device)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    kf = k_cache.float().repeat_interleave(g, dim=2).permute(0, 2, 1, 3)  # [b, hq, L, d]
    vf = v_cache.float().repeat_interleave(g, dim=2).permute(0, 2, 1, 3)
    scores = (q.float().permute(0, 2, 1, 3) @ kf.transpose(-1, -2)) * scale  # [b, hq, s, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    t = lens[:, None] - s + torch.arange(s, device=q.device)[None]  # [b, s]
    pos = torch.arange(L, device=q.device)[None, None]
    seen = (pos <= t[..., None]) & (pos < lens[:, None, None])
    if window_size[0] >= 0:
        seen &= pos >= t[..., None] - window_size[0]
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(b, hq, s, 1)
        scores = torch.cat([scores, sink], dim=-1)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return (p @ vf).permute(0, 2, 1, 3).to(q.dtype)


class Recorder:
    """Stands in for kvstream.decode, recording each call's arguments."""

    def __init__(self, impl=reference_decode):
        self.impl = impl
        self.calls = []

    def __call__(self, q, k_cache, v_cache, **kw):
        self.calls.append(dict(
            q_shape=tuple(q.shape), k_shape=tuple(k_cache.shape), k_stride=k_cache.stride(),
            v_stride=v_cache.stride(), k_contiguous=k_cache.is_contiguous(),
            lens=None if kw.get("cache_seqlens") is None else kw["cache_seqlens"].tolist(),
            lens_dtype=getattr(kw.get("cache_seqlens"), "dtype", None),
            window=kw.get("window_size"), softcap=kw.get("softcap"),
            scale=kw.get("softmax_scale"),
            sinks=None if kw.get("sinks") is None else (kw["sinks"].dtype,
                                                       tuple(kw["sinks"].shape)),
        ))
        return self.impl(q, k_cache, v_cache, **kw)


@pytest.fixture
def on_cpu(monkeypatch):
    """kvstream.decode replaced by a recording float32 stand-in, and the integration allowed
    to route CPU tensors to it."""
    rec = Recorder()
    monkeypatch.setattr(kvt, "_REQUIRE_CUDA", False)
    monkeypatch.setattr(kvstream, "decode", rec)
    return rec


@pytest.fixture(autouse=True, scope="module")
def _registered():
    kvt.register()


# ---- registration ----


def test_import_needs_neither_torch_nor_transformers():
    out = run(
        "import sys; import kvstream.integrations, kvstream.integrations.transformers as t; "
        "print(t.NAME, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    assert out == "kvstream False False"


def test_register_is_idempotent_and_fills_both_interfaces():
    assert kvt.register() == "kvstream"
    assert kvt.register() == "kvstream"
    assert "kvstream" in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert ALL_ATTENTION_FUNCTIONS["kvstream"] is kvt.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["kvstream"] is kvt.build_mask
    # the class-wide mappings: every model and every new interface instance sees them
    assert transformers.AttentionInterface()["kvstream"] is kvt.attention_forward
    assert list(ALL_ATTENTION_FUNCTIONS.keys()).count("kvstream") == 1


def test_register_in_a_fresh_interpreter():
    out = run(
        "import kvstream.integrations.transformers as t\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, "
        "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64)\n"
        "try:\n"
        "    AutoModelForCausalLM.from_config(cfg, attn_implementation='kvstream')\n"
        "except ValueError as e:\n"
        "    print('refused before register')\n"
        "name = t.register()\n"
        "m = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)\n"
        "print(m.config._attn_implementation)\n"
    )
    assert out.splitlines() == ["refused before register", "kvstream"]


def test_register_without_transformers_raises_import_error():
    out = run(
        "import sys; sys.modules['transformers'] = None\n"
        "import kvstream.integrations.transformers as t\n"
        "try:\n"
        "    t.register()\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    assert "needs torch and transformers >= 5" in out


def test_version_check():
    assert kvt._transformers_major("5.25.0") == 5
    assert kvt._transformers_major("4.57.1") == 4
    assert kvt._transformers_major("dev") == 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_build_on_cpu(name):
    make, _ = MODELS[name]
    model = AutoModelForCausalLM.from_config(make(), attn_implementation="kvstream")
    assert model.config._attn_implementation == "kvstream"
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa" if name != "gpt_oss" else "eager")
        model.set_attn_implementation("kvstream")
        assert model.config._attn_implementation == "kvstream"


# ---- on CPU tensors everything falls back to transformers' attention ----


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cpu_tensors_fall_back_to_transformers(name, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(kvstream, "decode", rec)  # CUDA is required: never called
    ref, kv = model_pair(name, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    rs, rl = generate(ref, ids, new=6)
    ks, kl = generate(kv, ids, new=6)
    assert rec.calls == []
    assert torch.equal(rs, ks)
    torch.testing.assert_close(kl, rl, rtol=1e-5, atol=1e-5)


# ---- routing rules on CUDA fake tensors ----


@pytest.fixture
def fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        yield mode


class Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def cuda(*shape, dtype=BF16):
    return torch.empty(*shape, device="cuda", dtype=dtype)


def decode_args(b=2, hq=8, hkv=2, q_len=1, L=64, d=128, dtype=BF16, mask_dtype=torch.bool):
    q = cuda(b, hq, q_len, d, dtype=dtype)
    k = cuda(b, hkv, L, d, dtype=dtype)
    v = cuda(b, hkv, L, d, dtype=dtype)
    mask = cuda(b, 1, q_len, L, dtype=mask_dtype)
    return q, k, v, mask


def test_fallback_reason_accepts_a_decode_step(fake):
    q, k, v, mask = decode_args()
    assert kvt.fallback_reason(Module(), q, k, v, mask) is None
    q, k, v, mask = decode_args(q_len=8, d=64, hq=64, hkv=2)
    assert kvt.fallback_reason(Module(), q, k, v, mask, sliding_window=128, softcap=30.0,
                               s_aux=cuda(64, dtype=torch.float32)) is None
    q, k, v, mask = decode_args(dtype=torch.float16, d=256, hkv=8)
    assert kvt.fallback_reason(Module(), q, k, v, mask[:1]) is None  # a mask broadcast over b


@pytest.mark.parametrize(
    "change, expected",
    [
        (dict(q_len=9), "prefill"),
        (dict(mask=None), "no mask"),
        (dict(mask_dtype=BF16), "not boolean"),
        (dict(L=1), "no cached positions"),
        (dict(dtype=torch.float32), "dtypes"),
        (dict(d=80), "head dims"),
        (dict(hq=6, hkv=4), "query heads"),
        (dict(hq=66, hkv=2), "query heads"),
        (dict(kw=dict(cu_seq_lens_q=1)), "continuous batching"),
        (dict(kw=dict(block_table=1)), "continuous batching"),
        (dict(kw=dict(position_bias=1)), "position bias"),
        (dict(kw=dict(is_causal=False)), "non-causal"),
        (dict(module=Module(is_causal=False)), "non-causal"),
        (dict(kw=dict(sliding_window=0)), "sliding_window"),
        (dict(kw=dict(softcap=-1.0)), "softcap"),
        (dict(kw=dict(s_aux="sinks3")), "sinks"),
        (dict(k_slice=True), "cache strides"),
        (dict(mask_shape=True), "mask of shape"),
    ],
)
def test_fallback_reason_refusals(fake, change, expected):
    q, k, v, mask = decode_args(**{n: change[n] for n in ("q_len", "mask_dtype", "L", "dtype",
                                                          "d", "hq", "hkv") if n in change})
    if "mask" in change:
        mask = change["mask"]
    if change.get("k_slice"):
        k = cuda(2, 2, 64, 132)[..., :128]  # a head-dim slice: rows of 264 bytes
    if change.get("mask_shape"):
        mask = cuda(2, 1, q.shape[2], 65, dtype=torch.bool)
    kw = dict(change.get("kw", {}))
    if kw.get("s_aux") == "sinks3":
        kw["s_aux"] = cuda(3, dtype=torch.float32)
    reason = kvt.fallback_reason(change.get("module", Module()), q, k, v, mask, **kw)
    assert reason is not None and expected in reason, reason


def test_fallback_reason_training_and_autograd(fake):
    q, k, v, mask = decode_args()
    m = Module().train()
    assert "dropout" in kvt.fallback_reason(m, q, k, v, mask, dropout=0.1)
    assert kvt.fallback_reason(m, q, k, v, mask, dropout=0.0) is None
    q.requires_grad_(True)
    with torch.enable_grad():
        assert "autograd" in kvt.fallback_reason(Module(), q, k, v, mask)
    with torch.no_grad():
        assert kvt.fallback_reason(Module(), q, k, v, mask) is None


def test_fallback_reason_cpu_tensors():
    q = torch.empty(2, 8, 1, 128, dtype=BF16)
    k = torch.empty(2, 2, 64, 128, dtype=BF16)
    mask = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    assert "CUDA" in kvt.fallback_reason(Module(), q, k, k, mask)


@pytest.mark.parametrize("window, softcap, sinks", [(None, None, False), (16, 50.0, True)])
def test_attention_forward_calls_decode_in_place(fake, window, softcap, sinks):
    """Through kvstream.decode's fake implementation (its argument checks included): the
    output's layout, and the cache read as a strided view (no copy)."""
    b, hq, hkv, L, d = 2, 8, 2, 64, 128
    q, k, v, mask = decode_args(b, hq, hkv, 1, L, d)
    kw = {}
    if window is not None:
        kw["sliding_window"] = window
    if softcap is not None:
        kw["softcap"] = softcap
    if sinks:
        kw["s_aux"] = cuda(hq)  # bf16, as a model's parameter: converted to float32
    with torch.no_grad():
        out, weights = kvt.attention_forward(Module(), q, k, v, mask, scaling=0.1, **kw)
    assert weights is None
    assert tuple(out.shape) == (b, 1, hq, d) and out.dtype == BF16 and out.is_cuda


def test_attention_forward_compiles_to_one_graph(fake):
    """torch.compile(fullgraph=True) traces through the routing, the lengths and the call: one
    graph around the kvstream op (generate compiles the decode steps of a StaticCache)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(q, k, v, mask, sinks):
        return kvt.attention_forward(Module(), q, k, v, mask, scaling=0.125, sliding_window=32,
                                     s_aux=sinks)[0]

    torch._dynamo.reset()
    q, k, v, mask = decode_args(q_len=2)
    with torch.no_grad():
        out = torch.compile(layer, fullgraph=True, backend=backend)(q, k, v, mask, cuda(8))
    assert tuple(out.shape) == (2, 2, 8, 128)
    assert len(graphs) == 1
    ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("kvstream.decode" in o for o in ops), ops


def test_build_mask_compiles_without_reading_the_mask():
    torch._dynamo.reset()
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, 0] = False  # padding: eagerly, a float mask and a warning; traced, not read

    def make(attention_mask):
        return kvt.build_mask(batch_size=2, q_length=1, kv_length=16, q_offset=5, kv_offset=0,
                              attention_mask=attention_mask, allow_is_causal_skip=False,
                              dtype=BF16)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = torch.compile(make, fullgraph=True, backend="eager")(pad)
    assert m.dtype == torch.bool and tuple(m.shape) == (2, 1, 1, 16)


def test_attention_forward_arguments(fake, monkeypatch):
    calls = []

    def spy(q, k_cache, v_cache, **kw):
        calls.append((q, k_cache, v_cache, kw))
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    monkeypatch.setattr(kvstream, "decode", spy)
    b, hq, hkv, L, d = 2, 8, 2, 64, 128
    q, k, v, mask = decode_args(b, hq, hkv, 4, L, d)
    sinks = cuda(hq)
    with torch.no_grad():
        kvt.attention_forward(Module(), q, k, v, mask, scaling=0.25, sliding_window=16,
                              softcap=30, s_aux=sinks)
    (qq, kk, vv, kw), = calls
    assert tuple(qq.shape) == (b, 4, hq, d) and qq.is_contiguous()
    assert tuple(kk.shape) == (b, L, hkv, d) and kk.stride() == (hkv * L * d, d, L * d, 1)
    assert tuple(vv.shape) == (b, L, hkv, d) and vv.stride() == kk.stride()
    assert kw["softmax_scale"] == 0.25
    assert kw["window_size"] == (15, 0)  # HF's window W: the token and the W - 1 before it
    assert kw["softcap"] == 30.0 and isinstance(kw["softcap"], float)
    assert kw["sinks"].dtype == torch.float32 and tuple(kw["sinks"].shape) == (hq,)
    assert kw["cache_seqlens"].dtype == torch.int32 and tuple(kw["cache_seqlens"].shape) == (b,)
    calls.clear()
    with torch.no_grad():
        kvt.attention_forward(Module(), q, k, v, mask)
    (_, _, _, kw), = calls
    assert kw["softmax_scale"] is None and kw["window_size"] == (-1, 0)
    assert kw["softcap"] == 0.0 and kw["sinks"] is None


# ---- the cache lengths from the mask ----


def test_cache_seqlens_from_transformers_masks():
    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    # a static cache of 16 positions, 2 requests that have seen 9 tokens, a step of 3
    mask = sdpa_mask(batch_size=2, q_length=3, kv_length=16, q_offset=9, kv_offset=0,
                     mask_function=causal_mask_function, allow_is_causal_skip=False)
    lens = kvt._cache_seqlens(mask, 2)
    assert lens.dtype == torch.int32 and lens.tolist() == [12, 12]
    # a sliding window of 6 over a full ring of 6: the whole buffer
    mask = sdpa_mask(batch_size=2, q_length=1, kv_length=6, q_offset=30, kv_offset=25,
                     mask_function=sliding_window_causal_mask_function(6),
                     allow_is_causal_skip=False)
    assert kvt._cache_seqlens(mask, 2).tolist() == [6, 6]
    # a mask broadcast over the batch, and per-request lengths
    m = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    m[..., :4] = True
    assert kvt._cache_seqlens(m, 3).tolist() == [4, 4, 4]
    m = torch.zeros(2, 1, 2, 10, dtype=torch.bool)
    m[0, 0, 1, :7] = True
    m[1, 0, 1, 2:5] = True
    assert kvt._cache_seqlens(m, 2).tolist() == [7, 5]


def test_build_mask_is_sdpa_mask_without_padding():
    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    kw = dict(batch_size=2, q_length=1, kv_length=16, q_offset=5, kv_offset=0,
              attention_mask=torch.ones(2, 6, dtype=torch.bool), allow_is_causal_skip=False,
              dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(kvt.build_mask(**kw), sdpa_mask(**kw))


def test_build_mask_with_padding_is_additive():
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, :2] = False
    kw = dict(batch_size=2, q_length=1, kv_length=16, q_offset=5, kv_offset=0,
              attention_mask=pad, allow_is_causal_skip=False, dtype=BF16)
    with pytest.warns(UserWarning, match="padding"):
        m = kvt.build_mask(**kw)
    assert m.dtype == BF16 and tuple(m.shape) == (2, 1, 1, 16)
    assert (m[1, 0, 0, :2] < -1e30).all() and (m[1, 0, 0, 2:6] == 0).all()
    assert (m[0, 0, 0, :6] == 0).all() and (m[:, 0, 0, 6:] < -1e30).all()
    # without a cache (kv_length == q_length) sdpa's boolean mask is kept: kvstream never runs
    kw.update(q_length=6, kv_length=6, q_offset=0)
    assert kvt.build_mask(**kw).dtype == torch.bool


# ---- the decode path on the CPU, with a float32 stand-in for kvstream.decode ----


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_static_cache_routes_decode_steps(name, on_cpu):
    ref, kv = model_pair(name)
    ids = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    ref_gen = generate(ref, ids)
    assert on_cpu.calls == []
    kv_gen = generate(kv, ids)
    layers = kv.config.num_hidden_layers
    # every decode step of every layer (the prefill is the first token's, on sdpa / eager)
    assert len(on_cpu.calls) == layers * (NEW - 1)
    cfg = kv.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * layers
    for step in range(NEW - 1):
        for layer in range(layers):
            c = on_cpu.calls[step * layers + layer]
            assert c["q_shape"] == (2, 1, hq, d)
            seen = PROMPT + step + 1
            if types[layer] == "sliding_attention":
                w = cfg.sliding_window
                assert c["window"] == (w - 1, 0)
                assert c["lens"] == [min(seen, w)] * 2  # the ring holds the last w tokens
            else:
                assert c["window"] == (-1, 0)
                assert c["lens"] == [seen] * 2
            assert c["lens_dtype"] == torch.int32
            L = c["k_shape"][1]
            assert c["k_stride"] == (hkv * L * d, d, L * d, 1) and not c["k_contiguous"]
            assert c["sinks"] == ((torch.float32, (hq,)) if name == "gpt_oss" else None)
            assert c["softcap"] == 0.0
    assert_same_generation(ref_gen, kv_gen, teacher_forced(ref, kv_gen[0], PROMPT), PROMPT)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_multi_token_steps_over_a_full_window(name, on_cpu):
    """Steps of 4 tokens (speculative verification) after the sliding ring filled: the window
    then cuts into what the layer sees."""
    ref, kv = model_pair(name)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, PROMPT), generator=g)
    chunks = [torch.randint(0, VOCAB, (2, 4), generator=g) for _ in range(3)]
    want = chunked_steps(ref, ids, chunks, max_len=48)
    got = chunked_steps(kv, ids, chunks, max_len=48)
    assert len(on_cpu.calls) == kv.config.num_hidden_layers * len(chunks)
    assert {c["q_shape"][1] for c in on_cpu.calls} == {4}
    scale = max(w.abs().max().item() for w in want)
    for w, g_ in zip(want, got):
        assert (w - g_).abs().max().item() <= 0.05 * scale


def test_padded_batch_falls_back(on_cpu):
    ref, kv = model_pair("llama")
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # request 1 is left-padded by 3
    ids[1, :3] = 0
    ref_gen = generate(ref, ids, new=6, attention_mask=mask)
    with pytest.warns(UserWarning, match="padding"):
        kv_gen = generate(kv, ids, new=6, attention_mask=mask)
    assert on_cpu.calls == []  # every step on sdpa
    assert torch.equal(ref_gen[0], kv_gen[0])
    torch.testing.assert_close(kv_gen[1], ref_gen[1], rtol=0, atol=0)


def test_dynamic_cache_falls_back(on_cpu):
    """A DynamicCache grows every step (one-token steps get no mask): sdpa throughout."""
    ref, kv = model_pair("llama")
    ids = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0)
    a = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    b = kv.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert on_cpu.calls == []
    assert torch.equal(a.sequences, b.sequences)
