"""Helpers for the end-to-end launcher tests: write a rank script, start zrun, find leftovers.

Every process a job starts carries the test's tmp_path in its command line, so "nothing left
behind" is checked by scanning the process table for it.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import psutil

from zero.launcher.world import find_free_port

# A rank script may start a grandchild that sleeps; it carries the marker in its argv.
GRANDCHILD = "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', MARKER])"

# A rank that starts a grandchild, reports it is ready in OUT/ready<RANK>, then sleeps.
SLEEPING_RANK = f"""
{GRANDCHILD}
open(os.path.join(OUT, "ready" + os.environ["RANK"]), "w").close()
time.sleep(120)
"""

# A rank started by zrun: a gloo all-reduce of rank + 1, then what it saw, in OUT/rank<R>.json.
ALL_REDUCE = """
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
record = {"sum": value.item(), "argv": sys.argv[1:], "cwd": os.getcwd()}
record["env"] = {k: v for k, v in os.environ.items() if k.startswith(("ZERO_T_", "NOT_EXP"))}
for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR"):
    record[key] = os.environ[key]
with open(os.path.join(OUT, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(record, f)
dist.barrier()  # no rank closes its sockets while a peer still talks to it
dist.destroy_process_group()
"""
# Rank 1 fails with code 7 while rank 0 waits: the job must end with 7 and leave nothing behind.
FAIL_ON_RANK_1 = """
if os.environ["RANK"] == "1":
    sys.exit(7)
time.sleep(60)
"""
# A rank started directly by srun or mpirun (no RANK/WORLD_SIZE): zero.initialize finds the
# layout in SLURM_* or OMPI_COMM_WORLD_* variables, sets up gloo and takes one ZeRO-2 step.
DIRECT_LAUNCH = """
import torch
import torch.distributed as dist
import zero
from zero.comm import read_launch_env
launch = read_launch_env()
torch.manual_seed(0)
config = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 2},
}
engine, _, _, _ = zero.initialize(model=torch.nn.Linear(4, 1), config=config)
engine.backward(engine(torch.full((1, 4), float(launch.rank + 1))).pow(2).mean())
engine.step()
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
record = {"sum": value.item(), "launch": [launch.rank, launch.local_rank, launch.world_size]}
record["dist"] = [dist.get_rank(), dist.get_world_size(), engine.comm.world_size]
record["params"] = [p.tolist() for p in engine.module.parameters()]
record["master"] = [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]
with open(os.path.join(OUT, f"rank{launch.rank}.json"), "w") as f:
    json.dump(record, f)
zero.comm.destroy_process_group()  # a barrier, then torch's: every rank exits cleanly
"""


def zrun_command() -> list[str]:
    zrun = shutil.which("zrun")
    if zrun is not None:
        return [zrun]
    return [sys.executable, "-c", "import sys; from zero.launcher import main; sys.exit(main())"]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def write_script(tmp_path, body):
    # faulthandler: a rank that aborts (SIGABRT) prints every thread's Python stack.
    header = "import faulthandler, json, os, subprocess, sys, time\nfaulthandler.enable()\n"
    header += f"MARKER = {str(tmp_path)!r}\nOUT = {str(tmp_path)!r}\n"
    return write(tmp_path, "script.py", header + textwrap.dedent(body))


def start_zrun(tmp_path, hosts, script, *args):
    hostfile = write(tmp_path, "hosts", hosts)
    command = [*zrun_command(), "--hostfile", hostfile, "--master_port", str(find_free_port())]
    command += [*args, script]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def job_processes(marker):
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.pid != os.getpid() and any(marker in part for part in cmdline):
            found.append(proc)
    return found


def assert_nothing_left(marker, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while job_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [(p.pid, p.info["cmdline"]) for p in job_processes(marker)]
    assert not left, f"processes left behind: {left}"


def wait_for_files(paths, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"ranks did not start: {paths}"
        time.sleep(0.05)


def read_records(tmp_path, world_size):
    """The rank<R>.json records of ranks 0..world_size-1, in rank order."""
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def run_job(tmp_path, command, env, timeout_s=80):
    """Run a job's command from tmp_path, with HOME there too (so no ~/.zero_env of the machine
    takes part); returns the CompletedProcess with text stdout and stderr."""
    env = {**env, "HOME": str(tmp_path)}
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout_s
    )
