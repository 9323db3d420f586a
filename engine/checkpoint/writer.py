"""Writing a checkpoint: each rank writes what it owns, rank 0 writes meta.json last.

Owns: save, the checks of its inputs made on every rank before anything is written (tag,
client_state, lr scheduler state, an accumulation boundary, the data loader's state), and the
contents of the rank files (their per-rank state through rank_state.py), module.safetensors and
meta.json. The files are written and published through files.py ([Note: crash-safe
publication]); the ranks agree on every step through agreement.py.
"""

import contextlib
import json
import logging
import os
from collections.abc import Mapping

import torch

from ..progress import progress
from . import rank_state
from .agreement import _on_every_rank, _on_rank_0, _share_text, enter
from .client_state import encode as encode_client_state
from .files import (
    _create_json,
    _fsync_dir,
    _remove,
    _remove_stale,
    _write_shard,
    _write_text_atomic,
    publish_directory,
)
from .format import (
    FORMAT,
    LATEST,
    LAYOUT_METADATA,
    META,
    MODULE_FILE,
    CheckpointError,
    _check_tag,
    _jsonable,
    holds_gradients,
    layout_digest,
    optimizer_name,
    rank_file,
)
from .ownership import _group_slots, _laid_out_ids, _module_tensors, _written_shard, owned_ranges

logger = logging.getLogger("zero")


def save(
    state,
    save_dir: str,
    tag: str | None,
    client_state: Mapping,
    save_latest: bool,
    exclude_frozen: bool = False,
) -> str:
    """Write a checkpoint of the training state `state` (state.TrainingState); see
    Engine.save_checkpoint. Returns the checkpoint directory.

    `exclude_frozen` leaves the frozen parameters (requires_grad=False) out of module.safetensors
    and lists their names in meta.json's `excluded_frozen` ([Note: frozen parameters left out]).

    Collective: every rank calls it with the same exclude_frozen (RankMismatchError
    otherwise). Raises CheckpointError on every rank (before anything is written) for a bad tag
    or client_state, a data loader state a checkpoint cannot hold, or a save while the optimizer
    holds accumulated gradients ([Note: saved at an accumulation boundary] in format.py); and on
    every rank when any rank fails to write (the failing rank raises its own error); the
    previous checkpoint and `latest` stay as they were then.
    """
    _refuse_excluded_trainable(state, exclude_frozen)
    enter(state.comm, "save_checkpoint", int(exclude_frozen))
    tag = tag if tag is not None else f"global_step{state.counters.global_steps}"
    scheduler_state, loader_state, client_state = _on_every_rank(
        state,
        "check the checkpoint tag and state",
        lambda: _check_inputs(state, tag, client_state),
    )
    tag = _agree_on_tag(state, tag)
    final = os.path.join(save_dir, tag)
    tmp = final + ".tmp"
    _on_rank_0(state, f"prepare {tmp}", lambda: _prepare(save_dir, tag))
    try:
        excluded = dict(_frozen_params(state)) if exclude_frozen else None
        # Stage 3 partitions frozen parameters too: rank 0 gathers them for module.safetensors
        # (unless they are all left out).
        gather = state.frozen is not None and not exclude_frozen
        frozen = state.frozen.full_values() if gather else {}
        digest = layout_digest(_layout(state, excluded))
        written = _on_every_rank(
            state,
            f"write {tmp}",
            lambda: _write_files(state, tmp, frozen, excluded or {}, loader_state, digest),
        )
        files, crcs = _gather_files(state, written)

        def publish():
            meta = _meta(state, tag, client_state, scheduler_state, files, crcs, excluded)
            _finish(meta, save_dir, tag, save_latest)

        _on_rank_0(state, f"publish {final}", publish)
    except Exception:
        if state.comm.rank == 0:
            with contextlib.suppress(OSError):
                _remove(tmp)  # the next save would remove it too
        raise
    return final


def _refuse_excluded_trainable(state, exclude_frozen: bool) -> None:
    """NotImplementedError, before any collective, for exclude_frozen_parameters=True on a
    stage-3 engine without an optimizer whose parameters require grad: only such an engine
    partitions trainable parameters outside its optimizer, and the writer gathers those only
    when it leaves none of them out."""
    shards = state.frozen.buckets if state.frozen is not None else []
    if exclude_frozen and any(p.requires_grad for b in shards for p in b.params):
        raise NotImplementedError(
            f"rank {state.comm.rank}: save_checkpoint(exclude_frozen_parameters=True) on a "
            "stage-3 engine built without an optimizer whose parameters require grad; save "
            "without exclude_frozen_parameters (every parameter is then written)"
        )


