"""The per-node agent: several agents on one machine as separate nodes, and an agent whose zrun
is gone."""

import json
import signal

import pytest
from zrun_helpers import GRANDCHILD, assert_nothing_left, start_zrun, wait_for_files, write_script

pytestmark = pytest.mark.timeout(60)


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


def test_agent_ends_the_job_when_zrun_is_killed(tmp_path):
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
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert_nothing_left(str(tmp_path), timeout_s=10.0)
