"""zero.config: the configuration a job runs with (DeepSpeed's JSON keys).

Owns: the pydantic schema (one model per block, every field described, unknown keys refused with a
"did you mean" hint), the file loaders (JSON, hjson, YAML), DeepSpeed's deprecated and
unsupported keys, the resolution of "auto" values and the batch-size triple, and DeepSpeed's
config names for scripts (DeepSpeedConfig, OffloadDeviceEnum).
May import: zero.errors only (and torch, pydantic, hjson, PyYAML).
Every block's model is exported here, as before the package was split.

Modules, lowest first (each imports only modules above it in this list):
  values.py             value types of fields (element / byte counts, dtypes, ...) and _Block
  errors.py             ConfigError, how values are shown, pydantic errors described as messages
  zero_optimization.py  the zero_optimization block (ZeroConfig, offload, leaf modules, ZeRO++)
  autotuning.py         the autotuning block (zrun --autotuning's search)
  schema.py             every other block, and Config
  parse.py              reading files and mappings: JSON / hjson / YAML, the checking walk
  deepspeed_keys.py     DeepSpeed's deprecated names, unsupported blocks and their warnings
  policy.py             what an unknown key is: an error (zero's API) or, under the DeepSpeed
                        doorway, dropped with one warning (KeyPolicy)
  auto.py               "auto" values and the batch-size triple
  load.py               load_config (runs the steps in order) and settings_without_effect
  deepspeed_config.py   DeepSpeedConfig: a loaded config under DeepSpeed's attribute names
"""

from .autotuning import AutotuningConfig, ModelInfoConfig
from .deepspeed_config import DeepSpeedConfig
from .errors import ConfigError, ConfigNotImplementedError
from .load import load_config, settings_without_effect
from .parse import read_mapping
from .policy import STRICT, KeyPolicy, current_key_policy, use_key_policy
from .schema import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    Config,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    MonitorConfig,
    OptimizerConfig,
    SchedulerConfig,
    TensorParallelConfig,
    TorchAutocastConfig,
    WandbConfig,
)
from .values import OffloadDeviceEnum
from .zero_optimization import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "AutotuningConfig",
    "BF16Config",
    "CheckpointConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "Config",
    "ConfigError",
    "ConfigNotImplementedError",
    "DataTypesConfig",
    "DeepSpeedConfig",
    "FlopsProfilerConfig",
    "FP16Config",
    "KeyPolicy",
    "ModelInfoConfig",
    "MonitorConfig",
    "OffloadDeviceEnum",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "STRICT",
    "SchedulerConfig",
    "TensorParallelConfig",
    "TorchAutocastConfig",
    "WandbConfig",
    "ZeroConfig",
    "current_key_policy",
    "load_config",
    "read_mapping",
    "settings_without_effect",
    "use_key_policy",
]
