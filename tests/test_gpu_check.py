"""benchmarks/gpu_check.py --dry: the GPU check's own logic, on the CPU, before device time is
spent on it. The dry run's JSON must hold every section with passing parity rows and sane
figures; the section runner must record a failing section and skip one that has no time; bad
arguments (an unwritable --out, a budget that is not a positive number) fail before any section
runs, and a failed section or parity row makes the exit status 1."""

import importlib.util
import json
import subprocess
import sys
import time
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
    return json.loads((out / "gpu_check.json").read_text()), result.stdout, out


def rows_of(report, section):
    record = report["sections"][section]
    assert record["status"] == "ok", record.get("error") or record["notes"]
    return record["rows"]


def test_every_section_ran_and_printed_its_table(dry_run):
    report, stdout, _ = dry_run
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
        "stage 3, offload optimizer to nvme",
        "stage 3, offload optimizer+param to nvme",
        "stage 3, offload optimizer, ratio 0.5",
    ]
    for row in cases:
        assert row["ok"] and row["max_abs_diff"] <= 1e-6, row
        if "nvme" in row["case"]:  # every bucket's state in files: no host copies to time
            assert row["buckets"].endswith(" nvme") and "cpu" not in row["buckets"], row
            assert row["engine_d2h_GBps"] is None and row["host_buffers_pinned"] is None, row
            continue
        assert row["host_buffers_pinned"] is False  # dry: nothing is pinned without CUDA
        assert row["engine_d2h_GBps"] > 0 and row["engine_h2d_GBps"] > 0, row
    ratio = cases[-1]["buckets"]  # ratio 0.5: some buckets stay on the device, some go to cpu
    assert "device" in ratio and "cpu" in ratio, ratio
    out = Path(dry_run[2])
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json"]  # swap dir removed


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


def test_an_unwritable_out_fails_before_any_section(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--out", str(not_a_dir / "sub")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--out" in result.stderr and "cannot write" in result.stderr, result.stderr
    assert "## " not in result.stdout  # no section ran
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "inf"])
def test_a_budget_that_is_not_a_positive_number_is_refused(tmp_path, capsys, budget):
    script = load_script()
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--dry", "--out", str(tmp_path), "--budget_s", budget])
    assert exit_info.value.code == 2
    assert "--budget_s" in capsys.readouterr().err


def test_a_failed_row_or_section_makes_the_exit_status_1(tmp_path, capsys, monkeypatch):
    script = load_script()
    monkeypatch.setattr(script.torch, "set_num_threads", lambda n: None)
    records = {
        "ops": {"status": "failed", "seconds": 0.1, "rows": [], "notes": [], "error": "boom"},
        "stages": {"status": "ok", "seconds": 0.1, "notes": [], "rows": [
            {"world_size": 2, "stage": 3, "dtype": "fp32", "ok": False},
            {"world_size": 1, "stage": 3, "dtype": "fp32", "ok": True}]},
    }  # fmt: skip
    monkeypatch.setattr(script, "run_sections", lambda *args: records)
    assert script.main(["--dry", "--out", str(tmp_path), "--sections", "ops,stages"]) == 1
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("gpu_check: FAILED") and "ops (section failed)" in summary
    assert "'world_size': 2" in summary and "'world_size': 1" not in summary
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["sections"]["stages"]["rows"][0]["ok"] is False  # written before exiting
    records["ops"] = {"status": "ok", "seconds": 0.1, "rows": [{"ok": True}], "notes": []}
    records["stages"]["rows"].pop(0)
    assert script.main(["--dry", "--out", str(tmp_path), "--sections", "ops,stages"]) == 0
