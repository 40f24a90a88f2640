"""Does the cache layout, or the order in which CTAs walk it, set the decode streaming rate?

A [b, L, hkv, d] cache (FA3's and kvstream's native layout) stores the hkv heads of one position
side by side: one (request, KV head) stream reads d * 2 bytes out of every hkv * d * 2. This
probe measures, in one process, on large uniform batches:

* ``read`` rows: a plain streaming-read kernel (cupy) over one [b, L, hkv, d] bf16 buffer in four
  orders: ``contiguous`` (one address sweep), ``heads-in-step`` (one CTA per (request, head)
  stream, the streams of one request's heads on neighbouring CTAs, started together),
  ``heads-apart`` (the same streams, each head starting at a different position, so the heads of
  one position are read at different times, as a tile-balanced schedule does) and
  ``head-major`` (the same bytes stored [b, hkv, L, d]: one stream is one address sweep).
* ``decode`` rows: kvstream (both engines) and FA3 on the same data stored [b, L, hkv, d] and,
  through strides, [b, hkv, L, d].

Timer, pools and the correctness check are compare.py's (CUDA graph over a rotating pool).

    PYTHONPATH=... python3 bench/layout_probe.py --out bench/results/layout-probe.json
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402

PATTERN_SRC = r"""
// Streams of rows, one CTA per stream at a time (grid-stride over streams). Stream s is
// (request s / hkv, head s % hkv): `rows` rows of 16 * words bytes, row r at
// request * req_stride + head * head_stride + r * row_stride (in 16-byte words). With skew_mod
// set, head h starts at row h * rows / skew_mod and wraps. Eight rows of loads per thread are
// in flight (~64 KB per CTA of 512 threads).
extern "C" __global__ void pattern_read(const uint4* __restrict__ src, unsigned int streams,
                                        unsigned int hkv, unsigned int rows, unsigned int words,
                                        unsigned long long req_stride,
                                        unsigned long long head_stride,
                                        unsigned long long row_stride, unsigned int skew_mod,
                                        unsigned int* __restrict__ sink) {
    const unsigned int lane_word = threadIdx.x % words;
    const unsigned int row_in_step = threadIdx.x / words;
    const unsigned int rows_per_step = blockDim.x / words;
    unsigned int acc = 0;
    for (unsigned int s = blockIdx.x; s < streams; s += gridDim.x) {
        const unsigned int head = s % hkv;
        const uint4* base = src + (unsigned long long)(s / hkv) * req_stride +
                            (unsigned long long)head * head_stride + lane_word;
        const unsigned int start = skew_mod ? (head % skew_mod) * (rows / skew_mod) : 0;
        for (unsigned int r0 = 0; r0 < rows; r0 += 8 * rows_per_step) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const unsigned int r = r0 + u * rows_per_step + row_in_step;
                v[u] = make_uint4(0, 0, 0, 0);
                if (r < rows) {
                    unsigned int rr = r + start;
                    if (rr >= rows) rr -= rows;
                    v[u] = __ldg(base + (unsigned long long)rr * row_stride);
                }
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0 && acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
}
"""


def read_rows(b, L, hkv, d, reps):
    """Streaming-read rates of the orders over one [b, L, hkv, d] bf16 buffer (the same bytes)."""
    import cupy as cp

    kern = cp.RawKernel(PATTERN_SRC, "pattern_read")
    nbytes = b * L * hkv * d * 2
    buf = cp.random.randint(0, 2**31, size=nbytes // 4, dtype=cp.uint32)
    sink = cp.zeros(1 << 16, dtype=cp.uint32)
    w = d * 2 // 16  # 16-byte words in one head's row
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    # (req_stride, head_stride, row_stride, skew_mod) in words
    cases = {
        "head-major": (hkv * L * w, L * w, w, 0),
        "heads-in-step": (L * hkv * w, w, hkv * w, 0),
        "heads-apart": (L * hkv * w, w, hkv * w, hkv),
    }
    out = {}
    for name, (rs, hs, ws, skew) in cases.items():
        for grid in (sms, 2 * sms):
            for threads in (256, 512):
                args = (buf, cp.uint32(b * hkv), cp.uint32(hkv), cp.uint32(L), cp.uint32(w),
                        cp.uint64(rs), cp.uint64(hs), cp.uint64(ws), cp.uint32(skew), sink)
                times = []
                for r in range(reps + 2):
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    start.record()
                    kern((grid,), (threads,), args)
                    end.record()
                    end.synchronize()
                    if r >= 2:
                        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
                us = statistics.median(times)
                key = f"b{b}-L{L}/{name}/grid{grid}/t{threads}"
                out[key] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)}
                print(f"read {key:<40} {us:9.2f} us {nbytes / us / 1e3:7.1f} GB/s", flush=True)
    del buf
    cp.get_default_memory_pool().free_all_blocks()
    return out


def decode_rows(shape, rounds):
    """kvstream (default, persistent, split) and FA3 on [b, L, hkv, d] and [b, hkv, L, d] data."""
    import torch

    import kvstream
    from fa3_fwd_interface import flash_attn_with_kvcache as fa3

    sets = compare.pool_sets(shape)
    io = compare.io_bytes(shape)
    pool = compare.make_pool(shape, sets)
    # the same values stored head-major, seen through strides as [sets, b, L, hkv, d]
    hm = {x: pool[x].transpose(2, 3).contiguous().transpose(2, 3) for x in ("k", "v")}
    ref = compare.reference(pool["q"][0], pool["k"][0], pool["v"][0])
    layouts = {"bshd": (pool["k"], pool["v"]), "bhsd": (hm["k"], hm["v"])}
    calls = {}
    for lay, (k, v) in layouts.items():
        for engine in (None, "persistent", "split"):
            outs = torch.empty_like(pool["q"])

            def call(s, k=k, v=v, outs=outs, engine=engine):
                return kvstream.decode(pool["q"][s], k[s], v[s], out=outs[s], engine=engine)

            calls[f"kvstream{'/' + engine if engine else ''}/{lay}"] = call

        def fcall(s, k=k, v=v):
            return fa3(pool["q"][s], k[s], v[s], num_splits=0)

        calls[f"fa3/{lay}"] = fcall
    graphs, outs, res = {}, {}, {}
    for name, call in calls.items():
        try:
            g, o = compare.capture(call, sets)
            for t in o:
                t.fill_(float("nan"))
            graphs[name], outs[name] = (g, sets), o
        except Exception as e:
            res[name] = {"error": compare.short_error(e)}
            torch.cuda.synchronize()
    times = compare.time_graphs(graphs, rounds)
    reader = compare.StreamRead(torch.cuda.get_device_properties(0).multi_processor_count)
    res["floor"] = {"us": round(reader.time_pool(io, sets, rounds, []), 3)}
    for name in graphs:
        res[name] = compare.timing_entry(times[name], io, compare.rel_err(outs[name][0], ref))
    sid = f"b{shape['batch']}-L{shape['L']}-{shape['hq']}/{shape['hkv']}-d{shape['d']}"
    for name, e in res.items():
        print(f"decode {sid} {name:<28} {json.dumps(e)}", flush=True)
    del graphs, outs, pool, hm, layouts, calls
    torch.cuda.empty_cache()
    return sid, res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="layout-probe.json")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shapes", default="16,32768;128,4096;32,32768",
                    help="batch,L pairs (32/8 heads, d 128)")
    ap.add_argument("--skip-read", action="store_true")
    args = ap.parse_args()
    doc = {"read": {}, "decode": {}}
    if not args.skip_read:
        doc["read"].update(read_rows(16, 65536, 8, 128, args.rounds))
        doc["read"].update(read_rows(128, 8192, 8, 128, args.rounds))
    for spec in args.shapes.split(";"):
        b, L = map(int, spec.split(","))
        shape = {"batch": b, "q_len": 1, "hq": 32, "hkv": 8, "d": 128, "L": L, "dtype": "bf16"}
        sid, res = decode_rows(shape, args.rounds)
        doc["decode"][sid] = res
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
