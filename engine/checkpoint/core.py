"""Sharded checkpoints: each rank writes what it owns, any world size reads them back.

Layout of one checkpoint, `save_dir/<tag>/`:

    meta.json               rank 0: format, config, world size, stage, parameter names/shapes,
                            the ranges each rank holds, counters, loss scaler, lr scheduler,
                            optimizer hyper-parameters, client_state, file sizes and crc32s
    rank<r>.safetensors     rank r: its owned fp32 master weights and optimizer moments, one
                            1-D tensor per (param group, kind), plus its RNG state
    module.safetensors      rank 0: what ZeRO does not partition (frozen parameters, buffers)

and `save_dir/latest` names the newest tag. No pickle is involved: tensors go through
safetensors, everything else is JSON.

[Note: world-size independent coordinates]
Within a param group the flat layout packs parameters in a fixed order; buckets only cut that
sequence and add padding. Ranges are therefore recorded in "group coordinates": the offset of an
element in the unpadded concatenation of the group's parameters. These coordinates do not depend
on the world size or the bucket size, so a rank of a new run computes the ranges it owns, and
reads exactly those elements from whichever old rank files hold them (safetensors slices).

[Note: crash-safe publication]
Ranks write into `<tag>.tmp/` (created afresh by rank 0; nothing is written through a symbolic
link: stale paths are unlinked, never followed, and files are created with O_EXCL|O_NOFOLLOW).
Each rank reads its file back once for its size and crc32, and rank 0 collects them into
meta.json, written last. Publication is then a sequence of renames in save_dir:
`<tag>` -> `<tag>.old` (only when the tag exists), `<tag>.tmp` -> `<tag>`, remove `<tag>.old`,
then `latest.tmp` -> `latest`. At every point between two of these operations the tag `latest`
names is a complete checkpoint, except right after the first rename, when `<tag>` is missing and
`<tag>.old` holds its previous, complete version: `resolve` loads `<tag>.old` then, and the next
save keeps it until a new `<tag>` is in place. Directories are fsynced after their renames.

[Note: agreement on failure]
Every step that may fail on one rank (checking inputs, rank 0 preparing the directory, writing
files, rank 0 publishing; on load, verifying) runs through `_on_every_rank`: the ranks all-reduce
a failure flag, and the lowest failing rank broadcasts its message, so every rank raises at the
same point within one collective (none waits for a rank that gave up) and names the cause.
"""

import contextlib
import json
import logging
import os
import random
import re
import shutil
import stat
import zlib
from collections.abc import Mapping
from typing import Annotated

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from safetensors import safe_open
from safetensors.torch import save_file

from ..progress import progress

logger = logging.getLogger("zero")

FORMAT = "zero-checkpoint/1"
META, MODULE_FILE, LATEST = "meta.json", "module.safetensors", "latest"
# File names are limited to 255 bytes (NAME_MAX); a save writes into `<tag>.tmp` first.
MAX_TAG_BYTES = 255 - len(".tmp")
_MESSAGE_BYTES = 1024  # how much of a failing rank's message the other ranks receive
_CHUNK_BYTES = 4 << 20  # read size of the crc32 pass
# What a checkpoint directory can hold (safetensors writes `.tmpXXXXXX` and renames it).
_CHECKPOINT_ENTRY = re.compile(r"meta\.json|module\.safetensors|rank\d+\.safetensors|\.tmp\w+")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read; the message names the file and the key."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


# ----- ownership in group coordinates ---------------------------------------------------------
def owned_ranges(buckets, shard: int) -> dict[int, list[tuple[int, int, "object"]]]:
    """Per param group, [(begin, end, bucket)] in group coordinates that `shard` owns (padding
    excluded), in layout order."""
    out: dict[int, list] = {}
    group_start: dict[int, int] = {}
    for bucket in buckets:
        layout = bucket.layout
        start = group_start.get(layout.group, 0)
        lo, hi = layout.owned_range(shard)
        hi = min(hi, layout.numel)
        if hi > lo:
            out.setdefault(layout.group, []).append((start + lo, start + hi, bucket))
        group_start[layout.group] = start + layout.numel
    return out


def _written_shard(layout, rank: int) -> int | None:
    """The shard a rank writes, or None when it writes nothing (stage 0: only rank 0 writes)."""
    shard = layout.shard_of(rank)
    return shard if layout.num_shards > 1 or rank == 0 else None


def _sharded_state_keys(engine) -> list[str]:
    """Optimizer state entries shaped like the master shard (Adam: exp_avg, exp_avg_sq)."""
    keys: set[str] = set()
    for bucket in engine.optimizer.buckets:
        for key, value in engine.optimizer.optimizer.state.get(bucket.master, {}).items():
            if torch.is_tensor(value) and value.shape == bucket.master.shape and value.dim():
                keys.add(key)
    return sorted(keys)


# ----- meta.json schema -----------------------------------------------------------------------
# [Note: meta.json schema] Every key meta.json must have, with its JSON type; read_meta checks a
# file against it before anything else reads it, so a damaged or hand-edited file is a
# CheckpointError naming the key, never a KeyError or a failure halfway through a load. Checks
# that need the running engine (the scheduler's keys, the param groups) are in _verify.
_Number = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]*)$")]  # a rank or group
_FileName = Annotated[
    str, StringConstraints(pattern=r"^(module|rank(0|[1-9][0-9]*))\.safetensors$")
]
_Count = Annotated[int, Field(ge=0)]
_Crc32 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{8}$")]


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _SavedParam(_Schema):
    name: str
    shape: list[_Count]


class _ScalarState(_Schema):
    tensor: str | None  # "torch.float32" for a 0-dim tensor, None for a plain value
    value: JsonValue

    @model_validator(mode="after")
    def _tensor_dtype(self):
        if self.tensor is not None:
            if _dtype(self.tensor) is None:
                raise ValueError(f"tensor dtype {self.tensor!r} is not one such as 'torch.float32'")
            if not isinstance(self.value, (int, float)):
                raise ValueError(f"a tensor's value must be a number, not {self.value!r}")
        return self


class _Counters(_Schema):
    global_steps: _Count
    global_samples: _Count
    skipped_steps: _Count
    micro_steps: _Count


class _LossScaler(_Schema):  # precision.LossScaler.state_dict()
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    hysteresis_left: _Count
    steps_since_change: _Count


