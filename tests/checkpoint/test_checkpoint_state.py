"""State beside the weights: a save between the micro-batches of an accumulation cycle is
refused (and such a checkpoint of an older zero is refused on load); every rank's random number
generators come back as that rank saved them (derived, with a warning, for a rank that saved
none); the data loader resumes with the next batch and reshuffles every epoch; a reader racing
a re-save of the same tag says so instead of blaming the storage."""

import json
import logging
import os
import random
import shutil

import numpy as np
import pytest
import torch
from distributed import run_ranks
from parity_model import Net
from safetensors import safe_open
from safetensors.torch import save_file
from test_checkpoint import GLOBAL_BATCH, global_batches, make_engine, masters_of, train
from test_checkpoint_faults import assert_same, edit_meta, snapshot

import zero
from zero.api import DistributedDataLoader
from zero.checkpoint import CheckpointError, file_crc32
from zero.checkpoint import reader as checkpoint_reader

GAS = {"gradient_accumulation_steps": 2}


def draws() -> list:
    """One value of each generator a checkpoint restores."""
    return [random.random(), float(np.random.rand()), torch.rand(2).tolist()]


def micro_batch(engine, index):
    """Micro-batch `index` (of 2) of this rank's share of the first global batch."""
    x, y = global_batches(1)[0]
    micro = GLOBAL_BATCH // (engine.world_size * 2)
    begin = (engine.rank * 2 + index) * micro
    return x[begin : begin + micro], y[begin : begin + micro]


def refused_mid_cycle(engine, root) -> list[str]:
    """Save `root`/start, then the errors of saving twice and loading it between the
    micro-batches of one cycle; ends the cycle."""
    engine.save_checkpoint(root, tag="start")
    errors = []
    engine.backward(engine(*micro_batch(engine, 0)))
    for _ in range(2):  # after micro-batch 0's backward, then after its step
        with pytest.raises(CheckpointError) as error:
            engine.save_checkpoint(root, tag="mid")
        errors.append(str(error.value))
        if len(errors) == 1:
            engine.step()
    with pytest.raises(CheckpointError) as error:
        engine.load_checkpoint(root)
    errors.append(str(error.value))
    engine.backward(engine(*micro_batch(engine, 1)))
    engine.step()  # the boundary: the gradients are used
    return errors


# ----- accumulation boundary ------------------------------------------------------------------
@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (3, "bf16")])  # stage 2: two_ranks
def test_save_between_micro_batches_is_refused(tmp_path, stage, dtype):
    engine = make_engine(stage, dtype, extra=GAS)
    save, again, load = refused_mid_cycle(engine, tmp_path)
    for error in (save, again):
        assert "save_checkpoint between the micro-batches of a gradient accumulation" in error
        assert "Call save_checkpoint after engine.step() at the accumulation boundary" in error
    assert "load_checkpoint between the micro-batches" in load
    assert sorted(os.listdir(tmp_path)) == ["latest", "start"]  # nothing written
    engine.save_checkpoint(tmp_path, tag="boundary")
    meta = json.loads((tmp_path / "boundary" / "meta.json").read_text())
    assert meta["at_accumulation_boundary"] is True and meta["counters"]["micro_steps"] == 2


def test_older_checkpoint_saved_mid_cycle_is_refused(tmp_path):
    engine = make_engine(2, extra=GAS)
    refused_mid_cycle(engine, tmp_path / "mid")
    engine.save_checkpoint(tmp_path / "good", tag="T")
    older = tmp_path / "older"
    shutil.copytree(tmp_path / "good", older)

    def as_older_zero_saved_it_mid_cycle(meta):
        del meta["at_accumulation_boundary"]
        meta["counters"]["micro_steps"] = 3

    edit_meta(older / "T", as_older_zero_saved_it_mid_cycle)
    fresh = make_engine(2, extra=GAS)
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match=r"counters\.micro_steps is 3, not a multiple") as e:
        fresh.load_checkpoint(older)
    assert "load_module_only=True" in str(e.value)
    assert_same(snapshot(fresh), before)
    fresh.load_checkpoint(older, load_module_only=True)  # weights alone: nothing is wrong
    assert fresh.global_steps == 0
    edit_meta(older / "T", lambda meta: meta["counters"].update(micro_steps=2))
    fresh.load_checkpoint(older)  # an older checkpoint at a boundary loads
    assert (fresh.global_steps, fresh.micro_steps) == (1, 2)


