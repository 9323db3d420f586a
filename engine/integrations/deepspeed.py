"""DeepSpeed's module paths served by zero: `import deepspeed` under zero-as-deepspeed.

TABLE lists the DeepSpeed module paths whose names map to zero's objects (deepspeed,
deepspeed.runtime.engine, deepspeed.accelerator, ...) and the zero object behind each of those
names; the catalog serves every other path and name ([Note: the whole surface]). Once the doorway's
`deepspeed` package (doorway/deepspeed/__init__.py) is imported, it calls install(), which puts
_DoorwayFinder first in sys.meta_path and the module of the path "deepspeed" in sys.modules in
the package's place. Each path is one module object (however it is imported) whose names resolve on
first use, so `import deepspeed` imports neither torch nor the engine, and
`from deepspeed import DeepSpeedEngine` gives zero.Engine itself (isinstance checks hold).

Behaviour lives in zero's own modules; this module only maps names, except for DeepSpeed's small
helpers that have no other home (clone_tensors_for_torch_save, recursive_getattr,
recursive_setattr, required_torch_version, unwrap_model_for_generation,
DEEPSPEED_ENVIRONMENT_NAME), which are real functions here, and DeepSpeed's config key policy
(use_deepspeed_key_policy: unknown keys as DeepSpeed treats them, docs/config.md).

[Note: the whole surface]
Every module path and public name of DeepSpeed 0.19.8 resolves: deepspeed_catalog.json lists
them, generated from DeepSpeed's own source by tools/deepspeed_catalog.py (zero never imports
DeepSpeed). A path in TABLE or the catalog is one module object; its names resolve, in order, to
TABLE's zero object, the all_of module's name, the catalog's literal constant, the object behind
a name the DeepSpeed module imports from another (`deepspeed.utils.logger` is
`deepspeed.utils.logging.logger`, one object under both names), and otherwise a Placeholder
(placeholder.py) that imports without error and fails, naming itself, when it is used. A TABLE
name whose zero object is missing (an older zero) is a placeholder too. A name or path that
DeepSpeed 0.19.8 does not have raises as Python does: ModuleNotFoundError for `import
deepspeed.x`, ImportError for `from deepspeed import x`, AttributeError for `deepspeed.x`.
So the doorway needs no look at how a name is being imported.
"""

import contextlib
import copy
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import doorway
from .placeholder import Placeholder

logger = logging.getLogger("zero")

# The DeepSpeed release whose API the doorway follows; `deepspeed.__version__` is this with
# zero's version as the local label (doorway_version()).
DEEPSPEED_API_VERSION = "0.19.8"
API_VERSION_MAJOR, API_VERSION_MINOR, API_VERSION_PATCH = (
    int(part) for part in DEEPSPEED_API_VERSION.split(".")
)

# What zero-as-deepspeed puts on PYTHONPATH (and its bin/ on PATH).
DOORWAY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "doorway")
MIGRATION_DOC = "docs/migrating-from-deepspeed.md"

# DeepSpeed's deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME: the name of the files
# (~/NAME, ./NAME) of KEY=VALUE lines the launcher sets on every node of a multi-node job.
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")


def doorway_version() -> str:
    """`deepspeed.__version__` and the doorway dist-info's version: DeepSpeed's API version with
    zero's version as the local label, e.g. "0.19.8+zero.0.1.0" (so version checks against
    DeepSpeed releases pass, and `pip list` says it is zero)."""
    import zero

    label = re.sub(r"[^0-9A-Za-z]+", ".", zero.__version__).strip(".").lower()
    return f"{DEEPSPEED_API_VERSION}+zero.{label}"


def __getattr__(name: str):
    # DOORWAY_VERSION is computed on first use: zero.__version__ reads package metadata.
    if name == "DOORWAY_VERSION":
        value = globals()["DOORWAY_VERSION"] = doorway_version()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# DeepSpeed's small helpers


