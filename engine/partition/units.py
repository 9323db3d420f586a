"""ZeRO stage 3's fetch units: a module and the parameters gathered together for it, the unit's
state, and how a model is cut into units (paper, 5.3).

[Note: fetch units]
choose_units() walks the module tree from the root: a module whose parameters (its whole subtree)
number at most `threshold` elements, whose class is listed in stage3_module_classes, or that has
no children becomes one unit; a larger module recurses into its children, and its own direct
parameters form a unit of their own. Each unit's parameters are laid out together (FlatLayout
closes a bucket at every unit boundary), so gathering a unit is one all-gather per bucket.

[Note: parameter lifecycle]
A unit is SHARDED (each rank holds its 1/N slice; the module's parameters are 0-element
placeholders) or GATHERED (full parameters in a transient buffer). It is gathered by a forward
pre-hook, released by the forward hook, gathered again when the first gradient reaches its
outputs (a multi-grad hook registered during forward). In backward a trainable bucket is
released once every parameter of it has its gradient (the gradient is then in the
reduce-scatter buffer), and the unit's frozen buckets once its backward is over ([Note: frozen
weights in backward] in gatherer.py). A forward that runs inside backward (an
activation-checkpoint recomputation) keeps its units gathered (its saved tensors are used at
once, and backward releases the units) and is not recorded as forward order. An in-place write
to a gathered parameter that a release would lose raises instead
(ParamGatherer._check_not_modified). A parameter used
outside its unit's forward (a tied lm_head weight, `h @ embed.weight.T` in a parent's forward) is
caught by UsageGuard, a TorchFunctionMode active during the outermost forward of any module of the
model: the root's (engine(...), engine.module(...), each step of generate()) or a submodule's
called on its own (generate() runs an encoder-decoder's encoder directly, whose embedding is
tied to `shared.weight`). It gathers the parameter's unit on the spot; a unit with trainable
parameters is pinned, so it stays gathered until the end of backward (of the outermost
forward, when none follows), where their gradients arrive; a frozen one goes with its own
forward's release, or with the end of the outermost forward or of backward. Gathering stays
per fetch unit. Reading a placeholder's dtype, device or requires_grad gathers nothing, and a
parametrization's no-op set_() is not a write ([Note: parametrized parameters] in
unit_hooks.py). Every batch of all-gathers is checked across ranks first (comm.Agreement): a
rank that runs a module another rank skips makes every rank raise before the collectives
differ (see docs/stages.md).
"""

import enum
import sys
import weakref
from dataclasses import dataclass, field

import torch

from .ds_params import ZeroParamStatus, set_status
from .init import full_numel

# Modules made one fetch unit whatever their size (zero.utils.set_z3_leaf_modules).
_LEAF_MODULES: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def mark_leaf(module: torch.nn.Module) -> None:
    """Make `module` one fetch unit whatever its size (zero.utils.set_z3_leaf_modules)."""
    _LEAF_MODULES.add(module)


def is_leaf(module: torch.nn.Module) -> bool:
    """True for a module marked by zero.utils.set_z3_leaf_modules."""
    return module in _LEAF_MODULES


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather in flight (prefetch)
    GATHERED = "gathered"


# DeepSpeed's ds_status of a unit's parameters in each state ([Note: attributes are views] in
# ds_params.py).
_PARAM_STATUS = {
    UnitState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
    UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
    UnitState.GATHERED: ZeroParamStatus.AVAILABLE,
}


