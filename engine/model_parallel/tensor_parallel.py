"""Tensor-parallel Linear layers over a model-parallel group (Megatron-style intra-layer
parallelism), enough to split a transformer's attention and MLP over `mp` ranks.

    fc = ColumnParallelLinear(d, 4 * d, mpu)   # weight (4d/mp, d): each rank computes a slice
    proj = RowParallelLinear(4 * d, d, mpu)    # weight (d, 4d/mp): partial sums, all-reduced
    y = proj(gelu(fc(x)))                      # x and y replicated; one all-reduce forward,
                                               # one in backward

[Note: the four region functions]
A column-parallel layer takes a replicated input: forward is the identity, and backward sums the
input gradients of all ranks (each rank saw only its output slice) -> copy_to_region. A
row-parallel layer produces partial sums: forward all-reduces them, backward passes the
(replicated) gradient through -> reduce_from_region. gather_from_region / scatter_to_region move
between a last-dimension slice and the full tensor, each the other's backward. All communication
goes through zero's Communicator (comm/communicator.py), so the model-parallel traffic is counted.

[Note: full-size initialization and loading]
A parallel layer initializes the FULL weight with the default generator and keeps its slice, so
every model-parallel rank (seeded alike) holds a slice of one and the same full matrix, and a
tensor-parallel model equals the single-process model it was cut from. load_state_dict accepts
either this rank's slice or the full tensor (which it cuts): a checkpoint of the plain model
loads straight into the tensor-parallel one.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import Communicator


def _comm_of(mpu) -> Communicator:
    from .mpu import model_parallel_comm

    return model_parallel_comm(mpu)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    buffer = torch.empty(comm.world_size * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(buffer, x.contiguous().view(-1))
    # (mp, ..., k) -> (..., mp, k) -> (..., mp * k): rank r's slice lands at columns r*k.
    stacked = buffer.view(comm.world_size, *x.shape)
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], comm.world_size * x.shape[-1])


def _split_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    width = x.shape[-1]
    if width % comm.world_size:
        raise ValueError(
            f"rank {comm.rank}: last dimension {width} does not divide by the model-parallel "
            f"size {comm.world_size}"
        )
    return x.chunk(comm.world_size, dim=-1)[comm.rank].contiguous()


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_last(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.comm), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split_last(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.comm), None


def copy_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient over `comm` in backward."""
    return _CopyToRegion.apply(x, comm) if comm.world_size > 1 else x


def reduce_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """All-reduce (sum) over `comm` forward; identity backward."""
    return _ReduceFromRegion.apply(x, comm) if comm.world_size > 1 else x


def gather_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(..., k) slices -> (..., mp * k) full tensor, in rank order; backward keeps the slice."""
    return _GatherFromRegion.apply(x, comm) if comm.world_size > 1 else x


def scatter_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(..., mp * k) full tensor -> this rank's (..., k) slice; backward gathers the gradient."""
    return _ScatterToRegion.apply(x, comm) if comm.world_size > 1 else x


