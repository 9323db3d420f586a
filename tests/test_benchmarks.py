"""benchmarks/side_by_side.py on a tiny GPT: it runs, reports every system and agrees with DDP.

A smoke test of the script, not of its timings: one round of one step per system on 2 gloo
ranks. Needs no deepspeed (no ds* system is requested).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "side_by_side.py"
SYSTEMS = ["zero0", "zero3", "ddp", "fsdp2", "local"]


def test_side_by_side_tiny(tmp_path):
    out = tmp_path / "result.json"
    command = [
        sys.executable,
        str(SCRIPT),
        *("--n_layer", "1", "--n_embd", "32", "--block_size", "16", "--micro_batch", "2"),
        *("--rounds", "1", "--steps_per_round", "1", "--warmup", "1", "--device", "cpu"),
        *("--systems", ",".join(SYSTEMS), "--json", str(out)),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())

    assert list(result["systems"]) == SYSTEMS
    assert result["skipped"] == {}
    for name in SYSTEMS:
        assert result["systems"][name]["median_ms"] > 0
        assert result["systems"][name]["cpu_ms"] > 0
    ratios = {r["ratio"]: r for r in result["ratios"]}
    assert set(ratios) == {"zero0/ddp", "zero3/fsdp2"}  # ds* not requested, so no ratio to them
    for r in ratios.values():
        assert math.isfinite(r["value"]) and r["value"] > 0
        assert r["pass"] == (r["value"] <= r["target"])
        assert math.isfinite(r["cpu"]) and r["cpu"] > 0
    for name in ("zero0", "zero3", "fsdp2"):
        parity = result["loss"][name]
        assert parity["pass"], (name, parity)
        assert parity["max_abs_diff_vs_ddp"] <= 1e-4
    assert "pass" not in result["loss"]["local"]  # its own micro-batch: no parity to check
    assert set(result["paper"]) == {"zero0", "zero3"}
    for p in result["paper"].values():
        assert abs(p["model_state_bytes"] / p["formula_bytes"] - 1) < 0.01  # padding at most
    assert "| ratio |" in proc.stdout
