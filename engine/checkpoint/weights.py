"""Loading weights alone: an engine built without an optimizer (ZeRO-Inference) takes every
parameter and buffer from any zero checkpoint (training or inference, any world size or stage),
one full tensor at a time."""

import logging

import torch

from ..errors import listed
from .agreement import _on_every_rank
from .client_state import decode as decode_client_state
from .consolidation import ConsolidatedReader
from .format import CheckpointError
from .ownership import _module_tensors
from .reader import read_meta

logger = logging.getLogger("zero")


def load_weights(state, load_dir: str, tag, strict: bool, module_only: bool):
    """Engine.load_checkpoint of an engine without an optimizer: every parameter and buffer
    from the checkpoint's fp32 values (master weights of the trained parameters, the saved
    frozen parameters and buffers), read one full tensor at a time (checkpoint.
    ConsolidatedReader: any world size and stage saved it), cast to the tensor's dtype; at
    stage 3 a rank keeps its owned part (FrozenShards.write). Every rank verifies names, shapes
    and dtypes (CheckpointError; strict=False allows missing and unexpected names, never a
    wrong shape) and the ranks agree before any value changes. Without `module_only` the step
    counters load too. Returns (checkpoint directory, client_state). Collective."""

    def verify():
        verify_files = state.config.checkpoint.verify_checksums
        reader = ConsolidatedReader(load_dir, tag, verify=verify_files)
        meta = read_meta(reader.path)
        excluded = set(meta.get("excluded_frozen") or ())
        return reader, _weights_to_load(state, reader, strict, excluded), meta

    reader, targets, meta = _on_every_rank(state, f"verify the checkpoint in {load_dir}", verify)
    with torch.no_grad():
        for saved, tensor in targets:
            value = reader.read(saved)
            if state.frozen is not None and state.frozen.full_shape(tensor) is not None:
                state.frozen.write(tensor, value)  # stage 3: this rank's owned part
            else:
                tensor.copy_(value.to(tensor.dtype))
        if state.gatherer is not None:
            state.gatherer.forget_writes()  # the shards' new values replace gathered ones
        state.optimizer.refresh_params()  # stage 3: the persistent unit gathers them
    if not module_only:
        state.counters.load_state_dict(meta["counters"])
        logger.info(
            "load_checkpoint: weights and step counters of %s loaded; its optimizer and lr "
            "scheduler state are not (the engine has no optimizer)",
            reader.path,
        )
    return reader.path, decode_client_state(meta["client_state"])


def _weights_to_load(state, reader, strict: bool, excluded: set) -> list[tuple]:
    """(name in the checkpoint, tensor) for each of the model's parameters and buffers, each
    tensor once; CheckpointError listing every missing or unexpected name (with `strict`) and
    every shape or dtype that does not fit. A frozen parameter the checkpoint left out
    (`excluded`, its excluded_frozen: [Note: frozen parameters left out] in
    checkpoint/format.py) keeps its value when it is frozen here too."""
    named = list(_module_tensors(state.module))  # parameters and persistent buffers
    targets, problems = {}, []  # id(tensor) -> (name in the checkpoint, tensor)
    for name, tensor in named:
        saved = reader.ties.get(name, name)
        if saved not in reader:
            kept = name in excluded and not tensor.requires_grad
            problems += [f"missing key '{name}'"] if strict and not kept else []
            continue
        frozen = state.frozen.full_shape(tensor) if state.frozen is not None else None
        shape, there = tuple(tensor.shape if frozen is None else frozen), reader.dtype(saved)
        if tuple(reader.shape(saved)) != shape:
            problems.append(f"'{name}' is {tuple(reader.shape(saved))} there, {shape} here")
        elif tensor.is_floating_point() != there.is_floating_point or (
            not tensor.is_floating_point() and there != tensor.dtype
        ):
            problems.append(f"'{name}' is {there} there, {tensor.dtype} here")
        targets.setdefault(id(tensor), (saved, tensor))
    if strict:
        names = {name for name, _ in named}
        problems += [f"unexpected key '{n}'" for n in reader.names if n not in names]
    if problems:
        raise CheckpointError(
            f"{reader.path} does not fit {type(state.module).__name__}: {listed(problems)} "
            "(load_module_strict=False skips missing and unexpected keys)"
        )
    return list(targets.values())
