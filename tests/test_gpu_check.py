"""benchmarks/gpu_check.py --dry: the GPU check's own logic, on the CPU, before device time is
spent on it. The dry run's JSON must hold every section with passing parity rows and sane
figures; the section runner must record a failing section and skip one that has no time."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
SECTIONS = ("ops", "stages", "offload", "throughput")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), result.stdout


def rows_of(report, section):
    record = report["sections"][section]
    assert record["status"] == "ok", record.get("error") or record["notes"]
    return record["rows"]


def test_every_section_ran_and_printed_its_table(dry_run):
    report, stdout = dry_run
    assert report["meta"]["dry"] is True and report["meta"]["device"] == "cpu"
    for section in SECTIONS:
        assert rows_of(report, section), section
        assert f"## {section} (ok" in stdout
    assert report["meta"]["budget_s"] == 420.0  # wall time: see the subprocess timeout


def test_adam_rows_agree_with_torch(dry_run):
    rows = rows_of(dry_run[0], "ops")
    parity = [r for r in rows if "mode" in r]
    assert {r["mode"] for r in parity} == {"AdamW fp32", "Adam (L2) fp32", "AdamW + bf16 copy"}
    for row in parity:
        assert row["ok"] and row["max_scaled_diff"] <= 1e-6, row
        if "bf16" in row["mode"]:
            assert row["bf16_copy_mismatches"] == 0, row
    speed = [r for r in rows if r["check"].startswith("throughput")]
    assert len(speed) == 2 and all(r["Gelem_per_s"] > 0 for r in speed), speed
    report = dry_run[0]["sections"]["ops"]["zero_report"]  # zero-report's lines
    assert any("fused_adam:" in line for line in report) and any(
        "torch:" in line for line in report
    )


def test_stages_match_the_reference_at_world_size_1_and_2(dry_run):
    rows = rows_of(dry_run[0], "stages")
    cases = {(r["world_size"], r["stage"], r["dtype"]) for r in rows}
    for world_size in (1, 2):
        for stage in (0, 1, 2, 3):
            assert (world_size, stage, "fp32") in cases
        assert (world_size, 2, "bf16") in cases
    for row in rows:
        assert row["ok"] and row["max_abs_diff"] <= row["tolerance"], row
        if row["dtype"] == "fp32":
            assert row["tolerance"] == 1e-6
        if row["world_size"] == 2:
            assert row["backend"] == "gloo"
            assert 0.0 <= row["hidden_fraction"] <= 1.0, row
            assert row["reduction_ms"] > 0 and row["backward_ms"] > 0, row
    notes = " ".join(dry_run[0]["sections"]["stages"]["notes"])
    assert "gloo" in notes and "perf_counter" in notes


def test_offload_parity_and_bandwidth(dry_run):
    rows = rows_of(dry_run[0], "offload")
    machine = rows[0]
    assert machine["case"] == "machine" and machine["h2d_pinned_GBps"] > 0
    cases = [r for r in rows[1:]]
    assert [r["case"] for r in cases] == [
        "stage 2, offload optimizer",
        "stage 3, offload optimizer",
        "stage 3, offload optimizer+param",
    ]
    for row in cases:
        assert row["ok"] and row["max_abs_diff"] <= 1e-6, row
        assert row["host_buffers_pinned"] is False  # dry: nothing is pinned without CUDA
        assert row["engine_d2h_GBps"] > 0 and row["engine_h2d_GBps"] > 0, row


def test_throughput_rows_and_mfu(dry_run):
    rows = rows_of(dry_run[0], "throughput")
    names = [r["run"] for r in rows]
    assert names[:3] == ["torch AdamW, fp32 weights + bf16 autocast", "zero stage 0 bf16",
                         "zero stage 2 bf16"]  # fmt: skip
    assert any("offload optimizer+param" in n for n in names)
    assert any(n.endswith("offload optimizer") for n in names)
    for row in rows:
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["MFU"] is None, row  # dry: no peak
    # The largest ladder size that fits is taken (dry: the first one).
    assert max(r["layers"] for r in rows if "offload" in r["run"]) == 4


def test_flops_per_token_formula():
    script = load_script()
    shape = script.Shape(n_layer=2, n_embd=8, n_head=2, block_size=4, micro_batch=1)
    n = 2 * (12 * 64 + 13 * 8) + (256 + 2) * 8  # layers, tied embedding, final norm
    assert shape.numel() - 4 * 8 == n
    assert script.flops_per_token(shape) == 6 * n + 12 * 2 * 8 * 4


def test_runner_records_a_failure_and_skips_what_has_no_time():
    script = load_script()

    def fails(check):
        raise RuntimeError("boom")

    def works(check):
        check.notes.append("ran")
        return {"rows": [{"x": 1}]}

    sections = [("a", fails), ("b", works), ("c", works)]
    records = script.run_sections(sections, 30.0, lambda deadline: script.Check(
        device=None, dry=True, plan=None, deadline=deadline))  # fmt: skip
    assert records["a"]["status"] == "failed" and "boom" in records["a"]["error"]
    assert records["b"]["status"] == "ok" and records["b"]["notes"] == ["ran"]
    assert records["b"]["rows"] == [{"x": 1}]
    skipped = script.run_sections(sections, 0.5, lambda d: None)
    assert all(r["status"] == "skipped" and "budget" in r["notes"][0] for r in skipped.values())
