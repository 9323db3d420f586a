"""Elastic jobs (zrun --nnodes MIN:MAX --max_restarts N): a node lost mid-run over ssh, the job
finishing on the survivor from the last checkpoint (equal to a run resumed by hand on the
smaller world), a node joining a running job, a failing script retried a bounded number
of times, and a restart inside a SLURM allocation (srun, on the one-node cluster of
conftest.py)."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
from zrun_helpers import assert_nothing_left, run_job, write, write_script, zrun_command

from zero.launcher.world import find_free_port

pytestmark = pytest.mark.timeout(120)

# Short rendezvous timings: a lost node's entry expires after 1 s x 3 heartbeats, a round
# completes 1 s after MIN nodes joined.
FAST_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
STEPS, LOST_AT = 5, 2

# One rank per node trains a tiny model with a checkpoint at every step (asynchronous) and
# auto_resume; in the first run, rank 1 reports its pid and its agent's, then waits to be
# killed after step LOST_AT. Rank 0 records the final weights; on one rank, once the job is
# done, it also resumes the test's copy of checkpoint LOST_AT by hand (auto_resume in a fresh
# engine on this one-rank world) and records where that ends: the reference.
TRAIN = """
import torch
import zero


def train(save_dir, steps, lost_at, interval):
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000,
        "checkpoint": {"save_dir": save_dir, "save_interval_steps": interval, "auto_resume": True},
    }
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    engine, _, loader, _ = zero.initialize(model=model, config=config, training_data=data)
    batches = iter(loader)
    while engine.global_steps < steps:
        if engine.global_steps == lost_at and engine.comm.rank == 1:
            with open(os.path.join(OUT, "victim.json"), "w") as f:
                json.dump([os.getpid(), os.getppid()], f)
            time.sleep(120)
        x, y = next(batches)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    params = [p.detach().flatten().tolist() for p in engine.module.parameters()]
    engine.close()
    return params, engine.comm.rank, engine.comm.world_size


save_dir, steps, lost_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
params, rank, world_size = train(save_dir, steps, lost_at, interval=1)
if rank == 0:
    result = {"params": params, "world_size": world_size}
    if world_size == 1:
        result["reference"] = train(os.path.join(OUT, "reference"), steps, -1, interval=None)[0]
    with open(os.path.join(OUT, "final.json"), "w") as f:
        json.dump(result, f)
