"""`zrun --autotuning tune|run`: find the stage, offload, micro-batch and bucket size that train
fastest here, by predicting before running (docs/tuning.md).

1. space.py lists the candidates. trials.py runs each as a short child job of the user's script
   through zrun, which reports step time, samples/s, TFLOP/s, peak memory and the model's
   parameter count and shape after autotuning.end_profile_step (zero.autotuning).
2. The first trial, the probe, is the candidate with the least memory; from its report
   predict.py asks the planner (zero.planning) for every other candidate's peak bytes per rank
   and drops those predicted not to fit.
3. search.py orders the rest (autotuning.tuner_type). A failed trial is recorded and the search
   goes on.
4. The num_finalists best are measured again, in finalist_rounds interleaved rounds with a
   longer window (FINALIST_SECONDS of steps); the best median wins (one short window on a
   shared machine misleads).
5. report.py writes the table, the best config and the plot; `run` then starts the real job with
   the best config.
"""

import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import time

from zero.config import ConfigError, load_config, read_mapping

from ..cli import resource_pool
from . import trials
from .predict import Machine, ModelFacts, predict
from .report import GIB, Row, table, write_results
from .search import Search
from .space import Candidate, candidate_config, candidates

__all__ = ["autotune"]

PROBE_TRIES = 3  # candidates tried, smallest first, before a tune gives up for want of facts
# A finalist round measures at least twice the search's window and at least FINALIST_SECONDS
# of steps (at the search's step time): long enough that the median step of a round moves by
# less than the few percent that separate close candidates on a shared machine.
FINALIST_WINDOW = 2
FINALIST_SECONDS = 5.0


def _say(text: str) -> None:
    print(f"zrun --autotuning: {text}", file=sys.stderr, flush=True)


