"""Hugging Face checkpoints: safetensors weights into zero's shards, and back out in HF's layout.

    with zero.Init(config="zero3.json"):
        model = AutoModelForCausalLM.from_pretrained(path)   # partitioned as it loads (init.py)
    engine, *_ = zero.initialize(model=model, config="zero3.json")
    zero.load_pretrained(engine, other_path)                   # every rank: straight into shards
    engine.save_pretrained("out")                              # every rank: config.json + shards

An HF checkpoint directory holds config.json and either model.safetensors or the shards
model-0000i-of-0000n.safetensors that model.safetensors.index.json lists (name -> file).
transformers is never imported here: its conventions (base_model_prefix, the
_keys_to_ignore_on_load_* / _keys_to_ignore_on_save patterns, a tied weight saved once) are read
from the model's attributes when it has them. The reading and writing of safetensors files is in
safetensors_io.py.

[Note: where a loaded value goes]
load_pretrained reads one tensor at a time, and of it only the elements this rank keeps:
- a parameter a stage-3 engine lays out (trainable or frozen): this rank's owned part, into the
  shard (compute dtype) and the fp32 master slice;
- a parameter a stage 0-2 engine lays out: all of it, into the flat buffer the parameter views,
  and its owned part into the fp32 master slice;
- a zero.Init parameter (before zero.initialize): its slice, into its InitShard (an empty one,
  on the meta device, too);
- anything else (a plain model's tensors, buffers, frozen parameters below stage 3): all of it.
A part is read as the row range of a safetensors slice that covers it (at most two partial rows
more), so a rank holds at most one tensor (under stage 3 or zero.Init one part) beside the model.

[Note: export]
save_pretrained writes what training produced: the fp32 master weights (cast to `dtype` when
given), then frozen parameters and persistent buffers. A laid-out tensor's elements lie in the
shards of one or more ranks (stages 1-3; at stage 0 every rank holds them all): each owner
broadcasts its part, which rank 0 receives straight into the tensor, writes, and drops before
the next tensor. Rank 0 streams the tensors into safetensors files whose headers it wrote first,
since the layout gives every name, shape and dtype up front: it holds one tensor (and its cast
to `dtype`), never a bucket, a whole shard of max_shard_size nor the model. The traffic is an
all-gather's (every rank receives every part), in one broadcast per tensor and owner.
"""

import copy
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import listed
from ..partition.gathered import laid_out_buckets, owner
from ..partition.init import is_partitioned, own_ops
from ..partition.stages import ZeroOptimizer
from ..partition.units import UnitState
from ..progress import progress
from .agreement import enter
from .consolidation import ConsolidatedReader
from .files import publish_directory
from .format import CheckpointError
from .full_state import slot_value
from .ownership import non_persistent_buffer_names
from .safetensors_io import (
    INDEX_FILE,
    SafetensorsReader,
    ShardedWriter,
    is_weights_file,
    parse_size,
)


class LoadResult(NamedTuple):
    """What zero.load_pretrained did on this rank.

    missing_keys: model names the files lack; unexpected_keys: file names the model lacks (both
    empty unless strict=False). bytes_read: bytes this rank read from the files; largest_read:
    bytes of its largest single read (one tensor, or one rank's part of it).
    """

    missing_keys: list
    unexpected_keys: list
    bytes_read: int
    largest_read: int


@dataclass
class _Target:
    """A parameter or persistent buffer of the model, under all its names (tied: several)."""

    names: list
    tensor: torch.Tensor