def _check_inputs(state, tag, client_state: Mapping):
    """This rank's checks before anything is written; returns the lr scheduler's state, the
    data loader's (None, or its encoded state_dict() and tensors) and client_state as meta.json
    holds it (client_state.py)."""
    _check_tag(tag)
    _refuse_mid_accumulation(state)
    encoded = encode_client_state(client_state)
    _check_json_size(encoded, "client_state")
    return _scheduler_state(state), rank_state.encode_loader(state), encoded


def _refuse_mid_accumulation(state) -> None:
    """[Note: saved at an accumulation boundary] in format.py: CheckpointError while the
    optimizer holds gradients that no step has used yet."""
    if not holds_gradients(state):
        return
    gas = state.config.gradient_accumulation_steps
    raise CheckpointError(
        f"rank {state.comm.rank}: save_checkpoint between the micro-batches of a gradient "
        f"accumulation cycle (gradient_accumulation_steps={gas}, micro_steps="
        f"{state.counters.micro_steps}): this rank holds the gradients accumulated since the last "
        "optimizer step, which a checkpoint does not carry, so a run resumed from it would step "
        "without them. Call save_checkpoint after engine.step() at the accumulation boundary "
        f"(after the step that ends each cycle of {gas} micro-batches)"
    )


def _finish(meta: dict, save_dir: str, tag: str, save_latest: bool) -> None:
    """Rank 0: meta.json last, then publication ([Note: crash-safe publication] in files.py)."""
    tmp = os.path.join(save_dir, tag + ".tmp")
    _create_json(os.path.join(tmp, META), meta)
    _fsync_dir(tmp)
    publish_directory(tmp, os.path.join(save_dir, tag))
    if save_latest:
        _write_text_atomic(os.path.join(save_dir, LATEST), tag)


def _prepare(save_dir: str, tag: str) -> None:
    """Rank 0: remove what interrupted saves left in save_dir, and create `<tag>.tmp/`."""
    os.makedirs(save_dir, exist_ok=True)
    _remove_stale(save_dir, tag)
    os.mkdir(os.path.join(save_dir, tag + ".tmp"))


def _agree_on_tag(state, tag: str) -> str:
    """Every rank saves under rank 0's tag. A rank whose own tag differs is reported as
    checkpoint.tag_validation says: Warn (log, go on), Fail (CheckpointError on every rank) or
    Ignore. Every rank's tag has passed _check_tag. Collective."""
    if state.comm.world_size == 1:
        return tag
    chosen = _share_text(state, tag, src=0)  # a checked tag fits the message buffer whole
    differs = torch.tensor([float(chosen != tag)], device=state.device)
    state.comm.all_reduce(differs, op="max")
    mode = state.config.checkpoint.tag_validation
    if differs.item() and mode != "Ignore":
        message = (
            f"rank {state.comm.rank}: ranks passed different checkpoint tags (this rank {tag!r}, "
            f"rank 0 {chosen!r}); pass the same tag on every rank (checkpoint.tag_validation)"
        )
        if mode == "Fail":
            raise CheckpointError(message)
        logger.warning("%s; saving under %r", message, chosen)
    return chosen


# The most bytes of client_state as JSON: half of what read_meta accepts beside any tensor files
# ([Note: meta.json size bound] in reader.py), so that every checkpoint saved can be loaded.
CLIENT_STATE_BYTES = 8 << 20


def _check_json_size(value, what: str) -> None:
    size = len(json.dumps(value, allow_nan=True))
    if size > CLIENT_STATE_BYTES:
        raise CheckpointError(
            f"{what} takes {size:,} bytes as JSON, over the {CLIENT_STATE_BYTES >> 20} MiB a "
            "checkpoint's meta.json keeps for it (a larger meta.json is refused on load as "
            "damaged); write large data to a file of your own beside the checkpoint and put its "
            "name in client_state"
        )


def _scheduler_state(state):
    if state.lr_scheduler is None:
        return None
    scheduler_state = state.lr_scheduler.state_dict()
    try:
        json.dumps(scheduler_state, allow_nan=True)
    except (TypeError, ValueError):
        raise CheckpointError(
            f"the lr scheduler {type(state.lr_scheduler).__name__} has a state_dict that is not "
            "JSON-serializable; use a scheduler from the config or one with plain state"
        ) from None
    return scheduler_state


