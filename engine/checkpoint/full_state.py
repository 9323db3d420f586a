"""The model's full state dict in the compute dtype, gathered one bucket at a time.

Owns: full_state_dict, the body of Engine._zero3_consolidated_16bit_state_dict (DeepSpeed's
name; accelerate's get_state_dict and the Hugging Face Trainer's save_model call it to save a
stage-3 model).

[Note: streamed 16-bit state dict]
The values are the low-precision parameters forward uses (compute dtype), not the fp32 master
weights (save_pretrained writes those). At stage 3 each laid-out bucket, trainable or frozen,
is all-gathered from the ranks' parameter shards into one device buffer, rank 0 copies its
parameters to the host, and the buffer is dropped before the next bucket: a rank's device holds
one bucket beyond its shards, never the model, and rank 0's host holds the result, the model
once. Units are not gathered through the ParamGatherer, so no unit changes state and the
prefetch order is untouched. At stages 0-2 every rank holds the full parameters already, and
rank 0 copies them. Keys are those of module.state_dict() (tied names included, sharing one
tensor as there), taken with keep_vars=True before any value is read.
"""

from collections import OrderedDict

import torch

from ..partition.gathered import laid_out_buckets


def full_state_dict(engine, entries: dict, exclude_frozen: bool) -> "OrderedDict | None":
    """Name -> CPU tensor (compute dtype for parameters) for every entry of `entries` on rank 0;
    None on the other ranks. See [Note: streamed 16-bit state dict].

    `entries` is engine.module.state_dict(keep_vars=True) taken without gathering (name -> the
    parameter, buffer or extra state itself); `exclude_frozen` leaves out the parameters with
    requires_grad=False (buffers stay), whose stage-3 buckets are then not gathered at all.
    Collective at stage 3 (all-gathers), every rank in the same bucket order."""
    rank0 = engine.comm.rank == 0
    wanted = OrderedDict(
        (name, value)
        for name, value in entries.items()
        if not (
            exclude_frozen and isinstance(value, torch.nn.Parameter) and not value.requires_grad
        )
    )
    copies: dict[int, torch.Tensor] = {}  # id(tensor) -> its host copy (rank 0)
    if engine.gatherer is not None:
        wanted_ids = {id(value) for value in wanted.values() if torch.is_tensor(value)}
        for bucket in laid_out_buckets(engine.optimizer):
            if any(id(param) in wanted_ids for param in bucket.params):
                copies.update(_gathered_bucket(engine, bucket, rank0))
    if not rank0:
        return None
    state = OrderedDict()
    for name, value in wanted.items():
        if torch.is_tensor(value):
            if id(value) not in copies:  # a buffer, or a parameter every rank holds whole
                copies[id(value)] = value.detach().to("cpu", copy=True)
            value = copies[id(value)]
        state[name] = value
    return state


def _gathered_bucket(engine, bucket, rank0: bool) -> dict[int, torch.Tensor]:
    """id(param) -> the parameter's full value on the host, on rank 0 (empty elsewhere), from
    one all-gather of the bucket's parameter shards. Collective."""
    with engine.optimizer.param_resident(bucket):  # nvme: the shard is read from its file
        shard = bucket.param_shard.to(engine.device)  # offload_param: from host memory
        if bucket.layout.num_shards == 1:
            full = shard
        else:
            full = torch.empty(bucket.layout.padded_numel, dtype=shard.dtype, device=engine.device)
            engine.comm.all_gather(full, shard)
        if not rank0:
            return {}
        return {
            id(param): full[slot.offset : slot.offset + slot.numel]
            .view(slot.shape)
            .to("cpu", copy=True)
            for slot, param in zip(bucket.layout.slots, bucket.params)
        }