class _Places:
    """Where each tensor of a model lives ([Note: where a loaded value goes])."""

    def __init__(self, module: torch.nn.Module):
        self.optimizer = None  # the ZeroOptimizer of the engine over the model, if any
        self._init_shard = None  # an InitShard of the model's, if built under zero.Init
        self._slot_of: dict[int, tuple] = {}  # id(param) -> (bucket, slot)
        for param in module.parameters():
            found = owner(param)
            if found is not None and self.optimizer is None:
                self.optimizer = found
            elif found is not None and found is not self.optimizer:
                raise NotImplementedError("the model's parameters belong to two zero engines")
            if self._init_shard is None and is_partitioned(param):
                self._init_shard = param.zero_shard
        if self.optimizer is None:
            return
        _refuse_model_parallel(self.optimizer)
        for bucket in laid_out_buckets(self.optimizer):
            for slot, param in zip(bucket.layout.slots, bucket.params):
                self._slot_of[id(param)] = (bucket, slot)

    def shape(self, tensor) -> tuple:
        """The tensor's full shape, also while it is partitioned."""
        place = self._slot_of.get(id(tensor))
        if place is not None:
            return tuple(place[1].shape)
        return tuple(tensor.zero_shard.shape if is_partitioned(tensor) else tensor.shape)

    def comm(self):
        """(Communicator, device of its collectives) of the ranks the model is partitioned over,
        or (None, None) for a model that is not."""
        if self.optimizer is not None:
            devices = [b.grad_device for b in self.optimizer.buckets]
            return self.optimizer.comm, devices[0] if devices else torch.device("cpu")
        if self._init_shard is not None:
            return self._init_shard.comm, self._init_shard.comm_device
        return None, None

    def write(self, tensor, read) -> None:
        """Load `tensor`'s value; read(begin, end) gives elements [begin, end) of the flattened
        value (1-D, any dtype)."""
        place = self._slot_of.get(id(tensor))
        if place is not None:
            self._write_laid_out(*place, read)
        elif is_partitioned(tensor):
            _write_init(tensor, read)
        else:
            value = read(0, tensor.numel()).view(tensor.shape).to(tensor.dtype)
            if tensor.is_meta:
                _fill_meta(tensor, value)  # a plain model built on the meta device
            else:
                tensor.copy_(value)

    def _write_laid_out(self, bucket, slot, read) -> None:
        shard_index = self.optimizer.layout.shard_of(self.optimizer.comm.rank)
        begin, end = bucket.layout.owned_range(shard_index)
        lo, hi = max(begin, slot.offset), min(end, slot.offset + slot.numel)
        with self.optimizer.resident(bucket, write=True):  # nvme: read, change, write back
            self._write_owned(bucket, slot, read, begin, lo, hi)

    def _write_owned(self, bucket, slot, read, begin: int, lo: int, hi: int) -> None:
        owned = None
        if self.optimizer.settings.stage < 3:  # every rank holds the whole parameter
            value = read(0, slot.numel)
            bucket.param_buffer[slot.offset : slot.offset + slot.numel].copy_(value)
            if lo < hi:
                owned = value[lo - slot.offset : hi - slot.offset]
        elif lo < hi:
            owned = read(lo - slot.offset, hi - slot.offset)
            bucket.param_shard[lo - begin : hi - begin].copy_(owned)
        if owned is not None and bucket.master is not None:
            bucket.master[lo - begin : hi - begin].copy_(owned)  # from the file's precision

    def check_at_rest(self) -> None:
        """Stage 3: refuse while a unit is gathered (its gathered copy would keep old values)."""
        gatherer = self.optimizer.gatherer if self.optimizer is not None else None
        if gatherer is None:
            return
        for unit in gatherer.units:
            if not unit.persistent and unit.state is not UnitState.SHARDED:
                raise RuntimeError(
                    f"rank {self.optimizer.comm.rank}: zero.load_pretrained while stage-3 unit "
                    f"'{unit.name}' is gathered (inside forward or backward, or inside "
                    "zero.GatheredParameters); call it between optimizer steps, outside them"
                )

    def finish(self) -> None:
        """Stage 3: gather the persistent unit's new values and release any other unit still
        gathered with old ones (ParamGatherer.refresh_gathered). Collective."""
        if self.optimizer is not None and self.optimizer.gatherer is not None:
            self.optimizer.gatherer.refresh_gathered()


def _refuse_model_parallel(optimizer) -> None:
    if optimizer.settings.model_parallel is not None:
        raise NotImplementedError(
            "Hugging Face checkpoints with tensor parallelism (mpu): each rank holds slices of "
            "full tensors; load or save the model without an mpu"
        )


def _write_init(param, read) -> None:
    """A zero.Init parameter: keep this rank's slice (a gathered one takes the whole value)."""
    shard = param.zero_shard
    if shard.gathered:
        param.data.copy_(read(0, shard.numel).view(shard.shape))
        return
    begin, end = shard.owned_range()
    shard.keep_owned(read(begin, end), param.dtype)
    if param.is_meta:
        _fill_meta(param, torch.empty(0, dtype=param.dtype, device=shard.home))


