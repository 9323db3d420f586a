"""zrun --launcher slurm inside salloc, and a direct ``srun python train.py``, on the one-node
SLURM cluster of conftest.py (this machine, 2 CPUs).

zrun: srun starts one agent, which finds its node by SLURMD_NODENAME in the allocation's node
list. Direct: srun starts both ranks and zero.initialize reads SLURM_PROCID, SLURM_NTASKS and
SLURM_LOCALID, with MASTER_ADDR defaulting to the first host of SLURM_JOB_NODELIST.
"""

import socket
import sys

import pytest
from zrun_helpers import (
    ALL_REDUCE,
    DIRECT_LAUNCH,
    FAIL_ON_RANK_1,
    assert_nothing_left,
    read_records,
    run_job,
    write_script,
    zrun_command,
)

from zero.launcher.world import find_free_port

pytestmark = pytest.mark.timeout(90)


def zrun_in_salloc(tmp_path, body, script_args=()):
    command = ["salloc", "--nodes", "1", "--ntasks", "2", *zrun_command(), "--launcher", "slurm"]
    command += ["--num_gpus", "2", "--master_port", str(find_free_port())]
    return [*command, write_script(tmp_path, body), *script_args]


def test_zrun_in_salloc_all_reduce(slurm_cluster, tmp_path):
    command = zrun_in_salloc(tmp_path, ALL_REDUCE, ["--tag", "a b"])
    result = run_job(tmp_path, command, slurm_cluster.env)
    assert result.returncode == 0, result.stderr
    for rank, record in enumerate(read_records(tmp_path, 2)):
        assert record["sum"] == 3.0 and record["cwd"] == str(tmp_path)
        assert [record[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK")] == [str(rank)] * 2 + ["0"]
        assert record["WORLD_SIZE"] == "2" and record["MASTER_ADDR"] == "127.0.0.1"
        assert record["argv"] == [f"--local_rank={rank}", "--tag", "a b"]
    assert_nothing_left(str(tmp_path))


def test_failed_rank_ends_the_job_with_its_code(slurm_cluster, tmp_path):
    result = run_job(tmp_path, zrun_in_salloc(tmp_path, FAIL_ON_RANK_1), slurm_cluster.env)
    assert result.returncode == 7, result.stderr
    node = slurm_cluster.node
    assert f"zrun: rank 1 (local_rank 1 on node 0 '{node}') exited with code 7" in result.stderr
    assert "zrun: srun failed (code 7), stopping the job" in result.stderr
    assert_nothing_left(str(tmp_path), timeout_s=30.0)


def test_direct_srun_ranks_read_slurm_variables(slurm_cluster, tmp_path):
    port = str(find_free_port())
    env = {**slurm_cluster.env, "MASTER_PORT": port}
    try:
        socket.gethostbyname(slurm_cluster.node)
        master_addr = slurm_cluster.node  # zero's default: the node list's first host
    except OSError:
        master_addr = env["MASTER_ADDR"] = "127.0.0.1"  # the host name does not resolve here
    command = ["srun", "--nodes", "1", "--ntasks", "2", sys.executable]
    result = run_job(tmp_path, [*command, write_script(tmp_path, DIRECT_LAUNCH)], env)
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_records(tmp_path, 2)
    for rank, record in enumerate(records):
        assert record["launch"] == [rank, rank, 2]  # SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS
        assert record["dist"] == [rank, 2, 2] and record["sum"] == 3.0
        assert record["master"] == [master_addr, port]
    assert records[0]["params"] == records[1]["params"]  # one ZeRO-2 step, same result
    assert_nothing_left(str(tmp_path))
