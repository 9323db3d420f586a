"""Periodic checkpoints (checkpoint.save_interval_steps, async_save) and auto_resume: a
background save holds exactly what a blocking one holds, a run resumed from it ends where the
uninterrupted run ends (gradient accumulation 2: the checkpoint records the boundary it was
saved at), and a resume that cannot keep the global batch is refused."""

import os

import pytest
import torch
from distributed import run_ranks
from safetensors.torch import load_file

import zero
from zero.config import ConfigError, load_config

STEPS = 6


def _config(save_dir, **checkpoint):
    return {
        "train_batch_size": 8,  # 2 ranks x micro-batch 2 x accumulation 2
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000,
        "checkpoint": {"save_dir": str(save_dir), **checkpoint},
    }


def _dataset():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    )


def _train(config, steps):
    torch.manual_seed(0)
    engine, _, loader, _ = zero.initialize(
        model=torch.nn.Linear(4, 1), config=config, training_data=_dataset()
    )
    batches = iter(loader)
    while engine.global_steps < steps:
        x, y = next(batches)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    params = [p.detach().clone() for p in engine.module.parameters()]
    blocking = list(engine.periodic.blocking_s) if engine.periodic is not None else []
    engine.close()  # waits for the background save
    return engine, params, blocking


def _ranks(root):
    rank = int(os.environ["RANK"])
    uninterrupted, stopped = os.path.join(root, "a"), os.path.join(root, "b")
    _, final, blocking = _train(_config(uninterrupted, save_interval_steps=2), STEPS)
    # Stopped after step 4 (blocking saves), then resumed by auto_resume.
    _train(_config(stopped, save_interval_steps=2, async_save=False), 4)
    resumed, resumed_final, _ = _train(_config(stopped, auto_resume=True), STEPS)
    failures = _failing_write(os.path.join(root, "c"), rank)
    try:
        _train({**_config(uninterrupted, auto_resume=True), "train_batch_size": 16}, STEPS)
        refused = None
    except ValueError as error:
        refused = str(error)
    return {
        "rank": rank,
        "final": final,
        "resumed_final": resumed_final,
        "resumed_step": (resumed.global_steps, resumed.micro_steps),
        "blocking": blocking,
        "refused": refused,
        "failures": failures,
    }


def _failing_write(save_dir, rank):
    """Rank 1's write of checkpoint 2 fails (a full disk, say): training goes on, the next
    checkpoint is published. Returns this rank's count of failed background saves."""
    from zero.checkpoint import periodic

    write, calls = periodic._write_shard, []

    def failing(*args, **kwargs):
        calls.append(None)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return write(*args, **kwargs)

    if rank == 1:
        periodic._write_shard = failing
    try:
        engine, _, _ = _train(_config(save_dir, save_interval_steps=1), 3)
    finally:
        periodic._write_shard = write
    return engine.periodic.failures


def test_periodic_async_saves_and_auto_resume(tmp_path):
    results = run_ranks(_ranks, 2, str(tmp_path), timeout=120)
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "latest").read_text() == "global_step6"
    assert sorted(os.listdir(a)) == ["global_step2", "global_step4", "global_step6", "latest"]
    assert sorted(os.listdir(a / "global_step4")) == sorted(os.listdir(b / "global_step4"))
    for rank in (0, 1):
        # The background save holds what the blocking save of the same step holds.
        name = f"rank{rank}.safetensors"
        mine, theirs = load_file(a / "global_step4" / name), load_file(b / "global_step4" / name)
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    c = tmp_path / "c"
    assert (c / "latest").read_text() == "global_step3"
    assert sorted(os.listdir(c)) == ["global_step1", "global_step3", "latest"]
    for result in results:
        assert result["failures"] == 1  # rank 1's write, and rank 0's publication of it
        assert len(result["blocking"]) == 3
        assert result["resumed_step"] == (STEPS, 2 * STEPS)
        for p, q in zip(result["final"], result["resumed_final"], strict=True):
            assert torch.equal(p, q)
        assert "train_batch_size 8 on 2 ranks" in result["refused"]
        assert "train_batch_size 16 on 2 ranks" in result["refused"]


def test_periodic_keys_need_save_dir():
    for key, value in (("save_interval_steps", 10), ("save_interval_minutes", 5.0)):
        with pytest.raises(ConfigError, match=f"checkpoint.{key} is set but checkpoint.save_dir"):
            load_config({"train_batch_size": 1, "checkpoint": {key: value}})


def _tag_inodes(save_dir):
    return {
        name: os.stat(os.path.join(save_dir, name)).st_ino
        for name in sorted(os.listdir(save_dir))
        if name.startswith("global_step")
    }


def _resume_without_latest(root):
    """auto_resume when `latest` is missing, a link to nothing or a directory, when the newest
    checkpoint is damaged, and when rank 1 does not see `latest` (issue 42)."""
    import shutil

    import torch.distributed as dist

    from zero.checkpoint import CheckpointError

    rank = int(os.environ["RANK"])
    saved = os.path.join(root, "saved")
    config = {**_config(saved, save_interval_steps=2, async_save=False), "agreement_timeout": 30}
    _, final, _ = _train(config, STEPS)
    out = {}
    for case in ("missing", "dangling", "directory", "damaged", "unseen on rank 1"):
        save_dir = os.path.join(root, case.replace(" ", "_"))
        if rank == 0:
            shutil.copytree(saved, save_dir, symlinks=True)
            latest = os.path.join(save_dir, "latest")
            if case != "unseen on rank 1":
                os.remove(latest)
            if case == "dangling":
                os.symlink("global_step9", latest)
            elif case == "directory":
                os.mkdir(latest)
            elif case == "damaged":  # the last byte of a value flipped
                file = os.path.join(save_dir, "global_step6", "rank1.safetensors")
                with open(file, "r+b") as handle:
                    handle.seek(-1, os.SEEK_END)
                    last = handle.read(1)[0]
                    handle.seek(-1, os.SEEK_END)
                    handle.write(bytes([last ^ 1]))
        dist.barrier()
        before, isfile = _tag_inodes(save_dir), os.path.isfile
        if case == "unseen on rank 1" and rank == 1:
            os.path.isfile = lambda p, isfile=isfile: not str(p).endswith("latest") and isfile(p)
        try:
            config = _config(save_dir, save_interval_steps=2, auto_resume=True)
            _, params, _ = _train({**config, "agreement_timeout": 30}, STEPS)
            out[case] = all(torch.equal(p, q) for p, q in zip(params, final, strict=True))
        except CheckpointError as error:
            out[case] = str(error)
        finally:
            os.path.isfile = isfile
        out[case + " untouched"] = _tag_inodes(save_dir) == before
    return out


def test_auto_resume_without_latest_resumes_the_newest_or_refuses(tmp_path):
    for rank, out in enumerate(run_ranks(_resume_without_latest, 2, str(tmp_path), timeout=300)):
        # Resumed from global_step6: the run ends where the one that saved it ended, and no
        # periodic save wrote over global_step2/4/6.
        for case in ("missing", "dangling", "unseen on rank 1"):
            assert out[case] is True, (rank, case, out[case])
        assert "latest is a directory" in out["directory"], (rank, out["directory"])
        assert "global_step6, does not pass its checks" in out["damaged"], (rank, out["damaged"])
        assert "rank1.safetensors" in out["damaged"], out["damaged"]
        for case in ("missing", "dangling", "directory", "damaged", "unseen on rank 1"):
            assert out[case + " untouched"], (rank, case)