def _fill_meta(tensor, value) -> None:
    """Give a tensor on the meta device `value` (its dtype, on a real device) in place: the
    Parameter object, its attributes (zero_shard) and every reference to it stay (`.data =`
    cannot move a tensor off the meta device)."""
    attributes = dict(tensor.__dict__)
    if isinstance(tensor, torch.nn.Parameter):
        value = type(tensor)(value, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, value)
    tensor.__dict__.update(attributes)


def _targets(module: torch.nn.Module) -> list[_Target]:
    """Every parameter and persistent buffer, each once, under all its names, in module order."""
    found: dict[int, _Target] = {}
    named = list(module.named_parameters(remove_duplicate=False))
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                named.append((f"{prefix}.{name}" if prefix else name, buffer))
    for name, tensor in named:
        found.setdefault(id(tensor), _Target([], tensor)).names.append(name)
    return list(found.values())


def _renamer(module, names, file_keys):
    """file key -> model name, as transformers maps them: a checkpoint of the bare base model
    loads into a model with a head (base_model_prefix added) and the other way round."""
    prefix = getattr(module, "base_model_prefix", "") or ""
    dot = prefix + "."
    in_model = bool(prefix) and any(n.startswith(dot) for n in names)
    in_file = bool(prefix) and any(k.startswith(dot) for k in file_keys)
    if in_model and not in_file:
        return lambda key: dot + key if dot + key in names else key
    if in_file and not in_model:
        return lambda key: key[len(dot) :] if key.startswith(dot) else key
    return lambda key: key


def _not_ignored(keys: list, patterns) -> list:
    """`keys` without those a pattern of the model's _keys_to_ignore_on_load_* matches."""
    patterns = [re.compile(p) for p in patterns or ()]
    return [k for k in keys if not any(p.search(k) for p in patterns)]


def _match(module, targets, files: SafetensorsReader, places: _Places):
    """([(target, file key)], missing, unexpected, problems) for the model and the files."""
    names = {n: t for t in targets for n in t.names}
    rename = _renamer(module, names, files.keys)
    key_of, unexpected = {}, []
    for key in files.keys:
        name = rename(key)
        if name in names:
            key_of.setdefault(name, key)
        else:
            unexpected.append(key)
    pairs, missing, problems = [], [], []
    for target in targets:
        key = next((key_of[n] for n in target.names if n in key_of), None)
        if key is None:
            missing.append(target.names[0])
            continue
        shape = places.shape(target.tensor)
        if files.shape(key) != shape:
            problems.append(
                f"'{key}' has shape {files.shape(key)} in {files.file_of[key]}, "
                f"{shape} in the model ('{target.names[0]}')"
            )
        pairs.append((target, key))
    missing = _not_ignored(missing, getattr(module, "_keys_to_ignore_on_load_missing", None))
    ignored = getattr(module, "_keys_to_ignore_on_load_unexpected", None)
    return pairs, missing, _not_ignored(unexpected, ignored), problems


def _unwrap(model) -> torch.nn.Module:
    """An Engine's model (engine.module), or the model itself."""
    inner = getattr(model, "module", None)
    if isinstance(getattr(model, "optimizer", None), ZeroOptimizer) and inner is not None:
        return inner
    return model


def _on_every_rank(comm, device, what: str, action):
    """action() on every rank; when it raises on any rank, every rank raises (so no rank goes on
    to a collective another one never joins). Collective when `comm` spans several ranks."""
    if comm is None or comm.world_size == 1:
        return action()
    failed = torch.zeros(1, device=device)
    try:
        result = action()
    except Exception:
        failed += 1
        comm.all_reduce(failed, op="max")
        raise
    comm.all_reduce(failed, op="max")
    if failed.item():
        raise CheckpointError(f"rank {comm.rank}: another rank failed to {what}; see its error")
    return result