def clone_tensors_for_torch_save(item, device="cpu"):
    """DeepSpeed's deepspeed.checkpoint.utils.clone_tensors_for_torch_save: `item` with every
    tensor in it (at any depth of lists, tuples and dicts) replaced by a detached copy on
    `device` (a torch.device or its name, default "cpu"), so torch.save writes each tensor's own
    elements instead of the whole storage a view shares. Shapes and dtypes are kept; the copy
    never shares memory with the original (DeepSpeed returns the tensor itself when `device`
    names its device only loosely, "cuda" for cuda:0; zero always copies). Lists and tuples
    come back as list and tuple, dicts keep their type (OrderedDict, defaultdict); any other
    value is returned as it is. Not a collective."""
    import torch

    if torch.is_tensor(item):
        return item.detach().to(torch.device(device), copy=True)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(value, device) for value in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(value, device) for value in item)
    if isinstance(item, dict):
        result = copy.copy(item)
        for key, value in item.items():
            result[key] = clone_tensors_for_torch_save(value, device)
        return result
    return item


def recursive_getattr(model, module_name: str):
    """DeepSpeed's deepspeed.compression.helper.recursive_getattr: the attribute at the dotted
    path `module_name` below `model` ("layers.0.attn" is model.layers[0].attn for a ModuleList,
    whose children are attributes named "0", "1", ...). Raises AttributeError naming the first
    missing part."""
    value = model
    for name in module_name.split("."):
        value = getattr(value, name)
    return value


def recursive_setattr(model, module_name: str, module) -> None:
    """DeepSpeed's deepspeed.compression.helper.recursive_setattr: set the attribute at the
    dotted path `module_name` below `model` to `module` (on a torch.nn.Module this registers a
    submodule, replacing the old one). Raises AttributeError when a parent on the path is
    missing."""
    parent_path, _, name = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_path) if parent_path else model
    setattr(parent, name, module)


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """DeepSpeed's deepspeed.runtime.zero.stage3.unwrap_model_for_generation (also
    deepspeed.runtime.zero's): a context manager that gathers every parameter of `model` (an
    engine, or a module zero manages) for its body and yields `model`, so generation's many
    forwards gather nothing more. Stage 3: each parameter is whole inside and partitioned again
    at exit (zero.GatheredParameters, read-only); other stages: nothing to gather. Collective:
    every rank enters it (the gather is an all-gather)."""
    from zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        yield model


def required_torch_version(min_version=None, max_version=None) -> bool:
    """DeepSpeed's deepspeed.utils.torch.required_torch_version: whether the running torch's
    version is at least `min_version` and at most `max_version` (each a version string or
    number such as 2.1, or None for no bound; PEP 440 ordering, so "2.13.0" > "2.2"). Raises
    ValueError when neither bound is given. Not a collective."""
    import torch

    if not min_version and not max_version:
        raise ValueError("required_torch_version needs min_version or max_version (or both)")
    version = torch.__version__  # a TorchVersion: compares with version strings
    if min_version and version < str(min_version):
        return False
    return not (max_version and version > str(max_version))


# ---------------------------------------------------------------------------------------------
# DeepSpeed's config keys

# The blocks DeepSpeed 0.19.8 validates with its pydantic DeepSpeedConfigModel (extra="forbid":
# an unknown key is an error there, at any depth). Everywhere else DeepSpeed reads the keys it
# knows from plain dicts and ignores the rest: the top level, aio, activation_checkpointing,
# flops_profiler, checkpoint, data_types, optimizer, scheduler, timers (but not
# timers.throughput), ...
DEEPSPEED_STRICT_BLOCKS = (
    "zero_optimization",
    "bf16",
    "fp16",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "compile",
    "hybrid_engine",
    "tensor_parallel",
    "timers.throughput",
    "weight_quantization",
)


@functools.cache
def use_deepspeed_key_policy() -> None:
    """Make load_config follow DeepSpeed 0.19.8 on unknown keys in this process (zero.config's
    KeyPolicy): dropped with one warning each naming the nearest known key, except in
    DEEPSPEED_STRICT_BLOCKS, where they stay errors. Called when the first DeepSpeed name is
    resolved, so that `import deepspeed` alone imports no torch (zero.config does)."""
    from zero.config import KeyPolicy, use_key_policy

    use_key_policy(
        KeyPolicy(
            ignore_unknown=True,
            strict_blocks=DEEPSPEED_STRICT_BLOCKS,
            follows=f"DeepSpeed {DEEPSPEED_API_VERSION}",
        )
    )