# ----- per-rank state in the rank file --------------------------------------------------------
def rewrite_metadata(path, name, change):
    """Rewrite a rank file with its header metadata changed; record its new size and crc32."""
    file = os.path.join(path, name)
    with safe_open(file, framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    change(metadata, tensors)
    os.remove(file)
    save_file(tensors, file, metadata=metadata)

    def record(meta):
        meta["files"][name] = os.path.getsize(file)
        meta["crc32"][name] = file_crc32(file)

    edit_meta(path, record)


def set_rng(key, value):
    def change(metadata, tensors):
        rng = json.loads(metadata["rng"])
        rng[key] = value
        metadata["rng"] = json.dumps(rng)

    return change


class Stateful:
    """What a torchdata StatefulDataLoader offers a checkpoint: iteration, state_dict (here
    with a tensor) and load_state_dict."""

    def __init__(self, seed=0):
        self.position, self.generator = 0, torch.Generator().manual_seed(seed)

    def __iter__(self):
        while True:
            self.position += 1
            yield torch.rand(1, generator=self.generator)

    def state_dict(self):
        return {"position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.position = state["position"]
        self.generator.set_state(state["generator"])


def stateful_engine(loader):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    engine, _, returned, _ = zero.initialize(model=Net(), config=config, training_data=loader)
    return engine, returned


BAD_RANK_FILES = [
    (set_rng("python", [3, [1, 2], None]), r"metadata 'rng' key 'python'.*random module"),
    (set_rng("numpy", ["MT19937", [1], 0, 0, 0.0]), r"metadata 'rng' key 'numpy'.*RandomState"),
    (
        lambda metadata, tensors: metadata.update(data_loader="{"),
        r"metadata 'data_loader' unreadable",
    ),
    (
        lambda metadata, tensors: tensors.pop("data_loader.0"),
        r"metadata 'data_loader' refers to tensor 'data_loader\.0'",
    ),
]


def test_rank_file_state_is_checked_before_anything_changes(tmp_path):
    engine, loader = stateful_engine(Stateful())
    assert loader is engine.training_dataloader and isinstance(loader, Stateful)
    for _, _ in zip(range(3), loader):
        pass
    engine.save_checkpoint(tmp_path / "good", tag="T")
    for index, (change, error) in enumerate(BAD_RANK_FILES):
        root = tmp_path / f"bad{index}"
        shutil.copytree(tmp_path / "good", root)
        rewrite_metadata(root / "T", "rank0.safetensors", change)
        masters = masters_of(engine)
        with pytest.raises(CheckpointError, match=error):
            engine.load_checkpoint(root)
        assert loader.position == 3, index
        assert all(torch.equal(a, b) for a, b in zip(masters, masters_of(engine))), index
    loader.position = 9
    engine.load_checkpoint(tmp_path / "good")
    assert loader.position == 3
    # What a checkpoint cannot hold is refused before anything is written.
    loader.position = (1, 2)
    with pytest.raises(CheckpointError, match=r"state_dict\(\)\['position'\] is \(1, 2\)"):
        engine.save_checkpoint(tmp_path / "tuple", tag="T")
    assert not os.path.exists(tmp_path / "tuple" / "T")


# ----- the data loader ------------------------------------------------------------------------
def take(iterator, count) -> list:
    return [batch[0].tolist() for _, batch in zip(range(count), iterator)]


def test_epoch_sampler_reshuffles_each_epoch_like_distributed_sampler():
    from torch.utils.data import DistributedSampler, TensorDataset

    data = TensorDataset(torch.arange(23))
    for world_size, drop_last in ((2, False), (3, False), (3, True)):
        loaders = [
            DistributedDataLoader(data, 4, world_size, rank, drop_last=drop_last)
            for rank in range(world_size)
        ]
        samplers = [
            DistributedSampler(data, world_size, rank, shuffle=True, drop_last=drop_last)
            for rank in range(world_size)
        ]
        orders = []
        for epoch in range(3):
            for loader, sampler in zip(loaders, samplers):
                sampler.set_epoch(epoch)
                got = [i for batch in loader for i in batch[0].tolist()]
                expected = list(sampler)  # DataLoader's drop_last drops a partial last batch
                expected = expected[: len(expected) // 4 * 4] if drop_last else expected
                assert got == expected, (world_size, drop_last, epoch)
            orders.append(list(samplers[0]))
        assert orders[0] != orders[1] != orders[2]


def test_loader_resumes_mid_epoch_at_the_same_and_another_world_size():
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.arange(26))
    two = [DistributedDataLoader(data, 3, 2, rank) for rank in range(2)]
    iterators = [iter(loader) for loader in two]
    for iterator in iterators:
        take(iterator, 2)
    states = [loader.state_dict() for loader in two]
    assert states[0] == states[1] == {"epoch": 0, "samples": 12, "dataset_size": 26, "seed": 0}
    expected = [take(iterator, 4) for iterator in iterators]  # the epoch's last 3 batches
    resumed = [DistributedDataLoader(data, 3, 2, rank) for rank in range(2)]
    for loader in resumed:
        loader.load_state_dict(states[0])
    assert [take(iter(loader), 4) for loader in resumed] == expected
    # Three ranks continue the epoch: its 14 remaining samples, split anew, each once.
    rest = [i for batches in expected for batch in batches for i in batch]
    three = [DistributedDataLoader(data, 3, 3, rank) for rank in range(3)]
    for loader in three:
        loader.load_state_dict(states[0])
        loader.set_epoch(0)  # a script's set_epoch at the top of the epoch keeps the position
    seen = [i for loader in three for batch in loader for i in batch[0].tolist()]
    assert len(rest) == 14 and len(seen) == 15 and set(rest) <= set(seen)  # 1 as padding
    assert all(loader.state_dict()["epoch"] == 1 for loader in three)
    with pytest.raises(ValueError, match="dataset_size 26, this loader has 25"):
        DistributedDataLoader(TensorDataset(torch.arange(25)), 3, 2, 0).load_state_dict(states[0])


def test_loader_of_initialize_continues_after_load_checkpoint(tmp_path, zero_log):
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.arange(20))
    engine, loader = stateful_engine(data)
    assert loader is engine.training_dataloader and isinstance(loader, DistributedDataLoader)
    epoch0 = take(loader, 10)  # the whole epoch of 2 samples per batch; 6 batches of epoch 1
    iterator = iter(loader)
    epoch1 = take(iterator, 6)
    engine.save_checkpoint(tmp_path, tag="T")
    expected = take(iterator, 4) + take(loader, 1)  # the epoch ends: a new iterator
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1 + expected[:4], [])) == list(range(20))
    assert epoch0[:5] != epoch1[:5]  # a new shuffle each epoch
    fresh, resumed = stateful_engine(data)
    other, _ = stateful_engine(TensorDataset(torch.arange(19)))
    masters = masters_of(other)
    with pytest.raises(CheckpointError, match="dataset_size 20, this loader has 19") as error:
        other.load_checkpoint(tmp_path)  # refused before anything changes
    assert "Nothing was loaded" in str(error.value)
    assert all(torch.equal(a, b) for a, b in zip(masters, masters_of(other)))
    assert not all(torch.equal(a, b) for a, b in zip(masters, masters_of(engine)))
    fresh.load_checkpoint(tmp_path)
    assert take(resumed, 4) + take(resumed, 1) == expected
    # A checkpoint without a loader state: the loader keeps its place, with a warning.
    bare, _ = stateful_engine(None)
    bare.save_checkpoint(tmp_path, tag="bare")
    zero_log.clear()
    fresh.load_checkpoint(tmp_path, tag="bare")
    assert any("holds no data loader state" in m for m in zero_log), zero_log