@dataclass
class Unit:
    """A fetch unit: a module and the trainable parameters gathered together for it.

    `state` changes only through to_gathering(), to_gathered() and to_sharded(), which check
    the state they start from and set DeepSpeed's ds_status of the unit's parameters to match;
    bucket_released() marks the parameters of one bucket released while the unit stays
    GATHERED (backward releases a trainable bucket once its gradients are in)."""

    index: int
    name: str
    module: torch.nn.Module
    buckets: list = field(default_factory=list)
    state: UnitState = UnitState.SHARDED
    pinned: bool = False  # gathered until the end of backward (used outside its forward)
    persistent: bool = False  # small parameters: gathered after every step, never released
    holds: int = 0  # open zero.GatheredParameters / state_dict() holds: never released then
    calls: int = 0  # observed calls (forward, reentrant recomputation) whose backward is not done
    # completion cannot be observed ([Note: end of a unit's backward] in unit_hooks.py)
    untracked: bool = False
    backward: bool = False  # some call of this micro-batch has a backward (_has_backward)
    check: object = None  # comm.PendingCheck of its all-gather in flight, if predicted

    @property
    def frozen(self) -> bool:
        """Only frozen parameters: no gradients, so no rank has a backward for it."""
        return all(b.master is None for b in self.buckets)

    def to_gathering(self) -> None:
        """SHARDED -> GATHERING: the all-gathers of its buckets are launched."""
        self._move(UnitState.SHARDED, UnitState.GATHERING)

    def to_gathered(self) -> None:
        """GATHERING -> GATHERED: they finished; its parameters hold their full values."""
        self._move(UnitState.GATHERING, UnitState.GATHERED)

    def to_sharded(self) -> None:
        """GATHERED -> SHARDED: its buckets are released; its parameters are placeholders."""
        self._move(UnitState.GATHERED, UnitState.SHARDED)

    def bucket_released(self, bucket) -> None:
        """One of its buckets was released, the unit staying GATHERED until the rest go."""
        set_status(bucket.params, ZeroParamStatus.NOT_AVAILABLE)

    def _move(self, start: UnitState, end: UnitState) -> None:
        assert self.state is start, (self.name, self.state, end)
        self.state = end
        for bucket in self.buckets:
            set_status(bucket.params, _PARAM_STATUS[end])


def choose_units(
    model: torch.nn.Module,
    threshold: int,
    class_names=(),
    persist_below: int = 0,
    persist_total: int = sys.maxsize,
) -> tuple[list, dict]:
    """Split `model` into fetch units. Returns (units, unit index by id(param)) for non-empty
    parameters, trainable and frozen; a parameter shared by several modules belongs to the first
    unit that reaches it in module order. Parameters with fewer than `persist_below` elements
    (stage3_param_persistence_threshold) form one persistent unit that stays gathered, taken in
    module order while their total stays within `persist_total` elements
    (stage3_model_persistence_threshold)."""
    units: list[Unit] = []
    unit_of: dict[int, int] = {}
    small, total = [], 0
    for param in model.parameters():
        numel = full_numel(param)
        if 0 < numel < persist_below and total + numel <= persist_total:
            small.append(param)
            total += numel
    if small:
        units.append(Unit(0, "<persistent>", model, persistent=True))
        unit_of.update({id(p): 0 for p in small})

    def numel(module):
        return sum(full_numel(p) for p in module.parameters())

    def add(name, module, params):
        fresh = [p for p in params if full_numel(p) and id(p) not in unit_of]
        if fresh:
            for param in fresh:
                unit_of[id(param)] = len(units)
            units.append(Unit(len(units), name or "<root>", module))

    def visit(name, module):
        children = list(module.named_children())
        whole = not children or numel(module) <= threshold
        if whole or type(module).__name__ in class_names or is_leaf(module):
            add(name, module, module.parameters())
            return
        add(name, module, module.parameters(recurse=False))
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return units, unit_of


def persistent_unit(units: list) -> int | None:
    """The index of the persistent unit among choose_units()'s units, or None."""
    return next((u.index for u in units if u.persistent), None)


def unit_numel(unit: Unit, trainable: bool = False) -> int:
    """Elements of the unit's buckets, padded; of its trainable buckets only when `trainable`."""
    return sum(b.layout.padded_numel for b in unit.buckets if not trainable or b.master is not None)


def data_chooser(root: torch.nn.Module, units: list) -> tuple | None:
    """(name, module) of the module that, by the look of it, picks some of `units` by data: the
    deepest ancestor of either unit that holds the unit's branch in a ModuleList / ModuleDict of
    several modules of one class (experts); else the closest common ancestor of two units that
    is neither the root nor a ModuleList / ModuleDict. None when there is none."""
    modules = dict(root.named_modules())
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    paths = [u.name.split(".") for u in units if u.module is not root]
    best = None  # (depth, name)
    for parts in paths:
        for depth in range(len(parts) - 1, 0, -1):
            owner, child = modules[".".join(parts[:depth])], modules[".".join(parts[: depth + 1])]
            kinds = {type(m) for m in child.children()} if isinstance(child, containers) else ()
            if len(kinds) == 1 and len(child) > 1 and not isinstance(owner, containers):
                if best is None or depth > best[0]:
                    best = depth, ".".join(parts[:depth])
                break
    if best is not None:
        return best[1], modules[best[1]]
    if len(paths) == 2:
        common = []
        for x, y in zip(*paths):
            if x != y:
                break
            common.append(x)
        while common and isinstance(modules[".".join(common)], containers):
            common = common[:-1]
        if common and common != paths[0] and common != paths[1]:
            return ".".join(common), modules[".".join(common)]
    return None
