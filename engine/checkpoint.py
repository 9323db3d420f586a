"""Sharded checkpoints: each rank writes what it owns, any world size reads them back.

Layout of one checkpoint, `save_dir/<tag>/`:

    meta.json               rank 0: format, config, world size, stage, parameter names/shapes,
                            the ranges each rank holds, counters, loss scaler, lr scheduler,
                            optimizer hyper-parameters, client_state, file sizes
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

[Note: atomic save]
Ranks write into `<tag>.tmp/`; success is agreed by an all-reduce; rank 0 then writes meta.json,
renames the directory to `<tag>` and replaces `latest` through a rename. A crash at any point
leaves the previous checkpoint and `latest` untouched.
"""

import json
import logging
import os
import random
import shutil
from collections.abc import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .progress import progress

logger = logging.getLogger("zero")

FORMAT = "zero-checkpoint/1"
META, MODULE_FILE, LATEST = "meta.json", "module.safetensors", "latest"


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


# ----- save -----------------------------------------------------------------------------------
def save(engine, save_dir: str, tag: str | None, client_state: Mapping, save_latest: bool) -> str:
    """Write a checkpoint; see Engine.save_checkpoint. Returns the checkpoint directory."""
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    _check_json(client_state, "client_state")
    tag = _agree_on_tag(engine, tag)
    scheduler_state = _scheduler_state(engine)
    final = os.path.join(save_dir, tag)
    tmp = final + ".tmp"
    if engine.comm.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    engine.comm.barrier()
    # Stage 3 partitions frozen parameters too: rank 0 gathers them for module.safetensors.
    frozen = engine.frozen.full_values() if engine.frozen is not None else {}
    _on_every_rank(engine, f"write {tmp}", lambda: _write_files(engine, tmp, frozen))
    if engine.comm.rank == 0:
        meta = _meta(engine, tag, dict(client_state), scheduler_state, tmp)
        _write_json(os.path.join(tmp, META), meta)
        publish_directory(tmp, final)
        if save_latest:
            _write_text_atomic(os.path.join(save_dir, LATEST), tag)
    engine.comm.barrier()
    return final


def _on_every_rank(engine, what: str, action):
    """Run action() on every rank; when it fails on any rank, every rank raises, so no rank
    goes on to a collective the failed one will never join. Collective."""
    failed = torch.zeros(1)
    try:
        result = action()
    except Exception:
        failed += 1
        engine.comm.all_reduce(failed, op="max")
        raise
    engine.comm.all_reduce(failed, op="max")
    if failed.item():
        raise CheckpointError(
            f"rank {engine.comm.rank}: another rank failed to {what}; see its error"
        )
    return result


def _write_files(engine, directory: str, frozen: dict) -> None:
    _write_rank_file(engine, directory)
    if engine.comm.rank == 0:
        _write_module_file(engine, directory, frozen)


def _check_tag(tag: str) -> None:
    """A tag is a plain directory name that cannot collide with zero's own files."""
    reserved = tag in (".", "..", LATEST) or tag.endswith((".tmp", ".old"))
    if not tag or reserved or "/" in tag or os.sep in tag:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not a plain directory name (no '/', not '.', '..' or "
            f"'{LATEST}', not ending in '.tmp' or '.old')"
        )


def _agree_on_tag(engine, tag: str) -> str:
    """Every rank saves under rank 0's tag. A rank whose own tag differs is reported as
    checkpoint.tag_validation says: Warn (log, go on), Fail (CheckpointError on every rank) or
    Ignore. Raises CheckpointError for a tag that is not a plain directory name."""
    _check_tag(tag)
    if engine.comm.world_size == 1:
        return tag
    encoded = torch.zeros(256, dtype=torch.uint8)
    raw = tag.encode()[:256]
    encoded[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    engine.comm.broadcast(encoded, src=0)
    chosen = bytes(encoded[encoded != 0].tolist()).decode()
    differs = torch.tensor([float(chosen != tag)])
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


def _write_rank_file(engine, directory: str) -> None:
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
                # the end); a prefix view is written without a copy.
                tensors[f"group{group}.master.{index}"] = bucket.master[: hi - lo].float().cpu()
                for kind in kinds:
                    value = state[bucket.master][kind][: hi - lo]
                    tensors[f"group{group}.{kind}.{index}"] = value.float().cpu()
    _save_safetensors(tensors, os.path.join(directory, rank_file(engine.comm.rank)))


def _write_module_file(engine, directory: str, frozen: dict) -> None:
    """module.safetensors: frozen and empty parameters and buffers; `frozen` maps id(param) to
    the full value of a stage-3 partitioned frozen parameter."""
    laid_out = _laid_out_ids(engine)
    tensors, seen = {}, set()
    for name, tensor in _module_tensors(engine.module):
        if id(tensor) in laid_out or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[name] = frozen.get(id(tensor), tensor).detach().cpu().contiguous()
    _save_safetensors(tensors, os.path.join(directory, MODULE_FILE))


def _module_tensors(module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _save_safetensors(tensors: dict, path: str) -> None:
    save_file(tensors, path)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # as any file the user creates (safetensors writes 0600)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _meta(engine, tag: str, client_state: dict, scheduler_state, directory: str) -> dict:
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
            [
                {"name": s.name, "shape": list(s.shape)}
                for b in _group_buckets(engine, g)
                for s in b.layout.slots
            ]
            for g in range(engine.optimizer.layout.num_groups)
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
        "files": {f: os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)},
    }


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