def _cut(full: torch.Tensor, dim: int, rank: int, parts: int, stride: int) -> torch.Tensor:
    """This rank's slice of `full` along `dim`. With stride s the dimension is s equal blocks
    (a fused q|k|v weight has 3) and the rank takes its 1/parts of every block, in order."""
    size = full.shape[dim]
    if size % (parts * stride):
        raise ValueError(
            f"dimension {dim} of size {size} does not divide into {parts} model-parallel parts "
            f"x stride {stride}; choose sizes divisible by {parts * stride}"
        )
    blocks = full.unflatten(dim, (stride, size // stride))
    piece = blocks.chunk(parts, dim=dim + 1)[rank]
    return piece.flatten(dim, dim + 1).contiguous()


class _ParallelLinear(nn.Module):
    """Shared machinery: a weight partitioned along `partition_dim`, an optional bias."""

    partition_dim = 0
    bias_partitioned = False

    def __init__(self, in_features, out_features, mpu, bias: bool, stride: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.comm = _comm_of(mpu)
        self.stride = stride
        self.full_weight_shape = (out_features, in_features)
        parts = self.comm.world_size
        if self.full_weight_shape[self.partition_dim] % (parts * stride):
            raise ValueError(
                f"rank {self.comm.rank}: {type(self).__name__}({in_features}, {out_features}) "
                f"splits dimension {self.full_weight_shape[self.partition_dim]} into "
                f"{parts} model-parallel parts x stride {stride}; choose a size divisible by "
                f"{parts * stride}"
            )
        local = list(self.full_weight_shape)
        local[self.partition_dim] //= parts
        self.weight = nn.Parameter(torch.empty(local))
        if bias:
            bias_numel = out_features // (parts if self.bias_partitioned else 1)
            self.bias = nn.Parameter(torch.empty(bias_numel))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, drawn for the full matrix (see [Note: full-size ...])."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        self.init_full_(lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)), bias=False)
        if self.bias is not None:
            full_bias = torch.empty(self.out_features).uniform_(-bound, bound)
            self._assign("bias", full_bias)

    @torch.no_grad()
    def init_full_(self, init, bias: bool = True) -> None:
        """Apply `init` (an in-place function of a tensor) to the full weight, keep this rank's
        slice; with bias=True the bias is zeroed (GPT-2 style init)."""
        full = torch.empty(self.full_weight_shape, dtype=self.weight.dtype)
        init(full)
        self._assign("weight", full)
        if bias and self.bias is not None:
            self.bias.zero_()

    @torch.no_grad()
    def _assign(self, name: str, full: torch.Tensor) -> None:
        getattr(self, name).copy_(self.shard_of(name, full))

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full `weight` or `bias` tensor."""
        if name == "bias" and not self.bias_partitioned:
            return full
        dim = self.partition_dim if name == "weight" else 0
        return _cut(full, dim, self.comm.rank, self.comm.world_size, self.stride)

    def partitioned_parameters(self) -> list[nn.Parameter]:
        """Parameters that hold a different slice on each model-parallel rank."""
        params = [self.weight]
        if self.bias is not None and self.bias_partitioned:
            params.append(self.bias)
        return params

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("weight", "bias"):
            key, param = prefix + name, getattr(self, name)
            if param is None or key not in state_dict:
                continue
            value = state_dict[key]
            if value.shape != param.shape and self.comm.world_size > 1:
                state_dict[key] = self.shard_of(name, value)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"model_parallel={self.comm.world_size}, local_weight={tuple(self.weight.shape)}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's rows (output features) split over the model-parallel ranks.

    Args:
        in_features, out_features: full sizes; out_features must divide by mp * stride.
        mpu: zero.mpu.ModelParallelGroups or a Megatron-style mpu (None: one rank).
        bias: keep a bias (partitioned like the outputs).
        gather_output: return the full (..., out_features) output (all-gather) instead of this
            rank's (..., out_features / mp) slice.
        stride: number of equal blocks fused along the output dimension (3 for q|k|v); each rank
            keeps its slice of every block, so its output is [q_r | k_r | v_r].

    Input (..., in_features), replicated on the model-parallel ranks. Collective in backward (and
    in forward with gather_output): every model-parallel rank runs the layer.
    """

    partition_dim = 0
    bias_partitioned = True

    def __init__(
        self, in_features, out_features, mpu=None, bias=True, gather_output=False, stride=1
    ):
        self.gather_output = gather_output
        super().__init__(in_features, out_features, mpu, bias, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_region(x, self.comm), self.weight, self.bias)
        return gather_from_region(y, self.comm) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's columns (input features) split over the model-parallel ranks.

    Args:
        in_features, out_features: full sizes; in_features must divide by mp.
        mpu: as for ColumnParallelLinear. bias: a replicated bias, added after the all-reduce.
        input_is_parallel: the input is already this rank's (..., in_features / mp) slice (the
            output of a ColumnParallelLinear); otherwise the full input is split here.

    Output (..., out_features), replicated. Collective in forward: one all-reduce of the output.
    """

    partition_dim = 1
    bias_partitioned = False

    def __init__(self, in_features, out_features, mpu=None, bias=True, input_is_parallel=True):
        self.input_is_parallel = input_is_parallel
        super().__init__(in_features, out_features, mpu, bias, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.comm)
        y = reduce_from_region(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y


def partitioned_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The tensor-parallel parameters of `model` (those of its parallel layers)."""
    params = []
    for module in model.modules():
        if isinstance(module, _ParallelLinear):
            params.extend(module.partitioned_parameters())
    return params


def partitioned_parameter_names(model: torch.nn.Module) -> frozenset:
    """Names of `model`'s tensor-parallel parameters: those zero's parallel layers partition,
    and those a Megatron model marks with `tensor_model_parallel = True`."""
    ours = {id(p) for p in partitioned_parameters(model)}
    return frozenset(
        name
        for name, param in model.named_parameters()
        if id(param) in ours or getattr(param, "tensor_model_parallel", False)
    )
