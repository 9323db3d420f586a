"""The planner's verdict on a candidate before it runs: its peak bytes per rank and whether that
fits (zero.planning: estimator.estimate_stage, footprint's activations and peak), from the model
facts the probe run reported (zero.autotuning) and the memory each rank may use."""

import dataclasses

import torch

from zero.config import AutotuningConfig, load_config
from zero.planning.estimator import (
    Cluster,
    Estimate,
    Options,
    activation_terms,
    count_layout,
    estimate_stage,
    shard_count,
)
from zero.planning.footprint import TransformerShape

from .space import without_auto

SHAPE_KEYS = ("num_layers", "hidden_size", "seq_len", "vocab_size")


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the probe run reported (zero.autotuning), with autotuning.model_info's values on
    top. num_params: Psi; runtime_bytes: a rank's memory that is not predicted tensors (the
    probe's measured peak less its predicted one: the Python and torch runtime, the script's
    data); the shape entries may be None (then activations are not predicted)."""

    num_params: int
    runtime_bytes: int = 0
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    seq_len: int | None = None

    @classmethod
    def from_probe(cls, record: dict, tuning: AutotuningConfig) -> "ModelFacts":
        values = {f.name: record.get(f.name) for f in dataclasses.fields(cls)}
        values["runtime_bytes"] = 0
        info = tuning.model_info
        if info is not None:
            for key in ("num_params", "hidden_size", "num_layers"):
                if getattr(info, key) is not None:
                    values[key] = getattr(info, key)
        return cls(**values)

    def shape(self, micro_batch: int) -> TransformerShape | None:
        if any(getattr(self, key) is None for key in SHAPE_KEYS):
            return None
        return TransformerShape(
            self.num_layers,
            self.hidden_size,
            self.seq_len,
            micro_batch,
            self.vocab_size,
            self.num_heads or 1,
        )


@dataclasses.dataclass(frozen=True)
class Machine:
    """nodes x ranks_per_node ranks; memory_per_rank: bytes a rank may use (device memory on
    CUDA, its share of host memory on CPU ranks); host_memory: bytes per node."""

    nodes: int
    ranks_per_node: int
    memory_per_rank: int
    host_memory: int
    cpu: bool

    @classmethod
    def here(cls, nodes: int, ranks_per_node: int, tuning: AutotuningConfig) -> "Machine":
        """This machine's kind of rank; every node is assumed alike."""
        import psutil

        host = psutil.virtual_memory().total
        cpu = not torch.cuda.is_available()
        if tuning.max_memory_per_rank is not None:
            per_rank = tuning.max_memory_per_rank
        elif cpu:
            per_rank = host // ranks_per_node
        else:
            per_rank = torch.cuda.get_device_properties(0).total_memory
        return cls(nodes, ranks_per_node, per_rank, host, cpu)

    def cluster(self) -> Cluster:
        # CPU ranks keep everything in host memory: their budget is the node's share of it.
        host = self.memory_per_rank * self.ranks_per_node if self.cpu else self.host_memory
        return Cluster(self.nodes, self.ranks_per_node, self.memory_per_rank, host)


def predict(candidate_config: dict, facts: ModelFacts, machine: Machine) -> Estimate:
    """The planner's row for one candidate config (a DeepSpeed mapping): per_device is the
    predicted peak bytes of one rank, fits whether it stays within the budget less the
    estimate's headroom. Raises ConfigError for a config zero would refuse."""
    cluster = machine.cluster()
    config = load_config(without_auto(candidate_config), world_size=cluster.world_size)
    options = Options.from_config(
        config,
        cpu=machine.cpu,
        runtime_bytes=facts.runtime_bytes,
        checkpointing="activation_checkpointing" in config.model_fields_set,
    )
    stage = config.zero.stage
    layout = count_layout(
        facts.num_params, shard_count(stage, cluster, options), options.bucket_numel
    )
    shape = facts.shape(config.train_micro_batch_size_per_gpu)
    activations, retention = activation_terms(shape, options)
    device = config.zero.offload_optimizer.device
    offload = device != "none"
    return estimate_stage(
        layout,
        stage,
        offload,
        cluster,
        options,
        activations,
        retention,
        device if offload else None,
    )
