"""DeepSpeed's engine API that zero answers without work of its own: one small mixin of the
Engine. Getters (each answer read from the config, the communicator or a part the engine holds),
DeepSpeed's aliases (destroy, _consolidated_16bit_state_dict), allreduce_gradients (zero reduced
in backward already) and the fallthrough to the wrapped model (__getattr__).

The step counters (`global_steps`, `global_samples`, `skipped_steps`, `micro_steps`) and
`training_dataloader` are views of the training state (state.py), which checkpoints save and
load.
"""

import os

import torch
import torch.distributed as dist

from . import guards
from .phase import Phase


def _counter(name: str, doc: str) -> property:
    def get(self) -> int:
        return getattr(self.state.counters, name)

    def set_(self, value: int) -> None:
        setattr(self.state.counters, name, value)

    return property(get, set_, doc=doc)


class DeepSpeedAPI:
    """Mixin of zero.engine.Engine: DeepSpeedEngine's getters and aliases. Not collectives
    unless said."""

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

    def destroy(self) -> None:
        """DeepSpeed's engine.destroy(): see close(), which it calls. Not a collective."""
        self.close()

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """DeepSpeed's name for the same state dict (it also covers AutoTP, which zero refuses):
        _zero3_consolidated_16bit_state_dict. Collective."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def allreduce_gradients(self, bucket_size: int = 500_000_000) -> None:
        """DeepSpeed's engine.allreduce_gradients(bucket_size): reduce the micro-batch's gradients
        over the data-parallel ranks. zero reduces them inside engine.backward() (stages 2-3
        every micro-batch, stages 0-1 at the accumulation boundary; [Note: gradient lifetime]
        in partition/stages.py), so after a backward there is nothing left to reduce and this
        returns without communicating: a DeepSpeed script that calls it after backward trains
        as it did there, and no gradient is reduced twice. `bucket_size` (elements, DeepSpeed's
        default 5e8) must be a positive int; zero's buckets follow
        zero_optimization.reduce_bucket_size instead.

        Not a collective in zero. Raises RuntimeError without a backward for the current
        micro-batch (there is no gradient to reduce), inside engine.no_sync() (the first
        backward after the context reduces the accumulated gradients), and after destroy();
        TypeError / ValueError for a bucket_size that is not a positive int."""
        self._refuse_closed("allreduce_gradients")
        guards.refuse_without_optimizer(self.optimizer, "engine.allreduce_gradients()")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
            raise TypeError(f"allreduce_gradients: bucket_size={bucket_size!r} is not an int")
        if bucket_size <= 0:
            raise ValueError(
                f"allreduce_gradients: bucket_size={bucket_size} must be a positive number of "
                "elements"
            )
        if self._no_sync:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.allreduce_gradients() inside engine.no_sync(); "
                "zero reduces the gradients accumulated there in the first backward after the "
                "context: leave the context instead"
            )
        if self.phase is not Phase.BACKWARD:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.allreduce_gradients() called without "
                "engine.backward() for this micro-batch; call it after backward (where zero "
                "has already reduced the gradients), or drop the call"
            )

    def __getattr__(self, name: str):
        """DeepSpeed's fallthrough (DeepSpeedEngine.__getattr__): a name that neither the
        engine nor nn.Module's own lookup (parameters, buffers, submodules such as
        engine.module) finds is looked up on the wrapped model, so
        engine.gradient_checkpointing_enable() or engine.generate(...) reach it. The engine's
        own attributes win (engine.config is zero's Config, not the model's config); names the
        engine's class defines (a property that raised AttributeError) and dunder names never
        fall through. Raises AttributeError when the model lacks the name too."""
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            missing = error
        modules = self.__dict__.get("_modules")  # absent early in __init__: no recursion
        module = modules.get("module") if modules is not None else None
        dunder = name.startswith("__") and name.endswith("__")
        if module is None or dunder or hasattr(type(self), name):
            raise missing
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}', nor has its model "
                f"({type(module).__name__})"
            ) from None
