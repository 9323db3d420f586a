"""``DeepSpeedConfig``: DeepSpeed's deepspeed.runtime.config.DeepSpeedConfig over a loaded Config.

Scripts build DeepSpeed's config object from a dict or a path to read what a job will run with
(``DeepSpeedConfig(ds_config).train_micro_batch_size_per_gpu``, ``.zero_optimization_stage``).
This class loads the source through ``load_config`` (same checks, same errors, same resolved
batch triple) and exposes the loaded values under DeepSpeed's attribute names. It holds no
behaviour of its own: zero.initialize never reads it.
"""

import math
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from .load import load_config
from .schema import Config
from .values import _thaw

__all__ = ["DeepSpeedConfig"]

# DeepSpeed lowercases optimizer.type for its own optimizers (runtime/config.py,
# DEEPSPEED_OPTIMIZERS) and keeps other names, torch.optim class names, as written.
_DEEPSPEED_OPTIMIZER_NAMES = (
    "adagrad",
    "adam",
    "adamw",
    "lamb",
    "onebitadam",
    "onebitlamb",
    "zerooneadam",
    "muadam",
    "muadamw",
    "musgd",
    "lion",
    "muon",
)


class DeepSpeedConfig:
    """A loaded config read through DeepSpeed's attribute names (DeepSpeedConfig, 0.19).

    Args:
        config: a dict, or a path to a .json / .hjson / .yaml / .yml file (anything
            ``load_config`` accepts, a ``Config`` included).
        mpu: a Megatron-style model-parallel unit; the data-parallel world size is then
            ``mpu.get_data_parallel_world_size()``, as in DeepSpeed.
        mesh_device: DeepSpeed's device mesh; not supported (NotImplementedError).

    The batch triple is derived for the data-parallel world size: the mpu's, else
    torch.distributed's world size once the default process group exists, else 1. Not a
    collective: it reads group sizes only.

    Attributes (DeepSpeed's names; values as zero.initialize would use them):
        train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps: ints.
        world_size, global_rank: data-parallel world size used above; this process's rank (0
            without a process group).
        steps_per_print: int, or float("inf") for never (Accelerate's value).
        zero_config: the zero_optimization block (``zero.config.ZeroConfig``; DeepSpeed's field
            names: stage, offload_optimizer, offload_param, reduce_bucket_size, ...).
        zero_optimization_stage: int 0-3; zero_enabled: stage > 0.
        float16_config, bfloat16_config: the fp16 / bf16 blocks (``.enabled``, ``.loss_scale``,
            ...); fp16_enabled, bfloat16_enabled: their ``enabled`` (DeepSpeed before 0.17.1).
        fp16_master_weights_and_gradients: fp16.fp16_master_weights_and_grads (old name).
        gradient_clipping, prescale_gradients, gradient_predivide_factor,
        gradient_allreduce_op, wall_clock_breakdown, memory_breakdown, dataloader_drop_last,
        zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer: the top-level keys.
        optimizer_name, optimizer_params, scheduler_name, scheduler_params: from the optimizer
            and scheduler blocks (None when absent); DeepSpeed's own optimizer names lowercased.
        activation_checkpointing_config: the activation_checkpointing block.
        config: the zero ``Config`` itself.

    Reading any other DeepSpeed attribute raises AttributeError naming it.

    Raises:
        ConfigError: everything load_config raises (unknown key, bad value, batch triple that
            does not fit the world size, ...), naming the dotted key.
        NotImplementedError: mesh_device given.
    """

    def __init__(
        self,
        config: "str | os.PathLike[str] | Mapping[str, Any] | Config",
        mpu=None,
        mesh_device=None,
    ) -> None:
        if mesh_device is not None:
            raise NotImplementedError(
                "DeepSpeedConfig(mesh_device=...): zero has no device mesh; pass mpu= (a "
                "Megatron-style model-parallel unit) or nothing for data parallelism over "
                "every rank."
            )
        started = dist.is_available() and dist.is_initialized()
        if mpu is not None:
            self.world_size = int(mpu.get_data_parallel_world_size())
        else:
            self.world_size = dist.get_world_size() if started else 1
        self.global_rank = dist.get_rank() if started else 0
        self.config = load_config(config, world_size=self.world_size)
        # DeepSpeed keeps the dict it was given; here, the data after deprecated names and
        # "auto" values were resolved (what was validated).
        self._param_dict = config if isinstance(config, dict) else _thaw(self.config._source)
        self._read(self.config)

    def _read(self, cfg: Config) -> None:
        self.train_batch_size = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.steps_per_print = math.inf if cfg.steps_per_print is None else cfg.steps_per_print
        self.zero_config = cfg.zero
        self.zero_optimization_stage = cfg.zero.stage
        self.zero_enabled = cfg.zero.stage > 0
        self.float16_config = cfg.fp16
        self.bfloat16_config = cfg.bf16
        self.fp16_enabled = cfg.fp16.enabled
        self.bfloat16_enabled = cfg.bf16.enabled
        self.fp16_master_weights_and_gradients = cfg.fp16.fp16_master_weights_and_grads
        for key in (
            "gradient_clipping",
            "prescale_gradients",
            "gradient_predivide_factor",
            "gradient_allreduce_op",
            "wall_clock_breakdown",
            "memory_breakdown",
            "dataloader_drop_last",
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
        ):
            setattr(self, key, getattr(cfg, key))
        optimizer, scheduler = cfg.optimizer, cfg.scheduler
        name = optimizer.type if optimizer is not None else None
        if name is not None and name.lower() in _DEEPSPEED_OPTIMIZER_NAMES:
            name = name.lower()
        self.optimizer_name = name
        self.optimizer_params = _thaw(optimizer.params) if optimizer is not None else None
        self.scheduler_name = scheduler.type if scheduler is not None else None
        self.scheduler_params = _thaw(scheduler.params) if scheduler is not None else None
        self.activation_checkpointing_config = cfg.activation_checkpointing

    def __getattr__(self, name: str) -> Any:
        # Only reached for names __init__ did not set.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"zero's DeepSpeedConfig has no attribute {name!r}: it exposes the batch sizes, "
            "ZeRO stage, precision, clipping, optimizer and scheduler under DeepSpeed's names "
            "(see its docstring); read other settings from its .config (zero.config.Config, "
            "DeepSpeed's key names, e.g. .config.zero_optimization.offload_param)."
        )

    def __repr__(self) -> str:
        return (
            f"DeepSpeedConfig(train_batch_size={self.train_batch_size}, "
            f"train_micro_batch_size_per_gpu={self.train_micro_batch_size_per_gpu}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
            f"zero_optimization_stage={self.zero_optimization_stage}, "
            f"world_size={self.world_size})"
        )
