"""zrun --autotuning on the example GPT (examples/train.py, a one-layer model): the probe run,
the planner dropping what it predicts will not fit, a failing candidate recorded and skipped,
the results table, the best config written, and `run` starting the job with it. Also the search
space and the tuners' order, and the errors a tune gives before any trial runs."""

import csv
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from zero.config import ConfigError, load_config
from zero.launcher.autotuning.search import Search
from zero.launcher.autotuning.space import Candidate, candidate_config, candidates
from zero.launcher.autotuning.space import micro_batch_sizes as sizes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The example, except that stage 0 at micro-batch 2 dies as a run out of memory would.
WRAPPER = f"""
import json, runpy, sys
sys.path.insert(0, {str(EXAMPLES)!r})
path = sys.argv[sys.argv.index("--config") + 1]
config = json.load(open(path))
print("wrapper: config", path, flush=True)
stage = config["zero_optimization"]["stage"]
if stage == 0 and config["train_micro_batch_size_per_gpu"] == 2:
    raise MemoryError("simulated: out of memory at stage 0, micro-batch 2")
sys.argv[0] = {str(EXAMPLES / "train.py")!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def tuning(**block):
    return load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": block}).autotuning


def test_micro_batch_sizes_span_the_limits_in_powers_of_two():
    assert sizes(tuning(), 1, 1) == [1, 32, 1024]
    assert sizes(tuning(max_train_batch_size=64), 4, 2) == [1, 4, 8]
    block = tuning(min_train_micro_batch_size_per_gpu=3, max_train_micro_batch_size_per_gpu=40)
    assert sizes(block, 1, 1) == [3, 8, 40]
    with pytest.raises(ValueError, match="no micro-batch size fits"):
        sizes(tuning(max_train_batch_size=4), 8, 1)


def test_candidates_follow_the_config_lists_and_deepspeed_defaults():
    raw = {"train_micro_batch_size_per_gpu": [1, 8], "gradient_accumulation_steps": 2}
    grid = candidates(raw, tuning(), 2)
    # stages 0-3; cpu offload only at stages 1-3
    assert len(grid) == (1 + 3 * 2) * 2
    assert {c.offload for c in grid if c.stage == 0} == {"none"}
    raw = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    grid = candidates(raw, tuning(fast=False, num_tuning_micro_batch_sizes=1), 1)
    assert [c.bucket for c in grid] == [50_000_000, 500_000_000, 1_000_000_000]
    config = candidate_config({"train_batch_size": 32, **raw}, grid[0])
    assert "train_batch_size" not in config  # derived from micro-batch x ranks x accumulation
    assert config["zero_optimization"]["reduce_bucket_size"] == 50_000_000
    with pytest.raises(ValueError, match="stage: 7 cannot be tried"):
        candidates({"zero_optimization": {"stage": [2, 7]}}, tuning(), 1)
    # a Trainer's "auto" bucket is the config's own; bad values are named before any trial
    auto = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    assert {c.bucket for c in candidates(auto, tuning(), 1)} == {None}
    for bad, named in (
        ({"train_micro_batch_size_per_gpu": []}, "train_micro_batch_size_per_gpu is an empty"),
        ({"train_micro_batch_size_per_gpu": [0, 2]}, "train_micro_batch_size_per_gpu: 0 cannot"),
        ({"train_micro_batch_size_per_gpu": [2.5]}, "train_micro_batch_size_per_gpu: 2.5 cannot"),
        ({"train_micro_batch_size_per_gpu": [True]}, "train_micro_batch_size_per_gpu: True"),
        ({"zero_optimization": {"reduce_bucket_size": "abc"}}, "reduce_bucket_size: 'abc'"),
        ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "device: 'gpu'"),
    ):
        with pytest.raises(ValueError, match=named):
            candidates(bad, tuning(), 1)
    assert [
        c.micro_batch for c in candidates({"train_micro_batch_size_per_gpu": [4.0]}, tuning(), 1)
    ][:1] == [4]


def test_autotuning_block_is_checked():
    with pytest.raises(ConfigError, match="arg_mappings"):
        tuning(arg_mappings={"train_micro_batch_size_per_gpu": 5})
    for budget in (-5, "0"):
        with pytest.raises(ConfigError, match="max_memory_per_rank"):
            tuning(max_memory_per_rank=budget)
    with pytest.raises(ConfigError, match="end_profile_step 3 must exceed"):
        tuning(start_profile_step=3, end_profile_step=3)
    with pytest.raises(ConfigError, match="Did you mean 'tuner_type'"):
        tuning(tunner_type="random")
    assert tuning(max_memory_per_rank="2G").max_memory_per_rank == 2 * 2**30
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zrun --autotuning implements it: no "not implemented"
        assert tuning(enabled=True).enabled


def test_model_based_follows_its_cost_model():
    grid = [Candidate(stage, "none", mb, 1) for stage in (0, 3) for mb in (1, 2, 4, 8)]
    search = Search(grid, "model_based")
    # Throughput grows with the micro-batch and stage 3 is slower: after two random trials the
    # model's pick is the largest micro-batch at stage 0.
    for _ in range(2):
        c = search.next()
        search.record(c, c.micro_batch * (0.5 if c.stage == 3 else 1.0))
    assert search.next() == Candidate(0, "none", 8, 1)


def test_no_config_flag_is_an_error_before_any_trial(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    done = subprocess.run(
        [sys.executable, "-m", "zero.launcher", "--autotuning", "tune", str(script), "--x", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "name no config file" in done.stderr
    assert not (tmp_path / "autotuning_exps").exists()


def test_tune_and_run_the_example_gpt(tmp_path):
    (tmp_path / "corpus.txt").write_text((EXAMPLES / "gpt.py").read_text() * 4)
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [0, 2], "offload_optimizer": {"device": "none"}},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 1,
            "end_profile_step": 2,
            "min_train_micro_batch_size_per_gpu": 2,
            "max_train_micro_batch_size_per_gpu": 8192,
            "num_tuning_micro_batch_sizes": 2,
            # a 1-layer GPT at micro-batch 8192 x 32 tokens needs about 2.5 GiB: dropped
            "max_memory_per_rank": "1G",
            "timeout": 300,
        },
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "zero.launcher", "--autotuning", "run", "--num_gpus", "1"]
    command += [str(tmp_path / "wrapper.py"), "--config", "ds.json", "--data", "corpus.txt"]
    command += ["--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32"]
    command += ["--steps", "3", "--eval_batches", "1"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    with open(tmp_path / "autotuning_results" / "results.csv") as handle:
        rows = {row["candidate"]: row for row in csv.DictReader(handle)}
    assert set(rows) == {"z0_none_mbs2", "z0_none_mbs8192", "z2_none_mbs2", "z2_none_mbs8192"}
    for name in ("z0_none_mbs8192", "z2_none_mbs8192"):
        assert rows[name]["status"] == "dropped"
        assert rows[name]["why"].startswith("planner: ")
        assert float(rows[name]["predicted_peak_GiB"]) > 0.8
        assert rows[name]["measured_peak_GiB"] == ""
    failed = rows["z0_none_mbs2"]
    assert failed["status"] == "failed"
    assert "MemoryError: simulated: out of memory" in failed["why"]
    best = rows["z2_none_mbs2"]
    assert best["status"] == "best"
    assert float(best["samples_per_s"]) > 0 and float(best["step_ms"]) > 0
    assert float(best["TFLOP_per_s"]) > 0
    assert 0 < float(best["predicted_peak_GiB"]) < 0.8
    assert float(best["measured_peak_GiB"]) > 0
    # The probe trial (least memory: stage 2, micro-batch 2) is where the planner's runtime term
    # is measured, so its predicted peak is its measured one.
    assert best["why"].startswith("probe")
    assert best["predicted_peak_GiB"] == best["measured_peak_GiB"]

    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == 2
    assert optimal["train_micro_batch_size_per_gpu"] == 2
    table = (tmp_path / "autotuning_results" / "results.txt").read_text()
    assert "| z2_none_mbs2" in table and "predicted_peak_GiB" in table
    plots = list((tmp_path / "autotuning_results").glob("throughput_vs_memory.*"))
    assert len(plots) == 1 and plots[0].stat().st_size > 0
    assert "[probe] z2_none_mbs2: " in done.stderr  # one progress line per trial
    assert "[1/1] z0_none_mbs2: failed" in done.stderr
    # `run`: the job itself, with the best config, to its end (trials log to exps_dir).
    assert "wrapper: config autotuning_results/ds_config_optimal.json" in done.stdout
    assert "batch: micro 2 x world 1 x accumulation 1" in done.stdout
    assert "final: train_loss=" in done.stdout


def test_plot_without_matplotlib_is_an_svg(tmp_path, monkeypatch):
    from zero.launcher.autotuning.report import Row, plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    rows = [
        Row(
            Candidate(s, "none", 4, 1), "ok", record={"peak_bytes": 2**30 * s, "samples_per_s": 9.5}
        )
        for s in (1, 2)
    ]
    path = plot(str(tmp_path), rows, rows[1])
    text = Path(path).read_text()
    assert path.endswith(".svg") and text.startswith("<svg")
    assert text.count("<circle") == 2 and 'fill="red"' in text and "z2_none_mbs4" in text


def test_a_trial_past_its_timeout_is_ended_and_recorded(tmp_path):
    from zero.launcher.autotuning import trials

    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(600)\n")
    argv = ["--num_gpus", "1", "--master_port", "0", str(script)]
    outcome = trials.run(argv, str(tmp_path / "metrics"), str(tmp_path / "log.txt"), timeout=8)
    assert outcome.code is None and outcome.record is None
    assert "ready" in (tmp_path / "log.txt").read_text()  # it ran, then was ended
    import psutil

    left = [p for p in psutil.process_iter(["cmdline"]) if str(script) in (p.info["cmdline"] or [])]
    assert not left  # zrun ended its rank before it exited


def test_overwrite_false_reuses_an_earlier_result(tmp_path):
    from zero.launcher.autotuning import _same_config
    from zero.launcher.autotuning.trials import command_for, earlier

    config = {"train_micro_batch_size_per_gpu": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _same_config(str(tmp_path / "config.json"), config)
    assert not _same_config(str(tmp_path / "config.json"), {"other": 1})
    prefix, log = str(tmp_path / "metrics"), str(tmp_path / "log.txt")
    argv = ["--num_gpus", "2", "train.py", "--config", "config.json"]
    assert earlier(argv, prefix, log) is None  # no trial yet
    (tmp_path / "log.txt").write_text(" ".join(command_for(argv, prefix)) + "\nstep 1\n")
    assert earlier(argv, prefix, log) is None  # no record
    (tmp_path / "metrics.rank0.json").write_text(json.dumps({"rank": 0, "peak_bytes": 5}))
    (tmp_path / "metrics.rank1.json").write_text(json.dumps({"rank": 1, "peak_bytes": 7}))
    outcome = earlier(argv, prefix, log)
    assert outcome.record == {"rank": 0, "peak_bytes": 7}  # rank 0's, with the largest peak
    # another world size or script argument is another trial
    assert earlier(["--num_gpus", "1", *argv[2:]], prefix, log) is None
    assert earlier([*argv, "--steps", "9"], prefix, log) is None
    # a partial window may be a crash's (its exit code was not kept): run it again
    partial = {"rank": 0, "peak_bytes": 5, "complete": False}
    (tmp_path / "metrics.rank0.json").write_text(json.dumps(partial))
    assert earlier(argv, prefix, log) is None


def _record(samples_per_s):
    if samples_per_s is None:
        return None
    # a global batch of 100 samples
    return {"samples_per_s": samples_per_s, "step_seconds": 100 / samples_per_s, "peak_bytes": 1}


def test_finalists_are_measured_again_and_the_best_median_wins():
    from types import SimpleNamespace

    from zero.launcher import autotuning
    from zero.launcher.autotuning.report import Row, table

    names = ("lucky", "steady", "flaky", "slow")
    # The search's single window: "lucky" leads; over three rounds it is slowest.
    search = dict(zip(names, (500.0, 300.0, 250.0, 100.0)))
    scripted = {"lucky": [90.0, 400.0, 80.0], "steady": [280.0, 290.0, 100.0]}
    scripted["flaky"] = [240.0, 260.0, None]  # a round that reported nothing counts as 0
    rows = [
        Row(Candidate(2, "none", 2**i, 1), "ok", record=_record(search[n]))
        for i, n in enumerate(names)
    ]
    by_name = {row.candidate: name for row, name in zip(rows, names)}
    rows[0].status = "best"
    calls = []

    def run_trial(candidate, finalist_round, steps):
        # 5 s at the search's step time (0.2, 0.33 and 0.4 s), more than twice its 2 steps
        assert steps == {"lucky": 25, "steady": 15, "flaky": 13}[by_name[candidate]]
        calls.append((by_name[candidate], finalist_round))
        figure = scripted[by_name[candidate]][finalist_round - 1]
        return autotuning.trials.Outcome(0, _record(figure), "")

    tune = SimpleNamespace(tuning=tuning(), run_trial=run_trial)
    best = autotuning.finalists(tune, rows, rows[0])
    assert by_name[best.candidate] == "steady" and best.status == "best"
    assert rows[0].status == "ok"
    # three interleaved rounds over the three best, the order rotated each round; "slow" is out
    assert calls == [
        ("lucky", 1), ("steady", 1), ("flaky", 1),
        ("steady", 2), ("flaky", 2), ("lucky", 2),
        ("flaky", 3), ("lucky", 3), ("steady", 3),
    ]  # fmt: skip
    values = {by_name[row.candidate]: row.values() for row in rows}
    assert values["lucky"]["finalist_samples_per_s"] == "90.00 400.00 80.00"
    assert values["lucky"]["finalist_median"] == "90.00"
    assert values["lucky"]["samples_per_s"] == "500.00"  # the search's window, as it was
    assert values["steady"]["finalist_median"] == "280.00"
    assert values["flaky"]["finalist_samples_per_s"] == "240.00 260.00 0.00"
    assert values["slow"]["finalist_samples_per_s"] == values["slow"]["finalist_median"] == ""
    assert "| 90.00 400.00 80.00" in table(rows)

    # num_finalists 0, or fewer than two measured rows: the search's best stands, nothing runs
    calls.clear()
    off = SimpleNamespace(tuning=tuning(num_finalists=0), run_trial=run_trial)
    assert autotuning.finalists(off, rows, rows[3]) is rows[3]
    assert autotuning.finalists(tune, rows[:1], rows[0]) is rows[0]
    assert calls == []
    # no round reports (the script ends before the longer window): the search's best stands
    for row in rows:
        row.rounds, row.status = [], "ok"
    scripted.update({name: [None] * 3 for name in names})
    assert autotuning.finalists(tune, rows, rows[3]) is rows[3]


def test_a_finalist_round_measures_a_longer_window_in_its_own_directory(tmp_path, monkeypatch):
    from zero.launcher import autotuning

    tune = object.__new__(autotuning.Tuning)
    tune.raw = {"train_micro_batch_size_per_gpu": 1, "autotuning": {"timeout": 60}}
    tune.tuning = tuning(start_profile_step=2, end_profile_step=5, exps_dir=str(tmp_path))
    tune.script_args, tune.launcher_argv = ["--config", "ds.json"], []
    tune.args = type("Args", (), {"script": "train.py"})
    seen = []
    monkeypatch.setattr(autotuning.trials, "run", lambda argv, *rest: seen.append(argv))
    candidate = Candidate(1, "none", 4, 1)
    tune.run_trial(candidate, finalist_round=2, steps=6)
    path = tmp_path / "z1_none_mbs4" / "round2" / "config.json"
    config = json.loads(path.read_text())
    assert config["autotuning"] == {"timeout": 60, "end_profile_step": 8}  # steps 2-8
    assert seen == [["train.py", "--config", str(path)]]
    tune.run_trial(candidate)  # a search trial: the config's own window
    search_config = json.loads((tmp_path / "z1_none_mbs4" / "config.json").read_text())
    assert search_config["autotuning"] == {"timeout": 60}


def test_a_finalist_window_is_twice_the_search_window_or_five_seconds():
    from zero.launcher.autotuning import FINALIST_SECONDS, finalist_window

    assert FINALIST_SECONDS == 5.0
    window = tuning(start_profile_step=2, end_profile_step=5)
    assert finalist_window(window, step_seconds=10.0) == 6  # slow steps: twice the 3 steps
    assert finalist_window(window, step_seconds=0.25) == 20  # fast ones: 5 s of them
    assert finalist_window(window, step_seconds=0.3) == 17


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _fake_engine(start, end):
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        module=torch.nn.Linear(2, 2),
        config=SimpleNamespace(
            autotuning=tuning(start_profile_step=start, end_profile_step=end), train_batch_size=8
        ),
        global_steps=0,
        device=torch.device("cpu"),
        monitor=SimpleNamespace(tokens_per_sample=16, psi=100),
        optimizer=SimpleNamespace(layout=SimpleNamespace(numel=100)),
        comm=SimpleNamespace(rank=0, world_size=1),
    )


def test_a_trial_times_each_step_and_reports_the_median(tmp_path, monkeypatch):
    from zero import autotuning

    clock = _Clock()
    monkeypatch.setattr(autotuning.time, "perf_counter", clock)
    monkeypatch.setattr(autotuning.atexit, "register", lambda *args: None)
    engine = _fake_engine(start=2, end=6)
    probe = autotuning.TrialProbe(str(tmp_path / "m"), engine)
    # steps 1-6 end at these times: steps 3-6 take 0.1, 0.1, 2.0 (another process ran), 0.1 s
    for step, now in enumerate((1.0, 2.0, 2.1, 2.2, 4.2, 4.3), start=1):
        engine.global_steps, clock.now = step, now
        if step < 6:
            probe.on_step(engine)
    with pytest.raises(SystemExit) as ended:
        probe.on_step(engine)
    assert ended.value.code == 0
    record = json.loads((tmp_path / "m.rank0.json").read_text())
    assert record["step_seconds"] == pytest.approx(0.1)  # the mean, 0.575 s, would be moved
    assert record["samples_per_s"] == pytest.approx(80.0)
    assert record["steps"] == [2, 6] and record["complete"] is True


def test_a_script_that_ends_inside_the_window_reports_what_it_measured(tmp_path, monkeypatch):
    from zero import autotuning
    from zero.launcher.autotuning.trials import Outcome, merged_record

    clock = _Clock()
    monkeypatch.setattr(autotuning.time, "perf_counter", clock)
    at_exit = []
    monkeypatch.setattr(autotuning.atexit, "register", lambda *args: at_exit.append(args))
    engine = _fake_engine(start=1, end=50)
    probe = autotuning.TrialProbe(str(tmp_path / "m"), engine)
    for step, now in enumerate((1.0, 1.5, 2.0, 2.5), start=1):
        engine.global_steps, clock.now = step, now
        probe.on_step(engine)
    assert not list(tmp_path.iterdir())  # nothing yet: the window runs to step 50
    function, *args = at_exit[0]
    function(*args)  # the interpreter exits
    record = merged_record(str(tmp_path / "m"))
    assert record["steps"] == [1, 4] and record["complete"] is False
    assert record["step_seconds"] == pytest.approx(0.5)
    # counted when the job exited with 0; a crash inside the window is a failed trial
    assert Outcome(0, record, "").measured is record
    assert Outcome(1, record, "").measured is None
    assert Outcome(1, dict(record, complete=True), "").measured is not None
    # a second engine in the process (DeepSpeed-Chat's critic beside the actor) does not write
    # its partial window over the record already there
    other = autotuning.TrialProbe(str(tmp_path / "m"), _fake_engine(start=1, end=50))
    other.step_seconds = [9.0]
    at_exit[-1][0](*at_exit[-1][1:])
    assert merged_record(str(tmp_path / "m"))["step_seconds"] == pytest.approx(0.5)


def test_the_config_path_is_found_beside_deepspeeds_switch():
    from zero.launcher.autotuning.trials import config_flag, script_args_for

    # DeepSpeed's add_config_arguments: --deepspeed is a switch, the path follows
    # --deepspeed_config; Hugging Face's --deepspeed takes the path itself.
    assert config_flag(["--deepspeed", "--deepspeed_config", "ds.json"]) == (
        2,
        "--deepspeed_config",
    )
    assert config_flag(["--deepspeed", "ds.json", "--steps", "3"]) == (1, "--deepspeed")
    assert config_flag(["--deepspeed", "--deepspeed_config=ds.json"]) == (1, "--deepspeed_config")
    # a model's own --config beside DeepSpeed's: the DeepSpeed config is tuned
    found = config_flag(["--config", "model.json", "--deepspeed", "--deepspeed_config", "ds.json"])
    assert found == (4, "--deepspeed_config")
    args = ["--deepspeed", "--deepspeed_config", "ds.json", "--steps", "3"]
    assert script_args_for(args, "trial.json", {}, None) == [
        "--deepspeed", "--deepspeed_config", "trial.json", "--steps", "3"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="name no config file"):
        config_flag(["--deepspeed", "--steps", "3"])


def fake_tune(block, raw: dict, run_trial):
    """What probe() reads of a Tuning, on this machine with one CPU rank; run_trial(candidate)
    gives each trial's Outcome."""
    from types import SimpleNamespace

    from zero.launcher.autotuning.predict import Machine

    return SimpleNamespace(
        tuning=block, raw=raw, machine=Machine.here(1, 1, block), run_trial=run_trial
    )


