"""Checkpoint faults: a damaged checkpoint is a CheckpointError naming the file and the key,
raised before the engine changes (flipped bytes fail the crc32); a save interrupted between any
two filesystem operations leaves a loadable checkpoint; no write follows a planted link; one
rank's failure reaches every rank at once; over-long tags are refused before anything is written.
"""

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import struct
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from safetensors.torch import load_file, save_file
from test_checkpoint import global_batches, make_engine, train

import zero.checkpoint as ckpt
from zero.checkpoint import CheckpointError, file_crc32
from zero.checkpoint import files as checkpoint_files


# ----- helpers that damage a checkpoint -------------------------------------------------------
def edit_meta(path, change):
    meta_path = Path(path, "meta.json")
    meta = json.loads(meta_path.read_text())
    change(meta)
    meta_path.write_text(json.dumps(meta))


def data_offset(file, key) -> int:
    """Byte offset of tensor `key`'s data in a safetensors file (8-byte header size, JSON)."""
    raw = Path(file).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + size])[key]["data_offsets"]
    return 8 + size + (begin + end) // 2


def flip_byte(path, name, key):
    file = Path(path, name)
    raw = bytearray(file.read_bytes())
    raw[data_offset(file, key)] ^= 0x10
    file.write_bytes(bytes(raw))


def rewrite_tensor(path, name, key, value):
    """Replace one tensor and record the file's new size and crc32, so that only the tensor is
    wrong."""
    file = os.path.join(path, name)
    tensors = load_file(file)
    tensors[key] = value(tensors[key])
    os.remove(file)
    save_file(tensors, file)

    def record(meta):
        meta["files"][name] = os.path.getsize(file)
        if "crc32" in meta:
            meta["crc32"][name] = file_crc32(file)

    edit_meta(path, record)


def truncate(path, name):
    file = Path(path, name)
    file.write_bytes(file.read_bytes()[:100])


def meta_case(change):
    return lambda path: edit_meta(path, change)


def set_key(*keys, value):
    def change(meta):
        for key in keys[:-1]:
            meta = meta[key]
        meta[keys[-1]] = value

    return meta_case(change)


def del_key(key):
    return meta_case(lambda meta: meta.pop(key))


