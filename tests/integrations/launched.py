"""Running a program the way its users start it (zero-as-deepspeed, DeepSpeed's `deepspeed`,
torchrun, accelerate launch) from a test, as a job of its own."""

import os
import subprocess


def run_launched(command: list, timeout: float) -> subprocess.CompletedProcess:
    """Run `command` without this process's rank variables (RANK, LOCAL_RANK, WORLD_SIZE: the
    launcher sets its own) and with one intra-op thread per rank; assert it exits 0, showing the
    tails of its stdout and stderr otherwise. Returns the finished process (text output)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result
