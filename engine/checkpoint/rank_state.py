"""What each rank saves of its own besides its shards: random number generators, data loader.

Owns: capturing this rank's generators (torch CPU, the device's, Python's random, NumPy's global
RandomState) and its data loader's state_dict() into its rank file, reading them back checked,
and applying them: rank r takes what rank r saved; a generator no rank r saved is derived
([Note: RNG of a rank that saved none]); a data loader takes rank 0's state when rank r saved
none. The layout in the rank file is [Note: per-rank state] in format.py.
"""

import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from ..accelerator import get_accelerator
from ..errors import listed
from .format import (
    LOADER_METADATA,
    LOADER_TENSORS,
    RNG_METADATA,
    CheckpointError,
    _as_tuple,
    _decode_state,
    _encode_state,
    _jsonable,
    _RankRng,
    _tensor_refs,
    numpy_state_tuple,
    rank_file,
)

logger = logging.getLogger("zero")


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


# ----- save -----------------------------------------------------------------------------------
def encode_loader(training):
    """(JSON value, tensors) of the engine's stateful data loader's state_dict(), or None.
    Raises CheckpointError naming the entry a checkpoint cannot hold."""
    loader = training.stateful_loader()
    if loader is None:
        return None
    return _encode_state(
        loader.state_dict(), LOADER_TENSORS, "engine.training_dataloader.state_dict()"
    )


def capture(device: torch.device, loader) -> tuple[dict, dict]:
    """(tensors, metadata) of this rank's generators and of `loader` (encode_loader's value).
    Not a collective."""
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if device.type != "cpu":
        tensors[f"rng.torch_{device.type}"] = get_accelerator().get_rng_state(device.index)
    numpy, numpy_state = _numpy(), None
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        numpy_state = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    rng = {"python": _jsonable(random.getstate()), "numpy": numpy_state}
    metadata = {RNG_METADATA: json.dumps(rng)}
    if loader is not None:
        encoded, loader_tensors = loader
        metadata[LOADER_METADATA] = json.dumps(encoded)
        tensors.update(loader_tensors)
    return tensors, metadata


# ----- load -----------------------------------------------------------------------------------
@dataclass
class RankState:
    """What a load applies to this rank; None: not saved for this rank (derived or kept)."""

    torch_cpu: torch.Tensor | None = None
    device: torch.Tensor | None = None
    python: list | None = None
    numpy: list | None = None
    loader: object = None
    loader_rank: int | None = None  # whose saved loader state `loader` is


def files_to_read(meta: dict, rank: int, wants_loader: bool) -> set[str]:
    """The rank files read() opens for `rank` (for the checksum pass)."""
    if str(rank) in meta["ranks"]:
        return {rank_file(rank)}
    return {rank_file(0)} if wants_loader else set()


def read(path: str, meta: dict, training, wants_loader: bool, open_file) -> RankState:
    """This rank's saved state, checked: tensors of the right dtype and length, metadata JSON
    that the generators accept. `open_file(path, name)` opens a safetensors file. Raises
    CheckpointError naming the file and the key. Not a collective."""
    rank, state = training.comm.rank, RankState()
    if str(rank) in meta["ranks"]:
        handle, file = open_file(path, rank_file(rank)), os.path.join(path, rank_file(rank))
        state.torch_cpu = _u8(handle, file, "rng.torch_cpu", torch.get_rng_state())
        device = training.device
        if device.type != "cpu" and f"rng.torch_{device.type}" in handle.keys():
            current = get_accelerator().get_rng_state(device.index)
            state.device = _u8(handle, file, f"rng.torch_{device.type}", current)
        metadata = handle.metadata() or {}
        if RNG_METADATA in metadata:
            try:
                rng = _RankRng.model_validate_json(metadata[RNG_METADATA])
            except ValidationError as error:
                item = error.errors()[0]
                where = ".".join(str(part) for part in item["loc"])
                raise CheckpointError(
                    f"{file}: metadata '{RNG_METADATA}'{f' key {where!r}' if where else ''}: "
                    f"{item['msg']}"
                ) from None
            state.python, state.numpy = rng.python, rng.numpy
        elif rank == 0:
            state.python = meta["python_rng"]  # older versions: rank 0's, in meta.json
    if wants_loader:
        state.loader_rank = rank if str(rank) in meta["ranks"] else 0
        state.loader = _read_loader(path, state.loader_rank, open_file)
    return state


def _u8(handle, file: str, key: str, current: torch.Tensor) -> torch.Tensor:
    expected = list(current.shape)
    saved = handle.get_slice(key) if key in handle.keys() else None
    if saved is None or (saved.get_dtype(), saved.get_shape()) != ("U8", expected):
        found = "missing" if saved is None else f"{saved.get_dtype()} {saved.get_shape()}"
        raise CheckpointError(f"{file}: tensor '{key}' is {found}, expected U8 {expected}")
    return handle.get_tensor(key)