"""


def _zrun(tmp_path, hosts, script, *flags, script_args=(), extra_env=None):
    hostfile = write(tmp_path, "hosts", hosts)
    command = [*zrun_command(), "--hostfile", hostfile, "--master_port", str(find_free_port())]
    command += [*flags, "--no_local_rank", script, *script_args]
    env = {**os.environ, "HOME": str(tmp_path), **(extra_env or {})}
    return subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(predicate, what, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _latest(save_dir):
    try:
        return (save_dir / "latest").read_text()
    except FileNotFoundError:
        return None


def test_lost_node_job_finishes_on_survivor_as_resumed_by_hand(loopback_sshd, tmp_path):
    script = write_script(tmp_path, TRAIN)
    save_dir = tmp_path / "ckpt"
    flags = ["--force_multi", *loopback_sshd.ssh_args(), "--nnodes", "1:2"]
    flags += ["--max_restarts", "1", "--rdzv_conf", FAST_RDZV]
    args = (str(save_dir), str(STEPS), str(LOST_AT))
    proc = _zrun(
        tmp_path, "localhost slots=1\n127.0.0.2 slots=1\n", script, *flags, script_args=args
    )
    _wait_for(lambda: (tmp_path / "victim.json").exists(), "rank 1 to reach the step")
    _wait_for(lambda: _latest(save_dir) == f"global_step{LOST_AT}", "the checkpoint")
    # The reference: the same checkpoint, resumed by hand on one rank.
    reference = tmp_path / "reference"
    shutil.copytree(save_dir / f"global_step{LOST_AT}", reference / f"global_step{LOST_AT}")
    (reference / "latest").write_text(f"global_step{LOST_AT}")
    rank_pid, agent_pid = json.loads((tmp_path / "victim.json").read_text())
    os.kill(agent_pid, signal.SIGKILL)  # the node's agent, then its rank: the node is gone
    os.kill(rank_pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 0, stderr
    assert "zrun: elastic job: c10d rendezvous at 127.0.0.1:" in stderr
    # Either node may have drawn rank 1 (the rendezvous orders nodes by address, then pid).
    left = r"zrun: node [01] '(localhost|127\.0\.0\.2)' left the job \(code 255\); the other"
    assert re.search(left, stderr), stderr
    assert f"at step {LOST_AT}: world size 2 -> 1, gradient_accumulation_steps 1 -> 2" in stderr
    assert "(restart 1 of the elastic job)" in stderr
    assert _latest(save_dir) == f"global_step{STEPS}"
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["world_size"] == 1
    for got, want in zip(final["params"], final["reference"], strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    assert_nothing_left(str(tmp_path), timeout_s=30.0)


def _agent(tmp_path, port, *flags):
    """An agent started by hand (as on a node that joins): the first one on the port hosts
    the rendezvous store (torch's choice for an endpoint on this machine), later ones join it."""
    command = [sys.executable, "-m", "zero.launcher.agent", "--master_port", str(port)]
    command += ["--rdzv_conf", FAST_RDZV, "--no_local_rank", *flags]
    return subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# Without torch: each rank records the world it ran in; alone, it waits for the second node.
JOIN = """
world_size = os.environ["WORLD_SIZE"]
with open(os.path.join(OUT, f"started{os.getpid()}.json"), "w") as f:
    json.dump([world_size, os.environ["TORCHELASTIC_RESTART_COUNT"]], f)
if world_size == "1":
    time.sleep(60)
"""


def test_node_joining_a_running_job_is_admitted(tmp_path):
    script = write_script(tmp_path, JOIN)
    port = find_free_port()
    flags = ["--nnodes", "1:2", "--max_restarts", "1", "--run_id", "join-test", script]
    first = _agent(tmp_path, port, *flags)
    _wait_for(lambda: list(tmp_path.glob("started*.json")), "the first node's rank")
    second = _agent(tmp_path, port, *flags)
    for agent in (second, first):
        _, stderr = agent.communicate(timeout=60)
        assert agent.returncode == 0, stderr
    started = [json.loads(p.read_text()) for p in tmp_path.glob("started*.json")]
    # Alone first; then both nodes' ranks in a world of 2 (a membership change is no retry).
    assert sorted(started) == [["1", "0"], ["2", "0"], ["2", "0"]]
    assert_nothing_left(str(tmp_path))


FAILS = """
with open(os.path.join(OUT, "attempts"), "a") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
sys.exit(3)
"""


def test_failing_script_is_retried_max_restarts_times(tmp_path):
    script = write_script(tmp_path, FAILS)
    agent = _agent(tmp_path, find_free_port(), "--max_restarts", "1", script)
    _, stderr = agent.communicate(timeout=60)
    assert agent.returncode == 3, stderr
    assert (tmp_path / "attempts").read_text().split() == ["0", "1"]
    assert "exited with code 3 after 1 restart(s), the limit (--max_restarts 1)" in stderr
    assert_nothing_left(str(tmp_path))


# Rank 1 fails in the first attempt while rank 0 waits; the restart succeeds on both.
FAILS_ONCE = """
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(OUT, "attempts"), "a") as f:
    f.write(f"{restart}:{os.environ['RANK']}/{os.environ['WORLD_SIZE']}\\n")
if restart == "0":
    if os.environ["RANK"] == "1":
        sys.exit(3)
    time.sleep(60)
"""


def test_elastic_job_in_salloc_restarts_after_a_failure(slurm_cluster, tmp_path):
    # srun accepts the elastic flags (--kill-on-bad-exit=0 --no-kill), the agent finds its
    # node by SLURMD_NODENAME, joins zrun's store and the ranks start again after a failure.
    command = ["salloc", "--nodes", "1", "--ntasks", "2", *zrun_command(), "--launcher", "slurm"]
    command += ["--num_gpus", "2", "--master_port", str(find_free_port()), "--max_restarts", "1"]
    command += ["--rdzv_conf", FAST_RDZV, "--no_local_rank"]
    result = run_job(tmp_path, [*command, write_script(tmp_path, FAILS_ONCE)], slurm_cluster.env)
    assert result.returncode == 0, result.stderr
    assert "zrun: elastic job: c10d rendezvous at 127.0.0.1:" in result.stderr
    attempts = sorted((tmp_path / "attempts").read_text().split())
    assert attempts == ["0:0/2", "0:1/2", "1:0/2", "1:1/2"], result.stderr
    assert_nothing_left(str(tmp_path))


def test_elastic_flags_refused_where_the_runner_cannot_lose_a_node(tmp_path):
    hostfile = write(tmp_path, "hosts", "localhost slots=1\n")
    cases = {
        ("--launcher", "openmpi", "--nnodes", "1:2"): "mpirun ends the whole job",
        ("--nnodes", "2:1"): "need 1 <= MIN <= MAX",
        ("--nnodes", "1:x"): "--nnodes must be MIN:MAX or N",
        ("--max_restarts", "-1"): "--max_restarts must be >= 0",
        ("--rdzv_conf", "last_call_timeout=1"): "--rdzv_conf needs an elastic job",
        ("--nnodes", "1:2", "--rdzv_conf", "oops"): "is not key=value",
    }
    for flags, message in cases.items():
        command = [*zrun_command(), "--hostfile", hostfile, *flags, "script.py"]
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, (flags, result.stderr)
        assert message in result.stderr, (flags, result.stderr)


def test_elastic_agent_commands(monkeypatch):
    # Pure functions: what each runner's agents are told, and srun left running on a loss.
    from zero.launcher import remote
    from zero.launcher.runner import JobSpec
    from zero.launcher.world import build_layout

    monkeypatch.setattr(remote, "check_ssh_reachable", lambda hosts, options: None)
    job = JobSpec(
        "train.py", (), "r1", nnodes="1:2", max_restarts=2, rdzv_conf="a=1", zrun_store=True
    )
    layout = build_layout({"localhost": [0], "w1": [0]}, "10.0.0.1", 29500)
    node0, node1 = (
        shlex.split(launch.command[-1])
        for launch in remote.remote_launches(layout, job, remote.RemoteOptions("ssh"))
    )
    for words in (node0, node1):
        assert words[words.index("--nnodes") + 1] == "1:2"
        assert words[words.index("--max_restarts") + 1] == "2"
        assert words[words.index("--rdzv_conf") + 1] == "a=1"
        assert "--zrun_store" in words
    assert node0[node0.index("--local_addr") + 1] == "10.0.0.1"  # not 'localhost'
    assert "--local_addr" not in node1  # its own host name
    (srun,) = remote.remote_launches(layout, job, remote.RemoteOptions("slurm"))
    assert "--no-kill" in srun.command and "--kill-on-bad-exit=0" in srun.command
    static = JobSpec("train.py", (), "r1")
    (srun,) = remote.remote_launches(layout, static, remote.RemoteOptions("slurm"))
    assert "--kill-on-bad-exit=1" in srun.command and "--no-kill" not in srun.command


def test_one_code_for_all_nodes_is_judged_by_the_store(capsys):
    # pdsh and srun exit non-zero when one of their nodes was lost, even if the survivors
    # finished: zrun's verdict comes from the success an agent records in its store.
    from zero.launcher.runner import JobRunner, Launch

    class Store:
        node_range, max_restarts = "1:2", 1

        def __init__(self, succeeded):
            self.succeeded = lambda: succeeded

    pdsh = [Launch("pdsh", [sys.executable, "-c", "raise SystemExit(255)"])]
    assert JobRunner(pdsh, 5, True, elastic=Store(succeeded=True)).run() == 0
    message = "zrun: pdsh ended (code 255): a node was lost on the way; the job succeeded"
    assert message in capsys.readouterr().err
    assert JobRunner(pdsh, 5, True, elastic=Store(succeeded=False)).run() == 255
    assert "zrun: pdsh failed (code 255)" in capsys.readouterr().err


def test_only_elastic_jobs_host_a_store(monkeypatch):
    # zrun hosts the store and the agents report to it only when the job is elastic: a static
    # job's agents must not look for a store at its end.
    import zero.launcher as launcher

    runs = []

    class Recorder:
        def __init__(self, launches, shutdown_timeout, report_failures, elastic=None):
            runs.append((launches[0].command, elastic))

        def run(self):
            return 0

    monkeypatch.setattr(launcher, "JobRunner", Recorder)
    for flags in ((), ("--max_restarts", "1")):
        launcher.main(["--num_gpus", "1", "--master_port", "0", *flags, "x.py"])
    (static, no_store), (elastic, store) = runs
    assert "--zrun_store" not in static and no_store is None
    assert "--zrun_store" in elastic and store is not None
