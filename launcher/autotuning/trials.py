"""One trial: the user's script started by zrun with a candidate's config, measured by the
engine (zero.autotuning) and ended after autotuning.end_profile_step.

The script names its config with --config, --deepspeed_config or --deepspeed (Hugging Face);
each trial gets its own file in place of that path, and the flags autotuning.arg_mappings names
get the candidate's values (a Trainer's --per_device_train_batch_size must agree with the
config's micro-batch). A trial that fails, runs out of memory or out of time is recorded with the
last line of its log and the search goes on.
"""

import dataclasses
import glob
import json
import os
import signal
import subprocess
import sys
import time

# In this order: a script with a model --config beside --deepspeed_config tunes the latter.
CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed", "--config")
METRICS_ENV = "ZERO_AUTOTUNING_METRICS"  # zero.autotuning.ENV_METRICS


@dataclasses.dataclass
class Outcome:
    """How a trial ended: code (None: ended for running past its timeout), the ranks'
    records (merged: rank 0's figures, the largest peak_bytes), and the log's last line."""

    code: int | None
    record: dict | None
    last_line: str
    seconds: float = 0.0

    @property
    def measured(self) -> dict | None:
        """The record when it counts: a whole window, or the steps a script that ended first
        measured ("complete": false) when the job then exited with 0 (not a crash mid-window)."""
        if self.record is None or self.record.get("samples_per_s") is None:
            return None
        return self.record if self.record.get("complete", True) or self.code == 0 else None


def config_flag(script_args: list[str]) -> tuple[int, str]:
    """(index of the value, flag) of the config path in the script's arguments, the first of
    CONFIG_FLAGS present. A flag followed by another flag holds no path: DeepSpeed's own
    `--deepspeed` is a switch beside `--deepspeed_config PATH`, while Hugging Face's takes the
    path.

    Raises ValueError when none of CONFIG_FLAGS is there with a path."""
    for wanted in CONFIG_FLAGS:
        for i, word in enumerate(script_args):
            flag, sep, _ = word.partition("=")
            if flag != wanted:
                continue
            if sep:
                return i, flag
            if i + 1 < len(script_args) and not script_args[i + 1].startswith("-"):
                return i + 1, flag
    raise ValueError(
        "zrun --autotuning: the script's arguments name no config file; pass it as --config, "
        "--deepspeed_config or --deepspeed PATH (each trial gets its own copy there)"
    )


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    for i, word in enumerate(args):
        if word == flag and i + 1 < len(args):
            return [*args[: i + 1], value, *args[i + 2 :]]
        if word.startswith(flag + "="):
            return [*args[:i], f"{flag}={value}", *args[i + 1 :]]
    return [*args, flag, value]


def script_args_for(script_args: list[str], config_path: str, config: dict, arg_mappings) -> list:
    """The script's arguments with `config_path` in place of its config and each
    arg_mappings flag set to the config's value of its key (dotted keys reach into blocks)."""
    index, flag = config_flag(script_args)
    args = list(script_args)
    args[index] = f"{flag}={config_path}" if "=" in args[index] else config_path
    for key, mapped in (arg_mappings or {}).items():
        value = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None and value != "auto":
            args = _set_flag(args, mapped, str(value))
    return args


def merged_record(prefix: str) -> dict | None:
    """Every rank's PREFIX.rank<R>.json as one record: rank 0's, with the largest peak_bytes."""
    records = []
    for path in sorted(glob.glob(glob.escape(prefix) + ".rank*.json")):
        with open(path) as handle:
            records.append(json.load(handle))
    if not records:
        return None
    record = min(records, key=lambda r: r.get("rank", 0))
    peaks = [r["peak_bytes"] for r in records if r.get("peak_bytes") is not None]
    if peaks:
        record["peak_bytes"] = max(peaks)
    return record


def _last_line(log_path: str) -> str:
    with open(log_path, errors="replace") as handle:
        lines = [line.strip() for line in handle.readlines()[-200:] if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or [""])[-1][:300]


def _end(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGTERM)  # zrun ends its ranks, then exits
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def command_for(zrun_argv: list[str], prefix: str) -> list[str]:
    """The trial's command line: zrun with METRICS_ENV=`prefix` on every rank (the first line
    of its log)."""
    return [sys.executable, "-m", "zero.launcher", "--env", f"{METRICS_ENV}={prefix}", *zrun_argv]


def earlier(zrun_argv: list[str], prefix: str, log_path: str) -> Outcome | None:
    """The outcome an earlier trial left for the same command (autotuning.overwrite false): its
    record, when complete; None when the command differed (other ranks, script arguments or
    config path) or nothing complete was recorded."""
    try:
        with open(log_path) as handle:
            if handle.readline().rstrip("\n") != " ".join(command_for(zrun_argv, prefix)):
                return None
    except OSError:
        return None
    record = merged_record(prefix)
    if record is None or not record.get("complete", True):
        return None  # a partial window may come from a crash: its exit code was not kept
    return Outcome(0, record, "reused", 0.0)


def run(zrun_argv: list[str], prefix: str, log_path: str, timeout: float) -> Outcome:
    """Run `zrun zrun_argv` with METRICS_ENV=`prefix` on every rank, its output into log_path;
    on timeout end it as a user's Ctrl-C would (SIGTERM: zrun ends its ranks) and wait."""
    for stale in glob.glob(glob.escape(prefix) + ".rank*.json"):
        os.remove(stale)
    command = command_for(zrun_argv, prefix)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(child)
            code = None
        except BaseException:  # the tuner itself is ended (Ctrl-C, SIGTERM): so is its trial
            _end(child)
            raise
    return Outcome(code, merged_record(prefix), _last_line(log_path), time.perf_counter() - start)
