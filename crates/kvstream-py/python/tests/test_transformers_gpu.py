"""GPU tests of kvstream.integrations.transformers (H100 / H200); skipped unless torch sees a
CUDA device and transformers 5.x is importable.

The small random models of test_transformers.py (Llama-style with head dims 64, 128 and 256,
Qwen2-style with a sliding-window layer, gpt-oss-style with sliding windows, sinks and a small
MoE) in bf16 on the GPU: greedy generation of 32 tokens with a StaticCache on
attn_implementation="kvstream" against "sdpa" ("eager" for gpt-oss, which has no sdpa), per-step
logits within bf16 tolerance, the same tokens (a difference allowed only where the reference's
own logits tie) and the teacher-forced reference over the whole run; kvstream.decode called for
every layer of every decode step, and its op seen by the profiler; steps of four tokens over a
full sliding window; padded batches falling back to sdpa; and generate's own torch.compile
(inductor, reduce-overhead: CUDA graphs) running the kvstream op inside captured graphs. If
KVSTREAM_PY_INTEGRATION_SUMMARY names a file, each model's generation comparison (whether the 32
tokens matched, the max logit difference up to the first different token and against the
reference teacher-forced on kvstream's tokens) and its eager decode-step time with kvstream and
with the reference implementation are written there (bench/results/integration-latest.json).
"""

import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_transformers import (  # noqa: E402  (skips this module too without transformers 5.x)
    MODELS,
    NEW,
    PROMPT,
    VOCAB,
    assert_same_generation,
    chunked_steps,
    generate,
    llama_config,
    model_pair,
    teacher_forced,
)

import kvstream  # noqa: E402
import kvstream.integrations.transformers as kvt  # noqa: E402

GPU_NEW = 32


INTEGRATION = {"models": {}}


@pytest.fixture(autouse=True, scope="module")
def _registered():
    kvt.register()
    yield
    # bench/results/integration-latest.json when KVSTREAM_PY_INTEGRATION_SUMMARY names a file
    path = os.environ.get("KVSTREAM_PY_INTEGRATION_SUMMARY")
    if path and INTEGRATION["models"]:
        import datetime
        import json

        import transformers

        INTEGRATION.update(date=datetime.date.today().isoformat(),
                           commit=os.environ.get("KVSTREAM_COMMIT", "unknown"),
                           device=torch.cuda.get_device_name(0),
                           versions={"torch": torch.__version__,
                                     "transformers": transformers.__version__})
        with open(path, "w") as f:
            json.dump(INTEGRATION, f, indent=1)


def step_us(model, ids, new):
    """Wall time of one decode step of greedy generation (new tokens past the first), us: two
    generations of ``new`` and of 2 tokens, the difference over new - 2 steps."""
    def run(n):
        generate(model, ids, new=n)
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(model, ids, new=n)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    return (run(new) - run(2)) / (new - 2) * 1e6


@pytest.fixture
def counted(monkeypatch):
    """kvstream.decode wrapped: each call's q shape and window recorded, then run."""
    real = kvstream.decode
    calls = []

    def wrapper(q, k_cache, v_cache, **kw):
        calls.append((tuple(q.shape), kw.get("window_size"), kw.get("sinks") is not None))
        return real(q, k_cache, v_cache, **kw)

    monkeypatch.setattr(kvstream, "decode", wrapper)
    return calls