# ----- a re-save of the tag during a load -----------------------------------------------------
def test_a_tag_replaced_during_a_load_is_named(tmp_path, monkeypatch):
    older, newer = make_engine(2), make_engine(2)
    train(older, global_batches(1))
    train(newer, global_batches(2))
    for verify in (True, False):
        root = tmp_path / str(verify)
        older.save_checkpoint(root, tag="T")
        loader = make_engine(2, extra={"checkpoint": {"verify_checksums": verify}})
        before = snapshot(loader)
        # The save lands after this rank read meta.json, before it opened the files it reads.
        step = "verify_checksums" if verify else "_read_module_file"
        original = getattr(checkpoint_reader, step)

        def racing(*args, **kwargs):
            newer.save_checkpoint(root, tag="T")  # noqa: B023 (called within this iteration)
            return original(*args, **kwargs)  # noqa: B023

        with monkeypatch.context() as patch:
            patch.setattr(checkpoint_reader, step, racing)
            with pytest.raises(CheckpointError, match="replaced while this rank read it") as e:
                loader.load_checkpoint(root)
        assert "Load again" in str(e.value) and "corruption" not in str(e.value), verify
        assert_same(snapshot(loader), before, str(verify))
        loader.load_checkpoint(root)
        assert loader.global_steps == 2
        assert all(torch.equal(a, b) for a, b in zip(masters_of(loader), masters_of(newer)))