BAD = [  # (damage, the error: file and key)
    (set_key("lr_scheduler", "last_batch_iteration", value=-1000), r"key 'lr_scheduler': .*>= -1"),
    (set_key("param_groups", 0, "lr", value=float("nan")), r"meta\.json: unreadable.*NaN"),
    (set_key("loss_scaler", "scale", value=float("inf")), r"meta\.json: unreadable.*Infinity"),
    (del_key("files"), r"meta\.json: key 'files': Field required"),
    (del_key("ranks"), r"meta\.json: key 'ranks': Field required"),
    (set_key("lr_scheduler", value={}), r"meta\.json: key 'lr_scheduler' lacks"),
    (set_key("python_rng", value=[3, [1, 2], None]), r"meta\.json: key 'python_rng'"),
    (set_key("python_rng", value="x"), r"meta\.json: key 'python_rng'"),
    (
        set_key("scalar_state", "0", "step", "tensor", value="torch.float99"),
        r"meta\.json: key 'scalar_state\.0\.step'.*torch\.float99",
    ),
    (set_key("loss_scaler", value={}), r"meta\.json: key 'loss_scaler\.scale': Field required"),
    (set_key("loss_scaler", "scale", value=0.0), r"meta\.json: key 'loss_scaler\.scale'"),
    (set_key("counters", "global_steps", value="7"), r"key 'counters\.global_steps'"),
    (set_key("counters", "optimizer", value=1), r"key 'counters\.optimizer': Extra inputs"),
    (set_key("param_groups", 0, "lr", value="fast"), r"key 'param_groups\.0\.lr' is 'fast'"),
    (set_key("param_groups", 0, "betas", value=[0.9]), r"key 'param_groups\.0\.betas' has 1"),
    (meta_case(lambda m: m["param_groups"].pop()), r"'param_groups' has 2 groups, the optimizer 3"),
    (set_key("files", "../x.safetensors", value=1), r"key 'files\.\.\./x\.safetensors"),
    (set_key("ranks", "5", value={}), r"meta\.json: .*rank 5, but world_size is 1"),
    (set_key("crc32", "rank0.safetensors", value="xyz"), r"key 'crc32\.rank0\.safetensors'"),
    (lambda p: Path(p, "meta.json").write_text("{"), r"meta\.json: unreadable"),
    (lambda p: Path(p, "meta.json").write_bytes(b"\xff"), r"meta\.json: unreadable"),
    (lambda p: os.remove(Path(p, "rank0.safetensors")), r"rank0\.safetensors is missing"),
    (lambda p: truncate(p, "rank0.safetensors"), r"rank0\.safetensors has 100 bytes.*truncated"),
    (
        lambda p: flip_byte(p, "rank0.safetensors", "group0.master.1"),
        r"rank0\.safetensors: crc32 [0-9a-f]{8}, but meta\.json recorded",
    ),
    (
        lambda p: flip_byte(p, "rank0.safetensors", "group1.exp_avg_sq.0"),
        r"rank0\.safetensors: crc32 [0-9a-f]{8}, but meta\.json recorded",
    ),
    (
        lambda p: flip_byte(p, "module.safetensors", "frozen.weight"),
        r"module\.safetensors: crc32",
    ),
    (
        lambda p: rewrite_tensor(p, "rank0.safetensors", "group0.master.0", lambda t: t.half()),
        r"rank0\.safetensors: tensor 'group0\.master\.0' is F16 \[42\], expected F32 \[42\]",
    ),
    (
        lambda p: rewrite_tensor(p, "rank0.safetensors", "group1.exp_avg.0", lambda t: t[:-1]),
        r"rank0\.safetensors: tensor 'group1\.exp_avg\.0' is F32 \[27\], expected F32 \[28\]",
    ),
    (
        lambda p: rewrite_tensor(p, "rank0.safetensors", "rng.torch_cpu", lambda t: t[:10]),
        r"rank0\.safetensors: tensor 'rng\.torch_cpu' is U8 \[10\], expected U8",
    ),
    (
        lambda p: rewrite_tensor(p, "module.safetensors", "frozen.weight", lambda t: t.long()),
        r"module\.safetensors: 'frozen\.weight' is I64 in the checkpoint",
    ),
]


def snapshot(engine) -> dict:
    """Everything a load may change, copied."""
    optimizer = engine.optimizer.optimizer
    return {
        "params": [p.detach().clone() for p in engine.module.parameters()],
        "masters": [b.master.detach().clone() for b in engine.optimizer.buckets],
        "state": [
            {
                k: v.clone() if torch.is_tensor(v) else v
                for k, v in optimizer.state[b.master].items()
            }
            for b in engine.optimizer.buckets
        ],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scheduler": engine.lr_scheduler.state_dict(),
        "scaler": engine.scaler.state_dict(),
        "counters": [
            engine.global_steps,
            engine.global_samples,
            engine.skipped_steps,
            engine.micro_steps,
        ],
        "rng": [torch.get_rng_state(), random.getstate()],
    }


def assert_same(a, b, where="state"):
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{index}")
    else:
        assert a == b, where


def test_bad_checkpoints_fail_before_any_state_changes(tmp_path):
    engine = make_engine(2, dtype="fp16")
    batches = global_batches(3)
    train(engine, batches[:1])
    engine.save_checkpoint(tmp_path / "good", tag="T", client_state={"saved": 1})
    train(engine, batches[1:2])
    x, y = batches[2]
    engine.backward(engine(x, y) * float("inf"))  # an overflow: the loss scaler's state moves
    engine.step()
    before = snapshot(engine)
    assert before["counters"][:3] == [3, 36, 1]  # a skipped step counts too
    for index, (damage, error) in enumerate(BAD):
        root = tmp_path / f"bad{index}"
        shutil.copytree(tmp_path / "good", root)
        damage(root / "T")
        with pytest.raises(CheckpointError, match=error):
            engine.load_checkpoint(root)
        assert_same(snapshot(engine), before, f"case {index} ({error})")
    # Training goes on from the untouched state.
    train(engine, batches[:1])
    assert engine.global_steps == 4
    assert not torch.equal(engine.optimizer.buckets[0].master, before["masters"][0])


