"""zero.config: the configuration a job runs with (DeepSpeed's JSON keys).

Owns: the pydantic schema (one model per block, every field described, unknown keys refused with a
"did you mean" hint), the file loaders (JSON, hjson, YAML), DeepSpeed's deprecated and
unsupported keys, and the resolution of "auto" values and the batch-size triple.
May import: zero.errors only (and torch, pydantic, hjson, PyYAML).
"""

from .schema import (
    ActivationCheckpointingConfig,
    AioConfig,
    Config,
    ConfigError,
    ZeroConfig,
    load_config,
    settings_without_effect,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "Config",
    "ConfigError",
    "ZeroConfig",
    "load_config",
    "settings_without_effect",
]