def _write_json(path: str, value) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def publish_directory(tmp: str, final: str) -> None:
    """Move the finished directory into place; an existing checkpoint of the same tag is replaced
    only after the new one is complete."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    dir_fd = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# ----- load -----------------------------------------------------------------------------------
def resolve(load_dir: str, tag: str | None) -> str:
    """The checkpoint directory for `tag`, or the one `latest` names. Raises CheckpointError."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"{latest} does not exist; pass tag= or save with save_latest")
        with open(latest) as handle:
            tag = handle.read().strip()
    _check_tag(tag)
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, META)):
        raise CheckpointError(f"{os.path.join(path, META)} does not exist: not a zero checkpoint")
    return path


def read_meta(path: str) -> dict:
    """Read and verify meta.json and the presence and size of every file it lists."""
    meta_path = os.path.join(path, META)
    try:
        with open(meta_path) as handle:
            meta = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{meta_path}: unreadable ({error})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
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
    rank files that hold it, touching only the overlapping slices."""

    def __init__(self, path: str, meta: dict):
        self.path = path
        self.pieces: dict[str, list[tuple[int, int, int, str]]] = {}
        for rank, groups in meta["ranks"].items():
            for group, ranges in groups.items():
                for index, (lo, hi) in enumerate(ranges):
                    self.pieces.setdefault(group, []).append((lo, hi, index, rank_file(int(rank))))
        self._handles: dict[str, object] = {}

    def _overlaps(self, group: int, kind: str, begin: int, end: int):
        """(a, b, piece_lo, file, key) for each saved piece overlapping [begin, end); raises
        CheckpointError when a tensor is missing, has the wrong size, or elements are uncovered."""
        covered, out = 0, []
        for lo, hi, index, file in self.pieces.get(str(group), []):
            a, b = max(lo, begin), min(hi, end)
            if a >= b:
                continue
            key = f"group{group}.{kind}.{index}"
            handle = self._handle(file)
            if key not in handle.keys() or handle.get_slice(key).get_shape() != [hi - lo]:
                raise CheckpointError(
                    f"{os.path.join(self.path, file)}: tensor '{key}' is missing or not of "
                    f"{hi - lo} elements"
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
        self._overlaps(group, kind, begin, end)

    def read_into(self, group: int, kind: str, begin: int, out: torch.Tensor) -> None:
        """Fill `out` (1-D, fp32) with elements [begin, begin + out.numel())."""
        end = begin + out.numel()
        for a, b, lo, file, key in self._overlaps(group, kind, begin, end):
            out[a - begin : b - begin].copy_(self._handle(file).get_slice(key)[a - lo : b - lo])

    def read(self, group: int, kind: str, begin: int, end: int) -> torch.Tensor:
        out = torch.empty(end - begin, dtype=torch.float32)
        self.read_into(group, kind, begin, out)
        return out

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = _open(self.path, file)
        return self._handles[file]


def _layout_problems(meta: dict, engine) -> list[str]:
    """Differences between the saved trained parameters (names, shapes, order) and the engine's."""
    saved = [[(p["name"], tuple(p["shape"])) for p in group] for group in meta["groups"]]
    current = [
        [(s.name, s.shape) for b in _group_buckets(engine, g) for s in b.layout.slots]
        for g in range(engine.optimizer.layout.num_groups)
    ]
    if saved == current:
        return []
    saved_all = {n: s for g in saved for n, s in g}
    current_all = {n: s for g in current for n, s in g}
    return _differences(saved_all, current_all) or [
        "the trained parameters are grouped or ordered differently (same optimizer param groups "
        "are needed)"
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
    path, meta, reader, owned, kinds, module_values = _on_every_rank(
        engine,
        f"verify the checkpoint in {load_dir}",
        lambda: _verify(engine, load_dir, tag, strict, load_optimizer),
    )
    rng = _read_rng(path, meta, engine.comm.rank)
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


def _verify(engine, load_dir, tag, strict, load_optimizer):
    """Resolve, read metadata, and check every file, key and range this rank will read."""
    path = resolve(load_dir, tag)
    meta = read_meta(path)
    laid_out = _laid_out_ids(engine)
    module_values, module_problems = _read_module_file(path, engine, laid_out, strict)
    problems = [f"{META}: {p}" for p in _layout_problems(meta, engine)] + module_problems
    if problems:
        raise CheckpointError(f"{path} does not fit the model: {'; '.join(problems)}")
    current = optimizer_name(engine.optimizer.optimizer)
    if load_optimizer and meta["optimizer"] != current:
        raise CheckpointError(
            f"{os.path.join(path, META)}: optimizer {meta['optimizer']!r} was saved, this run uses "
            f"{current!r}; pass load_optimizer_states=False to load the weights only"
        )
    kinds = ["master"] + (meta["sharded_state"] if load_optimizer else [])
    reader = GroupReader(path, meta)
    shard = engine.optimizer.layout.shard_of(engine.comm.rank)
    owned = [
        (group, lo, hi, bucket)
        for group, ranges in owned_ranges(engine.optimizer.buckets, shard).items()
        for lo, hi, bucket in ranges
    ]
    for group, lo, hi, _ in owned:
        for kind in kinds:
            reader.check(group, kind, lo, hi)
    _read_rng(path, meta, engine.comm.rank)
    return path, meta, reader, owned, kinds, module_values


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
    values = [
        (tensor, handle.get_tensor(name)) for name, tensor in targets.items() if name in saved
    ]
    return values, [f"{MODULE_FILE}: {p}" for p in problems]


def _read_rng(path, meta, rank):
    if str(rank) not in meta["ranks"]:
        return None
    return _open(path, rank_file(rank)).get_tensor("rng.torch_cpu")


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _read_shards(engine, meta, reader, owned, kinds, load_optimizer: bool) -> None:
    state = engine.optimizer.optimizer.state
    for group, lo, hi, bucket in progress(owned, "load", rank=engine.global_rank, unit="range"):
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
                    value = torch.tensor(value, dtype=getattr(torch, item["tensor"][6:]))
                state.setdefault(bucket.master, {})[key] = value


def _read_to_device(reader, group: int, kind: str, begin: int, target: torch.Tensor) -> None:
    if target.device.type == "cpu" and target.dtype == torch.float32:
        reader.read_into(group, kind, begin, target)
    else:
        target.copy_(reader.read(group, kind, begin, begin + target.numel()))


def _apply_training_state(engine, meta, load_optimizer: bool, load_scheduler: bool) -> None:
    if load_optimizer:
        for group, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
            for key, value in saved.items():
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        engine.scaler.load_state_dict(meta["loss_scaler"])
    if load_scheduler and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    for key, value in meta["counters"].items():
        setattr(engine, key, value)


# ----- consolidation --------------------------------------------------------------------------
def consolidate(checkpoint_dir: str, tag: str | None = None, state: str = "master") -> dict:
    """Full fp32 state dict of a checkpoint, in one process, without the original world size.

    Args:
        checkpoint_dir: a save_dir (its `latest` is followed) or a checkpoint directory itself.
        state: "master" for the weights, or an optimizer state kind such as "exp_avg" (then only
            trained parameters are returned).

    Returns name -> tensor for every parameter and buffer of the model (tied names included, as
    equal copies), with padding removed; master weights are bitwise the saved fp32 values;
    frozen parameters and floating-point buffers are cast to fp32. Raises CheckpointError.
    """
    if os.path.isfile(os.path.join(checkpoint_dir, META)):
        path = checkpoint_dir
    else:
        path = resolve(checkpoint_dir, tag)
    meta = read_meta(path)
    reader = GroupReader(path, meta)
    out = {}
    for group, params in enumerate(meta["groups"]):
        total = sum(_numel(p["shape"]) for p in params)
        flat = reader.read(group, state, 0, total)
        offset = 0
        for p in progress(params, f"consolidate group {group}", unit="tensor"):
            n = _numel(p["shape"])
            out[p["name"]] = flat[offset : offset + n].view(p["shape"]).clone()
            offset += n
    if state == "master":
        handle = _open(path, MODULE_FILE)
        for name in handle.keys():
            value = handle.get_tensor(name)
            out[name] = value.float() if value.is_floating_point() else value
    for alias, canonical in meta["ties"].items():
        if canonical in out:
            out[alias] = out[canonical].clone()
    return out


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