# ---------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class DeepSpeedModule:
    """One DeepSpeed module path the doorway serves.

    about: what the DeepSpeed module is (the served module's docstring says it, and where zero
        keeps the objects).
    names: DeepSpeed name -> "zero.module:attribute", imported on first use.
    all_of: a zero module every public name of which the DeepSpeed module has too
        (deepspeed.comm has each name of zero.comm), besides `names`.
    same_as: another path whose module object this path is (DeepSpeed's deepspeed.zero is
        deepspeed.runtime.zero).
    Child paths (deepspeed.runtime.engine below deepspeed.runtime) are attributes of their parent
    and are imported on first use.
    """

    about: str
    names: dict[str, str] = field(default_factory=dict)
    all_of: str | None = None
    same_as: str | None = None


def _from(module: str, *names: str) -> dict[str, str]:
    return {name: f"{module}:{name}" for name in names}


_ZERO_PARAMETERS = (
    "Init",
    "GatheredParameters",
    "register_external_parameter",
    "unregister_external_parameter",
    "ZeroParamStatus",
)

_PROFILER = (
    "FlopsProfiler",
    "get_model_profile",
    "DEFAULT_PRECISION",
    *(f"{kind}_to_string" for kind in ("number", "macs", "flops", "bytes", "params", "duration")),
)

