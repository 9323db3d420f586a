"""zero's own model-parallel unit: data-parallel x model-parallel process groups.

    mpu = zero.mpu.initialize_model_parallel(2)          # 4 ranks -> 2 (data) x 2 (model)
    engine, *_ = zero.initialize(model=model, config=cfg, mpu=mpu)

The object answers the Megatron-style questions zero.initialize and zero.checkpointing ask of any
mpu (get_model_parallel_rank/world_size/group, get_data_parallel_rank/world_size/group), so a
user's own Megatron mpu and this one are interchangeable.

[Note: rank layout]
Model-parallel groups are runs of consecutive ranks, data-parallel groups are strided, as in
Megatron: with world size 4 and model-parallel size 2 the model-parallel groups are {0, 1} and
{2, 3}, the data-parallel groups {0, 2} and {1, 3}. Consecutive ranks share a node first, so the
chatty tensor-parallel all-reduces (two per layer per pass) stay inside a node while ZeRO's
once-per-step reduce-scatter / all-gather crosses nodes.

[Note: gradient norm with model parallelism]
A tensor-parallel parameter holds a different slice on every model-parallel rank; a replicated
parameter (a LayerNorm, a row-parallel bias, an embedding that is not vocab-parallel) holds the
same values and the same gradient on all of them. The global norm therefore sums, over the
model-parallel group, each rank's tensor-parallel elements plus the replicated elements of
model-parallel rank 0 only. ModelParallelNorm does that count for the ZeRO optimizer.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import Communicator, init_process_group, new_group, read_launch_env


class ModelParallelGroups:
    """Process groups of a data-parallel x model-parallel layout (see [Note: rank layout]).

    Build it with initialize_model_parallel(). Every query is local (no communication).
    """

    def __init__(self, model_parallel_size: int, rank: int, world_size: int, groups: dict):
        self.model_parallel_size = model_parallel_size
        self.data_parallel_size = world_size // model_parallel_size
        self.rank = rank
        self.world_size = world_size
        self._mp_group = groups["model"]
        self._dp_group = groups["data"]
        self.model_parallel = Communicator(
            self._mp_group, rank % model_parallel_size, model_parallel_size
        )
        self.data_parallel = Communicator(
            self._dp_group, rank // model_parallel_size, self.data_parallel_size
        )

    # Megatron names (older, and the tensor_ spelling of newer releases).
    def get_model_parallel_rank(self) -> int:
        return self.model_parallel.rank

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel.world_size

    def get_model_parallel_group(self):
        return self._mp_group

    def get_model_parallel_src_rank(self) -> int:
        """Global rank of model-parallel rank 0 in this rank's model-parallel group."""
        return self.rank - self.model_parallel.rank

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel.rank

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel.world_size

    def get_data_parallel_group(self):
        return self._dp_group

    def __repr__(self) -> str:
        return (
            f"ModelParallelGroups(rank={self.rank}, model_parallel={self.model_parallel_size}, "
            f"data_parallel={self.data_parallel_size})"
        )


def initialize_model_parallel(model_parallel_size: int) -> ModelParallelGroups:
    """Split the world into data-parallel x model-parallel groups (Megatron layout).

    Initializes torch.distributed from the launcher's environment when no default group exists
    (as zero.initialize would); a process without a launcher is a world of one.
    Collective: every rank calls it with the same size. Raises ValueError when
    model_parallel_size is not a positive divisor of the world size.
    """
    if isinstance(model_parallel_size, bool) or not isinstance(model_parallel_size, int):
        raise TypeError(f"model_parallel_size must be an int, got {model_parallel_size!r}")
    launch = read_launch_env()
    if launch is not None and not dist.is_initialized():
        from ..accelerator import detect_accelerator

        init_process_group(detect_accelerator(launch.local_rank).backend, launch)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    if model_parallel_size < 1 or world_size % model_parallel_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"rank {rank}: model_parallel_size={model_parallel_size} must divide the world size "
            f"{world_size}; choose one of {divisors}"
        )
    groups = {"model": None, "data": None}
    if distributed:
        num_mp_groups = world_size // model_parallel_size
        # Every rank creates every group, in the same order (torch.distributed's rule).
        for g in range(num_mp_groups):
            ranks = list(range(g * model_parallel_size, (g + 1) * model_parallel_size))
            group = new_group(ranks)
            if rank in ranks:
                groups["model"] = group
        for m in range(model_parallel_size):
            ranks = list(range(m, world_size, model_parallel_size))
            group = new_group(ranks)
            if rank in ranks:
                groups["data"] = group
    return ModelParallelGroups(model_parallel_size, rank, world_size, groups)


def model_parallel_comm(mpu) -> Communicator:
    """A Communicator over `mpu`'s model-parallel group (world of one for mpu None).

    Accepts zero's ModelParallelGroups (returns its own communicator, whose ledger counts the
    tensor-parallel and activation traffic) and any Megatron-style mpu, with either the
    get_model_parallel_* or the get_tensor_model_parallel_* names.
    """
    if mpu is None:
        return Communicator(None, 0, 1)
    if isinstance(mpu, ModelParallelGroups):
        return mpu.model_parallel
    for prefix in ("get_model_parallel_", "get_tensor_model_parallel_"):
        if hasattr(mpu, prefix + "group"):
            return Communicator(
                getattr(mpu, prefix + "group")(),
                getattr(mpu, prefix + "rank")(),
                getattr(mpu, prefix + "world_size")(),
            )
    raise TypeError(
        f"mpu {type(mpu).__name__} has no get_model_parallel_group(); pass a Megatron-style "
        "model-parallel unit or zero.mpu.initialize_model_parallel(size)"
    )


@dataclass(frozen=True)
class ModelParallelNorm:
    """How the ZeRO optimizer counts gradient elements in the global norm with model parallelism
    (see [Note: gradient norm with model parallelism]).

    comm: the model-parallel Communicator (its all-reduce finishes the norm).
    partitioned: names (as in model.named_parameters()) of the tensor-parallel parameters.
    """

    comm: Communicator
    partitioned: frozenset

    def shard_squares(self, layout, shard: torch.Tensor, shard_index: int) -> torch.Tensor:
        """Sum of squares of the counted elements of one bucket's owned gradient shard.

        layout: the bucket's BucketLayout; shard: its owned fp32 gradient slice (elements
        [begin, end) of the bucket for shard `shard_index`). Local, no communication.
        """
        if self.comm.rank == 0:
            return torch.linalg.vector_norm(shard).square()
        begin, end = layout.owned_range(shard_index)
        total = torch.zeros((), dtype=torch.float32, device=shard.device)
        for slot in layout.slots:
            lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, end)
            if lo < hi and slot.name in self.partitioned:
                total += torch.linalg.vector_norm(shard[lo - begin : hi - begin]).square()
        return total

    def finish(self, squares: torch.Tensor) -> None:
        """Sum the per-rank squares over the model-parallel group, in place. Collective."""
        self.comm.all_reduce(squares)