def test_a_tune_where_even_the_smallest_candidate_does_not_fit_says_so():
    from zero.launcher import autotuning

    record = {"samples_per_s": 10.0, "step_seconds": 0.1, "peak_bytes": 2**30, "num_params": 1000}
    tune = fake_tune(
        tuning(max_memory_per_rank="1G"),
        {"train_micro_batch_size_per_gpu": 1},
        lambda candidate: autotuning.trials.Outcome(0, dict(record), ""),
    )
    space = [Candidate(3, "none", 1, 1), Candidate(3, "none", 4, 1)]
    # 1 GiB measured against 80% of 1 GiB: the candidate with the least memory does not fit
    with pytest.raises(RuntimeError, match="nothing fits: z3_none_mbs1, the candidate with"):
        autotuning.probe(tune, space)
    record["peak_bytes"] = 2**28
    rows, facts = autotuning.probe(tune, space)
    assert rows[-1].candidate.name == "z3_none_mbs1" and facts.num_params == 1000


def test_ctrl_c_ends_the_tune_and_its_trial_without_a_traceback(tmp_path):
    import signal
    import time

    import psutil

    script = tmp_path / "hang.py"
    script.write_text("import pathlib, time\npathlib.Path('started').touch()\ntime.sleep(600)\n")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "autotuning": {}}))
    tuner = subprocess.Popen(
        [sys.executable, "-m", "zero.launcher", "--autotuning", "tune", "--num_gpus", "1"]
        + [str(script), "--config", str(config)],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    tuner.send_signal(signal.SIGINT)  # as Ctrl-C reaches the tuner
    _, stderr = tuner.communicate(timeout=60)
    assert tuner.returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr and "zrun --autotuning: interrupted" in stderr, stderr
    left = [p for p in psutil.process_iter(["cmdline"]) if str(script) in (p.info["cmdline"] or [])]
    assert not left  # the trial's rank was ended too


def test_a_failed_probe_is_retried_at_the_smallest_micro_batch():
    """Before, the third try was the same stage at a larger micro-batch: more memory, not less."""
    from zero.launcher import autotuning

    tried = []

    def fails(candidate):
        tried.append(candidate.name)
        return autotuning.trials.Outcome(1, None, "RuntimeError: boom")

    tune = fake_tune(tuning(), {}, fails)
    space = [Candidate(s, o, m, 1) for s in (2, 3) for o in ("none", "cpu") for m in (1, 8)]
    with pytest.raises(
        RuntimeError, match="reported nothing; the last: exit code 1: RuntimeError: boom"
    ):
        autotuning.probe(tune, space)
    assert tried == ["z3_none_mbs1", "z3_cpu_mbs1", "z2_none_mbs1"]  # CPU ranks: offload last
