"""The per-node agent: several agents on one machine as separate nodes, and an agent whose zrun
is gone."""

import json
import signal

import pytest
from zrun_helpers import (
    SLEEPING_RANK,
    assert_nothing_left,
    start_zrun,
    wait_for_files,
    write_script,
)

pytestmark = pytest.mark.timeout(60)


def test_two_local_nodes_rendezvous(tmp_path):
    # The ranks skip torch (the gloo all-reduce across two agents is test_ssh.py's): this checks
    # the agents' rendezvous and the layout they agree on, at a fraction of the cost.
    script = write_script(
        tmp_path,
        """
        keys = ["RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_RANK"]
        record = {key: os.environ[key] for key in keys}
        record["argv"] = sys.argv
        with open(os.path.join(OUT, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(record, f)
        """,
    )
    proc = start_zrun(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n", script, "--no_local_rank")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["GROUP_RANK"] for r in records] == ["0", "1"]
    assert [r["WORLD_SIZE"] for r in records] == ["2", "2"]
    assert [r["LOCAL_RANK"] for r in records] == ["0", "0"]
    assert all(len(r["argv"]) == 1 for r in records)
    assert_nothing_left(str(tmp_path))


def test_agent_ends_the_job_when_zrun_is_killed(tmp_path):
    script = write_script(tmp_path, SLEEPING_RANK)
    proc = start_zrun(tmp_path, "localhost slots=2\n", script)
    wait_for_files([tmp_path / "ready0", tmp_path / "ready1"])
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert_nothing_left(str(tmp_path), timeout_s=10.0)