class _Meta(_Schema):
    format: str
    tag: str
    config: dict[str, JsonValue]
    world_size: Annotated[int, Field(ge=1)]
    stage: Annotated[int, Field(ge=0, le=3)]
    compute_dtype: str
    groups: list[list[_SavedParam]]
    ties: dict[str, str]
    ranks: dict[
        _Number, dict[_Number, list[Annotated[list[_Count], Field(min_length=2, max_length=2)]]]
    ]
    optimizer: str
    sharded_state: list[str]
    scalar_state: dict[_Number, dict[str, _ScalarState]]
    param_groups: list[dict[str, JsonValue]]
    counters: _Counters
    loss_scaler: _LossScaler
    lr_scheduler: dict[str, JsonValue] | None
    python_rng: JsonValue
    client_state: dict[str, JsonValue]
    files: dict[_FileName, _Count]
    crc32: dict[_FileName, _Crc32] | None = None  # absent in checkpoints of older versions
    frozen: list[str] | None = None  # absent in checkpoints of older versions

    @field_validator("python_rng")
    @classmethod
    def _python_rng(cls, value):
        try:
            random.Random().setstate(_as_tuple(value))  # a scratch generator: nothing changes
        except (TypeError, ValueError) as error:
            raise ValueError(f"not a state of Python's random module ({error})") from None
        return value

    @model_validator(mode="after")
    def _consistent(self):
        for rank, groups in self.ranks.items():
            if int(rank) >= self.world_size:
                raise ValueError(f"'ranks' has rank {rank}, but world_size is {self.world_size}")
            if rank_file(int(rank)) not in self.files:
                raise ValueError(f"'files' lacks {rank_file(int(rank))}, which 'ranks' lists")
            for group, ranges in groups.items():
                if int(group) >= len(self.groups):
                    raise ValueError(f"'ranks.{rank}' has group {group}, 'groups' has fewer")
                if any(lo > hi for lo, hi in ranges):
                    raise ValueError(
                        f"'ranks.{rank}.{group}' has a range [begin, end) with end < begin"
                    )
        if MODULE_FILE not in self.files:
            raise ValueError(f"'files' lacks {MODULE_FILE}")
        if self.crc32 is not None and set(self.crc32) != set(self.files):
            raise ValueError("'crc32' must list exactly the files of 'files'")
        return self


def _dtype(name: str) -> torch.dtype | None:
    """The torch dtype written as str(dtype) ("torch.float32"), or None."""
    value = getattr(torch, name[len("torch.") :], None) if name.startswith("torch.") else None
    return value if isinstance(value, torch.dtype) else None


def _schema_error(meta_path: str, error: ValidationError) -> CheckpointError:
    problems = []
    for item in error.errors()[:3]:
        key = ".".join(str(part) for part in item["loc"])
        problems.append(f"key '{key}': {item['msg']}" if key else item["msg"])
    more = f" (and {error.error_count() - 3} more)" if error.error_count() > 3 else ""
    return CheckpointError(f"{meta_path}: {'; '.join(problems)}{more}")


# ----- save -----------------------------------------------------------------------------------
def save(engine, save_dir: str, tag: str | None, client_state: Mapping, save_latest: bool) -> str:
    """Write a checkpoint; see Engine.save_checkpoint. Returns the checkpoint directory.

    Collective. Raises CheckpointError on every rank (before anything is written) for a bad tag
    or client_state, and on every rank when any rank fails to write (the failing rank raises
    its own error); the previous checkpoint and `latest` stay as they were then.
    """
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    scheduler_state = _on_every_rank(
        engine,
        "check the checkpoint tag and state",
        lambda: _check_inputs(engine, tag, client_state),
    )
    tag = _agree_on_tag(engine, tag)
    final = os.path.join(save_dir, tag)
    tmp = final + ".tmp"
    _on_rank_0(engine, f"prepare {tmp}", lambda: _prepare(save_dir, tag))
    try:
        # Stage 3 partitions frozen parameters too: rank 0 gathers them for module.safetensors.
        frozen = engine.frozen.full_values() if engine.frozen is not None else {}
        written = _on_every_rank(engine, f"write {tmp}", lambda: _write_files(engine, tmp, frozen))
        files, crcs = _gather_files(engine, written)

        def publish():
            meta = _meta(engine, tag, dict(client_state), scheduler_state, files, crcs)
            _finish(meta, save_dir, tag, save_latest)

        _on_rank_0(engine, f"publish {final}", publish)
    except Exception:
        if engine.comm.rank == 0:
            with contextlib.suppress(OSError):
                _remove(tmp)  # the next save would remove it too
        raise
    return final


def _check_inputs(engine, tag, client_state: Mapping):
    """This rank's checks before anything is written; returns the lr scheduler's state."""
    _check_tag(tag)
    _check_json(client_state, "client_state")
    return _scheduler_state(engine)


def _finish(meta: dict, save_dir: str, tag: str, save_latest: bool) -> None:
    """Rank 0: meta.json last, then publication ([Note: crash-safe publication])."""
    tmp = os.path.join(save_dir, tag + ".tmp")
    _create_json(os.path.join(tmp, META), meta)
    _fsync_dir(tmp)
    publish_directory(tmp, os.path.join(save_dir, tag))
    if save_latest:
        _write_text_atomic(os.path.join(save_dir, LATEST), tag)


def _on_every_rank(engine, what: str, action):
    """Run action() on every rank and agree on the outcome ([Note: agreement on failure]): when
    it raises on any rank, the failing rank re-raises its error and every other rank raises
    CheckpointError carrying the lowest failing rank's message. Collective."""
    error = None
    try:
        result = action()
    except Exception as caught:
        error, result = caught, None
    failed = torch.zeros(engine.comm.world_size, device=engine.device)
    failed[engine.comm.rank] = float(error is not None)
    engine.comm.all_reduce(failed, op="max")
    if not failed.any():
        return result
    first = int(failed.nonzero()[0])
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    message = _share_text(engine, text, first)
    if error is not None:
        raise error
    raise CheckpointError(f"rank {engine.comm.rank}: rank {first} failed to {what}: {message}")


def _on_rank_0(engine, what: str, action):
    return _on_every_rank(engine, what, lambda: action() if engine.comm.rank == 0 else None)


