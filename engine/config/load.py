"""Loading a config: ``load_config`` runs the steps below in order; ``settings_without_effect``.

1. read the source (path to .json/.hjson/.yaml/.yml, a mapping, or an existing ``Config``);
   YAML reads 1e-3 as a float, like JSON. A file over 256 KiB is refused before it is read,
   and a config of more than 5,000 values (YAML aliases expanded) as soon as the parser or the
   walk passes that many ([Note: size limits]). One walk over the data refuses a key given
   twice in one mapping, keys that are not strings, nesting deeper than 100 levels and
   non-finite numbers anywhere (parse.py, see [Note: what the checking walk refuses]);
2. map deprecated DeepSpeed names to their current ones (each with a ``FutureWarning``), and
   DeepSpeed's unprefixed names of the stage3_ keys to the prefixed ones (deepspeed_keys.py);
3. replace ``"auto"`` values from ``auto_values`` (Hugging Face style configs); an "auto"
   bucket size or threshold nothing fills takes its default, said in one info line (auto.py);
4. validate against the schema (schema.py; one ``ConfigError`` naming the dotted key on
   failure, errors.py; an unknown key is an error, or dropped with one warning where the key
   policy ignores it, policy.py; keys whose non-default value would change what is trained and that
   zero does not implement, ZeRO++ quantization, torch_autocast, AutoTP, weight_quantization and
   the like, are errors unless at their defaults);
5. derive the batch triple for the data-parallel world size (auto.py);
6. drop zero_optimization.offload_param below stage 3, which DeepSpeed ignores there, with one
   warning naming the key, and warn once per enabled block zero ignores (pipeline, ...;
   deepspeed_keys.py). Enabled blocks that would change training (amp, elasticity, ...) are
   refused at step 4 (subsystems.py).
"""

import logging
import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from .auto import _derive_batch, _resolve_auto
from .deepspeed_keys import _ignore_param_offload, _map_deprecated, _warn_unsupported
from .errors import ConfigError, _config_error, _walk
from .parse import _read_source
from .policy import KeyPolicy, current_key_policy, warn_ignored
from .schema import Config
from .values import _freeze, _thaw

logger = logging.getLogger("zero")

__all__ = ["load_config", "settings_without_effect"]


def load_config(
    source: "str | os.PathLike[str] | Mapping[str, Any] | Config",
    *,
    world_size: int = 1,
    auto_values: Mapping[str, Any] | None = None,
    notes: list[str] | None = None,
    key_policy: KeyPolicy | None = None,
) -> Config:
    """Load, validate and resolve a DeepSpeed-style config.

    Args:
        source: path to a .json (read with hjson, so comments work), .hjson, .yaml or .yml file;
            a mapping; or an existing ``Config``, which is re-validated for ``world_size``.
        world_size: data-parallel world size used to derive the batch triple.
        auto_values: values for ``"auto"`` entries, by dotted key (e.g.
            ``{"train_micro_batch_size_per_gpu": 8, "optimizer.params.lr": 1e-3}``); a
            ``"hidden_size"`` entry fills "auto" reduce_bucket_size (h*h),
            stage3_prefetch_bucket_size (0.9*h*h) and stage3_param_persistence_threshold (10*h).
            An "auto" bucket size or threshold in zero_optimization that nothing fills takes
            the field's default (see [Note: "auto" that takes the default] in auto.py).
        notes: when given, the info lines about how the config was resolved (the "auto"
            entries that took defaults; at most one line) are appended here instead of being
            logged to the "zero" logger, so a caller without a log handler yet (zero.initialize)
            can log them once it has one.
        key_policy: what an unknown key is (policy.py): default the process's current policy,
            STRICT (an error) unless the DeepSpeed doorway set DeepSpeed's (dropped with one
            warning, outside the blocks DeepSpeed validates strictly).

    Returns:
        An immutable ``Config`` whose three batch keys are ints.

    Raises:
        ConfigError: missing, unreadable, non-UTF-8, unparsable or too large (over 256 KiB,
            or over 5,000 values with YAML aliases expanded) file or mapping, non-finite
            number or nesting deeper than 100 levels anywhere, unknown key, invalid value,
            broken cross-field rule, unresolved "auto", or a batch triple that does not fit
            ``world_size``. The message names the dotted key, the value and the fix (and the
            file, if any).
        ConfigNotImplementedError (a ConfigError and a NotImplementedError): only valid
            DeepSpeed settings zero does not implement and would change the run if ignored
            (ZeRO++'s quantized collectives, torch_autocast, AutoTP, ...).

    Warns:
        UserWarning, once per key per process, for each unknown key the key policy ignores;
        FutureWarning for each deprecated DeepSpeed name; UserWarning for enabled blocks of
        subsystems zero does not support, and for zero_optimization.offload_param with a device
        below stage 3 (ignored, as DeepSpeed does: the returned config has no offload_param).
    """
    found: list[str] = []
    if isinstance(source, Config):
        where = "config: "
        data = _thaw(source._source or source.model_dump(exclude_unset=True))
    else:
        where, data = _read_source(source)
        data = _map_deprecated(data, where)
        if auto_values is not None and not isinstance(auto_values, Mapping):
            raise ConfigError(
                "auto_values must be a mapping of dotted keys to values, got "
                f"{type(auto_values).__name__}."
            )
        data = _resolve_auto(data, auto_values or {}, where, found)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}.")
    config, data = _validate(data, where, key_policy or current_key_policy())
    train, micro, gas = _derive_batch(
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
        world_size,
        where,
    )
    config = config.model_copy(
        update={
            "train_batch_size": train,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
        }
    )
    first = not isinstance(source, Config)  # a Config's first load already warned
    config = _ignore_param_offload(config, where, warn=first)
    config._source = _freeze(data)
    if first:
        _warn_unsupported(config, where)
    if notes is not None:
        notes.extend(found)
    else:
        for line in found:
            logger.info(line)
    return config


