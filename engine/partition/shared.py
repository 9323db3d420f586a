"""What the stage 0-2 optimizer (stages.py) and stage 3's gatherer (gatherer.py) both use: a
bucket's initial values, host copies of shards, the error for a failed stage-3 collective, and
the check that the parameters still hold what zero put in them.

[Note: parameters changed behind the engine's back]
Once zero lays a parameter out, `param.data` is zero's: a view of its bucket's buffer (stages
0-2; stage 3 while its unit is gathered) or a 0-element placeholder (stage 3, released), in
the compute dtype, and whether it requires grad was fixed when the layout was made (trainable
parameters have fp32 master weights and optimizer state; frozen ones have none). A script that
changes any of these after zero.initialize would leave two copies that no longer meet:
`engine.module.half()` / `.double()` / `.to(dtype)` and `param.data = tensor` rebind the
parameter to a tensor zero never writes (stages 0-2: the module stops training while the fp32
masters go on; stage 3: the next all-gather silently undoes it), and requires_grad_(False)
leaves the optimizer moving the parameter by momentum and weight decay, where torch would leave
it alone. check_params() compares each parameter's data pointer, dtype and requires_grad with
what zero set (a few attribute reads per parameter, no device synchronization) and raises
naming the parameter and the fix; the engine runs it at every forward and backward, stage 3
also at every all-gather and release. Writing new values in place (engine.load_checkpoint,
zero.GatheredParameters(params, modifier_rank=0)) keeps the tensor and is the way to load.
"""

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


def check_params(bucket, dtype: torch.dtype, rank: int, trains: bool = False) -> None:
    """Raise RuntimeError naming the first parameter of `bucket` (a stages.Bucket or a stage-3
    frozen bucket) that no longer holds what zero put in it ([Note: parameters changed behind
    the engine's back]): its slot's view of the buffer while the bucket is gathered (stages 0-2
    always), else a 0-element placeholder, in `dtype`; with `trains` (the engine has an
    optimizer), requires_grad as at zero.initialize (True in a trainable bucket, False in a
    frozen one). Not a collective; reads no tensor values."""
    buffer = bucket.param_buffer if bucket.pending is None else None
    base = buffer.data_ptr() if buffer is not None else 0
    size = buffer.element_size() if buffer is not None else 0
    trainable = bucket.master is not None
    for slot, param in zip(bucket.layout.slots, bucket.params):
        if buffer is None:
            held = param.numel() == 0
        else:
            held = param.data_ptr() == base + slot.offset * size
        # dtypes and bools are singletons: `is` keeps this loop a few attribute reads
        if (
            not held
            or param.dtype is not dtype
            or (trains and param.requires_grad is not trainable)
        ):
            raise changed_parameter(rank, slot.name, param, dtype, trainable, trains)


def changed_parameter(rank, name, param, dtype, trainable: bool, trains: bool) -> RuntimeError:
    """The error for parameter `name`, whose tensor, dtype or requires_grad changed after
    zero.initialize (check_params)."""
    head = f"rank {rank}: parameter '{name}'"
    load = (
        "To load values, write them in place: engine.load_checkpoint(...), or "
        "`with zero.GatheredParameters(params, modifier_rank=0): param.copy_(value)` on every "
        "rank"
    )
    if param.dtype != dtype:
        return RuntimeError(
            f"{head} is {param.dtype}, but zero.initialize laid it out in {dtype}: the module "
            "was cast after it (engine.module.half(), .double(), .to(dtype)), which rebinds the "
            "parameter to a copy zero never writes (stages 0-2 would stop training it while the "
            "fp32 master weights go on; stage 3 would undo the cast). Choose the dtype in the "
            "config (the bf16 / fp16 blocks) or cast the model before zero.initialize. " + load
        )
    if trains and param.requires_grad != trainable:
        if trainable:
            return RuntimeError(
                f"{head} has requires_grad=False, but it was trainable when zero.initialize "
                "laid it out: zero's optimizer would go on updating it (momentum and weight "
                "decay move it without a gradient), where torch leaves a frozen parameter "
                "alone. Freeze parameters before zero.initialize (the engine then keeps them "
                "frozen), or set requires_grad back to True"
            )
        return RuntimeError(
            f"{head} has requires_grad=True, but it was frozen when zero.initialize laid it "
            "out, so zero keeps no optimizer state for it and would never update it. Set "
            "requires_grad before zero.initialize, or set it back to False"
        )
    return RuntimeError(
        f"{head} no longer holds the tensor zero gave it: `param.data = tensor` (or moving "
        "the module with .to() / .cpu() / .cuda()) replaced it after zero.initialize, so the "
        "module and zero's fp32 master weights would train two different copies. " + load
    )