def load_pretrained(model, path, strict: bool = True) -> LoadResult:
    """Load a Hugging Face safetensors checkpoint into `model`, one tensor at a time.

    Args:
        model: a plain nn.Module, one built under zero.Init (before zero.initialize; parameters
            still on the meta device included), an Engine, or an engine's `engine.module`, at
            any ZeRO stage.
        path: a directory with model.safetensors or model.safetensors.index.json and its
            shards (as save_pretrained writes them), a .safetensors file, or an index file.
        strict: raise when the model and the files do not name the same tensors.

    Names map as transformers maps them: the model's base_model_prefix ("model.",
    "transformer.") is added to or removed from the file's names when only one side has it, a
    tied parameter (lm_head.weight = embed_tokens.weight) is satisfied by any of its names, and
    the model's _keys_to_ignore_on_load_missing / _unexpected patterns are honoured. Values are
    cast to each parameter's dtype; fp32 master weights take the file's values before any cast.
    Persistent buffers in the files are loaded too. Each rank reads only what it keeps ([Note:
    where a loaded value goes]); optimizer state is not touched (load before training).

    Returns LoadResult (missing and unexpected keys, bytes read on this rank). Raises
    CheckpointError (a ValueError) naming the files and keys when a file is unreadable, a shape
    differs, or (strict) keys are missing or unexpected, on every rank and before any tensor
    changes; ValueError for non-persistent buffers on the meta device (no file holds them);
    RuntimeError under stage 3 while a unit is gathered. Collective: every rank must call it
    (for an engine or a zero.Init model; a plain model is local).
    """
    module = _unwrap(model)
    places = _Places(module)
    comm, device = places.comm()
    enter(comm, "load_pretrained")

    def verify():
        places.check_at_rest()
        _refuse_meta_buffers(module, comm.rank if comm is not None else 0)
        files = SafetensorsReader(path)
        pairs, missing, unexpected, problems = _match(module, _targets(module), files, places)
        if strict:
            problems += [f"missing keys {listed(missing)}"] * bool(missing)
            problems += [f"unexpected keys {listed(unexpected)}"] * bool(unexpected)
        if problems:
            hint = ""
            if strict and missing and unexpected:
                hint = (
                    ". A checkpoint that transformers saved for this model class may hold tensors "
                    "in a layout it converts while loading (Mixtral's experts in transformers "
                    "5); load such a checkpoint with from_pretrained inside zero.Init (docs/hf.md)"
                )
            raise CheckpointError(
                f"{files.path} does not fit the model: {'; '.join(problems)}{hint}"
            )
        return files, pairs, missing, unexpected

    files, pairs, missing, unexpected = _on_every_rank(comm, device, f"verify {path}", verify)
    rank = comm.rank if comm is not None else 0
    # One file mapped at a time: its tensors in module order, then the next file's.
    first = {file: i for i, file in reversed(list(enumerate(files.file_of[k] for _, k in pairs)))}
    pairs.sort(key=lambda pair: first[files.file_of[pair[1]]])
    try:
        with torch.no_grad(), own_ops():
            for i, (target, key) in enumerate(progress(pairs, "load", rank=rank, unit="tensor")):
                if i and files.file_of[key] != files.file_of[pairs[i - 1][1]]:
                    files.close()
                places.write(target.tensor, lambda b, e, key=key: files.read(key, b, e))
    finally:
        files.close()
    places.finish()
    return LoadResult(missing, unexpected, files.bytes_read, files.largest_read)


def _refuse_meta_buffers(module, rank: int) -> None:
    names = [
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name, buffer in sub._buffers.items()
        if buffer is not None and buffer.is_meta and name in sub._non_persistent_buffers_set
    ]
    if names:
        raise ValueError(
            f"rank {rank}: non-persistent buffers {names[:5]} are on the meta device, and no "
            "checkpoint holds them (the model computes them, as rotary inv_freq): build the "
            "model with them on a real device (transformers' from_pretrained recomputes them)"
        )


# ----- export ---------------------------------------------------------------------------------
@dataclass
class _Piece:
    """Tensors written in turn: the slots of one bucket, each assembled from the owners'
    shards (`bucket`), or one tensor every rank holds whole (`tensor`)."""

    entries: list  # (name, shape, source dtype, offset in the bucket)
    bucket: object = None
    tensor: torch.Tensor = None