def prompt(batch=2, length=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g).cuda()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_matches_reference(name, counted):
    ref, kv = model_pair(name, device="cuda")
    ids = prompt()
    ref_gen = generate(ref, ids, new=GPU_NEW)
    assert counted == []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        kv_gen = generate(kv, ids, new=GPU_NEW)
    torch.cuda.synchronize()
    layers = kv.config.num_hidden_layers
    # every layer of every decode step (the first token comes from the prefill, on sdpa / eager)
    assert len(counted) == layers * (GPU_NEW - 1)
    assert {c[0] for c in counted} == {(2, 1, kv.config.num_attention_heads,
                                         kv.model.layers[0].self_attn.head_dim)}
    if name != "llama":
        assert (kv.config.sliding_window - 1, 0) in {c[1] for c in counted}
    assert all(c[2] == (name == "gpt_oss") for c in counted)
    # the torch op ran (a wrapper could have been counted without it)
    ops = [e for e in prof.events() if e.name.startswith("kvstream::decode")]
    assert len(ops) >= len(counted), sorted({e.name for e in prof.events()
                                             if "kvstream" in e.name})
    # the op's host time a call, as the profiler saw it (its own overhead included): what an
    # eager decode step pays for kvstream besides the kernels
    op_host_us = sum(e.cpu_time_total for e in ops) / len(ops)
    prompt_len = ids.shape[1]
    forced = teacher_forced(ref, kv_gen[0], prompt_len)
    # once the tokens differ (a tie in the reference's own logits) the two runs decode different
    # text: logits compare step by step up to there, and with the reference teacher-forced on
    # kvstream's tokens over the whole run
    same = [bool(torch.equal(ref_gen[0][:, prompt_len + i], kv_gen[0][:, prompt_len + i]))
            for i in range(GPU_NEW)]
    upto = same.index(False) + 1 if False in same else GPU_NEW
    INTEGRATION["models"][name] = {
        "new_tokens": GPU_NEW,
        "tokens_match": all(same),
        "first_different_token": None if all(same) else upto - 1,
        "max_logit_diff": round((kv_gen[1][:upto] - ref_gen[1][:upto]).abs().max().item(), 5),
        "max_logit_diff_teacher_forced": round((kv_gen[1] - forced).abs().max().item(), 5),
        "logit_scale": round(ref_gen[1].abs().max().item(), 5),
        "reference": MODELS[name][1],
        "decode_op_host_us": round(op_host_us, 1),
    }
    assert_same_generation(ref_gen, kv_gen, forced, prompt_len)
    # the decode step in that loop, eager (transformers' own Python around each layer)
    INTEGRATION["models"][name].update(
        step_us_kvstream=round(step_us(kv, ids, 16), 1),
        step_us_reference=round(step_us(ref, ids, 16), 1))


@pytest.mark.parametrize("head_dim", [64, 256])
def test_llama_head_dims(head_dim, counted, monkeypatch):
    import test_transformers as tt

    monkeypatch.setitem(tt.MODELS, "llama", (lambda: llama_config(head_dim), "sdpa"))
    ref, kv = model_pair("llama", device="cuda")
    ids = prompt(batch=3, length=17, seed=1)
    ref_gen = generate(ref, ids, new=NEW)
    kv_gen = generate(kv, ids, new=NEW)
    assert len(counted) == kv.config.num_hidden_layers * (NEW - 1)
    assert_same_generation(ref_gen, kv_gen, teacher_forced(ref, kv_gen[0], ids.shape[1]),
                           ids.shape[1])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_multi_token_steps(name, counted):
    """Steps of four tokens (speculative verification) once the sliding ring is full."""
    ref, kv = model_pair(name, device="cuda")
    ids = prompt(seed=2)
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randint(0, VOCAB, (2, 4), generator=g).cuda() for _ in range(4)]
    want = chunked_steps(ref, ids, chunks, max_len=64)
    got = chunked_steps(kv, ids, chunks, max_len=64)
    assert len(counted) == kv.config.num_hidden_layers * len(chunks)
    assert {c[0][1] for c in counted} == {4}
    scale = max(w.abs().max().item() for w in want)
    for i, (w, g_) in enumerate(zip(want, got)):
        diff = (w - g_).abs().max().item()
        assert diff <= 0.05 * scale, f"chunk {i}: logits differ by {diff:.4f} (scale {scale:.3f})"


def test_padded_batch_falls_back(counted):
    ref, kv = model_pair("llama", device="cuda")
    ids = prompt(seed=4)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    ref_gen = generate(ref, ids, new=8, attention_mask=mask)
    with pytest.warns(UserWarning, match="padding"):
        kv_gen = generate(kv, ids, new=8, attention_mask=mask)
    assert counted == []
    assert torch.equal(ref_gen[0], kv_gen[0])


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_generate_compiled_with_cuda_graphs(name):
    """generate's own torch.compile of the decode steps (a StaticCache on CUDA: inductor,
    mode reduce-overhead): the kvstream op traced, then replayed inside CUDA graphs."""
    torch._dynamo.reset()
    ref, kv = model_pair(name, device="cuda")
    ids = prompt(seed=5)
    ref_gen = generate(ref, ids, new=GPU_NEW)
    before = kvstream.decoder_cache_info()["captured"]
    kv_gen = generate(kv, ids, new=GPU_NEW, disable_compile=False)
    torch.cuda.synchronize()
    assert kvstream.decoder_cache_info()["captured"] > before, kvstream.decoder_cache_info()
    assert_same_generation(ref_gen, kv_gen, teacher_forced(ref, kv_gen[0], ids.shape[1]),
                           ids.shape[1])