def test_meta_json_sets_only_known_typed_fields(tmp_path):
    """A hand-edited meta.json cannot set engine attributes or an optimizer's tensors: unknown
    counters are refused, a null lr_scheduler is refused unless load_lr_scheduler_states=False
    (which leaves the run's scheduler), and param-group keys
    other than this optimizer's hyper-parameters (its "params" above all) are not applied."""
    engine = make_engine(2)  # with a WarmupLR scheduler
    train(engine, global_batches(1))
    engine.save_checkpoint(tmp_path / "good", tag="T")
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "good", bad)
    set_key("counters", "forward", value=1)(bad / "T")
    with pytest.raises(CheckpointError, match=r"key 'counters\.forward': Extra inputs"):
        engine.load_checkpoint(bad)
    odd = tmp_path / "odd"
    shutil.copytree(tmp_path / "good", odd)

    def change(meta):
        meta["lr_scheduler"] = None
        meta["param_groups"][0].update(params=[0, 1], not_a_hyperparameter=7)

    edit_meta(odd / "T", change)
    scheduler, params = engine.lr_scheduler, list(engine.optimizer.param_groups[0]["params"])
    with pytest.raises(CheckpointError, match="saved without an lr scheduler"):
        engine.load_checkpoint(odd)
    engine.load_checkpoint(odd, load_lr_scheduler_states=False)
    assert engine.lr_scheduler is scheduler
    assert engine.optimizer.param_groups[0]["params"] == params
    assert "not_a_hyperparameter" not in engine.optimizer.param_groups[0]
    train(engine, global_batches(1))  # still trains
    assert engine.global_steps == 2


def test_checksums_optional_and_absent_in_older_checkpoints(tmp_path):
    engine = make_engine(2)
    train(engine, global_batches(1))
    engine.save_checkpoint(tmp_path / "good", tag="T")
    older = tmp_path / "older"
    shutil.copytree(tmp_path / "good", older)
    edit_meta(older / "T", lambda meta: meta.pop("crc32"))  # as zero wrote them before crc32
    fresh = make_engine(2)
    fresh.load_checkpoint(older)
    assert fresh.global_steps == 1
    flipped = tmp_path / "flipped"
    shutil.copytree(tmp_path / "good", flipped)
    flip_byte(flipped / "T", "rank0.safetensors", "group0.master.0")
    with pytest.raises(CheckpointError, match="crc32"):
        ckpt.consolidate(str(flipped))
    assert ckpt.consolidate(str(flipped), verify=False)  # the read itself works
    unverified = make_engine(2, extra={"checkpoint": {"verify_checksums": False}})
    unverified.load_checkpoint(flipped)  # the flipped value loads: nothing checks it
    assert unverified.global_steps == 1


# ----- interrupted saves ----------------------------------------------------------------------
class Crash(BaseException):
    """The process dies here: no handler of zero's runs (they catch Exception)."""


# Every operation a save may do on the filesystem. shutil.rmtree also calls os.open, os.unlink
# and os.rmdir, so a crash can stop it halfway.
FS_OPERATIONS = [
    (os, "open"),
    (os, "mkdir"),
    (os, "makedirs"),
    (os, "replace"),
    (os, "rename"),
    (os, "unlink"),
    (os, "rmdir"),
    (os, "fsync"),
    (os, "fchmod"),
    (shutil, "rmtree"),
    (checkpoint_files, "save_file"),
]


@contextlib.contextmanager
def crash_at(step: int, monkeypatch):
    """Run the body with the filesystem "dying" before its `step`-th operation: that call and
    every later one raises Crash. Yields a list that holds the operations done so far."""
    done = []

    def wrap(module, name):
        original = getattr(module, name)

        def operation(*args, **kwargs):
            if len(done) >= step:
                raise Crash(f"{name} after {len(done)} operations")
            done.append(name)
            return original(*args, **kwargs)

        return operation

    with monkeypatch.context() as patch:
        for module, name in FS_OPERATIONS:
            patch.setattr(module, name, wrap(module, name))
        yield done


def masters(engine):
    return [b.master.detach().clone() for b in engine.optimizer.buckets]


