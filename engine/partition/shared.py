"""What the stage 0-2 optimizer (stages.py) and stage 3's fetch units (stage3.py) both use: a
bucket's initial values, host copies of shards, and the error for a failed stage-3 collective."""

import torch

from .flat import BucketLayout
from .init import is_partitioned, take_full


def bucket_values(layout: BucketLayout, params, dtype, device) -> torch.Tensor:
    """(padded_numel,) the values of a bucket's parameters in `dtype`, zero padding. A zero.Init
    parameter is gathered here, one at a time (collective) and its Init shard dropped."""
    full = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for slot, param in zip(layout.slots, params):
        value = take_full(param) if is_partitioned(param) else param.detach()
        full[slot.offset : slot.offset + slot.numel].copy_(value.reshape(-1))
    return full


def host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `tensor` (same dtype), page-locked when `pin` and CUDA exists, so copies
    to and from the device can be asynchronous."""
    host = tensor.detach().to("cpu", copy=True)
    return host.pin_memory() if pin and torch.cuda.is_available() else host


def collective_failure(rank: int, what: str, error: Exception) -> RuntimeError:
    """The error for a failed stage-3 collective, naming its usual cause."""
    return RuntimeError(
        f"rank {rank}: {what} failed under ZeRO stage 3: {error}. The usual cause is ranks "
        "running different modules in a micro-batch (every rank must run the same modules in "
        "the same order, see docs/stages.md); run with TORCH_DISTRIBUTED_DEBUG=DETAIL to have "
        "torch name the first collective that differs"
    )