def _export_pieces(state, skip: set) -> list[_Piece]:
    """The model's tensors in the order they are written: laid-out buckets (trainable, then
    stage-3 frozen), then the other parameters and persistent buffers. Tied names: the first."""
    pieces = []
    laid_out = set()
    for bucket in laid_out_buckets(state.optimizer):
        source = bucket.master if bucket.master is not None else bucket.param_shard
        entries = [
            (slot.name, tuple(slot.shape), source.dtype, slot.offset)
            for slot in bucket.layout.slots
            if slot.name not in skip
        ]
        laid_out.update(id(p) for p in bucket.params)
        pieces.append(_Piece(entries, bucket=bucket))
    for target in _targets(state.module):
        tensor, name = target.tensor, target.names[0]
        if id(tensor) not in laid_out and name not in skip:
            pieces.append(_Piece([(name, tuple(tensor.shape), tensor.dtype, 0)], tensor=tensor))
    return pieces


def _piece_values(state, piece: _Piece):
    """Yields (name, value) of a piece's tensors one at a time on rank 0 (nothing elsewhere);
    a value is valid until the next one is asked for. A bucket's tensors are assembled from the
    owners' shards ([Note: export]): collective, every rank iterates to the end."""
    rank0 = state.comm.rank == 0
    if piece.tensor is not None:
        if rank0:
            yield piece.entries[0][0], piece.tensor
        return
    bucket = piece.bucket
    with state.optimizer.resident(bucket):  # nvme: master or shard read from its file
        source = bucket.master if bucket.master is not None else bucket.param_shard
        for name, shape, _, offset in piece.entries:
            value = slot_value(state, bucket.layout, source, offset, math.prod(shape))
            if rank0:
                yield name, value.view(shape)


def save_pretrained(state, save_dir, max_shard_size="5GB", dtype=None) -> str:
    """Engine.save_pretrained: see there. Returns the directory on every rank."""
    limit = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} must be positive (e.g. '5GB')")
    dtype = _export_dtype(dtype)
    _refuse_model_parallel(state.optimizer)
    enter(state.comm, "save_pretrained")
    save_dir = os.fspath(save_dir)
    skip = set(getattr(state.module, "_keys_to_ignore_on_save", None) or ())
    pieces = _export_pieces(state, skip)
    rank0 = state.comm.rank == 0
    tmp = save_dir.rstrip("/" + os.sep) + ".tmp"
    errors: list[Exception] = []

    def attempt(action):
        """Rank 0 writes; its first error stops the writing, not its collectives."""
        if rank0 and not errors:
            try:
                return action()
            except Exception as error:  # raised after every rank finished its all-gathers
                errors.append(error)
        return None

    entries = [
        (name, shape, dtype if src.is_floating_point else src)
        for piece in pieces
        for name, shape, src, _ in piece.entries
    ]
    writer = attempt(lambda: _start(tmp, entries, limit))
    for piece in progress(pieces, "save_pretrained", rank=state.comm.rank, unit="bucket"):
        for name, value in _piece_values(state, piece):
            attempt(lambda name=name, value=value: writer.write(name, value))
    attempt(lambda: _finish(state.module, writer, tmp, save_dir, dtype))
    failed = torch.tensor([float(bool(errors))], device=state.device)
    state.comm.all_reduce(failed, op="max")
    if errors:
        raise errors[0]
    if failed.item():
        raise CheckpointError(
            f"rank {state.comm.rank}: rank 0 failed to write {save_dir}; see its error"
        )
    return save_dir