def _validate(data: dict, where: str, policy: KeyPolicy) -> tuple[Config, dict]:
    """(Config, the data it was built from): `data` validated, less the unknown keys `policy`
    ignores (each warned about once). Raises the ConfigError of every other problem."""
    try:
        return Config.model_validate(data), data
    except ValidationError as err:
        ignored = [
            e["loc"]
            for e in err.errors()
            if e["type"] == "extra_forbidden" and policy.ignores(tuple(e["loc"]))
        ]
        if not ignored:
            raise _config_error(err, where, Config) from None
    for loc in ignored:
        block, _ = _walk(Config, loc)
        known = list(block.model_fields) if block is not None else []
        warn_ignored(loc, known, where, policy)
        parent = data
        for part in loc[:-1]:
            parent = parent[part]
        del parent[loc[-1]]
    try:
        return Config.model_validate(data), data
    except ValidationError as err:
        raise _config_error(err, where, Config) from None


def settings_without_effect(config: Config, *, model_parallel_world_size: int) -> list[str]:
    """Lines naming what ``config`` asks for that has no effect in this run (empty when none).

    zero.initialize logs them once at INFO (shown on rank 0): settings that are inert because
    of how the run is set up, and switches of DeepSpeed features zero does not have that a user
    would otherwise wait for (wandb, comet, gradient pre-division).

    Args:
        config: a loaded config.
        model_parallel_world_size: ranks in the model-parallel (tensor-parallel) group; 1
            without model parallelism (no mpu).
    """
    lines = []
    block = config.activation_checkpointing
    if block.partition_activations and model_parallel_world_size == 1:
        # Pa keeps a 1/mp slice of an input that every model-parallel rank holds in full; with
        # mp = 1 the slice is the whole input (activation.py's _KeptInputs skips partitioning).
        lines.append(
            "activation_checkpointing.partition_activations has no effect without model "
            "parallelism (model-parallel world size 1): checkpointed activations are not "
            "replicated across a model-parallel group, so each rank keeps them whole "
            "(cpu_checkpointing and contiguous_memory_optimization still apply). Set it to "
            "false, or pass an mpu whose model-parallel size is above 1."
        )
    if config.wandb.enabled:
        lines.append(
            "wandb.enabled: zero does not log to Weights & Biases; its step metrics go to "
            "tensorboard or csv_monitor (docs/observability.md), or log engine values from the "
            "training script."
        )
    if config.comet.enabled:
        lines.append(
            "comet.enabled: zero does not log to Comet; its step metrics go to tensorboard or "
            "csv_monitor (docs/observability.md), or log engine values from the training script."
        )
    if config.aio.use_gds:
        lines.append(
            "aio.use_gds: zero's nvme offload reads and writes through host buffers "
            "(zero.ops.aio), not GPUDirect Storage."
        )
    if config.prescale_gradients or config.gradient_predivide_factor != 1.0:
        lines.append(
            "prescale_gradients / gradient_predivide_factor: zero sums gradients over ranks "
            "and divides once after the reduction, in fp32 or communication_data_type; "
            "these keys do not change that."
        )
    return lines