def _read_loader(path: str, rank: int, open_file):
    """The data loader state rank `rank` saved (decoded), or None when it saved none."""
    handle, file = open_file(path, rank_file(rank)), os.path.join(path, rank_file(rank))
    text = (handle.metadata() or {}).get(LOADER_METADATA)
    if text is None:
        return None
    try:
        encoded = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(
            f"{file}: metadata '{LOADER_METADATA}' unreadable ({error})"
        ) from None
    keys = set(handle.keys())
    for key in _tensor_refs(encoded):
        if not isinstance(key, str) or not key.startswith(LOADER_TENSORS + ".") or key not in keys:
            raise CheckpointError(
                f"{file}: metadata '{LOADER_METADATA}' refers to tensor {key!r}, which the file "
                "does not hold"
            )
    return _decode_state(encoded, {key: handle.get_tensor(key) for key in _tensor_refs(encoded)})


def _refuse_constant(name: str):
    raise ValueError(f"non-finite number {name}")


# [Note: RNG of a rank that saved none]
# A rank whose generator state the checkpoint lacks (the world size grew; or the saving run had
# no such generator: an older zero saved no NumPy state and only rank 0's Python state, a CPU
# run saves no CUDA state) seeds that generator with 64 bits of SHA-256 over
# "<torch.initial_seed()>:<rank>:<global_steps>": this run's torch seed (what the script gave
# torch.manual_seed, the same on every rank when it seeds alike), the rank, and the checkpoint's
# step. So the state is reproducible from run to run, differs between ranks, and differs from
# the stream a fresh run seeded alike starts with. The rank logs a warning naming the generators.


def derived_seed(rank: int, global_steps: int) -> int:
    """[Note: RNG of a rank that saved none]; read before any generator is set."""
    text = f"{torch.initial_seed()}:{rank}:{global_steps}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def apply_rng(training, meta: dict, state: RankState, path: str) -> None:
    """Set this rank's generators from `state`, deriving those it lacks (with a warning).
    Not a collective."""
    rank, derived = training.comm.rank, []
    seed = derived_seed(rank, meta["counters"]["global_steps"])
    if state.torch_cpu is not None:
        torch.set_rng_state(state.torch_cpu)
    else:
        torch.default_generator.manual_seed(seed)
        derived.append("torch CPU")
    device = training.device
    if device.type != "cpu":
        if state.device is not None:
            get_accelerator().set_rng_state(state.device, device.index)
        else:
            get_accelerator().default_generator(device.index).manual_seed(seed)
            derived.append(f"torch {device.type}")
    if state.python is not None:
        random.setstate(_as_tuple(state.python))
    else:
        random.seed(seed)
        derived.append("Python random")
    numpy = _numpy()
    if numpy is not None and state.numpy is not None:
        numpy.random.set_state(numpy_state_tuple(state.numpy))
    elif numpy is not None:
        numpy.random.seed(seed % 2**32)
        derived.append("NumPy")
    if derived:
        saved = meta["world_size"]
        why = (
            f"it was saved on {saved} rank(s)"
            if rank >= saved
            else "not recorded by the saving run: an older zero, another device or no NumPy"
        )
        logger.warning(
            "rank %d: %s holds no %s state of rank %d (%s); derived from torch.initial_seed(), "
            "the rank and global_steps (docs/checkpoints.md, 'Random number generators')",
            rank,
            path,
            listed(derived),
            rank,
            why,
        )


def apply_loader(training, meta: dict, state: RankState, path: str) -> None:
    """Give the engine's stateful data loader the saved state (rank 0's where this rank saved
    none), or warn that it keeps its position. Not a collective. Raises CheckpointError
    carrying what the loader's load_state_dict raised (load runs this before anything else
    changes)."""
    loader, rank = training.stateful_loader(), training.comm.rank
    if loader is None:
        return
    if state.loader is None:
        logger.warning(
            "rank %d: %s holds no data loader state; engine.training_dataloader keeps its "
            "position (its next batch is not the one the saving run would have seen next)",
            rank,
            path,
        )
        return
    if state.loader_rank != rank:
        logger.warning(
            "rank %d: %s was saved on %d rank(s); this rank's data loader takes rank %d's state",
            rank,
            path,
            meta["world_size"],
            state.loader_rank,
        )
    try:
        loader.load_state_dict(state.loader)
    except Exception as error:
        raise CheckpointError(
            f"{os.path.join(path, rank_file(state.loader_rank))}: metadata '{LOADER_METADATA}': "
            f"engine.training_dataloader ({type(loader).__name__}) refused rank "
            f"{state.loader_rank}'s saved state: {type(error).__name__}: {error}. Nothing was "
            "loaded; set engine.training_dataloader = None before load_checkpoint to load the "
            "rest and start the loader afresh"
        ) from error