def _share_text(engine, text: str, src: int) -> str:
    """Rank src's `text` (its first _MESSAGE_BYTES bytes in UTF-8) on every rank. Collective."""
    buffer = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    raw = text.encode("utf-8", "replace")[:_MESSAGE_BYTES]
    if engine.comm.rank == src and raw:
        buffer[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buffer = buffer.to(engine.device)
    engine.comm.broadcast(buffer, src=src)
    return bytes(buffer.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")


def _gather_files(engine, written: dict) -> tuple[dict, dict]:
    """(name -> size in bytes, name -> crc32) of every rank's files, from the (size, crc32)
    each rank measured of the files it wrote; complete on rank 0. Collective."""
    rank = engine.comm.rank
    table = torch.zeros(engine.comm.world_size, 4, dtype=torch.int64)
    for column, name in enumerate((rank_file(rank), MODULE_FILE)):
        if name in written:
            size, crc = written[name]
            table[rank, 2 * column : 2 * column + 2] = torch.tensor([size, int(crc, 16)])
    table = table.to(engine.device)
    engine.comm.all_reduce(table)
    files, crcs = {}, {}
    for r, (size, crc, module_size, module_crc) in enumerate(table.tolist()):
        files[rank_file(r)], crcs[rank_file(r)] = size, f"{crc:08x}"
        if r == 0:
            files[MODULE_FILE], crcs[MODULE_FILE] = module_size, f"{module_crc:08x}"
    return files, crcs


def _write_files(engine, directory: str, frozen: dict) -> dict:
    written = {rank_file(engine.comm.rank): _write_rank_file(engine, directory)}
    if engine.comm.rank == 0:
        written[MODULE_FILE] = _write_module_file(engine, directory, frozen)
    return written


def _refuse_constant(name: str):
    """json.loads' hook for NaN and Infinity, which zero never writes: a meta.json holding one
    was edited, and a non-finite lr or step would train NaN weights."""
    raise ValueError(f"non-finite number {name} (zero writes only finite numbers)")


def _check_tag(tag) -> None:
    """A tag is a plain directory name that cannot collide with zero's own files and leaves
    room for the '.tmp' suffix within the 255-byte file-name limit."""
    if not isinstance(tag, str):
        raise CheckpointError(f"checkpoint tag {tag!r} is a {type(tag).__name__}, not a str")
    reserved = tag in (".", "..", LATEST) or tag.endswith((".tmp", ".old"))
    blank = tag != tag.strip() or any(not c.isprintable() for c in tag)  # `latest` is stripped
    if not tag or reserved or blank or "/" in tag or os.sep in tag:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not a plain directory name (no '/', no leading or "
            f"trailing space, no control character, not '.', '..' or '{LATEST}', not ending in "
            "'.tmp' or '.old')"
        )
    try:
        size = len(tag.encode("utf-8"))
    except UnicodeEncodeError:
        raise CheckpointError(f"checkpoint tag {tag!r} is not encodable as UTF-8") from None
    if size > MAX_TAG_BYTES:
        raise CheckpointError(
            f"checkpoint tag {tag[:32]!r}... is {size} bytes long in UTF-8; at most "
            f"{MAX_TAG_BYTES} are allowed (file names have at most 255 bytes and a save adds "
            "'.tmp'); pass a shorter tag"
        )


def _agree_on_tag(engine, tag: str) -> str:
    """Every rank saves under rank 0's tag. A rank whose own tag differs is reported as
    checkpoint.tag_validation says: Warn (log, go on), Fail (CheckpointError on every rank) or
    Ignore. Every rank's tag has passed _check_tag. Collective."""
    if engine.comm.world_size == 1:
        return tag
    chosen = _share_text(engine, tag, src=0)  # a checked tag fits the message buffer whole
    differs = torch.tensor([float(chosen != tag)], device=engine.device)
    engine.comm.all_reduce(differs, op="max")
    mode = engine.config.checkpoint.tag_validation
    if differs.item() and mode != "Ignore":
        message = (
            f"rank {engine.comm.rank}: ranks passed different checkpoint tags (this rank {tag!r}, "
            f"rank 0 {chosen!r}); pass the same tag on every rank (checkpoint.tag_validation)"
        )
        if mode == "Fail":
            raise CheckpointError(message)
        logger.warning("%s; saving under %r", message, chosen)
    return chosen


def _check_json(value, what: str) -> None:
    """`value` must survive JSON unchanged (no tensors, tuples or non-string keys)."""
    if _is_json(value):
        return
    bad = (
        [k for k, v in value.items() if not _is_json({k: v})] if isinstance(value, Mapping) else []
    )
    where = f"{what}[{bad[0]!r}]" if bad else what
    raise CheckpointError(
        f"{where} does not survive JSON unchanged; checkpoints store client_state as JSON: use "
        "numbers, strings, lists and dicts with string keys (tensor.tolist(), list(tuple))"
    )


def _is_json(value) -> bool:
    try:
        return json.loads(json.dumps(value, allow_nan=True)) == value and _no_tuples(value)
    except (TypeError, ValueError):
        return False


def _no_tuples(value) -> bool:
    if isinstance(value, tuple):
        return False
    if isinstance(value, list):
        return all(_no_tuples(v) for v in value)
    if isinstance(value, dict):
        return all(_no_tuples(v) for v in value.values())
    return True


def _scheduler_state(engine):
    if engine.lr_scheduler is None:
        return None
    state = engine.lr_scheduler.state_dict()
    try:
        json.dumps(state, allow_nan=True)
    except (TypeError, ValueError):
        raise CheckpointError(
            f"the lr scheduler {type(engine.lr_scheduler).__name__} has a state_dict that is not "
            "JSON-serializable; use a scheduler from the config or one with plain state"
        ) from None
    return state


def _write_rank_file(engine, directory: str) -> tuple[int, str]:
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng.torch_cuda"] = torch.cuda.get_rng_state()
    shard = _written_shard(engine.optimizer.layout, engine.comm.rank)
    if shard is not None:
        state = engine.optimizer.optimizer.state
        kinds = _sharded_state_keys(engine)
        for group, ranges in owned_ranges(engine.optimizer.buckets, shard).items():
            bar = progress(ranges, f"save group {group}", rank=engine.global_rank, unit="bucket")
            for index, (lo, hi, bucket) in enumerate(bar):
                # The owned, unpadded part of a bucket is the head of its shard (padding is at
                # the end); a prefix view is written without a copy, except of nvme state
                # (engine/offload/nvme.py), whose host buffer is reused for the next bucket.
                offloader = engine.optimizer.offloader
                swapped = offloader is not None and offloader.swapped(bucket)
                with engine.optimizer.resident(bucket):
                    values = {"master": bucket.master[: hi - lo]}
                    values.update({kind: state[bucket.master][kind][: hi - lo] for kind in kinds})
                    for kind, value in values.items():
                        value = value.float().cpu()
                        tensors[f"group{group}.{kind}.{index}"] = (
                            value.clone() if swapped else value
                        )
    return _write_shard(tensors, os.path.join(directory, rank_file(engine.comm.rank)))


def _write_module_file(engine, directory: str, frozen: dict) -> tuple[int, str]:
    """module.safetensors: frozen and empty parameters and buffers; `frozen` maps id(param) to
    the full value of a stage-3 partitioned frozen parameter."""
    laid_out = _laid_out_ids(engine)
    tensors, seen = {}, set()
    for name, tensor in _module_tensors(engine.module):
        if id(tensor) in laid_out or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[name] = frozen.get(id(tensor), tensor).detach().cpu().contiguous()
    return _write_shard(tensors, os.path.join(directory, MODULE_FILE))


def _module_tensors(module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _write_shard(tensors: dict, path: str) -> tuple[int, str]:
    """Write a checkpoint's safetensors file; returns its (size in bytes, crc32)."""
    os.close(_create(path))  # claims the name; fails on anything already there, links included
    save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as any file the user creates (safetensors: 0600)
        os.fsync(fd)
        return os.fstat(fd).st_size, _crc32(fd)
    finally:
        os.close(fd)


def _save_safetensors(tensors: dict, path: str) -> None:
    """Write a consolidated output file (a path the user chose; an existing file is replaced)."""
    save_file(tensors, path)
    os.chmod(path, 0o666 & ~_umask())
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _create(path: str) -> int:
    """A new file's descriptor (write-only); never opens an existing file or follows a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o666)


def _crc32(fd: int) -> str:
    """crc32 (zlib.crc32, the CRC-32 of zip and gzip) of the file open as `fd`, 8 hex digits."""
    crc, buffer = 0, bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    os.lseek(fd, 0, os.SEEK_SET)
    while count := os.readv(fd, [buffer]):
        crc = zlib.crc32(view[:count], crc)
    return f"{crc:08x}"


def file_crc32(path: str) -> str:
    """crc32 of a file as 8 hex digits, as meta.json records it (read in 4 MiB chunks)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _crc32(fd)
    finally:
        os.close(fd)


def _meta(engine, tag: str, client_state: dict, scheduler_state, files: dict, crcs: dict) -> dict:
    optimizer = engine.optimizer.optimizer
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    ranks = {}
    for rank in range(engine.comm.world_size):
        shard = _written_shard(engine.optimizer.layout, rank)
        ranges = {} if shard is None else owned_ranges(engine.optimizer.buckets, shard)
        ranks[str(rank)] = {str(g): [[lo, hi] for lo, hi, _ in r] for g, r in ranges.items()}
    return {
        "format": FORMAT,
        "tag": tag,
        "config": engine.config.to_dict(),
        "world_size": engine.comm.world_size,
        "stage": engine.config.zero.stage,
        "compute_dtype": str(engine.config.compute_dtype).replace("torch.", ""),
        "groups": [
            [{"name": s.name, "shape": list(s.shape)} for s in slots]
            for slots in _group_slots(engine)
        ],
        "ties": _ties(engine.module),
        "ranks": ranks,
        "optimizer": optimizer_name(engine.optimizer.optimizer),
        "sharded_state": _sharded_state_keys(engine),
        "scalar_state": _scalar_state(engine),
        "param_groups": _jsonable(groups),
        "counters": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "micro_steps": engine.micro_steps,
        },
        "loss_scaler": engine.scaler.state_dict(),
        "lr_scheduler": scheduler_state,
        "python_rng": _jsonable(random.getstate()),
        "client_state": client_state,
        "files": files,
        "crc32": crcs,
        "frozen": _frozen_names(engine),
    }


def _frozen_names(engine) -> list[str]:
    """The names module.safetensors holds frozen parameters under (requires_grad=False; each
    tensor under its first name), so consolidation can leave them out without the model."""
    laid_out, seen, names = _laid_out_ids(engine), set(), []
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        if id(param) in laid_out or id(param) in seen:
            continue
        seen.add(id(param))
        if not param.requires_grad:
            names.append(name)
    return names


def _group_buckets(engine, group: int):
    return [b for b in engine.optimizer.buckets if b.layout.group == group]


def _ties(module) -> dict[str, str]:
    """Names that alias another parameter or buffer: alias -> the first (canonical) name."""
    first: dict[int, str] = {}
    ties = {}
    for name, tensor in _module_tensors(module):
        if id(tensor) in first:
            ties[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return ties


def _scalar_state(engine) -> dict:
    """Per param group, the optimizer state that is not per element (Adam's step count)."""
    out = {}
    state = engine.optimizer.optimizer.state
    for bucket in engine.optimizer.buckets:
        group = str(bucket.layout.group)
        for key, value in state.get(bucket.master, {}).items():
            if torch.is_tensor(value) and value.dim() == 0:
                out.setdefault(group, {})[key] = {"tensor": str(value.dtype), "value": value.item()}
            elif not torch.is_tensor(value):
                out.setdefault(group, {})[key] = {"tensor": None, "value": _jsonable(value)}
    return out


def _jsonable(value):
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if torch.is_tensor(value):
        return value.tolist()
    return value


def _create_json(path: str, value) -> None:
    with os.fdopen(_create(path), "w") as handle:
        json.dump(value, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _write_json(path: str, value) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    _remove_leftover(tmp)
    with os.fdopen(_create(tmp), "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare(save_dir: str, tag: str) -> None:
    """Rank 0: remove what interrupted saves left in save_dir, and create `<tag>.tmp/`."""
    os.makedirs(save_dir, exist_ok=True)
    _remove_stale(save_dir, tag)
    os.mkdir(os.path.join(save_dir, tag + ".tmp"))


def _remove_stale(save_dir: str, tag: str) -> None:
    """Remove `<tag>.tmp` whatever it is, and what interrupted saves of other tags left:
    `<other>.tmp/`, and `<other>.old/` where `<other>` exists, when they are directories
    holding only checkpoint files (anything else there is left alone)."""
    with os.scandir(save_dir) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        path = os.path.join(save_dir, name)
        if name == tag + ".tmp" or _is_stale(save_dir, name):
            _remove_leftover(path)


def _is_stale(save_dir: str, name: str) -> bool:
    path = os.path.join(save_dir, name)
    if name.endswith(".tmp"):
        return _holds_only_checkpoint_files(path)
    if name.endswith(".old"):
        return os.path.isdir(path[: -len(".old")]) and _holds_only_checkpoint_files(path)
    return False


def _holds_only_checkpoint_files(path: str) -> bool:
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        return all(_CHECKPOINT_ENTRY.fullmatch(name) for name in os.listdir(path))
    except OSError:
        return False


def _remove_leftover(path: str) -> None:
    if os.path.lexists(path):
        logger.warning("rank 0: removing %s, left behind by an interrupted save", path)
        _remove(path)


def _remove(path: str) -> None:
    """Remove a file, link or directory tree, if there is one, without following links (a link
    to a directory is unlinked; rmtree never descends through links)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def publish_directory(tmp: str, final: str) -> None:
    """Move the finished directory into place ([Note: crash-safe publication]): an existing
    checkpoint of the same tag becomes `<tag>.old` until the new one is in place."""
    old = final + ".old"
    if os.path.lexists(final):
        _remove(old)  # left by an interrupted save after `<tag>` was complete again
        os.replace(final, old)
    # else: a `<tag>.old` left by an interrupted save is the only copy of the tag; kept.
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final))
    try:
        _remove(old)
    except OSError as error:
        logger.warning("rank 0: could not remove %s (%s); the next save removes it", old, error)


# ----- load -----------------------------------------------------------------------------------
def resolve(load_dir: str, tag: str | None) -> str:
    """The checkpoint directory for `tag`, or the one `latest` names. Raises CheckpointError."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            deepspeed = deepspeed_checkpoint_files(load_dir)
            if deepspeed:
                raise CheckpointError(deepspeed_checkpoint_message(load_dir, deepspeed))
            raise CheckpointError(f"{latest} does not exist; pass tag= or save with save_latest")
        try:
            with open(latest, "rb") as handle:
                tag = handle.read().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{latest}: unreadable ({error})") from None
    _check_tag(tag)
    path = os.path.join(load_dir, tag)
    if os.path.isfile(os.path.join(path, META)):
        return path
    old = path + ".old"
    if not os.path.lexists(path) and os.path.isfile(os.path.join(old, META)):
        # [Note: crash-safe publication]: a save of this tag stopped between its two renames.
        logger.warning(
            "%s is missing and %s holds its previous version (a save of this tag was "
            "interrupted); loading that",
            path,
            old,
        )
        return old
    deepspeed = deepspeed_checkpoint_files(path)
    if deepspeed:
        raise CheckpointError(deepspeed_checkpoint_message(path, deepspeed))
    raise CheckpointError(f"{os.path.join(path, META)} does not exist: not a zero checkpoint")


# DeepSpeed's files in a checkpoint directory: mp_rank_00_model_states.pt (stages 0-2),
# zero_pp_rank_0_mp_rank_00_model_states.pt (stage 3), *_optim_states.pt (the optimizer shards).
_DEEPSPEED_FILE = re.compile(r".*_(model|optim)_states\.pt")


def deepspeed_checkpoint_files(path: str) -> list[str]:
    """The DeepSpeed checkpoint files in directory `path` (sorted; empty when there are none or
    `path` is not a readable directory)."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(n for n in names if _DEEPSPEED_FILE.fullmatch(n))


def deepspeed_checkpoint_message(path: str, files: list[str]) -> str:
    """What a DeepSpeed checkpoint is to zero, and how to carry its weights over."""
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    save_dir = os.path.dirname(os.path.abspath(path))
    return (
        f"{path} is a DeepSpeed checkpoint ({shown}), not a zero checkpoint: zero reads only its "
        "own format (safetensors and meta.json) and never unpickles .pt files, which can run "
        "code. To continue from it, consolidate its weights with DeepSpeed's own zero_to_fp32.py "
        f"(the copy DeepSpeed saved in {save_dir}, or deepspeed.utils.zero_to_fp32) into a state "
        "dict, e.g. `python zero_to_fp32.py SAVE_DIR OUT_DIR --safe_serialization`; load it into "
        "the model with model.load_state_dict(...) before zero.initialize; then train on and "
        "save zero checkpoints (the optimizer state, lr scheduler and step counters start "
        "afresh; see docs/checkpoints.md, 'Checkpoints from DeepSpeed')"
    )


def read_meta(path: str) -> dict:
    """Read meta.json, check it against the schema ([Note: meta.json schema]), and check the
    presence and size of every file it lists. Raises CheckpointError naming the file and key."""
    meta_path = os.path.join(path, META)
    try:
        with open(meta_path, "rb") as handle:
            text = handle.read().decode("utf-8")
        meta = json.loads(text, parse_constant=_refuse_constant)
    except (OSError, ValueError, RecursionError) as error:  # JSON, UTF-8, NaN, depth
        raise CheckpointError(f"{meta_path}: unreadable ({error})") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise CheckpointError(f"{meta_path}: format {found!r}, expected {FORMAT!r}")
    try:
        _Meta.model_validate_json(text)
    except ValidationError as error:
        raise _schema_error(meta_path, error) from None
    for name, size in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing from the checkpoint")
        if os.path.getsize(file) != size:
            raise CheckpointError(
                f"{file} has {os.path.getsize(file)} bytes, the checkpoint recorded {size} "
                "(truncated or replaced)"
            )
    return meta


def _open(path: str, name: str):
    file = os.path.join(path, name)
    try:
        return safe_open(file, framework="pt")
    except Exception as error:
        raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None


class GroupReader:
    """Reads any [begin, end) range of a param group's flat vector of one state kind from the
    rank files that hold it, touching only the overlapping slices.

    Ranges are in the saved order's group coordinates, or, given `order` (per group, the
    parameter names in the reading engine's layout order), in that order's: a checkpoint saved
    at another stage lays out the same parameters in another order ([Note: units laid out
    together] in partition/flat.py), and each parameter's elements are then read from where the
    saved order put them."""

    def __init__(self, path: str, meta: dict, order: list[list[str]] | None = None):
        self.path = path
        # per group: (begin in the reader's coordinates, numel, begin in the saved ones)
        self._moved: dict[int, list[tuple[int, int, int]]] = {}
        for group, params in enumerate(meta["groups"] if order is not None else ()):
            saved, offset = {}, 0
            for p in params:
                saved[p["name"]] = (offset, _numel(p["shape"]))
                offset += _numel(p["shape"])
            if [p["name"] for p in params] != order[group]:
                moved, begin = [], 0
                for name in order[group]:
                    at, numel = saved[name]
                    moved.append((begin, numel, at))
                    begin += numel
                self._moved[group] = moved
        self.pieces: dict[str, list[tuple[int, int, int, str]]] = {}
        for rank, groups in meta["ranks"].items():
            for group, ranges in groups.items():
                for index, (lo, hi) in enumerate(ranges):
                    self.pieces.setdefault(group, []).append((lo, hi, index, rank_file(int(rank))))
        self._handles: dict[str, object] = {}

    def _saved_ranges(self, group: int, begin: int, end: int):
        """(saved begin, saved end, offset into [begin, end)) covering [begin, end)."""
        moved = self._moved.get(group)
        if moved is None:
            yield begin, end, 0
            return
        for at, numel, saved_at in moved:
            a, b = max(at, begin), min(at + numel, end)
            if a < b:
                yield saved_at + a - at, saved_at + b - at, a - begin

    def files(self, group: int, begin: int, end: int) -> set[str]:
        """The rank files holding elements [begin, end) of a group (for any state kind)."""
        pieces = self.pieces.get(str(group), [])
        return {
            file
            for sa, sb, _ in self._saved_ranges(group, begin, end)
            for lo, hi, _, file in pieces
            if max(lo, sa) < min(hi, sb)
        }

    def _overlaps(self, group: int, kind: str, begin: int, end: int):
        """(a, b, piece_lo, file, key) for each saved piece overlapping [begin, end); raises
        CheckpointError when a tensor is missing, is not fp32 of the right size, or elements
        are uncovered."""
        covered, out = 0, []
        for lo, hi, index, file in self.pieces.get(str(group), []):
            a, b = max(lo, begin), min(hi, end)
            if a >= b:
                continue
            key = f"group{group}.{kind}.{index}"
            handle = self._handle(file)
            saved = handle.get_slice(key) if key in handle.keys() else None
            if saved is None or (saved.get_dtype(), saved.get_shape()) != ("F32", [hi - lo]):
                found = "missing" if saved is None else f"{saved.get_dtype()} {saved.get_shape()}"
                raise CheckpointError(
                    f"{os.path.join(self.path, file)}: tensor '{key}' is {found}, expected F32 "
                    f"[{hi - lo}]"
                )
            out.append((a, b, lo, file, key))
            covered += b - a
        if covered != end - begin:
            raise CheckpointError(
                f"{self.path}: group {group} elements [{begin}, {end}) of '{kind}' are not held "
                "by any rank file"
            )
        return out

    def check(self, group: int, kind: str, begin: int, end: int) -> None:
        for sa, sb, _ in self._saved_ranges(group, begin, end):
            self._overlaps(group, kind, sa, sb)

    def read_into(self, group: int, kind: str, begin: int, out: torch.Tensor) -> None:
        """Fill `out` (1-D, fp32) with elements [begin, begin + out.numel())."""
        for sa, sb, at in self._saved_ranges(group, begin, begin + out.numel()):
            for a, b, lo, file, key in self._overlaps(group, kind, sa, sb):
                piece = self._handle(file).get_slice(key)[a - lo : b - lo]
                out[at + a - sa : at + b - sa].copy_(piece)

    def read(self, group: int, kind: str, begin: int, end: int) -> torch.Tensor:
        out = torch.empty(end - begin, dtype=torch.float32)
        self.read_into(group, kind, begin, out)
        return out

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = _open(self.path, file)
        return self._handles[file]


def _group_slots(engine) -> list[list]:
    """Per param group, the trained parameters' layout Slots in the engine's layout order."""
    return [
        [s for b in _group_buckets(engine, g) for s in b.layout.slots]
        for g in range(engine.optimizer.layout.num_groups)
    ]


def _layout_problems(meta: dict, slots: list[list]) -> list[str]:
    """Differences between the saved trained parameters (names, shapes, param groups) and the
    engine's (`slots`, _group_slots); the order within a group may differ (GroupReader follows
    it)."""
    saved = [sorted((p["name"], tuple(p["shape"])) for p in group) for group in meta["groups"]]
    current = [sorted((s.name, s.shape) for s in group) for group in slots]
    if saved == current:
        return []
    saved_all = {n: s for g in saved for n, s in g}
    current_all = {n: s for g in current for n, s in g}
    return _differences(saved_all, current_all) or [
        "the trained parameters are grouped differently (same optimizer param groups are needed)"
    ]


def _differences(saved: dict, current: dict) -> list[str]:
    """Missing keys, unexpected keys and shape mismatches between name -> shape maps."""
    problems = []
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for name in sorted(set(saved) & set(current)):
        if tuple(saved[name]) != tuple(current[name]):
            problems.append(
                f"'{name}' has shape {tuple(saved[name])} in the checkpoint, "
                f"{tuple(current[name])} in the model"
            )
    return problems


def load(engine, load_dir, tag, strict, load_optimizer, load_scheduler, module_only):
    """Read a checkpoint into the engine; see Engine.load_checkpoint. Everything is verified on
    every rank (and the ranks agree on it) before any engine state changes."""
    load_optimizer = load_optimizer and not module_only
    load_scheduler = load_scheduler and not module_only
    path, meta, reader, owned, kinds, module_values, rng = _on_every_rank(
        engine,
        f"verify the checkpoint in {load_dir}",
        lambda: _verify(engine, load_dir, tag, strict, load_optimizer, load_scheduler),
    )
    # Verified: from here on state changes. Values are read straight into their destinations.
    with torch.no_grad():
        _read_shards(engine, meta, reader, owned, kinds, load_optimizer)
        for tensor, value in module_values:
            if engine.frozen is not None and engine.frozen.full_shape(tensor) is not None:
                engine.frozen.write(tensor, value)  # stage 3: a partitioned frozen parameter
            else:
                tensor.copy_(value.to(tensor.dtype))
        if engine.gatherer is not None:
            engine.gatherer.forget_writes()  # the checkpoint's values replace them
        engine.optimizer.refresh_params()
    if not module_only:
        _apply_training_state(engine, meta, load_optimizer, load_scheduler)
        if rng is not None:
            torch.set_rng_state(rng)
            random.setstate(_as_tuple(meta["python_rng"]))
    return path, meta["client_state"]


def _verify(engine, load_dir, tag, strict, load_optimizer, load_scheduler):
    """Resolve, read metadata, and check every file, key, range and value this rank will read
    or apply: meta.json against its schema, the size and crc32 of every file this rank reads
    (before it opens them), each tensor's dtype and shape, the training state's keys."""
    path = resolve(load_dir, tag)
    meta = read_meta(path)
    slots = _group_slots(engine)
    layout_problems = [f"{META}: {p}" for p in _layout_problems(meta, slots)]
    order = [[s.name for s in group] for group in slots]
    reader = GroupReader(path, meta, None if layout_problems else order)
    shard = engine.optimizer.layout.shard_of(engine.comm.rank)
    owned = [
        (group, lo, hi, bucket)
        for group, ranges in owned_ranges(engine.optimizer.buckets, shard).items()
        for lo, hi, bucket in ranges
    ]
    if engine.config.checkpoint.verify_checksums:
        files = {MODULE_FILE} | {f for g, lo, hi, _ in owned for f in reader.files(g, lo, hi)}
        if str(engine.comm.rank) in meta["ranks"]:
            files.add(rank_file(engine.comm.rank))  # its RNG state
        verify_checksums(path, meta, files)
    laid_out = _laid_out_ids(engine)
    module_values, module_problems = _read_module_file(path, engine, laid_out, strict)
    problems = layout_problems + module_problems
    if problems:
        raise CheckpointError(f"{path} does not fit the model: {'; '.join(problems)}")
    current = optimizer_name(engine.optimizer.optimizer)
    if load_optimizer and meta["optimizer"] != current:
        raise CheckpointError(
            f"{os.path.join(path, META)}: optimizer {meta['optimizer']!r} was saved, this run uses "
            f"{current!r}; pass load_optimizer_states=False to load the weights only"
        )
    problems = _training_state_problems(meta, engine, load_optimizer, load_scheduler)
    if problems:
        raise CheckpointError(f"{os.path.join(path, META)}: {'; '.join(problems)}")
    kinds = ["master"] + (meta["sharded_state"] if load_optimizer else [])
    for group, lo, hi, _ in owned:
        for kind in kinds:
            reader.check(group, kind, lo, hi)
    rng = _read_rng(path, meta, engine.comm.rank)
    return path, meta, reader, owned, kinds, module_values, rng


def verify_checksums(path: str, meta: dict, names) -> None:
    """Check the crc32 meta.json records for each file in `names` (none are recorded in
    checkpoints of zero versions before checksums: nothing to check). Raises CheckpointError
    naming the file. Reads each file once, in 4 MiB chunks."""
    recorded = meta.get("crc32")
    if recorded is None:
        return
    for name in sorted(names):
        file = os.path.join(path, name)
        found = file_crc32(file)
        if found != recorded[name]:
            raise CheckpointError(
                f"{file}: crc32 {found}, but {META} recorded {recorded[name]}: the file's bytes "
                "changed after it was saved (storage or copy corruption); restore it, or load "
                "another checkpoint"
            )


def _training_state_problems(meta, engine, load_optimizer: bool, load_scheduler: bool) -> list:
    """What in the saved param groups and lr scheduler state this run could not apply."""
    problems = []
    if load_optimizer:
        saved, current = meta["param_groups"], engine.optimizer.param_groups
        if len(saved) != len(current):
            problems.append(
                f"key 'param_groups' has {len(saved)} groups, the optimizer {len(current)}"
            )
        for index, (group, now) in enumerate(zip(saved, current)):
            now = _jsonable({k: v for k, v in now.items() if k != "params" and k in group})
            problems += _kind_problems(group, now, f"param_groups.{index}")
    scheduler = engine.lr_scheduler
    if load_scheduler and scheduler is not None and meta["lr_scheduler"] is None:
        name = type(scheduler).__name__
        problems.append(
            f"the checkpoint was saved without an lr scheduler, and this run has {name}: there is "
            f"no schedule position to restore, and loading on would train with the saved "
            f"optimizer lr instead of {name}'s. Pass load_lr_scheduler_states=False to keep "
            f"{name} where it is (from its start in a new run; the param groups keep the lr it "
            "set), or resume from a checkpoint saved with the scheduler"
        )
    if load_scheduler and scheduler is not None and meta["lr_scheduler"] is not None:
        now = _jsonable(scheduler.state_dict())
        found = _kind_problems(meta["lr_scheduler"], now, "lr_scheduler")
        if not found:
            found = _scheduler_refuses(scheduler, meta["lr_scheduler"])
        problems += [
            f"{p} ({type(scheduler).__name__}'s state; pass load_lr_scheduler_states=False to "
            "keep this run's schedule)"
            for p in found
        ]
    return problems


def _scheduler_refuses(scheduler, saved: dict) -> list[str]:
    """Try the saved state on the scheduler and put its own back: the scheduler's own checks
    (a negative step count) must fail here, before the load changes anything, not after the
    weights were written."""
    own = scheduler.state_dict()
    try:
        scheduler.load_state_dict(saved)
    except (ValueError, TypeError, KeyError) as error:
        return [f"key 'lr_scheduler': {error}"]
    finally:
        scheduler.load_state_dict(own)
    return []


_JSON_KINDS = {bool: "a bool", int: "a number", float: "a number", str: "a string"}


def _json_kind(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _kind_problems(saved, current, key: str) -> list[str]:
    """Where `saved` (from JSON) differs in kind from `current` (this run's value, as JSON): a
    string for a number, a list of another length, an object lacking a key of this run's.
    None on either side matches anything."""
    kind = _json_kind(current)
    if kind is None or saved is None:
        return []
    if _json_kind(saved) != kind:
        return [f"key '{key}' is {saved!r}, this run has {kind} ({current!r})"]
    if kind == "a list":
        if len(saved) != len(current):
            return [f"key '{key}' has {len(saved)} entries, this run {len(current)}"]
        pairs = [(f"{key}.{i}", s, c) for i, (s, c) in enumerate(zip(saved, current))]
    elif kind == "an object":
        missing = sorted(set(current) - set(saved))
        if missing:
            return [f"key '{key}' lacks {missing}"]
        pairs = [(f"{key}.{k}", saved[k], c) for k, c in current.items()]
    else:
        return []
    return [p for where, s, c in pairs for p in _kind_problems(s, c, where)]


def optimizer_name(optimizer) -> str:
    """The algorithm an optimizer runs, as recorded in meta.json: zero's CPUAdam and FusedAdam
    (what offload and the CUDA path put in place of the config's Adam/AdamW) count as "Adam" or
    "AdamW" by their mode, so a checkpoint resumes with offload switched on or off."""
    name = type(optimizer).__name__
    if name in ("CPUAdam", "FusedAdam"):
        return "AdamW" if optimizer.param_groups[0]["adamw_mode"] else "Adam"
    return name


def _laid_out_ids(engine) -> set[int]:
    """ids of the parameters ZeRO partitions (their values live in the rank files)."""
    return {id(p) for b in engine.optimizer.buckets for p in b.params}


def _full_shape(engine, tensor) -> tuple:
    """The tensor's shape; for a stage-3 partitioned frozen parameter, its full shape."""
    shape = engine.frozen.full_shape(tensor) if engine.frozen is not None else None
    return tuple(tensor.shape) if shape is None else tuple(shape)


def _read_module_file(path: str, engine, laid_out: set[int], strict: bool):
    """([(tensor, saved value)], problems) for every tensor ZeRO does not lay out (frozen and
    empty parameters, buffers), checked against module.safetensors."""
    handle = _open(path, MODULE_FILE)
    targets, seen = {}, set()
    for name, tensor in _module_tensors(engine.module):
        if id(tensor) not in laid_out and id(tensor) not in seen:
            seen.add(id(tensor))
            targets[name] = tensor
    saved = {name: handle.get_slice(name).get_shape() for name in handle.keys()}
    problems = _differences(saved, {n: _full_shape(engine, t) for n, t in targets.items()})
    if not strict:
        problems = [p for p in problems if "shape" in p]
    for name, tensor in targets.items():
        dtype = handle.get_slice(name).get_dtype() if name in saved else None
        if dtype is not None and not _dtype_fits(dtype, tensor.dtype):
            problems.append(f"'{name}' is {dtype} in the checkpoint, {tensor.dtype} in the model")
    values = [
        (tensor, handle.get_tensor(name)) for name, tensor in targets.items() if name in saved
    ]
    return values, [f"{MODULE_FILE}: {p}" for p in problems]


# torch dtype -> safetensors' name for it (the format's spec lists these); also what
# safetensors_io writes.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_OTHER_DTYPES = {d: n for d, n in SAFETENSORS_DTYPES.items() if not d.is_floating_point}


def _dtype_fits(saved: str, dtype: torch.dtype) -> bool:
    """A saved tensor of safetensors dtype `saved` may be copied into one of `dtype`: floating
    point into floating point (a run may change its compute dtype), anything else unchanged."""
    if dtype.is_floating_point:
        return saved in _FLOAT_DTYPES
    return _OTHER_DTYPES.get(dtype) == saved


def _read_rng(path, meta, rank):
    """This rank's saved torch CPU generator state, checked (None when rank saved none)."""
    if str(rank) not in meta["ranks"]:
        return None
    handle, key = _open(path, rank_file(rank)), "rng.torch_cpu"
    expected = list(torch.get_rng_state().shape)
    saved = handle.get_slice(key) if key in handle.keys() else None
    if saved is None or (saved.get_dtype(), saved.get_shape()) != ("U8", expected):
        found = "missing" if saved is None else f"{saved.get_dtype()} {saved.get_shape()}"
        raise CheckpointError(
            f"{os.path.join(path, rank_file(rank))}: tensor '{key}' is {found}, expected U8 "
            f"{expected}"
        )
    return handle.get_tensor(key)


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _read_shards(engine, meta, reader, owned, kinds, load_optimizer: bool) -> None:
    state = engine.optimizer.optimizer.state
    for group, lo, hi, bucket in progress(owned, "load", rank=engine.global_rank, unit="range"):
        with engine.optimizer.resident(bucket, write=True):  # nvme: read, change, write back
            for kind in kinds:
                if kind == "master":
                    target = bucket.master
                else:
                    per_param = state.setdefault(bucket.master, {})
                    if kind not in per_param:
                        per_param[kind] = torch.zeros_like(bucket.master)
                    target = per_param[kind]
                _read_to_device(reader, group, kind, lo, target[: hi - lo])
        if load_optimizer:
            for key, item in meta["scalar_state"].get(str(group), {}).items():
                value = item["value"]
                if item["tensor"]:
                    value = torch.tensor(value, dtype=_dtype(item["tensor"]))
                state.setdefault(bucket.master, {})[key] = value


def _read_to_device(reader, group: int, kind: str, begin: int, target: torch.Tensor) -> None:
    if target.device.type == "cpu" and target.dtype == torch.float32:
        reader.read_into(group, kind, begin, target)
    else:
        target.copy_(reader.read(group, kind, begin, begin + target.numel()))


def _apply_training_state(engine, meta, load_optimizer: bool, load_scheduler: bool) -> None:
    if load_optimizer:
        # A scheduler whose state is not loaded keeps driving the lr: the param groups keep the
        # values it wrote ([Note: a scheduler that is not loaded]).
        kept = _scheduled_keys(engine.lr_scheduler) if not load_scheduler else ()
        for group, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
            for key, value in saved.items():
                if key == "params" or key not in group or key in kept:
                    continue  # only the hyper-parameters this optimizer has: never its tensors
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
        engine.scaler.load_state_dict(meta["loss_scaler"])
    if load_scheduler and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    counters = meta["counters"]
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
    engine.skipped_steps = counters["skipped_steps"]
    engine.micro_steps = counters["micro_steps"]


def _scheduled_keys(scheduler) -> tuple[str, ...]:
    """[Note: a scheduler that is not loaded]
    With load_lr_scheduler_states=False (which a checkpoint saved without a scheduler needs),
    this run's scheduler keeps its own position, and the param-group values it writes stay its
    own: "lr", and the momentum a one-cycle schedule cycles ("betas" or "momentum"). Restoring
    the saved lr instead would run the first step after the load at the old run's lr and the
    next ones at the scheduler's. The other hyper-parameters (weight decay, eps...) load."""
    if scheduler is None:
        return ()
    keys = ("lr",)
    if getattr(scheduler, "cycle_momentum", False):  # zero's OneCycle, torch's OneCycleLR
        keys += ("betas", "momentum")
    return keys


# ----- consolidation --------------------------------------------------------------------------
class ConsolidatedReader:
    """A checkpoint's full tensors, read one at a time, without the original world size.

    Args:
        checkpoint_dir: a save_dir (its `latest` is followed, or `tag`) or a checkpoint
            directory itself.
        state: "master" for the weights, or an optimizer state kind such as "exp_avg" (then
            only trained parameters are listed).
        verify: check every file's crc32 recorded in meta.json first (one extra read).

    `names`: every tensor once, trained parameters group by group, then the others (frozen
    parameters, buffers) of module.safetensors; `ties`: alias -> canonical name for the names
    a tied tensor also has (not in `names`); `frozen`: the names in `names` of frozen
    parameters, or None for a checkpoint of a zero version that did not record them.
    `shape(name)`, `dtype(name)` (as read: fp32 for floating point) and `read(name)` (the full
    tensor, padding removed; master weights bitwise the saved fp32 values) read only what the
    tensor needs, so a caller that writes each tensor before reading the next holds one
    tensor, never the model. Raises CheckpointError.
    """

    def __init__(
        self, checkpoint_dir: str, tag: str | None = None, state="master", verify: bool = True
    ):
        if os.path.isfile(os.path.join(checkpoint_dir, META)):
            path = checkpoint_dir
        else:
            path = resolve(checkpoint_dir, tag)
        meta = read_meta(path)
        if verify:
            verify_checksums(path, meta, meta["files"])
        self.path, self.state, self.ties = path, state, dict(meta["ties"])
        self.frozen = None if meta.get("frozen") is None else set(meta["frozen"])
        self._groups = GroupReader(path, meta)
        self._trained: dict[str, tuple] = {}  # name -> (group, offset in group coordinates)
        self._shapes: dict[str, tuple] = {}
        for group, params in enumerate(meta["groups"]):
            offset = 0
            for p in params:
                self._trained[p["name"]] = (group, offset)
                self._shapes[p["name"]] = tuple(p["shape"])
                offset += _numel(p["shape"])
        self._module = _open(path, MODULE_FILE) if state == "master" else None
        self._saved_dtypes: dict[str, str] = {}
        for name in self._module.keys() if self._module is not None else ():
            piece = self._module.get_slice(name)
            self._shapes[name] = tuple(piece.get_shape())
            self._saved_dtypes[name] = piece.get_dtype()
        self.names = list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        saved = self._saved_dtypes.get(name, "F32")
        if saved in _FLOAT_DTYPES:
            return torch.float32
        return next(d for d, n in _OTHER_DTYPES.items() if n == saved)

    def read(self, name: str) -> torch.Tensor:
        if name in self._trained:
            group, offset = self._trained[name]
            numel = _numel(self._shapes[name])
            return self._groups.read(group, self.state, offset, offset + numel).view(
                self._shapes[name]
            )
        value = self._module.get_tensor(name)
        return value.float() if value.is_floating_point() else value


def consolidate(
    checkpoint_dir: str,
    tag: str | None = None,
    state: str = "master",
    verify: bool = True,
    exclude_frozen: bool = False,
) -> dict:
    """Full fp32 state dict of a checkpoint, in one process, without the original world size.

    Arguments as ConsolidatedReader's. Returns name -> tensor for every parameter and buffer of
    the model (tied names included, as equal copies), with padding removed; master weights are
    bitwise the saved fp32 values; frozen parameters and floating-point buffers are cast to
    fp32. `exclude_frozen` leaves frozen parameters out (buffers stay). Raises CheckpointError.
    """
    reader = ConsolidatedReader(checkpoint_dir, tag, state, verify)
    names = consolidated_names(reader, exclude_frozen)
    out = {name: reader.read(name) for name in progress(names, "consolidate", unit="tensor")}
    for alias, canonical in reader.ties.items():
        if canonical in out:
            out[alias] = out[canonical].clone()
    return out


def consolidated_names(reader: ConsolidatedReader, exclude_frozen: bool = False) -> list[str]:
    """reader.names, without the frozen parameters when `exclude_frozen`. Raises CheckpointError
    for exclude_frozen on a checkpoint that does not record which tensors are frozen."""
    if not exclude_frozen:
        return list(reader.names)
    if reader.frozen is None:
        raise CheckpointError(
            f"{os.path.join(reader.path, META)} does not record which parameters are frozen (a "
            "checkpoint of an older zero version): consolidate without excluding them and drop "
            "their names from the state dict, or load and save the checkpoint again"
        )
    return [name for name in reader.names if name not in reader.frozen]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def save_consolidated(state_dict: dict, output: str, max_shard_bytes: int | None = None) -> list:
    """Write a consolidated state dict as one safetensors file, or as several of at most
    max_shard_bytes each plus `<output>.index.json` (name -> file). Returns the files written."""
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    if not max_shard_bytes:
        _save_safetensors(tensors, output)
        return [output]
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    stem = output[: -len(".safetensors")] if output.endswith(".safetensors") else output
    files, index = [], {}
    for i, shard in enumerate(progress(shards, "write", unit="file")):
        file = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_safetensors(shard, file)
        files.append(file)
        index.update({name: os.path.basename(file) for name in shard})
    _write_json(f"{stem}.index.json", {"weight_map": index})
    return files
