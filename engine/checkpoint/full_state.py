"""The model's full state dict in the compute dtype, gathered one tensor at a time.

Owns: consolidated_16bit_state_dict, the body of Engine._zero3_consolidated_16bit_state_dict
(DeepSpeed's name; accelerate's get_state_dict and the Hugging Face Trainer's save_model call it
to save a stage-3 model), and save_16bit_model (DeepSpeed's engine.save_16bit_model).

[Note: streamed 16-bit state dict]
The values are the low-precision parameters forward uses (compute dtype), not the fp32 master
weights (save_pretrained writes those). At stage 3 each laid-out bucket, trainable or frozen,
is visited in turn and each of its parameters assembled on rank 0 from the ranks' parameter
shards (slot_value: every owner broadcasts its part), copied to the host, and dropped before
the next: a rank's device holds one parameter beyond its shards, never a bucket nor the model,
and rank 0's host holds the result, the model once. Units are not gathered through the
ParamGatherer, so no unit changes state and the prefetch order is untouched. At stages 0-2
every rank holds the full parameters already, and rank 0 copies them. Keys are those of
module.state_dict() (tied names included, sharing one tensor as there), taken with
keep_vars=True before any value is read.
"""

import contextlib
import os
from collections import OrderedDict

import torch

from ..partition.gathered import laid_out_buckets
from .agreement import enter


def consolidated_16bit_state_dict(state, state_dict_gather, exclude_frozen: bool):
    """The model's full state dict on rank 0, as DeepSpeed's _zero3_consolidated_16bit_state_dict
    returns it: an OrderedDict of every module.state_dict() key (tied names sharing one tensor)
    to a detached CPU tensor, parameters in the compute dtype (fp32/bf16/fp16: what forward
    uses, not the fp32 master weights), buffers as the model holds them; None on every other
    rank. `exclude_frozen` leaves out the parameters with requires_grad=False (the Hugging Face
    Trainer passes it for peft models at stage 3). `state_dict_gather` is stage 3's
    partition.state_dict_gather.StateDictGather (None below stage 3).

    Stage 3 streams it tensor by tensor ([Note: streamed 16-bit state dict]). It does not read
    stage3_gather_16bit_weights_on_model_save (DeepSpeed's does not either: accelerate checks
    zero_gather_16bit_weights_on_model_save() first). DeepSpeed raises ValueError below stage 3;
    zero returns the same state dict at every stage.

    Collective at stage 3: every rank must call it, with the same exclude_frozen
    (RankMismatchError otherwise); below stage 3 it communicates nothing."""
    listing = contextlib.nullcontext()
    if state_dict_gather is not None:  # the stage-3 state dict, gathered: ranks must agree
        enter(state.comm, "state_dict() (stage 3)", int(exclude_frozen))
        listing = state_dict_gather.listing()  # keys and tensors, not gathered values
    with listing:
        entries = state.module.state_dict(keep_vars=True)
    return full_state_dict(state, entries, exclude_frozen)


def save_16bit_model(state, save_dir, save_filename: str, state_dict_gather=None) -> str | None:
    """Write the full model in the compute dtype (fp32/bf16/fp16) as one safetensors file from
    rank 0, every state_dict key included (tied parameters as equal copies); DeepSpeed's
    engine.save_16bit_model. `state_dict_gather`: stage 3's StateDictGather (None below), whose
    state_dict() gathers here under the doorway too.

    Collective: every rank must call it (stage 3 gathers the parameters). Raises RuntimeError
    under stage 3 when stage3_gather_16bit_weights_on_model_save is false, or when a parameter
    would be written as its 0-element placeholder (called inside a zero.GatheredParameters that
    holds only some parameters). Returns the path on rank 0, None elsewhere."""
    from safetensors.torch import save_file

    enter(state.comm, "save_16bit_model")
    own = state_dict_gather.own_save() if state_dict_gather else contextlib.nullcontext()
    with own:
        module_state = state.module.state_dict()
    _refuse_placeholders(state.module, module_state, state.comm.rank)
    if state.comm.rank != 0:
        return None
    os.makedirs(save_dir, exist_ok=True)
    # safetensors refuses tensors sharing storage: every name gets its own copy.
    tensors = {name: t.detach().cpu().clone() for name, t in module_state.items()}
    path = os.path.join(save_dir, save_filename)
    save_file(tensors, path)
    return path


