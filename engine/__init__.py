"""zero: ZeRO distributed training for PyTorch (arXiv 1910.02054).

    engine, optimizer, dataloader, lr_scheduler = zero.initialize(model=model, config="zero2.json")

Names are imported on first use, so `zrun` (zero.launcher) starts without importing torch.
"""

import importlib

_EXPORTS = {
    "CheckpointError": "checkpoint",
    "GatheredParameters": "gathered",
    "Init": "init",
    "RankMismatchError": "comm",
    "initialize": "api",
    "add_config_arguments": "api",
    "is_compile_supported": "api",
    "init_distributed": "comm",
    "Engine": "engine",
    "Config": "config",
    "ConfigError": "config",
    "load_config": "config",
    "load_pretrained": "hf",
}

# Submodules reachable as attributes: zero.checkpointing is engine/activation.py (DeepSpeed's
# deepspeed.checkpointing); zero.mpu and zero.tensor_parallel are model parallelism (ZeRO-R).
_MODULES = {
    "checkpointing": "activation",
    "mpu": "mpu",
    "tensor_parallel": "tensor_parallel",
    "checkpoint": "checkpoint",
    "config": "config",
    "optim": "optim",
    "lr_schedules": "lr_schedules",
    "ops": "ops",
    "init": "init",
    "utils": "utils",
    "hf": "hf",
    "comm": "comm",
    "zero": "zero",  # deepspeed.zero's names: zero.zero.Init, zero.zero.GatheredParameters
}

__all__ = sorted([*_EXPORTS, *_MODULES, "__version__"])


def _version() -> str:
    """The installed distribution's version, else (a source tree on PYTHONPATH) setup.py's."""
    import os
    import re
    from importlib import metadata

    try:
        return metadata.version("zero")
    except metadata.PackageNotFoundError:
        pass
    setup = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "setup.py")
    try:
        with open(setup, encoding="utf-8") as handle:
            found = re.search(r"""\bversion\s*=\s*["']([^"']+)["']""", handle.read())
    except OSError:
        found = None
    return found.group(1) if found else "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        value = globals()["__version__"] = _version()
        return value
    if name in _MODULES:
        value = importlib.import_module(f".{_MODULES[name]}", __name__)
        globals()[name] = value
        return value
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zero' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
