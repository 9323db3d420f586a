"""Swap files on nvme carry a crc32 checked on every read ([Note: swap file checksums] in
engine/offload/nvme.py):

- bytes flipped in an optimizer state file (offload_optimizer nvme) stop the step with
  SwapCorruptionError naming the file, what it holds and the fix, before the value reaches the
  weights; the store then refuses every read (a checkpoint, zero.utils), so nothing saves the
  half-stepped state;
- the same for a stage-3 parameter shard file (offload_param nvme), before its all-gather;
- on two ranks, the rank that finds a damaged file stops and the other stops too, at its next
  collective with it, instead of waiting.
"""

import glob
import os

import pytest
import torch
from distributed import abandon_group, run_ranks
from test_nvme import STEPS, make_engine, param_config, train
from test_offload import config

import zero
from zero.offload.nvme import SwapCorruptionError, SwapStore


def flip(path: str, offset: int = 8, count: int = 16) -> None:
    """Invert `count` bytes of the file at `offset` (what a failing disk returns)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        data = handle.read(count)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in data))


def swap_file(root: str, name: str, rank: int = 0) -> str:
    (path,) = glob.glob(os.path.join(root, f"zero-*-rank{rank}", name))
    return path


def test_store_checks_every_read_and_refuses_io_after_a_mismatch(tmp_path):
    from zero.offload.nvme import OptimizerOffload

    store = SwapStore(OptimizerOffload("nvme", nvme_path=str(tmp_path)), rank=0)
    try:
        values = store.empty(5 << 18)  # 5 MiB: two checksummed pieces (4 MiB and 1 MiB)
        values.copy_(torch.arange(5 << 18, dtype=torch.float32))
        store.write((0, "master"), values, "the master of bucket 0").wait()
        store.write((1, "master"), values[:1024] * 2).wait()
        back = store.empty(5 << 18)
        store.read((0, "master"), back).wait()
        assert torch.equal(back, values)
        flip(store.files[(0, "master")].path, offset=(4 << 20) + 100, count=1)
        request = store.read((0, "master"), back)
        named = (
            r"b0\.master\.swp is corrupt: it holds the master of bucket 0 \(5,242,880 bytes\), "
            r"and reading back its bytes \[4,194,304, 5,242,880\) gave crc32"
        )
        for _ in range(2):  # raised again on a second wait
            with pytest.raises(SwapCorruptionError, match=named):
                request.wait()
        with pytest.raises(SwapCorruptionError, match="no longer trusted.*b0.master.swp"):
            store.read((1, "master"), back[:1024])  # an intact file: the run's state is not
        with pytest.raises(SwapCorruptionError, match="no longer trusted"):
            store.write((1, "master"), values[:1024])
    finally:
        store.close()
    assert glob.glob(os.path.join(tmp_path, "zero-*")) == []


def test_flipped_optimizer_state_stops_the_step_before_the_weights(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = make_engine(config(2, 1, {"device": "nvme", "nvme_path": str(swap)}))
    try:
        before = train(engine, 1, range(1), False)[-1]
        flip(swap_file(str(swap), "b0.exp_avg_sq.swp"))
        with pytest.raises(SwapCorruptionError) as info:
            train(engine, 1, range(1, 2), False)
        message = str(info.value)
        for part in (
            "rank 0: swap file ",
            "b0.exp_avg_sq.swp is corrupt",
            "optimizer state 'exp_avg_sq' of bucket 0 (parameters ['out.weight'])",
            "zero_optimization.offload_optimizer.nvme_path",
            "resume from the last checkpoint",
        ):
            assert part in message, part
        with torch.no_grad():  # bucket 0 is stepped first: nothing was updated
            assert all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
        with pytest.raises(SwapCorruptionError, match="no longer trusted"):  # intact file
            zero.utils.safe_get_full_optimizer_state(engine.module.proj.weight, "exp_avg")
    finally:
        engine.close()
    assert not os.listdir(swap)


def test_flipped_parameter_shard_stops_before_its_all_gather(tmp_path):
    engine = make_engine(param_config(1, str(tmp_path)))
    try:
        train(engine, 1, range(1), True)
        flip(swap_file(str(tmp_path), "b0.param.swp"))
        with pytest.raises(SwapCorruptionError) as info:
            train(engine, 1, range(1, 2), True)
        message = str(info.value)
        assert "b0.param.swp is corrupt: it holds the torch.float32 parameter shard of" in message
        assert "zero_optimization.offload_param.nvme_path" in message
    finally:
        engine.close()
    assert not os.listdir(tmp_path)


def one_rank_finds_a_damaged_file(root):
    """Stage 3, parameters and optimizer state on nvme: rank 0's first parameter shard file is
    damaged after a step. (type, message) of what each rank raised at the next step; each rank
    then leaves its process group (rank 0's process exits, as a failed rank's does)."""
    rank = int(os.environ["RANK"])
    swap = os.path.join(root, "swap")
    os.makedirs(swap, exist_ok=True)
    opt = {"device": "nvme", "nvme_path": swap, "buffer_count": 2}
    engine = make_engine(param_config(1, swap, opt))
    train(engine, 1, range(1), True)
    if rank == 0:
        flip(swap_file(swap, "b0.param.swp"))
    try:
        train(engine, 1, range(1, STEPS), True)
    except Exception as error:  # what the rank's program would die of
        abandon_group()
        return type(error).__name__, str(error)
    return None


def test_the_other_rank_stops_when_one_finds_a_damaged_file(tmp_path):
    (found, what), (other, message) = run_ranks(one_rank_finds_a_damaged_file, 2, str(tmp_path))
    assert found == "SwapCorruptionError" and "b0.param.swp is corrupt" in what
    # rank 1 waited in a collective with rank 0, whose exit ended it (not a timeout)
    assert other != "SwapCorruptionError" and "rank 1" in message, (other, message)