def _refuse_placeholders(module, module_state: dict, rank: int) -> None:
    """RuntimeError when a state dict about to be written holds a stage-3 parameter as its
    0-element placeholder (its full size, ds_numel, is not 0): the file would hold no weights."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, tensor in module_state.items():
        param = params.get(name)
        if param is not None and tensor.numel() == 0 and getattr(param, "ds_numel", 0) > 0:
            raise RuntimeError(
                f"rank {rank}: '{name}' would be written as a 0-element placeholder (its full "
                f"shape is {tuple(param.ds_shape)}): inside zero.GatheredParameters, "
                "state_dict() gathers only what the context holds. Call save_16bit_model "
                "outside the context (it gathers every parameter itself)"
            )


def full_state_dict(state, entries: dict, exclude_frozen: bool) -> "OrderedDict | None":
    """Name -> CPU tensor (compute dtype for parameters) for every entry of `entries` on rank 0;
    None on the other ranks. See [Note: streamed 16-bit state dict].

    `entries` is state.module.state_dict(keep_vars=True) taken without gathering (name -> the
    parameter, buffer or extra state itself); `exclude_frozen` leaves out the parameters with
    requires_grad=False (buffers stay), whose stage-3 buckets are then not gathered at all.
    Collective at stage 3 (all-gathers), every rank in the same bucket order."""
    rank0 = state.comm.rank == 0
    wanted = OrderedDict(
        (name, value)
        for name, value in entries.items()
        if not (
            exclude_frozen and isinstance(value, torch.nn.Parameter) and not value.requires_grad
        )
    )
    copies: dict[int, torch.Tensor] = {}  # id(tensor) -> its host copy (rank 0)
    if state.gatherer is not None:
        wanted_ids = {id(value) for value in wanted.values() if torch.is_tensor(value)}
        for bucket in laid_out_buckets(state.optimizer):
            if any(id(param) in wanted_ids for param in bucket.params):
                copies.update(_gathered_bucket(state, bucket, rank0, wanted_ids))
    if not rank0:
        return None
    out = OrderedDict()
    for name, value in wanted.items():
        if torch.is_tensor(value):
            if id(value) not in copies:  # a buffer, or a parameter every rank holds whole
                copies[id(value)] = value.detach().to("cpu", copy=True)
            value = copies[id(value)]
        out[name] = value
    return out


def _gathered_bucket(state, bucket, rank0: bool, wanted_ids: set) -> dict[int, torch.Tensor]:
    """id(param) -> the parameter's full value on the host, on rank 0 (empty elsewhere), for
    the bucket's parameters in `wanted_ids`, assembled one at a time (slot_value).
    Collective."""
    out = {}
    with state.optimizer.param_resident(bucket):  # nvme: the shard is read from its file
        for slot, param in zip(bucket.layout.slots, bucket.params):
            if id(param) in wanted_ids:
                value = slot_value(
                    state, bucket.layout, bucket.param_shard, slot.offset, slot.numel
                )
                if rank0:
                    out[id(param)] = value.view(slot.shape).to("cpu", copy=True)
    return out


def slot_value(state, layout, source, offset: int, numel: int) -> "torch.Tensor | None":
    """Elements [offset, offset + numel) of a laid-out bucket, 1-D on state.device, on rank 0
    (None elsewhere); `source` is this rank's shard of the bucket (its master or parameter
    shard, on the host or the device). Every owner of a part broadcasts it and rank 0 receives
    it in place, so rank 0 holds the tensor and nothing more; the other ranks at most one part.
    Collective: every rank of state.comm calls it with the same offset and numel. With one
    shard (stage 0, one rank) rank 0 gets a view of `source`."""
    comm = state.comm
    if layout.num_shards == 1:
        return source[offset : offset + numel] if comm.rank == 0 else None
    full = None
    if comm.rank == 0:
        full = torch.empty(numel, dtype=source.dtype, device=state.device)
    size = layout.shard_numel
    owners = range(offset // size, (offset + numel - 1) // size + 1) if numel else ()
    for owner in owners:
        lo = layout.owned_range(owner)[0]
        a, b = max(lo, offset), min(lo + size, offset + numel)
        if comm.rank == owner:
            part = source[a - lo : b - lo].to(state.device)  # offload: from host memory
        elif comm.rank == 0:
            part = full[a - offset : b - offset]
        else:
            part = torch.empty(b - a, dtype=source.dtype, device=state.device)
        comm.broadcast(part, src=owner)
        if comm.rank == 0 and owner == 0:
            full[a - offset : b - offset].copy_(part)
    return full