class Tuning:
    """One tune: the user's command split into zrun's flags, the script and its arguments."""

    def __init__(self, args, argv: list[str]):
        self.args = args
        self.script_args = list(args.script_args)
        launcher = argv[: len(argv) - len(self.script_args) - 1]
        self.launcher_argv = _without_autotuning(launcher)
        if not any(word.split("=")[0] == "--master_port" for word in self.launcher_argv):
            self.launcher_argv += ["--master_port", "0"]  # each trial a free port
        index, _ = trials.config_flag(self.script_args)
        path = self.script_args[index].split("=", 1)[-1]
        self.raw = read_mapping(path)
        block = self.raw.get("autotuning") or {}
        self.tuning = load_config(
            {"train_micro_batch_size_per_gpu": 1, "autotuning": block}
        ).autotuning
        pool = resource_pool(args)
        ranks_per_node = max(len(slots) for slots in pool.values())
        world = sum(len(slots) for slots in pool.values())
        self.data_parallel = max(1, world // self.tuning.mp_size)
        self.machine = Machine.here(len(pool), ranks_per_node, self.tuning)
        self._check_mappings()

    def _check_mappings(self) -> None:
        mapped = self.tuning.arg_mappings or {}
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if self.raw.get(key) == "auto" and key not in mapped:
                raise ValueError(
                    f'autotuning: {key} is "auto" in the config, so the script sets it from its '
                    f"own flag; name that flag in autotuning.arg_mappings (e.g. "
                    f'"{key}": "--per_device_train_batch_size" for a Trainer) so each trial '
                    "gets the candidate's value"
                )

    def argv_for(self, config_path: str, config: dict) -> list[str]:
        """zrun's arguments for one trial or the final run."""
        script_args = trials.script_args_for(
            self.script_args, config_path, config, self.tuning.arg_mappings
        )
        return [*self.launcher_argv, self.args.script, *script_args]

    def run_trial(
        self, candidate: Candidate, finalist_round: int | None = None, steps: int | None = None
    ) -> trials.Outcome:
        """One trial of `candidate`; a `finalist_round` (1, 2, ...) gets its own directory
        under the candidate's and a window of `steps` optimizer steps."""
        directory = os.path.join(self.tuning.exps_dir, candidate.name)
        config = candidate_config(self.raw, candidate)
        if finalist_round is not None:
            directory = os.path.join(directory, f"round{finalist_round}")
            window = {"end_profile_step": self.tuning.start_profile_step + steps}
            config["autotuning"] = {**(config.get("autotuning") or {}), **window}
        os.makedirs(directory, exist_ok=True)
        config_path = os.path.join(directory, "config.json")
        prefix = os.path.join(directory, "metrics")
        argv = self.argv_for(config_path, config)
        log = os.path.join(directory, "log.txt")
        if not self.tuning.overwrite and _same_config(config_path, config):
            earlier = trials.earlier(argv, prefix, log)
            if earlier is not None:
                return earlier
        with open(config_path, "w") as handle:
            json.dump(config, handle, indent=2)
        return trials.run(argv, prefix, log, self.tuning.timeout)


def _same_config(config_path: str, config: dict) -> bool:
    # autotuning.overwrite false: an earlier tune's result for the same config and command
    # stands (trials.earlier).
    if not os.path.isfile(config_path):
        return False
    with open(config_path) as handle:
        return json.load(handle) == config


def _without_autotuning(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--autotuning":
            skip = True
        elif not word.startswith("--autotuning="):
            kept.append(word)
    return kept


def probe(tune: Tuning, space: list[Candidate]) -> tuple[list[Row], ModelFacts]:
    """The first trials: the candidates with the least memory (smallest micro-batch, then
    highest stage; with GPU ranks offload first, with CPU ranks, where it saves nothing, last)
    until one reports, at most PROBE_TRIES; returns their rows (the reporting one last) and the
    model facts it reported. Raises RuntimeError naming the logs when none reports (the planner
    has no Psi to work with), and when the one that reports does not fit the budget."""
    cpu = tune.machine.cpu
    order = sorted(space, key=lambda c: (c.micro_batch, -c.stage, (c.offload == "none") != cpu))
    tried = []
    for candidate in order[:PROBE_TRIES]:
        outcome = tune.run_trial(candidate)
        row = Row(candidate, "ok")
        _record(row, outcome)
        tried.append(row)
        if row.record is not None:
            break
        _say(f"[probe] {_progress(row, outcome)}")
    else:
        logs = ", ".join(os.path.join(tune.tuning.exps_dir, r.candidate.name) for r in tried)
        raise RuntimeError(
            f"the probe trials (the candidates with the least memory) reported nothing; the "
            f"last: {tried[-1].why}; logs in {logs}"
        )
    facts = ModelFacts.from_probe(row.record, tune.tuning)
    # The planner's runtime term, measured once (footprint.py [Note: peak]): what the probe's
    # peak holds beyond the tensors predicted for its own config.
    config = candidate_config(tune.raw, row.candidate)
    predicted = predict(config, facts, tune.machine).per_device
    runtime = max(0, row.record["peak_bytes"] - predicted)
    facts = dataclasses.replace(facts, runtime_bytes=runtime)
    row.predicted_peak = predicted + runtime
    if not predict(config, facts, tune.machine).fits:  # the least memory of all: none fits
        raise RuntimeError(
            f"nothing fits: {row.candidate.name}, the candidate with the least memory, peaked at "
            f"{row.record['peak_bytes'] / GIB:.3f} GiB, above 80% of max_memory_per_rank "
            f"({tune.machine.memory_per_rank / GIB:.3f} GiB); raise max_memory_per_rank, or "
            "shrink the model or its micro-batch"
        )
    row.why = "probe (the planner's runtime term is measured here)"
    shape = (
        "no transformer shape"
        if facts.shape(1) is None
        else (f"{facts.num_layers} layers, hidden {facts.hidden_size}, seq_len {facts.seq_len}")
    )
    _say(
        f"[probe] {_progress(row, outcome)}; Psi = {facts.num_params:,}, {shape}, runtime "
        f"{runtime / GIB:.3f} GiB"
    )
    return tried, facts


def planned_rows(tune: Tuning, space: list[Candidate], facts: ModelFacts, tried: list) -> list:
    """One row per candidate with the planner's prediction (the probe's rows, `tried`, as they
    are); those predicted not to fit are "dropped", the rest "not run" until a trial runs
    them."""
    rows, done = [], {row.candidate: row for row in tried}
    for candidate in space:
        if candidate in done:
            rows.append(done[candidate])
            continue
        try:
            estimate = predict(candidate_config(tune.raw, candidate), facts, tune.machine)
        except (ConfigError, ValueError, NotImplementedError) as error:
            rows.append(Row(candidate, "dropped", why=f"config refused: {error}"))
            continue
        row = Row(candidate, "not run", estimate.per_device)
        if not estimate.fits:
            limit = tune.machine.memory_per_rank / GIB
            row.status = "dropped"
            row.why = f"planner: {estimate.per_device / GIB:.3f} GiB > 80% of {limit:.3f} GiB"
        rows.append(row)
    return rows


def search(tune: Tuning, rows: list[Row], tried: list[Row]) -> Row:
    """Run the candidates the planner kept, in the tuner's order, until tuner_num_trials ran
    (the probe's, `tried`, included) or tuner_early_stopping trials in a row did not improve;
    returns the best row."""
    by_candidate = {row.candidate: row for row in rows}
    runnable = [row.candidate for row in rows if row.status == "not run"]
    order, metric = Search(runnable, tune.tuning.tuner_type), tune.tuning.metric
    for row in tried:
        order.record(row.candidate, row.metric(metric))
    best, stale, done = tried[-1], 0, len(tried)
    while done < tune.tuning.tuner_num_trials and stale < tune.tuning.tuner_early_stopping:
        candidate = order.next()
        if candidate is None:
            break
        row = by_candidate[candidate]
        outcome = tune.run_trial(candidate)
        done += 1
        _record(row, outcome)
        order.record(candidate, row.metric(metric))
        improved = row.metric(metric) is not None and row.metric(metric) > best.metric(metric)
        best, stale = (row, 0) if improved else (best, stale + 1)
        _say(f"[{done - len(tried)}/{len(runnable)}] {_progress(row, outcome)}")
    best.status = "best"
    for row in rows:
        if row.status == "not run":
            row.why = "search stopped first (tuner_num_trials / tuner_early_stopping)"
    return best


def finalists(tune: Tuning, rows: list[Row], best: Row) -> Row:
    """Measure the num_finalists best measured rows again in finalist_rounds rounds (one trial
    of each per round, the order rotated each round, so a change of load on a shared machine
    hits each alike) and return the one with the best median metric over the rounds; a failed
    round counts as 0. A round's window is finalist_window(...) steps. Returns `best` when
    fewer than two rows were measured or num_finalists < 2, and when no finalist round
    reported."""
    metric, count = tune.tuning.metric, tune.tuning.num_finalists
    measured = [row for row in rows if row.metric(metric) is not None]
    chosen = sorted(measured, key=lambda row: row.metric(metric), reverse=True)[:count]
    if len(chosen) < 2:
        return best
    _rounds(tune, chosen)
    medians = {row.candidate: statistics.median(row.round_metrics(metric)) for row in chosen}
    winner = max(chosen, key=lambda row: medians[row.candidate])
    if medians[winner.candidate] <= 0:
        _say("no finalist round reported; the search's best stands")
        return best
    best.status, winner.status = "ok", "best"
    _say(
        f"finalists' median {metric}: "
        + ", ".join(f"{row.candidate.name} {medians[row.candidate]:.4g}" for row in chosen)
    )
    return winner


def finalist_window(tuning, step_seconds: float) -> int:
    """Optimizer steps a finalist round measures: FINALIST_WINDOW times the search's window, or
    more, to cover FINALIST_SECONDS at the search's `step_seconds`. A script that ends first
    reports the steps it ran (zero.autotuning)."""
    searched = tuning.end_profile_step - tuning.start_profile_step
    return max(FINALIST_WINDOW * searched, math.ceil(FINALIST_SECONDS / step_seconds))


def _rounds(tune: Tuning, chosen: list[Row]) -> None:
    total = tune.tuning.finalist_rounds
    steps = {
        row.candidate: finalist_window(tune.tuning, row.record["step_seconds"]) for row in chosen
    }
    names = ", ".join(f"{row.candidate.name} ({steps[row.candidate]} steps)" for row in chosen)
    _say(f"measuring the {len(chosen)} best again in {total} interleaved rounds: {names}")
    for number in range(1, total + 1):
        shift = (number - 1) % len(chosen)
        for row in chosen[shift:] + chosen[:shift]:
            outcome = tune.run_trial(row.candidate, number, steps[row.candidate])
            row.rounds.append(outcome.measured)
            shown = Row(
                row.candidate, "ok", row.predicted_peak, outcome.measured, outcome.last_line
            )
            _say(f"[finalists, round {number}/{total}] {_progress(shown, outcome)}")


def _record(row: Row, outcome: trials.Outcome) -> None:
    if outcome.measured is not None:
        row.status, row.record = "ok", outcome.measured
        return
    row.status = "failed"
    how = "timed out" if outcome.code is None else f"exit code {outcome.code}"
    if outcome.code == 0:
        how += ", no step measured: the script ended by start_profile_step + 1"
    row.why = f"{how}: {outcome.last_line}" if outcome.last_line else how


def _progress(row: Row, outcome: trials.Outcome) -> str:
    name = row.candidate.name
    if row.record is None:
        return f"{name}: failed ({row.why}) in {outcome.seconds:.1f} s"
    r = row.record
    predicted = "" if row.predicted_peak is None else f" (predicted {row.predicted_peak / GIB:.3f})"
    steps = r.get("steps") or [0, 0]
    partial = "" if r.get("complete", True) else f" (the script ended: {steps[1] - steps[0]} steps)"
    return (
        f"{name}: {r['samples_per_s']:.2f} samples/s, {r['step_seconds'] * 1e3:.1f} ms/step"
        f"{partial}, peak {r['peak_bytes'] / GIB:.3f} GiB{predicted}, {outcome.seconds:.1f} s"
    )


def autotune(args, argv: list[str]) -> int:
    """`zrun --autotuning tune|run ...`: tune, write the results, and with `run` start the job
    with the best config; returns the exit code (1 when no probe trial reports, or the one
    that does is over the budget; else tune: 0, run: the job's code).

    Raises:
        ValueError, ConfigError: before any trial runs: no config flag in the script's arguments,
            a malformed autotuning block or search space, an "auto" batch key without
            arg_mappings.
    """
    from .. import main as zrun_main

    for signum in (signal.SIGTERM, signal.SIGHUP):
        # as SystemExit, so the running trial is ended too (trials.run), as Ctrl-C ends it
        signal.signal(signum, lambda number, frame: sys.exit(128 + number))
    start = time.perf_counter()
    tune = Tuning(args, argv)
    space = candidates(tune.raw, tune.tuning, tune.data_parallel)
    _say(f"{len(space)} candidates; {tune.machine.memory_per_rank / GIB:.3f} GiB per rank")
    try:
        tried, facts = probe(tune, space)
    except RuntimeError as error:
        _say(f"error: {error}")
        return 1
    rows = planned_rows(tune, space, facts, tried)
    dropped = sum(row.why.startswith("planner") for row in rows)
    refused = sum(row.why.startswith("config refused") for row in rows)
    others = len(rows) - len(tried)
    _say(
        f"the planner drops {dropped} of {others} other candidates as too large"
        + (f"; {refused} configs refused (see results.txt)" if refused else "")
    )
    best = finalists(tune, rows, search(tune, rows, tried))
    best_config = candidate_config(tune.raw, best.candidate)
    optimal = os.path.join(tune.tuning.results_dir, "ds_config_optimal.json")
    # Under the doorway (zero-as-deepspeed sets ZERO_AS_DEEPSPEED) the script imports deepspeed.
    doorway = ["zero-as-deepspeed"] if os.environ.get("ZERO_AS_DEEPSPEED") == "1" else []
    command = [*doorway, "zrun", *tune.argv_for(optimal, best_config)]
    plot = write_results(tune.tuning.results_dir, rows, best, best_config, command)
    print(table(rows), flush=True)
    _say(f"tuning took {time.perf_counter() - start:.1f} s; results in {tune.tuning.results_dir}")
    _say(f"best: {best.candidate.name} ({tune.tuning.metric}); config {optimal}; plot {plot}")
    if args.autotuning == "tune":
        return 0
    _say("starting the job with the best config")
    return zrun_main(tune.argv_for(optimal, best_config))