TABLE: dict[str, DeepSpeedModule] = {
    "deepspeed": DeepSpeedModule(
        "DeepSpeed's top-level names",
        {
            **_from("zero.api", "initialize", "add_config_arguments", "is_compile_supported"),
            "init_distributed": "zero.comm:init_distributed",
            "DeepSpeedEngine": "zero.engine:Engine",
            "DeepSpeedConfig": "zero.config:DeepSpeedConfig",
            "get_accelerator": "zero.accelerator:get_accelerator",
            **_from("zero.utils", "log_dist", "logger"),
            "__version__": f"{__name__}:DOORWAY_VERSION",
            "__version_major__": f"{__name__}:API_VERSION_MAJOR",
            "__version_minor__": f"{__name__}:API_VERSION_MINOR",
            "__version_patch__": f"{__name__}:API_VERSION_PATCH",
        },
    ),
    "deepspeed.comm": DeepSpeedModule("DeepSpeed's collectives for scripts", all_of="zero.comm"),
    "deepspeed.zero": DeepSpeedModule("DeepSpeed's ZeRO names", same_as="deepspeed.runtime.zero"),
    "deepspeed.runtime": DeepSpeedModule("DeepSpeed's training runtime"),
    "deepspeed.runtime.engine": DeepSpeedModule(
        "DeepSpeed's engine", {"DeepSpeedEngine": "zero.engine:Engine"}
    ),
    "deepspeed.runtime.config": DeepSpeedModule(
        "DeepSpeed's parsed config", {"DeepSpeedConfig": "zero.config:DeepSpeedConfig"}
    ),
    "deepspeed.runtime.lr_schedules": DeepSpeedModule(
        "DeepSpeed's learning-rate schedules",
        _from("zero.optim.lr_schedules", "VALID_LR_SCHEDULES"),
        all_of="zero.optim.lr_schedules",
    ),
    "deepspeed.runtime.zero": DeepSpeedModule(
        "DeepSpeed's ZeRO names (also deepspeed.zero)",
        _from("zero.zero", *_ZERO_PARAMETERS, "TiledLinear", "TiledLinearReturnBias"),
    ),
    "deepspeed.runtime.zero.partition_parameters": DeepSpeedModule(
        "DeepSpeed's stage 3 parameter partitioning",
        {
            **_from("zero.zero", *_ZERO_PARAMETERS),
            # read by transformers' prevent_arange_dtype_change (zero.Init wraps no constructor)
            **_from(
                "zero.partition.init",
                "zero_wrapper_for_fp_tensor_constructor",
                "_orig_torch_arange",
                "get_accelerator",
            ),
        },
    ),
    "deepspeed.runtime.zero.config": DeepSpeedModule(
        "DeepSpeed's zero_optimization block", {"DeepSpeedZeroConfig": "zero.config:ZeroConfig"}
    ),
    "deepspeed.runtime.zero.offload_config": DeepSpeedModule(
        "DeepSpeed's offload settings",
        {
            **_from("zero.config", "OffloadDeviceEnum"),
            "DeepSpeedZeroOffloadParamConfig": "zero.config:OffloadParamConfig",
            "DeepSpeedZeroOffloadOptimizerConfig": "zero.config:OffloadOptimizerConfig",
        },
    ),
    "deepspeed.runtime.zero.stage3": DeepSpeedModule(
        "DeepSpeed's stage 3 optimizer (its helpers only)",
        _from(__name__, "unwrap_model_for_generation"),
    ),
    "deepspeed.runtime.zero.tiling": DeepSpeedModule(
        "DeepSpeed's tiled linear layers",
        _from("zero.zero", "TiledLinear", "TiledLinearReturnBias"),
    ),
    "deepspeed.runtime.activation_checkpointing": DeepSpeedModule(
        "DeepSpeed's activation checkpointing"
    ),
    "deepspeed.runtime.activation_checkpointing.checkpointing": DeepSpeedModule(
        "DeepSpeed's activation checkpointing (ZeRO-R)", all_of="zero.model_parallel.activation"
    ),
    "deepspeed.checkpointing": DeepSpeedModule(
        "DeepSpeed's activation checkpointing (ZeRO-R)",
        same_as="deepspeed.runtime.activation_checkpointing.checkpointing",
    ),
    "deepspeed.checkpoint": DeepSpeedModule("DeepSpeed's checkpoint tools"),
    "deepspeed.checkpoint.utils": DeepSpeedModule(
        "DeepSpeed's checkpoint helpers", _from(__name__, "clone_tensors_for_torch_save")
    ),
    "deepspeed.utils": DeepSpeedModule("DeepSpeed's utilities", all_of="zero.utils"),
    "deepspeed.utils.logging": DeepSpeedModule(
        "DeepSpeed's logging (its logger is zero's)", _from("zero.utils", "logger", "log_dist")
    ),
    "deepspeed.utils.torch": DeepSpeedModule(
        "DeepSpeed's torch version helpers", _from(__name__, "required_torch_version")
    ),
    "deepspeed.utils.zero_to_fp32": DeepSpeedModule(
        "DeepSpeed's consolidation of ZeRO checkpoints", all_of="zero.checkpoint.zero_to_fp32"
    ),
    "deepspeed.accelerator": DeepSpeedModule(
        "DeepSpeed's accelerator abstraction",
        _from("zero.accelerator", "get_accelerator", "DeepSpeedAccelerator"),
    ),
    "deepspeed.ops": DeepSpeedModule("DeepSpeed's compiled ops"),
    "deepspeed.ops.adam": DeepSpeedModule(
        "DeepSpeed's Adam optimizers", _from("zero.ops.adam", "DeepSpeedCPUAdam", "FusedAdam")
    ),
    "deepspeed.launcher": DeepSpeedModule("DeepSpeed's launcher"),
    "deepspeed.launcher.runner": DeepSpeedModule(
        "DeepSpeed's launcher command (zero-as-deepspeed's `deepspeed` maps it onto zrun)",
        _from(__name__, "DEEPSPEED_ENVIRONMENT_NAME"),
    ),
    "deepspeed.profiling": DeepSpeedModule("DeepSpeed's profilers"),
    "deepspeed.profiling.flops_profiler": DeepSpeedModule(
        "DeepSpeed's FLOPs profiler", _from("zero.profiling.flops_profiler", *_PROFILER)
    ),
    "deepspeed.profiling.flops_profiler.profiler": DeepSpeedModule(
        "DeepSpeed's FLOPs profiler", _from("zero.profiling.flops_profiler", *_PROFILER)
    ),
    "deepspeed.compression": DeepSpeedModule("DeepSpeed's model compression"),
    "deepspeed.compression.helper": DeepSpeedModule(
        "DeepSpeed's compression helpers", _from(__name__, "recursive_getattr", "recursive_setattr")
    ),
}

CATALOG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_catalog.json")


@dataclass(frozen=True)
class CatalogModule:
    """One module of DeepSpeed 0.19.8 as deepspeed_catalog.json lists it (tools/deepspeed_catalog.py
    says how it is read): whether it is a package, and its public names, each in one of defined
    (functions, classes, computed values), imports (name -> "deepspeed.module:name" or, for a
    module imported under a name, "deepspeed.module") and constants (name -> literal value)."""

    package: bool
    defined: frozenset[str]
    imports: dict[str, str]
    constants: dict[str, object]

    def names(self) -> set[str]:
        return {*self.defined, *self.imports, *self.constants}


