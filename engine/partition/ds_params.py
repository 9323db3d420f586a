"""DeepSpeed's attributes on a partitioned parameter, as views of zero's own state.

Scripts written for DeepSpeed branch on attributes that DeepSpeed's stage 3 and its zero.Init
set on every parameter they partition (deepspeed.runtime.zero.partition_parameters):

    ds_id       int, unique per parameter (in this process)
    ds_status   ZeroParamStatus: AVAILABLE (full value in param.data), INFLIGHT (its
                all-gather is in flight), NOT_AVAILABLE (sharded: param.data has 0 elements)
    ds_tensor   this rank's partition of the parameter, a 1-D tensor
    ds_shape    torch.Size, the full shape
    ds_numel    int, the full number of elements
    partition_numel()   int, the elements of ds_tensor (0 before it has values)
    ds_summary()        dict of the above, for printing (DeepSpeed's keys)

DeepSpeed-Chat saves a stage-3 model with `if hasattr(v, "ds_id")` and gathers the parameters
whose `ds_status == NOT_AVAILABLE`; TRL reads `p.ds_status != ZeroParamStatus.AVAILABLE`; peft
and transformers read `ds_numel` when `numel()` is 0. zero sets them on every parameter of a
stage-3 engine's model (gatherer.py) and on every parameter built inside zero.Init (init.py), and
on none at stages 0-2 (as DeepSpeed).

[Note: attributes are views]
The state itself lives on zero's objects (units.Unit and its buckets, init.InitShard); the
attributes are written only where that state changes (Unit's transitions, InitShard's), through
set_status() and set_tensor() here, so they never drift from it. ds_tensor is a view of zero's
shard, never a copy. Each parameter zero describes also carries a ZeroMark (attribute MARK),
zero's own object: it tells zero's ds_* attributes from those another library's zero.Init set (a
model built under real DeepSpeed's deepspeed.zero.Init, which zero cannot train), without
relying on attribute names. It is an attribute rather than a weak registry because a Parameter
with a weak reference cannot be filled in place by torch.utils.swap_tensors (checkpoint/hf.py).
"""

import enum
import functools
import itertools
from dataclasses import dataclass

import torch

MARK = "zero_ds_mark"  # the attribute holding zero's ZeroMark
_NAMES = (
    "ds_id",
    "ds_status",
    "ds_tensor",
    "ds_shape",
    "ds_numel",
    "partition_numel",
    "ds_summary",
)
_IDS = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's deepspeed.runtime.zero.partition_parameters.ZeroParamStatus (also
    deepspeed.zero.ZeroParamStatus): where a partitioned parameter's full value is."""

    AVAILABLE = 1  # param.data holds the full value on this rank
    NOT_AVAILABLE = 2  # only this rank's partition exists; param.data has 0 elements
    INFLIGHT = 3  # an all-gather of it is in flight


@dataclass(frozen=True)
class ZeroMark:
    """zero's mark on a parameter whose ds_* attributes zero set; ds_id is its id."""

    ds_id: int


def describe(param: torch.nn.Parameter, shape) -> None:
    """Give `param` zero's mark, ds_id (the one zero gave it before, if any), ds_shape and
    ds_numel (the full `shape`). Not a collective."""
    zero_mark = param.__dict__.get(MARK)
    if not isinstance(zero_mark, ZeroMark):
        zero_mark = ZeroMark(next(_IDS))
        setattr(param, MARK, zero_mark)
    param.ds_id = zero_mark.ds_id
    param.ds_shape = torch.Size(shape)
    param.ds_numel = param.ds_shape.numel()
    # DeepSpeed's parameter methods (Lightning's model summary calls partition_numel())
    param.partition_numel = functools.partial(_partition_numel, param)
    param.ds_summary = functools.partial(_ds_summary, param)


def _partition_numel(param) -> int:
    """Elements of this rank's partition (ds_tensor), 0 while it has none."""
    tensor = param.__dict__.get("ds_tensor")
    return 0 if tensor is None else tensor.numel()


def _ds_summary(param) -> dict:
    """DeepSpeed's param.ds_summary(): the attributes above in one dict."""
    tensor = param.__dict__.get("ds_tensor")
    return {
        "id": param.ds_id,
        "status": getattr(param, "ds_status", ZeroParamStatus.NOT_AVAILABLE).name,
        "numel": param.numel(),
        "ds_numel": param.ds_numel,
        "shape": tuple(param.shape),
        "ds_shape": tuple(param.ds_shape),
        "requires_grad": param.requires_grad,
        "grad_shape": tuple(param.grad.shape) if param.grad is not None else None,
        "ds_tensor.shape": tuple(tensor.shape) if tensor is not None else None,
    }


def set_status(params, status: ZeroParamStatus) -> None:
    """Set ds_status of `params`. Called only where zero's own state changes ([Note:
    attributes are views])."""
    for param in params:
        param.ds_status = status


def set_tensor(param, tensor: torch.Tensor | None) -> None:
    """Set ds_tensor: `tensor` is this rank's partition, a view of zero's shard (None: no
    values yet). The tensor gets DeepSpeed's `ds_numel` too: its number of elements."""
    if tensor is not None:
        tensor.ds_numel = tensor.numel()
    param.ds_tensor = tensor


def forget(param) -> None:
    """Remove DeepSpeed's attributes: `param` is no longer partitioned by zero.Init (an engine
    lays it out; stages 0-2 hold it whole, stage 3 describes it anew). Zero's mark stays, so a
    stage-3 engine gives it the same ds_id."""
    for name in _NAMES:
        param.__dict__.pop(name, None)


def is_zero_param(param) -> bool:
    """True when zero described `param` (built under zero.Init, or laid out by a stage-3
    engine): it carries zero's mark, and no other library has set a different ds_id since."""
    zero_mark = getattr(param, MARK, None)
    return (
        isinstance(zero_mark, ZeroMark)
        and getattr(param, "ds_id", zero_mark.ds_id) == zero_mark.ds_id
    )


def partitioned_elsewhere(param) -> bool:
    """True when another library's zero.Init partitioned `param`: it has DeepSpeed's ds_id or
    ds_status, and they are not zero's."""
    has = any(name in param.__dict__ for name in ("ds_id", "ds_status", "ds_tensor"))
    return has and not is_zero_param(param)


def refuse_partitioned_elsewhere(model: torch.nn.Module, rank: int) -> None:
    """Raise ValueError naming the first parameter of `model` that another library's zero.Init
    (DeepSpeed's deepspeed.zero.Init) partitioned: its full values are in that library's shards,
    which zero cannot read, and param.data is a 0-element placeholder. Not a collective: every
    rank decides alike from its own copy of the model."""
    for name, param in model.named_parameters():
        if partitioned_elsewhere(param):
            raise ValueError(
                f"rank {rank}: parameter '{name}' (ds_id {param.__dict__.get('ds_id')!r}, "
                f"{param.numel()} elements held here) was partitioned by DeepSpeed's "
                "deepspeed.zero.Init, not by zero: its values live in DeepSpeed's shards, which "
                "zero cannot read. Build the model under zero.Init (or with no Init) instead, or "
                "run the program through `zero-as-deepspeed` so that `deepspeed.zero.Init` is "
                "zero's"
            )
