"""A rank that stops answering (SIGSTOP before step 5) ends the job within the agreement
timeout, and the rank that gives up names it, or the rendezvous store when the stopped process
serves it (issue 42): at stage 2 with CPU offload, where the
peer waits inside a gradient collective, and at stage 3, where it waits inside a parameter
all-gather. Before, the peer waited out gloo's 30-minute timeout at stages 0-2 and named
nobody at stage 3. The agreement timeout is short here; the test's own timeout is generous.
"""

import os
import signal

import pytest
import torch
from distributed import run_ranks

TIMEOUT_S = 4


def _one_rank_stops(stage: int, offload: bool, frozen: int, stderr: str):
    import zero

    rank = int(os.environ["RANK"])
    if rank != frozen:  # the process's own stderr: children of a forkserver escape pytest's capture
        os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    zero_config = {"stage": stage}
    if offload:
        zero_config["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero_config,
        "agreement_timeout": TIMEOUT_S,
    }
    engine, _, _, _ = zero.initialize(model=model, config=config)
    for step in range(10):
        if step == 4 and rank == frozen:
            os.kill(os.getpid(), signal.SIGSTOP)  # run_ranks SIGKILLs it at the end
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
    return "trained"


@pytest.mark.parametrize("stage, offload", [(2, True), (3, False)])
def test_a_stopped_rank_is_named_by_its_peer(stage, offload, tmp_path):
    stderr = tmp_path / "rank0.stderr"
    with pytest.raises(RuntimeError) as info:
        run_ranks(_one_rank_stops, 2, stage, offload, 1, str(stderr), timeout=180)
    error = str(info.value)
    # Rank 0 ended: by its heartbeat's watch (its process exits, naming rank 1), or, at a
    # checked collective, by the agreement's timeout naming rank 1 as silent.
    assert "did not finish" not in error, error
    said = stderr.read_text() + error
    assert (
        f"rank 0: rank 1 stopped answering for over {TIMEOUT_S} s (agreement_timeout)" in said
        or "ranks [1] stopped answering (their heartbeat does not move)" in said
    ), said[-3000:]


def test_a_stopped_store_host_is_named(tmp_path):
    """Rank 0's process serves the rendezvous store (env://): stopped, the store stops answering
    too, and a store operation then never returns; rank 1 names the store and its host."""
    stderr = tmp_path / "rank1.stderr"
    with pytest.raises(RuntimeError) as info:
        run_ranks(_one_rank_stops, 2, 2, False, 0, str(stderr), timeout=180)
    assert "did not finish" not in str(info.value), info.value
    said = stderr.read_text()
    assert "rank 1: the rendezvous store at 127.0.0.1:" in said, said[-3000:]
    assert f"stopped answering for over {TIMEOUT_S} s (agreement_timeout)" in said, said[-3000:]
