"""zero: ZeRO distributed training for PyTorch (arXiv 1910.02054).

    engine, optimizer, dataloader, lr_scheduler = zero.initialize(model=model, config="zero2.json")

Names are imported on first use, so `zrun` (zero.launcher) starts without importing torch.
"""

import importlib
import importlib.abc
import importlib.util
import sys

_EXPORTS = {
    "CheckpointError": "checkpoint",
    "GatheredParameters": "partition.gathered",
    "Init": "partition.init",
    "RankMismatchError": "comm",
    "initialize": "api",
    "add_config_arguments": "api",
    "is_compile_supported": "api",
    "init_distributed": "comm",
    "Engine": "engine",
    "Config": "config",
    "ConfigError": "config",
    "load_config": "config",
    "load_pretrained": "checkpoint.hf",
}

# Modules scripts and docs name as zero.X whose code lives in a subpackage: `from zero import mpu`
# and `import zero.mpu` both give zero.model_parallel.mpu. zero.checkpointing is DeepSpeed's
# deepspeed.checkpointing (activation checkpointing, ZeRO-R).
_ALIASES = {
    "checkpointing": "model_parallel.activation",
    "mpu": "model_parallel.mpu",
    "tensor_parallel": "model_parallel.tensor_parallel",
    "lr_schedules": "optim.lr_schedules",
    "init": "partition.init",
    "hf": "checkpoint.hf",
    "estimator": "planning.estimator",
    "footprint": "planning.footprint",
    "zero_to_fp32": "checkpoint.zero_to_fp32",
}

# Submodules reachable as attributes (imported on first use).
_MODULES = {
    **_ALIASES,
    **{name: name for name in ("checkpoint", "comm", "config", "ops", "optim", "utils", "zero")},
    **{name: name for name in ("launcher", "model_parallel", "offload", "partition", "planning")},
}

__all__ = sorted([*_EXPORTS, *_MODULES, "__version__"])


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `zero.<alias>` (an _ALIASES key) as the module it names, so `import zero.mpu` and
    `from zero.hf import ...` keep working; the module keeps its own name and spec."""

    _own_specs: dict = {}

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _ALIASES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{_ALIASES[spec.name.rpartition('.')[2]]}")
        self._own_specs[spec.name] = module.__spec__  # the import system then sets the alias's
        return module

    def exec_module(self, module):
        module.__spec__ = self._own_specs.pop(module.__spec__.name)

    def get_code(self, fullname):
        """`python -m zero.<alias>` runs the module it names as __main__."""
        target = f"{__name__}.{_ALIASES[fullname.rpartition('.')[2]]}"
        source = f"import runpy\nrunpy.run_module({target!r}, run_name='__main__', alter_sys=True)"
        return compile(source, f"<zero alias {fullname}>", "exec")


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.append(_AliasFinder())


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