@functools.cache
def catalog() -> dict[str, CatalogModule]:
    """DeepSpeed 0.19.8's module paths -> CatalogModule, read once from CATALOG_FILE."""
    with open(CATALOG_FILE) as handle:
        data = json.load(handle)
    return {
        path: CatalogModule(
            entry["package"], frozenset(entry["defined"]), entry["imports"], entry["constants"]
        )
        for path, entry in data["modules"].items()
    }


def served_paths() -> set[str]:
    """Every module path the doorway serves: TABLE's and the catalog's."""
    return set(TABLE) | set(catalog())


@functools.cache
def _children(path: str) -> tuple[str, ...]:
    # path -> names of its child paths (deepspeed.runtime -> engine, config, ...)
    return tuple(
        sorted(p.rpartition(".")[2] for p in served_paths() if p.rpartition(".")[0] == path)
    )


assert all(p == "deepspeed" or p.rpartition(".")[0] in TABLE for p in TABLE), "orphan path"


def not_provided_message(name: str) -> str:
    """The error for a DeepSpeed name zero does not implement (a placeholder's message)."""
    return (
        f"zero does not implement DeepSpeed's {name}: zero runs in place of DeepSpeed here "
        "(zero-as-deepspeed), and the name imports but cannot be used. See "
        f"{MIGRATION_DOC} for the names zero implements and what to use instead"
    )


def _missing_target_message(name: str, target: str, cause: BaseException) -> str:
    return (
        f"DeepSpeed's {name} maps to {target.replace(':', '.')}, which this zero does not have "
        f"({cause}); update zero, or see {MIGRATION_DOC} for what to use instead"
    )


def _load_target(name: str, target: str):
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # Only the target module itself missing is "zero does not have it"; a module missing
        # among its own imports is that module's error.
        if error.name is None or not (module_name + ".").startswith(error.name + "."):
            raise
        return Placeholder(name, _missing_target_message(name, target, error))
    try:
        return getattr(module, attribute)
    except AttributeError as error:
        return Placeholder(name, _missing_target_message(name, target, error))


def _is_zero_object(value) -> bool:
    # A module's public names, without what it imported: modules, and classes and functions
    # defined outside zero (typing's, torch's). Constants and instances (a logger) count.
    if isinstance(value, types.ModuleType):
        return False
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return (getattr(value, "__module__", None) or "").split(".")[0] == "zero"
    return True