def checkpoint_to_pretrained(
    checkpoint_dir, model, save_dir, tag=None, max_shard_size="5GB", dtype=None
) -> str:
    """Write a zero checkpoint (engine.save_checkpoint) in Hugging Face's layout, as
    engine.save_pretrained would have written the model at that step (zero-to-fp32 --hf).

    Args:
        checkpoint_dir, tag: a save_dir (its `latest` is followed, or `tag`) or a checkpoint
            directory itself.
        model: the model the checkpoint was saved from, built on the meta device: its names,
            shapes, ties, persistent buffers and config are read from it, no values.
        save_dir, max_shard_size, dtype: as Engine.save_pretrained (values are the fp32 master
            weights, frozen parameters and floating-point buffers, cast to `dtype`).

    One process, any machine, without the world size the checkpoint was saved with. Every file's
    crc32 is checked first; then one tensor is read and written at a time (ConsolidatedReader,
    ShardedWriter), so memory holds one tensor, never the model. A tied tensor is written once
    under its first name (transformers ties lm_head.weight again on load); non-persistent
    buffers the checkpoint holds (rotary inv_freq) are left out. Atomic as save_pretrained.
    Returns save_dir. Raises CheckpointError (a ValueError) naming the keys when the
    checkpoint's tensors do not fit the model (missing, unexpected, another shape), before
    anything is written; ValueError for a bad max_shard_size or dtype.
    """
    limit = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} must be positive (e.g. '5GB')")
    dtype = _export_dtype(dtype)
    reader = ConsolidatedReader(os.fspath(checkpoint_dir), tag)
    entries, sources = _checkpoint_entries(reader, model, dtype)
    save_dir = os.fspath(save_dir)
    tmp = save_dir.rstrip("/" + os.sep) + ".tmp"
    writer = _start(tmp, entries, limit)
    for (name, _, _), source in zip(progress(entries, "export", unit="tensor"), sources):
        writer.write(name, reader.read(source))
    _finish(model, writer, tmp, save_dir, dtype)
    return save_dir


def _checkpoint_entries(reader: ConsolidatedReader, model, dtype) -> tuple[list, list]:
    """([(name, shape, dtype)] to write, [the checkpoint's name of each]): every parameter and
    persistent buffer of `model` once, under its first name, in module order."""
    skip = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    entries, sources, used, problems = [], [], set(), []
    for target in _targets(model):
        names = [reader.ties.get(n, n) for n in target.names]
        found = next((n for n in names if n in reader), None)
        if found is None:
            problems.append(f"missing '{target.names[0]}'")
            continue
        used.add(found)
        shape = tuple(target.tensor.shape)
        if reader.shape(found) != shape:
            problems.append(f"'{found}' has shape {reader.shape(found)}, the model {shape}")
        if target.names[0] not in skip:
            saved = reader.dtype(found)
            entries.append((target.names[0], shape, dtype if saved.is_floating_point else saved))
            sources.append(found)
    used |= non_persistent_buffer_names(model)
    unexpected = [name for name in reader.names if name not in used]
    if unexpected:
        problems.append(f"unexpected {unexpected[:5]}" + " ..." * (len(unexpected) > 5))
    if problems:
        peft = any(name.startswith("base_model.model.") for name in reader.names)
        raise CheckpointError(
            f"{reader.path} does not fit {type(model).__name__}: {'; '.join(problems[:8])}"
            + (" (a peft model's checkpoint: merge its adapters, see docs/hf.md)" if peft else "")
        )
    return entries, sources


def _export_dtype(dtype) -> torch.dtype:
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16}
    names.update({"bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16})
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype in names:
        return names[dtype]
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return dtype
    raise ValueError(f"dtype={dtype!r}: use None (fp32), torch.float32, torch.bfloat16 or fp16")


def _start(tmp: str, entries: list, limit: int) -> ShardedWriter:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return ShardedWriter(tmp, entries, limit)


def _finish(module, writer: ShardedWriter, tmp: str, save_dir: str, dtype) -> None:
    """Close the shards, write config.json (and generation_config.json), carry the other files
    of an existing save_dir over (a tokenizer saved there stays), then swap the directories."""
    written = writer.close()
    written += _write_config(module, tmp, dtype)
    if os.path.isdir(save_dir):
        for name in os.listdir(save_dir):
            if name not in written and not is_weights_file(name):
                _link_or_copy(os.path.join(save_dir, name), os.path.join(tmp, name))
    publish_directory(tmp, save_dir)


def _write_config(module, directory: str, dtype) -> list[str]:
    """The model's config (transformers' PretrainedConfig) as config.json, recording the
    saved dtype and the model class as transformers' own save_pretrained does."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return []
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__]
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(directory)
    written = ["config.json"]
    generation = getattr(module, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(directory)
        written.append("generation_config.json")
    return written


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.isdir(src) and not os.path.islink(src):
        shutil.copytree(src, dst, symlinks=True)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


__all__ = [
    "INDEX_FILE",
    "LoadResult",
    "checkpoint_to_pretrained",
    "load_pretrained",
    "save_pretrained",
]
