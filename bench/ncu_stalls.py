"""Where a kernel's warps wait, from ncu's per-instruction source page.

Reads the CSV of `ncu --import R.ncu-rep --page source --csv --print-source sass` (gpu-run.sh's
`widencu` / `mlancu` parts write it) and prints the warp-state samples (a) by instruction class
(wgmma issue, wgmma wait, mbarrier wait, named barrier, softmax arithmetic, shared and global
memory...), (b) by opcode, (c) the instructions holding the most samples with their addresses,
so that a stall is read against the SASS (`cuobjdump -sass` of the same CUBIN) by address.

    python3 bench/ncu_stalls.py wide-ncu-source.csv [--top 25] [--json out.json]

The samples column is found by name ("Warp Stall Sampling (All Samples)", or the first column
with "Sampling" and "All" in it); its not-issued twin is reported beside it where present.
"""
import argparse
import csv
import json
import re
import sys
from collections import defaultdict

# instruction classes, first match wins: (name, opcode pattern)
CLASSES = [
    ("wgmma issue", r"^HGMMA"),
    ("wgmma wait", r"^WARPGROUP\.(DEPBAR|ARRIVE)"),
    ("mbarrier wait / arrive", r"^SYNCS"),
    ("named barrier", r"^BAR\b|^BAR\."),
    ("tensor-core MMA (mma.sync)", r"^HMMA"),
    ("exp2 / special functions", r"^MUFU"),
    ("softmax arithmetic", r"^(FMNMX|FFMA|FMUL|FADD|FSEL|FSETP|F2FP|F2F|HADD2|HMUL2|HFMA2)"),
    ("warp shuffles / votes", r"^(SHFL|VOTE|REDUX|MATCH)"),
    ("shared memory", r"^(LDS|STS|LDSM|STSM|ATOMS|LDGSTS)"),
    ("bulk copies (TMA)", r"^(UTMALDG|UTMASTG|UBLKCP|UTMAPF|UTMACCTL|UBLKPF)"),
    ("global memory", r"^(LDG|STG|RED|ATOMG|ATOM|LD\b|ST\b|LDL|STL|CCTL|MEMBAR|ERRBAR|FENCE)"),
    ("branches and calls", r"^(BRA|BSSY|BSYNC|CALL|RET|EXIT|WARPSYNC|YIELD|NANOSLEEP|BPT)"),
]


def opcode(sass):
    """The opcode of a SASS line: predicate and operands dropped, modifiers kept."""
    text = sass.strip()
    text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
    return text.split()[0] if text else ""


def class_of(op):
    for name, pattern in CLASSES:
        if re.match(pattern, op):
            return name
    return "other"


def pick_column(header, *needles, exclude=()):
    for i, h in enumerate(header):
        low = h.lower()
        if all(n.lower() in low for n in needles) and not any(x.lower() in low for x in exclude):
            return i
    return None


def number(text):
    text = (text or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def read_rows(path):
    """[(address, sass, samples, not_issued)] of the source page's SASS lines."""
    with open(path, newline="") as f:
        lines = [l for l in f if l.strip()]
    # ncu may print notes before the table: the header is the first line naming a source column
    start = next((i for i, l in enumerate(lines) if '"Source"' in l or l.startswith("Source,")
                  or ',"Source"' in l or ",Source," in l), 0)
    reader = csv.reader(lines[start:])
    header = next(reader)
    src = pick_column(header, "source")
    addr = pick_column(header, "address")
    allc = pick_column(header, "sampling", "all") or pick_column(header, "stall", "all")
    noti = pick_column(header, "sampling", "not")
    if src is None or allc is None:
        sys.exit(f"ncu_stalls: no Source or samples column in {path}; header: {header}")
    rows = []
    for r in reader:
        if len(r) <= max(src, allc):
            continue
        rows.append((r[addr] if addr is not None else "", r[src], number(r[allc]),
                     number(r[noti]) if noti is not None and len(r) > noti else 0.0))
    return rows


def summarise(rows, top):
    total = sum(r[2] for r in rows) or 1.0
    by_class, by_op = defaultdict(float), defaultdict(float)
    for _, sass, n, _ in rows:
        op = opcode(sass)
        by_op[op] += n
        by_class[class_of(op)] += n
    hot = sorted(rows, key=lambda r: -r[2])[:top]
    return {
        "samples": total,
        "classes": sorted(((k, v / total) for k, v in by_class.items()), key=lambda kv: -kv[1]),
        "opcodes": sorted(((k, v / total) for k, v in by_op.items()), key=lambda kv: -kv[1])[:top],
        "hot": [{"address": a, "sass": s.strip(), "share": n / total,
                 "not_issued_share": ni / total} for a, s, n, ni in hot],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    a = ap.parse_args()
    s = summarise(read_rows(a.csv), a.top)
    print(f"{s['samples']:.0f} warp-state samples")
    print("\nby instruction class:")
    for k, v in s["classes"]:
        print(f"  {k:32s} {100 * v:5.1f}%")
    print("\nby opcode:")
    for k, v in s["opcodes"]:
        print(f"  {k:32s} {100 * v:5.1f}%")
    print("\nhottest instructions (address, share of all samples, of them not issued):")
    for h in s["hot"]:
        print(f"  {h['address']:>8s} {100 * h['share']:5.1f}% {100 * h['not_issued_share']:5.1f}%  {h['sass']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