def _write_files(
    state, directory: str, frozen: dict, excluded: dict, loader_state, digest: str
) -> dict:
    """Each rank its rank file, rank 0 also module.safetensors; `digest`: layout_digest of
    meta.json's layout, recorded in every file ([Note: the layout bound to the bytes])."""
    path = os.path.join(directory, rank_file(state.comm.rank))
    tensors, metadata = rank_file_tensors(state, loader_state, False, digest)
    written = {rank_file(state.comm.rank): _write_shard(tensors, path, metadata)}
    if state.comm.rank == 0:
        tensors = module_file_tensors(state, frozen, excluded, snapshot=False)
        path = os.path.join(directory, MODULE_FILE)
        written[MODULE_FILE] = _write_shard(tensors, path, {LAYOUT_METADATA: digest})
    return written


def _gather_files(state, written: dict) -> tuple[dict, dict]:
    """(name -> size in bytes, name -> crc32) of every rank's files, from the (size, crc32)
    each rank measured of the files it wrote; complete on rank 0. Collective."""
    rank = state.comm.rank
    table = torch.zeros(state.comm.world_size, 4, dtype=torch.int64)
    for column, name in enumerate((rank_file(rank), MODULE_FILE)):
        if name in written:
            size, crc = written[name]
            table[rank, 2 * column : 2 * column + 2] = torch.tensor([size, int(crc, 16)])
    table = table.to(state.device)
    state.comm.all_reduce(table)
    files, crcs = {}, {}
    for r, (size, crc, module_size, module_crc) in enumerate(table.tolist()):
        files[rank_file(r)], crcs[rank_file(r)] = size, f"{crc:08x}"
        if r == 0:
            files[MODULE_FILE], crcs[MODULE_FILE] = module_size, f"{module_crc:08x}"
    return files, crcs


def _sharded_state_keys(state) -> list[str]:
    """Optimizer state entries shaped like the master shard (Adam: exp_avg, exp_avg_sq)."""
    keys: set[str] = set()
    for bucket in state.optimizer.buckets:
        for key, value in state.optimizer.optimizer.state.get(bucket.master, {}).items():
            if torch.is_tensor(value) and value.shape == bucket.master.shape and value.dim():
                keys.add(key)
    return sorted(keys)


def rank_file_tensors(state, loader_state, snapshot: bool, digest: str) -> tuple[dict, dict]:
    """(tensors, metadata) of this rank's rank<r>.safetensors: its shards and its per-rank state
    ([Note: per-rank state] in format.py), and `digest` ([Note: the layout bound to the bytes]).
    `snapshot`: every tensor is a host copy that later training does not change (periodic.py
    writes it from a thread); otherwise a CPU master shard is written from its own memory,
    without a copy."""
    tensors, metadata = rank_state.capture(state.device, loader_state)
    metadata = {**(metadata or {}), LAYOUT_METADATA: digest}
    shard = _written_shard(state.optimizer.layout, state.comm.rank)
    if shard is None:
        return tensors, metadata
    opt_state = state.optimizer.optimizer.state
    kinds = _sharded_state_keys(state)
    for group, ranges in owned_ranges(state.optimizer.buckets, shard).items():
        bar = progress(ranges, f"save group {group}", rank=state.global_rank, unit="bucket")
        for index, (lo, hi, bucket) in enumerate(bar):
            # The owned, unpadded part of a bucket is the head of its shard (padding is at
            # the end); a prefix view is written without a copy, except of nvme state
            # (engine/offload/nvme.py), whose host buffer is reused for the next bucket.
            offloader = state.optimizer.offloader
            swapped = offloader is not None and offloader.swapped(bucket)
            with state.optimizer.resident(bucket):
                values = {"master": bucket.master[: hi - lo]}
                values.update({kind: opt_state[bucket.master][kind][: hi - lo] for kind in kinds})
                for kind, value in values.items():
                    key = f"group{group}.{kind}.{index}"
                    tensors[key] = _host_value(value, snapshot or swapped)
    return tensors, metadata