def test_save_interrupted_anywhere_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    engine = make_engine(2)
    batches = global_batches(2)
    train(engine, batches[:1])
    base = tmp_path / "base"
    engine.save_checkpoint(base, tag="A", client_state={"v": "old"})
    expected = {"old": (1, masters(engine))}
    train(engine, batches[1:])
    expected["new"] = (2, masters(engine))
    loader = make_engine(2)
    for tag in ("A", "B"):  # the same tag again (a directory to replace), a new tag
        outcomes, step = set(), 0
        while True:
            root = tmp_path / f"{tag}{step}"
            shutil.copytree(base, root)
            with crash_at(step, monkeypatch) as done:
                try:
                    engine.save_checkpoint(root, tag=tag, client_state={"v": "new"})
                    crashed = False
                except Crash:
                    crashed = True
            path, client = loader.load_checkpoint(root)
            steps, values = expected[client["v"]]
            assert loader.global_steps == steps, (tag, step, done)
            assert all(torch.equal(a, b) for a, b in zip(masters(loader), values)), (tag, step)
            outcomes.add((client["v"], os.path.basename(path)))
            # The next save cleans up after the crash and publishes normally.
            engine.save_checkpoint(root, tag=tag, client_state={"v": "new"})
            assert sorted(os.listdir(root)) == sorted({"A", tag, "latest"}), (tag, step)
            assert loader.load_checkpoint(root)[1] == {"v": "new"}
            shutil.rmtree(root)
            if not crashed:
                break
            step += 1
        assert step > 15, "the save did fewer filesystem operations than expected"
        assert ("old", "A") in outcomes and ("new", tag) in outcomes
        if tag == "A":  # crashed between its renames: the previous version of the tag loads
            assert ("old", "A.old") in outcomes


# ----- links and leftovers --------------------------------------------------------------------
def test_saves_never_write_through_links_and_remove_leftovers(tmp_path, zero_log):
    outside_file = tmp_path / "outside.txt"
    outside_file.write_text("keep")
    outside_dir = tmp_path / "outside"
    outside_dir.mkdir()
    (outside_dir / "keep.txt").write_text("keep")
    save = tmp_path / "save"
    save.mkdir()
    engine = make_engine(2)
    train(engine, global_batches(1))
    plants = [
        {"latest.tmp": outside_file, "T.tmp": outside_dir},
        {"latest.tmp": outside_file, "T.old": outside_dir, "T.tmp": outside_file},
        {"latest": outside_file},
    ]
    for round_, links in enumerate(plants):
        for name, target in links.items():
            if os.path.lexists(save / name):
                os.remove(save / name)
            os.symlink(target, save / name)
        engine.save_checkpoint(save, tag="T")
        assert outside_file.read_text() == "keep", round_
        assert sorted(os.listdir(outside_dir)) == ["keep.txt"], round_
        assert (outside_dir / "keep.txt").read_text() == "keep", round_
        assert sorted(os.listdir(save)) == ["T", "latest"], round_
        assert not any(p.is_symlink() for p in save.iterdir()), round_
        assert (save / "latest").read_text() == "T"
    # `T` itself a link: replaced without touching its target.
    shutil.rmtree(save / "T")
    os.symlink(outside_dir, save / "T")
    engine.save_checkpoint(save, tag="T")
    assert sorted(os.listdir(outside_dir)) == ["keep.txt"]
    assert not (save / "T").is_symlink() and make_engine(2).load_checkpoint(save)
    # Leftovers of interrupted saves of other tags: removed when they hold only checkpoint
    # files, kept (never guessed at) otherwise.
    (save / "B.tmp").mkdir()
    (save / "B.tmp" / "rank0.safetensors").write_bytes(b"partial")
    (save / "B.tmp" / ".tmpAbC123").write_bytes(b"partial")  # safetensors' own temporary file
    (save / "C.tmp").mkdir()
    (save / "C.tmp" / "notes.txt").write_text("mine")
    shutil.copytree(save / "T", save / "T2")
    shutil.copytree(save / "T", save / "T2.old")  # T2 exists: a finished save's leftover
    shutil.copytree(save / "T", save / "T3.old")  # T3 is missing: T3's only copy, kept
    zero_log.clear()
    engine.save_checkpoint(save, tag="U")
    assert sorted(os.listdir(save)) == ["C.tmp", "T", "T2", "T3.old", "U", "latest"]
    assert any("B.tmp, left behind by an interrupted save" in m for m in zero_log)
    assert any("T2.old, left behind by an interrupted save" in m for m in zero_log)
    assert make_engine(2).load_checkpoint(save, tag="T3")[0].endswith("T3.old")


