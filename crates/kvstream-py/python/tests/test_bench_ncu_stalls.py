"""bench/ncu_stalls.py on a synthetic ncu source page (no GPU: the CSV is written here)."""

import csv
import importlib.util
from pathlib import Path

NCU_STALLS_PY = Path(__file__).resolve().parents[4] / "bench" / "ncu_stalls.py"


def load_module():
    spec = importlib.util.spec_from_file_location("bench_ncu_stalls", NCU_STALLS_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_samples_by_class_opcode_and_address(tmp_path):
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        f.write("==PROF== a note before the table\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)",
                    "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed"])
        w.writerow(["0x100", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;", "40", "30", "9"])
        w.writerow(["0x110", "@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3 ;", "25", "25", "9"])
        w.writerow(["0x120", "MUFU.EX2 R5, R4 ;", "1,000", "900", "9"])
        w.writerow(["0x130", "FFMA R4, R6, R7, -R8 ;", "15", "5", "9"])
        w.writerow(["0x140", "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", "20", "20", "9"])
    mod = load_module()
    rows = mod.read_rows(str(path))
    assert [r[0] for r in rows] == ["0x100", "0x110", "0x120", "0x130", "0x140"]
    s = mod.summarise(rows, top=3)
    assert s["samples"] == 1100
    classes = dict(s["classes"])
    assert abs(classes["exp2 / special functions"] - 1000 / 1100) < 1e-12
    assert abs(classes["mbarrier wait / arrive"] - 25 / 1100) < 1e-12
    assert abs(classes["wgmma issue"] - 40 / 1100) < 1e-12
    assert abs(classes["wgmma wait"] - 20 / 1100) < 1e-12
    assert abs(classes["softmax arithmetic"] - 15 / 1100) < 1e-12
    assert [h["address"] for h in s["hot"]] == ["0x120", "0x100", "0x110"]
    assert abs(s["hot"][0]["not_issued_share"] - 900 / 1100) < 1e-12
    assert mod.opcode("@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2] ;") == "SYNCS.PHASECHK.TRANS64.TRYWAIT"
