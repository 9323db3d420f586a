"""zrun --launcher openmpi and a direct ``mpirun python train.py`` with a real Open MPI mpirun.

One node: mpirun starts the node's agent locally. Two nodes: this machine is two "hosts"
(localhost and 127.0.0.2) and mpirun reaches 127.0.0.2 over the loopback sshd of conftest.py,
so each agent finds its node rank in OMPI_COMM_WORLD_RANK. Direct: mpirun starts the ranks and
zero.initialize reads OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK.
"""

import sys

import pytest
from zrun_helpers import (
    ALL_REDUCE,
    DIRECT_LAUNCH,
    FAIL_ON_RANK_1,
    assert_nothing_left,
    read_records,
    run_job,
    write,
    write_script,
    zrun_command,
)

from zero.launcher.world import find_free_port

pytestmark = pytest.mark.timeout(90)

ONE_NODE = "localhost slots=2\n"


def zrun_openmpi(tmp_path, hosts, body, zrun_args=(), script_args=()):
    hostfile = write(tmp_path, "hosts", hosts)
    command = [*zrun_command(), "--launcher", "openmpi", "--hostfile", hostfile]
    command += ["--master_port", str(find_free_port()), *zrun_args]
    return [*command, write_script(tmp_path, body), *script_args]


def test_one_node_all_reduce(openmpi_env, tmp_path):
    command = zrun_openmpi(tmp_path, ONE_NODE, ALL_REDUCE, script_args=["--tag", "a b"])
    result = run_job(tmp_path, command, openmpi_env)
    assert result.returncode == 0, result.stderr
    for rank, record in enumerate(read_records(tmp_path, 2)):
        assert record["sum"] == 3.0
        assert [record[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK")] == [str(rank)] * 2 + ["0"]
        assert record["WORLD_SIZE"] == "2" and record["MASTER_ADDR"] == "127.0.0.1"
        assert record["argv"] == [f"--local_rank={rank}", "--tag", "a b"]
    assert_nothing_left(str(tmp_path))


def test_two_nodes_over_ssh_find_their_node_rank(openmpi_env, loopback_sshd, tmp_path):
    # mpirun's own ssh: 'ssh -F CONFIG' as its agent; zrun adds '-p PORT' (--ssh_port).
    agent = f"--mca plm_rsh_agent 'ssh -F {loopback_sshd.ssh_config}'"
    flags = ["--ssh_port", str(loopback_sshd.port), "--launcher_args", agent]
    hosts = "localhost slots=1\n127.0.0.2 slots=1\n"
    result = run_job(tmp_path, zrun_openmpi(tmp_path, hosts, ALL_REDUCE, flags), openmpi_env)
    assert result.returncode == 0, result.stderr
    for rank, record in enumerate(read_records(tmp_path, 2)):
        assert record["sum"] == 3.0 and record["cwd"] == str(tmp_path)
        assert [record[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK")] == [
            str(rank),
            "0",
            str(rank),
        ]
    assert_nothing_left(str(tmp_path), timeout_s=30.0)


def test_failed_rank_ends_the_job_with_its_code(openmpi_env, tmp_path):
    result = run_job(tmp_path, zrun_openmpi(tmp_path, ONE_NODE, FAIL_ON_RANK_1), openmpi_env)
    assert result.returncode == 7, result.stderr
    assert "zrun: rank 1 (local_rank 1 on node 0 'localhost') exited with code 7" in result.stderr
    assert "zrun: mpirun failed (code 7), stopping the job" in result.stderr
    assert_nothing_left(str(tmp_path), timeout_s=30.0)


def test_direct_mpirun_ranks_read_ompi_variables(openmpi_env, tmp_path):
    def run():
        # --oversubscribe: 2 ranks even where mpirun counts fewer cores.
        command = ["mpirun", "-np", "2", "--oversubscribe", "-x", "MASTER_ADDR=127.0.0.1"]
        command += ["-x", f"MASTER_PORT={port}", sys.executable, script]
        return run_job(tmp_path, command, openmpi_env)

    script = write_script(tmp_path, DIRECT_LAUNCH)
    port = str(find_free_port())
    result = run()
    if result.returncode == 134 and "terminate called without an active exception" in (
        result.stdout + result.stderr
    ):
        # A rank aborting in torch's gloo teardown after destroy_process_group (about one suite
        # run in twenty on a loaded 2-core machine, never reproduced alone); the launch under
        # test is already done. Run the job once more; a second abort fails the test.
        print(result.stdout + result.stderr, file=sys.stderr)
        port = str(find_free_port())
        result = run()
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_records(tmp_path, 2)
    for rank, record in enumerate(records):
        assert record["launch"] == [rank, rank, 2]  # OMPI_COMM_WORLD_RANK, _LOCAL_RANK, _SIZE
        assert record["dist"] == [rank, 2, 2] and record["sum"] == 3.0
        assert record["master"] == ["127.0.0.1", port]
    assert records[0]["params"] == records[1]["params"]  # one ZeRO-2 step, same result
    assert_nothing_left(str(tmp_path))