# ----- on two ranks ---------------------------------------------------------------------------
def seeded(offset: int) -> None:
    random.seed(offset)
    np.random.seed(offset)
    torch.manual_seed(offset)


def two_ranks(root, one_rank_checkpoint):
    import torch.distributed as dist

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("zero").addHandler(handler)
    engine = make_engine(2, extra=GAS)
    rank, out = dist.get_rank(), {}
    out["mid cycle"] = refused_mid_cycle(engine, os.path.join(root, "mid"))
    # Every rank's generators, as that rank saved them.
    seeded(10 + rank)
    engine.save_checkpoint(os.path.join(root, "rng"), tag="T")
    out["saved draws"] = draws()
    seeded(0)
    engine.load_checkpoint(os.path.join(root, "rng"))
    out["loaded draws"] = draws()
    # A checkpoint of one rank: rank 1 derives its generators (the same on every load).
    out["derived"] = []
    for _ in range(2):
        seeded(5)
        engine.load_checkpoint(one_rank_checkpoint)
        out["derived"].append(draws())
    out["warnings"] = list(warnings)
    # The loader of initialize: one shuffle per epoch on every rank; per-rank stateful loaders.
    data = torch.utils.data.TensorDataset(torch.arange(30))
    engine, loader = stateful_engine(data)
    out["epochs"] = [take(loader, 10) for _ in range(2)]
    iterator = iter(loader)
    take(iterator, 1)
    engine.save_checkpoint(os.path.join(root, "loader"), tag="T")
    out["next"] = take(iterator, 2) + take(loader, 1)
    fresh, resumed = stateful_engine(data)
    fresh.load_checkpoint(os.path.join(root, "loader"))
    out["resumed"] = take(resumed, 3)
    stateful = Stateful(seed=rank)
    engine, _ = stateful_engine(stateful)
    take(stateful, 3 + rank)
    engine.save_checkpoint(os.path.join(root, "stateful"), tag="T")
    out["stateful next"] = take(stateful, 2)
    stateful.position = -1
    engine.load_checkpoint(os.path.join(root, "stateful"))
    out["stateful"] = (stateful.position, take(stateful, 2))
    # Ranks reading different versions of one tag (rank 1 read it after a re-save).
    engine = make_engine(2)
    engine.save_checkpoint(os.path.join(root, "v1"), tag="A")
    train(engine, global_batches(1))
    engine.save_checkpoint(os.path.join(root, "v2"), tag="A")
    fresh = make_engine(2)
    before = masters_of(fresh)
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            patch.setattr(checkpoint_reader, "resolve", lambda d, t: os.path.join(root, "v2", "A"))
        try:
            fresh.load_checkpoint(os.path.join(root, "v1"))
            out["versions"] = None
        except CheckpointError as error:
            out["versions"] = str(error)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, masters_of(fresh)))
    return out


def test_two_ranks_each_keep_their_own_state(tmp_path):
    """Mid-cycle saves refused on every rank; per-rank generators and loaders; ranks that read
    different versions of a tag; on 2 ranks."""
    seeded(3)
    single = make_engine(2)
    single.save_checkpoint(tmp_path / "one", tag="T")
    one_rank_draws = draws()
    results = run_ranks(two_ranks, 2, str(tmp_path), str(tmp_path / "one"), timeout=180)
    for rank, out in enumerate(results):
        save, again, load = out["mid cycle"]
        assert f"rank {rank}: save_checkpoint between the micro-batches" in save, save
        assert "save_checkpoint between" in again and "load_checkpoint between" in load
        assert out["loaded draws"] == out["saved draws"], rank
        first, second = out["derived"]
        assert first == second, rank
        derived = [w for w in out["warnings"] if "derived from torch.initial_seed()" in w]
        if rank == 0:
            assert first == one_rank_draws and not derived
        else:
            assert first != one_rank_draws and "it was saved on 1 rank(s)" in derived[0]
        assert out["resumed"] == out["next"], rank
        assert out["stateful"] == (3 + rank, out["stateful next"]), rank
        assert "the ranks read different versions" in out["versions"], out["versions"]
        assert out["unchanged"], rank
    assert results[0]["saved draws"] != results[1]["saved draws"]
    for epoch in range(2):  # one shuffle per epoch, split over the ranks
        samples = [i for out in results for batch in out["epochs"][epoch] for i in batch]
        assert sorted(samples) == list(range(30)), epoch
    assert results[0]["epochs"][0] != results[0]["epochs"][1]
