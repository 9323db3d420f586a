"""End-to-end zrun runs on this machine: rank environment, failure and signal semantics.

Every process a job starts carries the test's tmp_path in its command line, so "nothing left
behind" is checked by scanning the process table for it.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from zero.launcher import main
from zero.launcher.world import find_free_port

pytestmark = pytest.mark.timeout(60)

# A rank script may start a grandchild that sleeps; it carries the marker in its argv.
GRANDCHILD = "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', MARKER])"


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
    header = "import json, os, subprocess, sys, time\n"
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


ENV_SCRIPT = """
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"]
record = {key: os.environ.get(key) for key in keys}
record["argv"] = sys.argv[1:]
with open(os.path.join(OUT, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
print(f"stdout of rank {os.environ['RANK']}")
print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr)
"""


def test_two_ranks_get_their_environment_and_args(tmp_path):
    script = write_script(tmp_path, ENV_SCRIPT)
    hostfile = write(tmp_path, "hosts", "# test hosts\nlocalhost slots=2  # two CPU ranks\n")
    port = find_free_port()
    log_dir = tmp_path / "logs"
    user_args = ["--config", "zero2.json", "--num_gpus", "3", "--hostfile", "x"]
    command = [*zrun_command(), "--hostfile", hostfile, "--master_port", str(port)]
    command += ["--log_dir", str(log_dir), script, *user_args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["RANK"] == record["LOCAL_RANK"] == str(rank)
        assert record["WORLD_SIZE"] == record["LOCAL_WORLD_SIZE"] == "2"
        assert record["GROUP_RANK"] == record["NODE_RANK"] == "0"
        assert record["MASTER_ADDR"] == "127.0.0.1"
        assert record["MASTER_PORT"] == str(port)
        assert int(record["OMP_NUM_THREADS"]) >= 1
        assert record["argv"] == [f"--local_rank={rank}", *user_args]
        log = (log_dir / f"rank{rank}.log").read_text()
        assert f"stdout of rank {rank}" in log and f"stderr of rank {rank}" in log
    assert sorted(os.listdir(log_dir)) == ["rank0.log", "rank1.log"]
    assert_nothing_left(str(tmp_path))


def test_two_local_nodes_rendezvous_and_all_reduce(tmp_path):
    script = write_script(
        tmp_path,
        """
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        record = {"sum": value.item(), "group_rank": os.environ["GROUP_RANK"], "argv": sys.argv}
        with open(os.path.join(OUT, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(record, f)
        dist.destroy_process_group()
        """,
    )
    proc = start_zrun(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n", script, "--no_local_rank")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in records] == [3.0, 3.0]
    assert [r["group_rank"] for r in records] == ["0", "1"]
    assert all(len(r["argv"]) == 1 for r in records)
    assert_nothing_left(str(tmp_path))


def test_failed_rank_ends_the_job_with_its_exit_code(tmp_path):
    script = write_script(
        tmp_path,
        f"""
        {GRANDCHILD}
        open(os.path.join(OUT, "ready" + os.environ["RANK"]), "w").close()
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            sys.exit(7)
        time.sleep(120)
        """,
    )
    proc = start_zrun(tmp_path, "localhost slots=2\n", script)
    wait_for_files([tmp_path / "ready0", tmp_path / "ready1"])
    failed_at = time.monotonic()
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 7, stderr
    assert time.monotonic() - failed_at < 10
    failure_lines = [line for line in stderr.splitlines() if "exited with code" in line]
    assert failure_lines == ["zrun: rank 1 (local_rank 1 on node 0 'localhost') exited with code 7"]
    assert_nothing_left(str(tmp_path))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_zrun_ends_every_rank(tmp_path, signum):
    script = write_script(
        tmp_path,
        f"""
        {GRANDCHILD}
        open(os.path.join(OUT, "ready" + os.environ["RANK"]), "w").close()
        time.sleep(120)
        """,
    )
    proc = start_zrun(tmp_path, "localhost slots=2\n", script)
    wait_for_files([tmp_path / "ready0", tmp_path / "ready1"])
    assert len(job_processes(str(tmp_path))) >= 4  # two ranks, two grandchildren
    sent_at = time.monotonic()
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - sent_at < 10
    assert proc.returncode == 128 + signum, stderr
    assert signal.Signals(signum).name in stderr
    assert_nothing_left(str(tmp_path))


def test_missing_hostfile_is_an_error_not_a_local_run(tmp_path, capsys):
    missing = str(tmp_path / "missing-hosts")
    assert main(["--hostfile", missing, "train.py"]) == 2
    assert f"hostfile '{missing}' does not exist" in capsys.readouterr().err


def test_remote_host_is_refused_with_its_name(tmp_path, capsys):
    hostfile = write(tmp_path, "hosts", "localhost slots=1\nno-such-node.invalid slots=1\n")
    assert main(["--hostfile", hostfile, "train.py"]) == 2
    assert "'no-such-node.invalid'" in capsys.readouterr().err