def _public_names(module: types.ModuleType) -> set[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return set(names)
    return {n for n, v in vars(module).items() if not n.startswith("_") and _is_zero_object(v)}


def listed_names(path: str) -> set[str]:
    """The names the served module `path` has: TABLE's names, with all_of the zero module's
    public names, and DeepSpeed 0.19.8's names from the catalog (not its child paths). Imports
    the all_of module."""
    entry = TABLE.get(path)
    names = set(entry.names) if entry is not None else set()
    if entry is not None and entry.all_of is not None:
        names |= _public_names(importlib.import_module(entry.all_of))
    found = catalog().get(path)
    if found is not None:
        names |= found.names()
    return names


def resolve(path: str, name: str):
    """The object behind DeepSpeed's `path`.`name` (a served path; `name` not a child path):
    zero's object, DeepSpeed's literal constant, or a Placeholder ([Note: the whole surface]).
    Raises AttributeError, as Python does, for a name DeepSpeed 0.19.8's module does not have."""
    entry = TABLE.get(path)
    if entry is not None and name in entry.names:
        return _load_target(f"{path}.{name}", entry.names[name])
    if name == "__all__":
        return sorted(listed_names(path))
    if entry is not None and entry.all_of is not None and not name.startswith("_"):
        module = importlib.import_module(entry.all_of)
        if name in _public_names(module):
            return getattr(module, name)
    found = catalog().get(path)
    if found is not None and name in found.constants:
        return found.constants[name]
    if found is not None and name in found.imports:
        return _imported(path, name, found.imports[name])
    if found is not None and name in found.defined:
        implemented = _implemented_at().get(f"{path}.{name}")
        if implemented is not None:
            return getattr(importlib.import_module(implemented[0]), implemented[1])
        return Placeholder(f"{path}.{name}", not_provided_message(f"{path}.{name}"))
    raise AttributeError(f"module {path!r} has no attribute {name!r}")


@functools.cache
def _implemented_at() -> dict[str, tuple[str, str]]:
    """ "P.N" -> (TABLE path, name) for every DeepSpeed name N defined in module P that a TABLE
    module implements under a name it imports from P, directly or through other modules
    (deepspeed.ops.adam's DeepSpeedCPUAdam is deepspeed.ops.adam.cpu_adam's): one object under
    every DeepSpeed name of it."""
    found: dict[str, tuple[str, str]] = {}
    modules = catalog()
    for path, entry in TABLE.items():
        implemented = set(entry.names)
        if entry.all_of is not None:
            implemented |= _public_names(importlib.import_module(entry.all_of))
        imports = modules[path].imports if path in modules else {}
        for name in implemented & set(imports):
            origin = imports[name]
            while ":" in origin:
                found.setdefault(origin.replace(":", "."), (path, name))
                module, _, attribute = origin.partition(":")
                origin = modules[module].imports.get(attribute, "") if module in modules else ""
    return found


def _imported(path: str, name: str, origin: str):
    # A name DeepSpeed's module imports from another: that module's object, so both names give
    # one object (deepspeed.utils.logger is deepspeed.utils.logging.logger).
    # DeepSpeed makes some names at run time (op_builder's builders), which the catalog cannot
    # see at their origin: those are placeholders under the importing module's name.
    module_path, _, attribute = origin.partition(":")
    module_path = canonical_path(module_path)
    if module_path not in served_paths() or (
        attribute and attribute not in listed_names(module_path) | set(_children(module_path))
    ):
        return Placeholder(f"{path}.{name}", not_provided_message(f"{path}.{name}"))
    module = importlib.import_module(module_path)
    return getattr(module, attribute) if attribute else module


class _DoorwayModule(types.ModuleType):
    """The module of one served path: child paths and names resolve on first use and are then
    kept in the module's namespace."""

    def __getattr__(self, name: str):
        if not name.startswith("__"):  # Python's own probes (__path__, ...) are no use
            use_deepspeed_key_policy()  # the program uses DeepSpeed's names: DeepSpeed's config
        path = self.__name__
        if name in _children(path):
            return importlib.import_module(f"{path}.{name}")
        value = resolve(path, name)
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_children(self.__name__), *listed_names(self.__name__)})


def _about(path: str) -> str:
    entry = TABLE.get(path)
    if entry is None:
        return (
            f"DeepSpeed 0.19.8's {path}, served by zero ({__name__}; zero-as-deepspeed, "
            f"{MIGRATION_DOC}): its names import, and those zero does not implement are "
            "placeholders that fail when used."
        )
    sources = sorted({t.partition(":")[0] for t in entry.names.values()} | {entry.all_of} - {None})
    where = f" Its names are zero's, from {', '.join(sources)}." if sources else ""
    return f"{entry.about}, served by zero ({__name__}; zero-as-deepspeed, {MIGRATION_DOC}).{where}"


def canonical_path(path: str) -> str:
    """The served path whose module `path` names: `path` itself, or `path` with a same_as
    prefix replaced (deepspeed.zero.partition_parameters ->
    deepspeed.runtime.zero.partition_parameters), so a module has one object under every name."""
    head = path
    while head:
        entry = TABLE.get(head)
        if entry is not None and entry.same_as is not None:
            return entry.same_as + path[len(head) :]
        head = head.rpartition(".")[0]
    return path


def _is_package(path: str) -> bool:
    found = catalog().get(path)
    return bool(_children(path)) or (found is not None and found.package)


