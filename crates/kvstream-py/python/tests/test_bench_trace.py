"""bench/trace.py's Perfetto export on a synthetic phase trace (no GPU: the CSV is written here)."""

import csv
import importlib.util
import json
from pathlib import Path

TRACE_PY = Path(__file__).resolve().parents[4] / "bench" / "trace.py"
POINTS = ["entry", "waited", "scheduled", "first_tile", "first_loop", "parked", "merged", "exit"]


def load_trace_module():
    spec = importlib.util.spec_from_file_location("bench_trace", TRACE_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_csv(path, ctas):
    head = ["seq"] + [p + "_ns" for p in POINTS] + [p + "_cycles" for p in POINTS]
    head += ["block_x", "block_y", "block_z", "sm", "tiles", "pieces", "range_tiles", "flags"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        for seq, (sm, stamps) in enumerate(ctas):
            w.writerow([seq] + stamps + [0] * len(POINTS) + [seq, 0, 0, sm, 4, 1, 4, 0])


def test_perfetto_spans_per_cta_and_sm(tmp_path):
    t = 5_000_000
    # CTA 0 on SM 3 stamps every point; CTA 1 on SM 7 never merged (0 = not stamped)
    ctas = [(3, [t, t + 100, t + 300, t + 700, t + 5700, t + 5900, t + 6400, t + 6500]),
            (7, [t + 50, t + 100, t + 310, t + 720, t + 5000, t + 5100, 0, t + 5200])]
    write_csv(tmp_path / "shape.decode_mla.bf16.n2.csv", ctas)
    mod = load_trace_module()
    points, rows = mod.read_rows(str(tmp_path / "shape.decode_mla.bf16.n2.csv"))
    events = mod.perfetto_events([("shape.decode_mla.bf16.n2", points, rows)])
    json.dumps(events)  # serialisable
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"shape.decode_mla.bf16.n2", "SM 3", "SM 7"} <= names
    cta0 = [e for e in spans if e["tid"] == 3]
    cta1 = [e for e in spans if e["tid"] == 7]
    assert len(cta0) == len(POINTS) - 1 and len(cta1) == len(POINTS) - 2
    assert cta0[0] == {"ph": "X", "name": "entry -> waited", "pid": 1, "tid": 3, "ts": 0.0, "dur": 0.1,
                       "args": {"seq": 0, "block_x": 0, "block_y": 0, "block_z": 0, "tiles": 4,
                                "pieces": 1, "range_tiles": 4}}
    loop = next(e for e in cta0 if e["name"] == "first_tile -> first_loop")
    assert loop["ts"] == 0.7 and loop["dur"] == 5.0
    # the unstamped merge is skipped: parked runs straight to exit
    assert any(e["name"] == "parked -> exit" for e in cta1)