def _host_value(value, copy: bool):
    """`value` as fp32 on the host; `copy`: in memory of its own. A device tensor goes through
    pinned memory without waiting (the caller synchronizes the device before reading it)."""
    if value.device.type == "cpu":
        value = value.float()
        return value.clone() if copy else value
    if not copy:
        return value.float().cpu()
    host = torch.empty(value.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(value, non_blocking=True)
    return host


def module_file_tensors(state, frozen: dict, excluded: dict, snapshot: bool) -> dict:
    """The tensors of module.safetensors: frozen and empty parameters and buffers; `frozen` maps
    id(param) to the full value of a stage-3 partitioned frozen parameter; the parameters of
    `excluded` (name -> frozen parameter) are left out. `snapshot`: host copies that later
    training does not change."""
    laid_out = _laid_out_ids(state)
    seen = {id(param) for param in excluded.values()}
    tensors = {}
    for name, tensor in _module_tensors(state.module):
        if id(tensor) in laid_out or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        value = frozen.get(id(tensor), tensor).detach()
        on_host = value.device.type == "cpu"
        value = value.cpu().contiguous()
        tensors[name] = value.clone() if snapshot and on_host else value
    return tensors


def _meta(
    state, tag: str, client_state: dict, scheduler_state, files: dict, crcs: dict, excluded
) -> dict:
    """meta.json's contents; `excluded`: name -> frozen parameter left out of the checkpoint, or
    None when the save did not ask for that (then meta.json has no `excluded_frozen`)."""
    optimizer = state.optimizer.optimizer
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {
        "format": FORMAT,
        "tag": tag,
        "config": state.config.to_dict(),
        "stage": state.config.zero.stage,
        "compute_dtype": str(state.config.compute_dtype).replace("torch.", ""),
        **_layout(state, excluded),
        "optimizer": optimizer_name(state.optimizer.optimizer),
        "sharded_state": _sharded_state_keys(state),
        "scalar_state": _scalar_state(state),
        "param_groups": _jsonable(groups),
        "counters": state.counters.state_dict(),
        "loss_scaler": state.scaler.state_dict(),
        "lr_scheduler": scheduler_state,
        "client_state": client_state,
        "files": files,
        "crc32": crcs,
        "at_accumulation_boundary": True,  # save refused otherwise
    }


def _layout(state, excluded) -> dict:
    """meta.json's LAYOUT_KEYS ([Note: the layout bound to the bytes]), the same on every rank:
    each rank computes it to record its digest in its own file. `excluded` as in _meta."""
    left_out = {id(param) for param in (excluded or {}).values()}
    ranks = {}
    for rank in range(state.comm.world_size):
        shard = _written_shard(state.optimizer.layout, rank)
        ranges = {} if shard is None else owned_ranges(state.optimizer.buckets, shard)
        ranks[str(rank)] = {str(g): [[lo, hi] for lo, hi, _ in r] for g, r in ranges.items()}
    layout = {
        "world_size": state.comm.world_size,
        "groups": [
            [{"name": s.name, "shape": list(s.shape)} for s in slots]
            for slots in _group_slots(state)
        ],
        "ties": _ties(state.module, left_out),
        "ranks": ranks,
        "frozen": [name for name, param in _frozen_params(state) if id(param) not in left_out],
    }
    if excluded is not None:
        layout["excluded_frozen"] = list(excluded)
    return layout


def _frozen_params(state) -> list[tuple[str, object]]:
    """(first name, parameter) of each frozen parameter (requires_grad=False), each once: those
    ZeRO does not lay out as trained, which module.safetensors holds unless left out."""
    laid_out, seen, frozen = _laid_out_ids(state), set(), []
    for name, param in state.module.named_parameters(remove_duplicate=False):
        if id(param) in laid_out or id(param) in seen:
            continue
        seen.add(id(param))
        if not param.requires_grad:
            frozen.append((name, param))
    return frozen


def _ties(module, excluded_ids=frozenset()) -> dict[str, str]:
    """Names that alias another parameter or buffer: alias -> the first (canonical) name; tensors
    whose id is in `excluded_ids` (left out of the checkpoint) have none."""
    first: dict[int, str] = {}
    ties = {}
    for name, tensor in _module_tensors(module):
        if id(tensor) in excluded_ids:
            continue
        if id(tensor) in first:
            ties[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return ties


def _scalar_state(state) -> dict:
    """Per param group, the optimizer state that is not per element (Adam's step count)."""
    out = {}
    opt_state = state.optimizer.optimizer.state
    for bucket in state.optimizer.buckets:
        group = str(bucket.layout.group)
        for key, value in opt_state.get(bucket.master, {}).items():
            if torch.is_tensor(value) and value.dim() == 0:
                out.setdefault(group, {})[key] = {"tensor": str(value.dtype), "value": value.item()}
            elif not torch.is_tensor(value):
                out.setdefault(group, {})[key] = {"tensor": None, "value": _jsonable(value)}
    return out