# ----- failures on one rank -------------------------------------------------------------------
def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


def attempt(engine, action) -> tuple[float, str]:
    """Seconds until action() raised, and what it raised (None when it returned)."""
    start = time.monotonic()
    try:
        action()
        error = None
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    return time.monotonic() - start, error


def one_rank_fails(root):
    """On 2 ranks: failures of one rank while saving and loading, bad tags."""
    import torch.distributed as dist

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("zero").addHandler(handler)
    engine = make_engine(2)
    train(engine, global_batches(1))
    engine.save_checkpoint(root, tag="A")
    rank, out = engine.rank, {}

    def save_with(name, failing_rank, module, attribute, tag="B"):
        with pytest.MonkeyPatch.context() as patch:
            if rank == failing_rank:
                patch.setattr(module, attribute, disk_full)
            out[name] = attempt(engine, lambda: engine.save_checkpoint(root, tag=tag))
        dist.barrier()
        out[name + " files"] = sorted(os.listdir(root)), Path(root, "latest").read_text()

    save_with("rank 0 writes", 0, checkpoint_files, "save_file")
    save_with("rank 1 writes", 1, checkpoint_files, "save_file")
    save_with("rank 0 publishes", 0, os, "replace")
    save_with("rank 0 prepares", 0, os, "mkdir")
    for name, tag in (
        ("long tag", "x" * 300),
        ("split character", "\u00e9" * 128),  # 256 bytes: the old 256-byte buffer cut it
        ("long tag on rank 1", "C" if rank == 0 else "x" * 300),
    ):
        out[name] = attempt(engine, partial(engine.save_checkpoint, root, tag=tag))
    out["longest tag"] = attempt(
        engine, lambda: engine.save_checkpoint(root, tag="a" * 251, save_latest=False)
    )
    damaged = os.path.join(root, "damaged")
    if rank == 0:
        shutil.copytree(os.path.join(root, "A"), os.path.join(damaged, "A"))
        Path(damaged, "latest").write_text("A")
        flip_byte(os.path.join(damaged, "A"), "rank1.safetensors", "group0.master.0")
    dist.barrier()
    out["load flipped"] = attempt(engine, lambda: engine.load_checkpoint(damaged))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(damaged, "A"))
        shutil.copytree(os.path.join(root, "A"), os.path.join(damaged, "A"))
        edit_meta(os.path.join(damaged, "A"), lambda meta: meta.update(lr_scheduler={}))
    dist.barrier()
    out["load bad meta"] = attempt(engine, lambda: engine.load_checkpoint(damaged))
    fresh = make_engine(2)
    fresh.load_checkpoint(root)
    out["loaded"] = fresh.global_steps
    return out, warnings


def test_one_ranks_failure_reaches_every_rank_at_once(tmp_path):
    results = run_ranks(one_rank_fails, 2, str(tmp_path), timeout=180)
    for rank, (out, warnings) in enumerate(results):
        for name, failing, cause in (
            ("rank 0 writes", 0, "No space left"),
            ("rank 1 writes", 1, "No space left"),
            ("rank 0 publishes", 0, "No space left"),
            ("rank 0 prepares", 0, "No space left"),
            ("long tag on rank 1", 1, "is 300 bytes long in UTF-8; at most 251"),
        ):
            seconds, error = out[name]
            assert seconds < 10, (rank, name, seconds)
            assert cause in error, (rank, name, error)
            if rank != failing:
                assert f"rank {rank}: rank {failing} failed to" in error, (rank, name, error)
            if name != "long tag on rank 1":
                assert out[name + " files"] == (["A", "latest"], "A"), (rank, name)
        assert "is 300 bytes long" in out["long tag"][1]
        assert "is 256 bytes long" in out["split character"][1]
        assert out["longest tag"][1] is None
        # Only rank 1 reads rank1.safetensors; both ranks read meta.json.
        error = out["load flipped"][1]
        assert "rank1.safetensors: crc32" in error, error
        assert rank == 1 or "rank 0: rank 1 failed to verify the checkpoint" in error, error
        assert "meta.json: key 'lr_scheduler' lacks" in out["load bad meta"][1]
        assert out["loaded"] == 1
        assert not any("different checkpoint tags" in w for w in warnings), (rank, warnings)