class _DoorwayFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `deepspeed` and every served path, one module object per path (a same_as path is
    its target's module). Other paths below `deepspeed` are not found, as in DeepSpeed."""

    def __init__(self, shim_file: str):
        self.shim_file = shim_file
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.partition(".")[0] != "deepspeed":
            return None
        if canonical_path(fullname) in served_paths():
            return self._spec(fullname)
        return None

    def _spec(self, fullname: str) -> importlib.machinery.ModuleSpec:
        spec = self._specs.get(fullname)
        if spec is None:
            top = fullname == "deepspeed"
            spec = importlib.machinery.ModuleSpec(
                fullname,
                self,
                origin=self.shim_file if top else __name__,
                is_package=_is_package(canonical_path(fullname)),
            )
            spec.has_location = top  # deepspeed.__file__ is the doorway package's file
            self._specs[fullname] = spec
        return spec

    def create_module(self, spec):
        canonical = canonical_path(spec.name)
        if canonical != spec.name:
            return importlib.import_module(canonical)
        return _DoorwayModule(spec.name, _about(spec.name))

    def exec_module(self, module):
        if module.__spec__.name != module.__name__:
            # A same_as path: the import system gave the shared module this path's spec; it
            # keeps its own.
            module.__spec__ = self._spec(module.__name__)


def install(shim_file: str) -> types.ModuleType:
    """Make `deepspeed` zero's: put the doorway's finder first in sys.meta_path (once), put the
    module of the path "deepspeed" in sys.modules, and report a real DeepSpeed it shadows
    (report_shadowed_deepspeed). Called by the doorway's deepspeed/__init__.py with its own
    file; returns the module that replaces it."""
    finder = next((f for f in sys.meta_path if isinstance(f, _DoorwayFinder)), None)
    if finder is None:
        finder = _DoorwayFinder(shim_file)
        sys.meta_path.insert(0, finder)
    spec = finder.find_spec("deepspeed")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["deepspeed"] = module
    doorway.enter()
    report_shadowed_deepspeed(os.path.dirname(os.path.dirname(os.path.abspath(shim_file))))
    return module


# ---------------------------------------------------------------------------------------------
# A real DeepSpeed that the doorway shadows


@dataclass(frozen=True)
class RealDeepSpeed:
    """A DeepSpeed package importable outside the doorway: its version ("unknown version"
    without metadata) and the directory of its package."""

    version: str
    location: str


def find_real_deepspeed(doorway_dir: str, paths: Iterable[str]) -> RealDeepSpeed | None:
    """The `deepspeed` package that `paths` (entries as in sys.path, "" for the working
    directory) give when `doorway_dir` is left out, or that another finder on sys.meta_path
    gives (an editable install's finder); None when there is none (a directory named deepspeed
    without __init__.py is no package and does not count)."""
    doorway = os.path.realpath(doorway_dir)
    others = [p for p in paths if os.path.realpath(p or os.curdir) != doorway]
    spec = importlib.machinery.PathFinder.find_spec("deepspeed", others)
    for finder in sys.meta_path:
        if spec is not None:
            break
        if isinstance(finder, _DoorwayFinder) or finder is importlib.machinery.PathFinder:
            continue
        find = getattr(finder, "find_spec", None)
        try:
            spec = find("deepspeed", None) if find is not None else None
        except Exception:  # a third-party finder's failure is not ours to report
            spec = None
    if spec is None or spec.origin is None or not spec.has_location:
        return None
    if os.path.realpath(os.path.dirname(os.path.dirname(spec.origin))) == doorway:
        return None
    from importlib import metadata

    versions = [
        d.version
        for d in metadata.distributions(name="deepspeed")
        if not str(d.version).startswith(f"{DEEPSPEED_API_VERSION}+zero")
    ]
    return RealDeepSpeed(
        versions[0] if versions else "unknown version", os.path.dirname(spec.origin)
    )


def shadow_message(real: RealDeepSpeed, doorway_dir: str) -> str:
    """Says that zero runs in place of the real DeepSpeed and how to run DeepSpeed instead."""
    import zero

    return (
        f"zero {zero.__version__} runs in place of DeepSpeed {real.version} at {real.location}: "
        f"`import deepspeed` finds zero's DeepSpeed doorway {doorway_dir} first (zero-as-deepspeed "
        "puts it on PYTHONPATH). To run DeepSpeed instead, run the command without "
        "zero-as-deepspeed, or remove that directory from PYTHONPATH"
    )


_shadow_reported = False


def report_shadowed_deepspeed(doorway_dir: str) -> None:
    """Log shadow_message once per process, on rank 0 (RANK unset or "0"), when a real
    DeepSpeed is importable from sys.path outside `doorway_dir`."""
    global _shadow_reported
    if _shadow_reported or os.environ.get("RANK", "0") != "0":
        return
    _shadow_reported = True
    real = find_real_deepspeed(doorway_dir, sys.path)
    if real is not None:
        logger.warning(shadow_message(real, doorway_dir))
