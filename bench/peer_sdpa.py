"""Times torch SDPA peers (cuDNN, FlashAttention-2) on decode shapes, by ../shared bench method.

Same timer as `kvstream demo`: a CUDA graph holding one call per set of a rotating input pool of
>= 512 MiB of KV, 2 warm-up replays, then rounds of one replay; per-call latency = replay time /
sets; median of rounds. Checks set 0 against an fp32 reference first.

    python3 bench/peer_sdpa.py --shape 1,16,2,128,4096 --shape 1,16,2,128,131072
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

POOL_BYTES = 512 << 20
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}


def time_backend(name, b, hq, hkv, d, L, rounds):
    dt = torch.bfloat16
    kv_set = 2 * b * hkv * L * d * 2
    sets = min(max(math.ceil(POOL_BYTES / kv_set), 2), 256)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(sets, b, hq, 1, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(sets, b, hkv, L, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(sets, b, hkv, L, d, device="cuda", dtype=dt, generator=g)
    out = torch.empty(sets, b, hq, 1, d, device="cuda", dtype=dt)

    def call(s):
        with sdpa_kernel([BACKENDS[name]]):
            out[s].copy_(F.scaled_dot_product_attention(q[s], k[s], v[s], enable_gqa=True))

    # correctness on set 0 against fp32
    call(0)
    kr = k[0].float().repeat_interleave(hq // hkv, dim=1)
    vr = v[0].float().repeat_interleave(hq // hkv, dim=1)
    ref = torch.softmax(q[0].float() @ kr.transpose(-1, -2) / math.sqrt(d), dim=-1) @ vr
    rel = ((out[0].float() - ref).norm() / ref.norm()).item()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in range(sets):  # warm the kernels outside capture
            call(s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in range(sets):
            call(s)
    for _ in range(2):
        graph.replay()
    times = []
    for _ in range(max(rounds, 7)):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) * 1e3 / sets)
    times.sort()
    io = 2 * b * hq * d * 2 + 2 * b * hkv * L * d * 2
    med = times[len(times) // 2]
    return med, times[0], io / med / 1e3, rel, sets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", required=True, help="batch,hq,hkv,d,L")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    for spec in args.shape:
        b, hq, hkv, d, L = map(int, spec.split(","))
        for name in BACKENDS:
            try:
                med, mn, gbps, rel, sets = time_backend(name, b, hq, hkv, d, L, args.rounds)
                print(f"PEER {name:<10} b{b}-h{hq}-{hkv}-d{d}-L{L}: {med:8.2f} us median "
                      f"({mn:.2f} min), {gbps:7.1f} GB/s, rel_err {rel:.2e}, {sets} sets")
            except Exception as e:  # a peer that cannot run a shape is reported, not fatal
                print(f"PEER {name:<10} b{b}-h{hq}-{hkv}-d{d}-L{L}: error {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
