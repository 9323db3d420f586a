"""zero.utils: DeepSpeed's deepspeed.utils helpers for stage-3 leaf modules.

A leaf module is gathered and released as one stage-3 fetch unit whatever its size, so the
children it picks by data (the experts of a mixture of experts, which receive different tokens
on different ranks) never make ranks issue different all-gathers. Mark leaves before
zero.initialize (the fetch units are chosen there):

    zero.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])
    engine, *_ = zero.initialize(model=model, config="configs/zero3.json")

`zero_optimization.stage3_module_classes` (class names in the config) does the same.
"""

import torch

from .stage3 import _LEAF_MODULES, is_leaf


def _matches(module: torch.nn.Module, classes) -> bool:
    return any(
        type(module).__name__ == c if isinstance(c, str) else isinstance(module, c) for c in classes
    )


def _check_classes(classes) -> list:
    classes = list(classes)
    for c in classes:
        if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, torch.nn.Module))):
            raise TypeError(
                f"leaf module classes must be nn.Module subclasses or class names, not {c!r}"
            )
    return classes


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes) -> list:
    """Mark every module of `model` that is an instance of one of `leaf_module_classes`
    (classes, or class names as strings) as a stage-3 leaf. Returns the marked modules.
    Raises ValueError when no module matches (a misspelled class would otherwise leave the
    model as it was). Not a collective, but every rank must mark the same modules
    (zero.initialize checks)."""
    classes = _check_classes(leaf_module_classes)
    marked = [m for m in model.modules() if _matches(m, classes)]
    if not marked:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"set_z3_leaf_modules: no module of {type(model).__name__} is a {names}")
    for module in marked:
        _LEAF_MODULES.add(module)
    return marked


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes) -> list:
    """Undo set_z3_leaf_modules for the modules of those classes. Returns them."""
    classes = _check_classes(leaf_module_classes)
    unmarked = [m for m in model.modules() if _matches(m, classes) and is_leaf(m)]
    for module in unmarked:
        _LEAF_MODULES.discard(module)
    return unmarked


def get_z3_leaf_modules(model: torch.nn.Module) -> list:
    """The modules of `model` marked as stage-3 leaves, in module order."""
    return [m for m in model.modules() if is_leaf(m)]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """True when `model` itself is marked as a stage-3 leaf."""
    return is_leaf(model)