# ----- meta.json edits that move tensors, files that shrink while read (issue 42) -------------
def swap_ranks(meta):
    meta["ranks"]["0"], meta["ranks"]["1"] = meta["ranks"]["1"], meta["ranks"]["0"]


def swap_names(meta):  # two parameters of the same shape
    first, second = meta["groups"][1][0], meta["groups"][1][1]
    assert first["shape"] == second["shape"]
    first["name"], second["name"] = second["name"], first["name"]


LAYOUT_EDITS = {
    "swap two ranks' ranges": swap_ranks,
    "swap two same-shape names": swap_names,
    "reverse the parameter order": lambda meta: meta["groups"][0].reverse(),
    "a crafted ties entry": lambda meta: meta["ties"].update({"alias.weight": "out.weight"}),
}


def hostile_layouts(root):
    """On 2 ranks: loads of a checkpoint whose meta.json moved tensors, and of one whose rank
    file shrinks after it was verified and opened."""
    import torch.distributed as dist

    import zero.checkpoint.reader as reader

    engine = make_engine(2)
    train(engine, global_batches(1))
    engine.save_checkpoint(os.path.join(root, "good"), tag="T")
    rank, out, before = engine.rank, {}, snapshot(engine)
    for name, edit in LAYOUT_EDITS.items():
        case = os.path.join(root, name.replace(" ", "_").replace("'", ""))
        if rank == 0:
            shutil.copytree(os.path.join(root, "good"), case)
            edit_meta(os.path.join(case, "T"), edit)
        dist.barrier()
        out[name] = attempt(engine, lambda case=case: engine.load_checkpoint(case))[1]
        assert_same(snapshot(engine), before, name)
    # rank1.safetensors is truncated once rank 1 verified and opened it (with the file mapped,
    # reading it killed rank 1 with SIGBUS).
    agree = reader._agree_on_version

    def truncate_after_verify(engine, path, version):
        if rank == 1:
            file = os.path.join(path, "rank1.safetensors")
            os.truncate(file, os.path.getsize(file) // 2)
        agree(engine, path, version)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reader, "_agree_on_version", truncate_after_verify)
        shrunk = os.path.join(root, "shrunk")
        if rank == 0:
            shutil.copytree(os.path.join(root, "good"), shrunk)
        dist.barrier()
        out["shrunk"] = attempt(engine, lambda: engine.load_checkpoint(shrunk))[1]
    fresh = make_engine(2)
    fresh.load_checkpoint(os.path.join(root, "good"))
    out["loaded"] = fresh.global_steps
    return out


def test_layout_edits_and_shrinking_files_are_refused_on_every_rank(tmp_path):
    results = run_ranks(hostile_layouts, 2, str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        for name in LAYOUT_EDITS:
            assert "was saved with another layout than meta.json describes" in out[name], (
                rank,
                name,
                out[name],
            )
        assert "rank1.safetensors: tensor 'group" in out["shrunk"], (rank, out["shrunk"])
        assert "changed after it was verified" in out["shrunk"], out["shrunk"]
        assert rank == 1 or "rank 0: rank 1 failed to read" in out["shrunk"], out["shrunk"]
        assert out["loaded"] == 1
    # Consolidation (zero-to-fp32) refuses the same edits, the ties entry included.
    assert ckpt.consolidate(str(tmp_path / "good"))
    for name in LAYOUT_EDITS:
        case = tmp_path / name.replace(" ", "_").replace("'", "")
        with pytest.raises(CheckpointError, match="saved with another layout"):
            ckpt.consolidate(str(case), verify=False)
