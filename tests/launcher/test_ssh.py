"""Multi-node zrun over a real ssh: this machine is two "hosts" (localhost and 127.0.0.2) behind
the loopback sshd of conftest.py. Checks the environment arrives byte for byte, a 2-node x 1-rank
gloo all-reduce, and that a killed rank or a signal to zrun ends every process on every node."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from zrun_helpers import (
    ALL_REDUCE,
    GRANDCHILD,
    assert_nothing_left,
    wait_for_files,
    write,
    write_script,
    zrun_command,
)

from zero.launcher.remote import (
    PDSH_NODE_RANK,
    RemoteOptions,
    pdsh_command,
    pdsh_environment,
    remote_shell_command,
)
from zero.launcher.world import find_free_port

pytestmark = pytest.mark.timeout(90)

TWO_HOSTS = "localhost slots=1\n127.0.0.2 slots=1\n"
# Values a shell would mangle; each must reach the ranks unchanged.
TRICKY = {
    "ZERO_T_SPACES": "a  b ",
    "ZERO_T_QUOTES": "it's \"quoted\" ''",
    "ZERO_T_DOLLAR": "$HOME ${PATH} $(id -u) `id -u` $",
    "ZERO_T_EQUALS": "a=b==c=",
    "ZERO_T_PARENS": "(x) {y} [z] ; & | < > * ? ~ # ! \\",
    "ZERO_T_JSON": json.dumps({"lr": 1e-3, "names": ["a b", "c'd"], "x": {"$y": "(z)"}}),
    "ZERO_T_PERCENT": "100% %n %h %%",
    "ZERO_T_NEWLINE": "line 1\nline 2",
    "ZERO_T_EMPTY": "",
}
DUMP_ENV = (
    "import json, os, sys; "
    "keys = [k for k in os.environ if k.startswith('ZERO_T_')]; "
    "json.dump({k: os.environ[k] for k in keys}, open(''.join(sys.argv[1:]), 'w'))"
)


def test_environment_round_trip_through_ssh(loopback_sshd, tmp_path):
    out = str(tmp_path / "env.json")
    command = remote_shell_command(str(tmp_path), TRICKY, [sys.executable, "-c", DUMP_ENV, out])
    result = loopback_sshd.ssh("127.0.0.2", command, text=True)
    assert result.returncode == 0, result.stderr
    with open(out) as f:
        assert json.load(f) == TRICKY


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="pdsh is not installed")
def test_environment_and_node_rank_through_pdsh(loopback_sshd, tmp_path):
    # The file name is tmp_path/env<node rank>.json, the node rank being pdsh's '%n'.
    argv = [sys.executable, "-c", DUMP_ENV, str(tmp_path / "env"), PDSH_NODE_RANK, ".json"]
    options = RemoteOptions("pdsh", loopback_sshd.port)
    command = pdsh_command(
        ["localhost", "127.0.0.2"], remote_shell_command("/", TRICKY, argv), options
    )
    env = {**os.environ, "PDSH_SSH_ARGS_APPEND": f"-F {loopback_sshd.ssh_config}"}
    result = subprocess.run(
        command, env=pdsh_environment(env, options), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    for node_rank in (0, 1):
        with open(tmp_path / f"env{node_rank}.json") as f:
            assert json.load(f) == TRICKY


SLEEPER = f"""
{GRANDCHILD}
with open(os.path.join(OUT, "ready" + os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


def start_multi_node_zrun(sshd, tmp_path, script, zrun_args=(), script_args=(), env=None):
    """zrun --force_multi over the loopback sshd, from tmp_path, with HOME there too (so no
    ~/.zero_env of the machine takes part)."""
    hostfile = write(tmp_path, "hosts", TWO_HOSTS)
    command = [*zrun_command(), "--hostfile", hostfile, "--force_multi", *sshd.ssh_args()]
    command += ["--master_port", str(find_free_port()), *zrun_args, script, *script_args]
    env = {**os.environ, "HOME": str(tmp_path), **(env or {})}
    return subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_two_node_all_reduce_with_exact_environment(loopback_sshd, tmp_path):
    script = write_script(tmp_path, ALL_REDUCE)
    write(tmp_path, ".zero_env", "# from the file\nZERO_T_FILE=x=(1) 'q' $HOME {}\n")
    flags = [arg for key, value in TRICKY.items() for arg in ("--env", f"{key}={value}")]
    exported = {"ZERO_T_EXPORTED": '$(id) "e"', "NOT_EXPORTED_X": "stays home"}
    script_args = ["--tag", "a b $X", '{"k": [1]}']
    proc = start_multi_node_zrun(
        loopback_sshd, tmp_path, script, [*flags, "--no_local_rank"], script_args, exported
    )
    _, stderr = proc.communicate(timeout=80)
    assert proc.returncode == 0, stderr
    expected_env = {**TRICKY, "ZERO_T_FILE": "x=(1) 'q' $HOME {}"}
    expected_env["ZERO_T_EXPORTED"] = exported["ZERO_T_EXPORTED"]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["sum"] == 3.0
        assert record["env"] == expected_env  # NOT_EXPORTED_X has no exported prefix
        assert record["argv"] == script_args
        assert record["RANK"] == record["NODE_RANK"] == str(rank)
        assert record["WORLD_SIZE"] == "2"
        assert record["MASTER_ADDR"] == "127.0.0.1"
        assert record["cwd"] == str(tmp_path)
    assert_nothing_left(str(tmp_path))


def _start_sleepers(sshd, tmp_path):
    script = write_script(tmp_path, SLEEPER)
    proc = start_multi_node_zrun(sshd, tmp_path, script)
    wait_for_files([tmp_path / "ready0", tmp_path / "ready1"], timeout_s=60)
    return proc


def test_killed_rank_ends_every_node(loopback_sshd, tmp_path):
    proc = _start_sleepers(loopback_sshd, tmp_path)
    os.kill(int((tmp_path / "ready1").read_text()), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    assert "rank 1 (local_rank 0 on node 1 '127.0.0.2') was killed by SIGKILL" in stderr
    assert "zrun: node 1 '127.0.0.2' failed" in stderr
    assert_nothing_left(str(tmp_path), timeout_s=30.0)


def test_sigterm_to_zrun_ends_every_node(loopback_sshd, tmp_path):
    proc = _start_sleepers(loopback_sshd, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert_nothing_left(str(tmp_path), timeout_s=30.0)


def test_killed_zrun_leaves_nothing_on_any_node(loopback_sshd, tmp_path):
    # zrun gets no chance to clean up: each remote agent sees EOF on its ssh channel.
    proc = _start_sleepers(loopback_sshd, tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert_nothing_left(str(tmp_path), timeout_s=30.0)


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="pdsh is not installed")
def test_two_node_all_reduce_through_pdsh(loopback_sshd, tmp_path):
    script = write_script(tmp_path, ALL_REDUCE)
    hostfile = write(tmp_path, "hosts", TWO_HOSTS)
    command = [*zrun_command(), "--hostfile", hostfile, "--force_multi", "--launcher", "pdsh"]
    command += ["--ssh_port", str(loopback_sshd.port), "--master_port", str(find_free_port())]
    command += [script]
    env = {**os.environ, "HOME": str(tmp_path)}
    env["PDSH_SSH_ARGS_APPEND"] = f"-F {loopback_sshd.ssh_config}"  # the throwaway key
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=80, check=False
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["sum"] == 3.0 and record["NODE_RANK"] == str(rank)
    assert_nothing_left(str(tmp_path))
