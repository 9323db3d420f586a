"""Running a program the way its users start it (zero-as-deepspeed, DeepSpeed's `deepspeed`,
torchrun, accelerate launch) from a test, as a job of its own."""

import os
import subprocess
import sys

# What a rank prints when it aborts in torch's gloo teardown at interpreter exit, after its
# work is done: a gloo worker thread frees a tensor once Python has begun to shut down. Torch
# DDP programs that never destroy their process group hit it too (a Trainer run, about one
# suite run in twenty on a loaded 2-core machine).
ABORT_AT_EXIT = "terminate called without an active exception"


def run_launched(command: list, timeout: float) -> subprocess.CompletedProcess:
    """Run `command` without this process's rank variables (RANK, LOCAL_RANK, WORLD_SIZE: the
    launcher sets its own) and with one intra-op thread per rank; assert it exits 0, showing the
    tails of its stdout and stderr otherwise. A job whose launcher reports a rank killed by
    SIGABRT after ABORT_AT_EXIT runs once more; a second failure fails the test. Returns the
    finished process (text output)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0 and ABORT_AT_EXIT in result.stderr and "SIGABRT" in result.stderr:
        print(result.stderr[-4000:], file=sys.stderr)
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result
