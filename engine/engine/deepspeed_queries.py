"""DeepSpeed's queries on its engine, which training scripts and libraries call: one small mixin
of the Engine, each answer read from the config, the communicator or a part the engine holds.

The step counters (`global_steps`, `global_samples`, `skipped_steps`, `micro_steps`) and
`training_dataloader` are views of the training state (state.py), which checkpoints save and
load.
"""

import os

import torch
import torch.distributed as dist


def _counter(name: str, doc: str) -> property:
    def get(self) -> int:
        return getattr(self.state.counters, name)

    def set_(self, value: int) -> None:
        setattr(self.state.counters, name, value)

    return property(get, set_, doc=doc)


class DeepSpeedQueries:
    """Mixin of zero.engine.Engine: DeepSpeed's getters (DeepSpeedEngine's names). Not
    collectives."""

    global_steps = _counter("global_steps", "Optimizer steps taken, skipped ones included.")
    global_samples = _counter("global_samples", "Samples trained on: train_batch_size per step.")
    skipped_steps = _counter("skipped_steps", "Steps skipped for an fp16/bf16 overflow.")
    micro_steps = _counter("micro_steps", "Micro-batches counted toward accumulation.")

    @property
    def training_dataloader(self):
        """The data loader zero.initialize built from training_data, or one the script sets;
        save_checkpoint saves its state when it has state_dict()/load_state_dict()."""
        return self.state.loader

    @training_dataloader.setter
    def training_dataloader(self, loader) -> None:
        self.state.loader = loader

    @property
    def lr_scheduler(self):
        """The lr scheduler the engine steps (the client's or the config's), or None."""
        return self.state.lr_scheduler

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-batch ends a gradient accumulation: the value given to
        set_gradient_accumulation_boundary, else every gradient_accumulation_steps-th."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Global L2 gradient norm of the last optimizer step, before clipping (all ranks equal)."""
        norm = self.optimizer.global_grad_norm
        return None if norm is None else float(norm)

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    @property
    def global_rank(self) -> int:
        """Rank in the whole job (torch.distributed's rank; 0 without a process group)."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def comm_stats(self) -> dict:
        """Collective traffic of the last optimizer step on this rank: op -> {calls, elements,
        bytes, intra_elements, intra_bytes, inter_elements, inter_bytes}; elements in the paper's
        units (an all-reduce counts twice its size), split into what stays on this rank's node
        and what crosses nodes ([Note: intra- and inter-node volume] in comm/topology.py)."""
        stats = {}
        for op, t in self.comm.ledger.last_step.items():
            intra = {"intra_elements": t.intra_elements, "intra_bytes": t.intra_bytes}
            stats[op] = {**vars(t), **intra}
        if self.comm.timing is None:  # seconds only when comms_logger times collectives
            for totals in stats.values():
                totals.pop("seconds")
        return stats

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in memory per model-state kind: {"params", "frozen_params",
        "grads", "master", "optimizer_state"}: the trained parameters, the parameters no
        optimizer trains (all of them in an engine built without an optimizer: stage 3 its
        shards, stages 0-2 whole tensors), gradients in data_types.grad_accum_dtype, fp32
        masters, optimizer state; what nvme offload keeps in files counts 0 here, see
        engine.optimizer.nvme_bytes(). With hpZ (zero_hpz_partition_size > 1) also
        "secondary_params": the secondary parameter shards ([Note: hpZ] in
        partition/hierarchy.py), made by the first forward. Not a collective."""
        from ..planning.memory import frozen_param_bytes

        held = self.optimizer.model_state_bytes()
        out = {"params": held["params"], "frozen_params": frozen_param_bytes(self), **held}
        if self.gatherer is not None and self.gatherer.secondary is not None:
            out["secondary_params"] = self.gatherer.secondary_bytes()
        return out

    def memory_report(self) -> dict:
        """Bytes this rank holds per model-state category, measured from zero's tensors, next
        to the formula for the configured stage (planning/memory.py). Not a collective; optimizer
        state exists only after the first optimizer step."""
        from ..planning.memory import memory_report

        return memory_report(self)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save; DeepSpeed's method of
        this name (accelerate asks it before _zero3_consolidated_16bit_state_dict)."""
        return self.config.zero.stage3_gather_16bit_weights_on_model_save

    @property
    def inference_only(self) -> bool:
        """True for an engine built without an optimizer (ZeRO-Inference: forward, evaluation
        and generation; backward() and step() raise), see _optimizer_or_none."""
        return not self.optimizer.trains
