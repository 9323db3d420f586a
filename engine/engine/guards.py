"""Misuse guards: checks that refuse a model, a parameter or a training call zero cannot take,
each raising one error that names the rank, what is wrong and the fix. They read the model, its
parameters and the parts handed to them, never the Engine.

- before construction: a model another engine lays out (`refuse_foreign_model`), the ranks'
  models and configs (`fingerprint`, checked by comm.Agreement), leaf modules;
- while building: `ModelSnapshot` puts the model back when construction fails;
- every training call: parameters changed behind the engine (`check_params`), a failed
  backward (`refuse_failed`), gradients zero does not manage, an engine without an optimizer
  or one that was closed, a stale graph (`stale_graph_error`).
"""

import logging
import zlib

import torch
import torch.distributed as dist

from ..compiler import refuse_compiled_model
from ..errors import listed
from ..partition.init import full_numel, full_shape, is_partitioned
from ..partition.shared import changed_parameter
from ..partition.stages import trained_by
from ..partition.units import is_leaf, mark_leaf
from ..partition.usage_guard import unmanaged_parameter

logger = logging.getLogger("zero")


def refuse_foreign_model(model, stage: int, rank: int) -> None:
    """ValueError / TypeError before construction for a model zero cannot lay out as it is:
    compiled with torch.compile (engine.compile() instead), laid out by another engine that was
    not closed, or holding a stage-3 engine's placeholders."""
    refuse_compiled_model(model, stage, rank)
    _refuse_trained(model, rank)
    _refuse_placeholders(model, rank)


def check_params(optimizer, whole_frozen: list, compute_dtype, rank: int) -> None:
    """RuntimeError naming a parameter whose tensor, dtype or requires_grad changed after
    zero.initialize ([Note: parameters changed behind the engine's back] in
    partition/shared.py): the laid-out ones (ZeroOptimizer.check_params) and, below stage
    3, the frozen ones kept whole, which must stay frozen. Not a collective."""
    optimizer.check_params()
    if not optimizer.trains:
        return  # nothing trains: requires_grad changes nothing
    for name, param in whole_frozen:
        if param.requires_grad:
            raise changed_parameter(rank, name, param, compute_dtype, False, True)


def check_no_unmanaged_gradients(module, rank: int) -> None:
    """A parameter with a .grad at the step is one zero does not manage (its hook would have
    taken the gradient): added to the module after initialize. Stage 3 refuses it earlier,
    at its first use in engine(...)."""
    for param in module.parameters():
        if param.grad is not None and param.numel() > 0:
            raise unmanaged_parameter(rank, param, module)


def refuse_failed(optimizer, method: str, rank: int) -> None:
    """RuntimeError for a training call after an engine.backward() that raised, until
    zero_grad() drops the step's gradients ([Note: a failed backward] in partition/stages.py)."""
    failed = optimizer.failed_backward
    if failed is not None:
        raise RuntimeError(
            f"rank {rank}: {method} after an engine.backward() that raised "
            f"({failed}): that backward left this optimizer step's gradients incomplete "
            "(some may already be reduced across ranks), so zero cannot step on them. Call "
            "engine.zero_grad() on every rank to drop them (the micro-batches of this step "
            "before the failed one too), then run forward and backward again"
        )


def refuse_without_optimizer(optimizer, method: str) -> None:
    """RuntimeError naming why a ZeRO-Inference engine has no optimizer, before any
    collective (every rank raises alike)."""
    if not optimizer.trains:
        raise optimizer.optimizer.refusal(method)


def refuse_closed(closed: bool, method: str, rank: int) -> None:
    """RuntimeError for a call on an engine after close() / destroy()."""
    if closed:
        raise RuntimeError(
            f"rank {rank}: engine.{method}() after engine.destroy() (or close()), "
            "which detached the engine from its model and released its buffers; build a "
            "new engine with zero.initialize"
        )


class ModelSnapshot:
    """What Engine construction changes on a model, to put back when construction fails: every
    module's and parameter's hook tables (zero adds forward, state_dict and gradient hooks), the
    tensor each parameter holds (zero rebinds parameters to its flat buffers or, at stage 3,
    releases them) and its attributes. Tensors are referenced, not copied.

    A zero.Init parameter's slice is not kept: holding it while the engine lays the parameter out
    would double each rank's share of the model during initialize (the memory a model that does
    not fit cannot spare). Everything that can be refused is checked before construction starts
    (config, optimizer, scheduler); should the layout itself fail for such a model, restore()
    says the model must be built again."""

    def __init__(self, model: torch.nn.Module):
        self.modules = [(m, _hook_tables(m)) for m in model.modules()]
        named = list(model.named_parameters())
        self.hooks = [(p, _hook_tables(p)) for _, p in named]
        self.params = [
            (p, p.data, p.grad, dict(vars(p))) for _, p in named if not is_partitioned(p)
        ]
        self.partitioned = [(n, p) for n, p in named if is_partitioned(p)]

    def restore(self) -> None:
        for owner, tables in self.modules + self.hooks:
            _set_hook_tables(owner, tables)
        for param, data, grad, attributes in self.params:
            param.data, param.grad = data, grad
            vars(param).clear()
            vars(param).update(attributes)
        lost = [name for name, p in self.partitioned if not is_partitioned(p)]
        if lost:
            logger.error(
                "zero.initialize failed after laying out zero.Init parameters %s: build the "
                "model again (under zero.Init) before retrying",
                lost[:5],
            )

    def added_hooks(self) -> list[tuple]:
        """(module or parameter, hook table name, key) of every hook added since the snapshot:
        zero's, once construction succeeded (Engine.close removes them)."""
        added = []
        for owner, tables in self.modules + self.hooks:
            for name in _hook_names(owner):
                before = tables.get(name, {})
                added += [(owner, name, key) for key in getattr(owner, name) if key not in before]
        return added


def stale_graph_error(error: BaseException, rank: int) -> RuntimeError | None:
    """torch's in-place modification error from a backward, with zero's usual reason for it
    ([Note: stale graphs] in partition/stages.py); None for any other error (and for stage 3's,
    which says it)."""
    text = str(error)
    if not isinstance(error, RuntimeError) or "modified by an inplace operation" not in text:
        return None
    if text.startswith("rank "):
        return None
    return RuntimeError(
        f"rank {rank}: {text} engine.step() (and load_checkpoint) update the parameters in "
        "place, as a torch optimizer does: if this loss was computed before the last "
        "engine.step(), it cannot be backpropagated after it (with retain_graph=True neither); "
        "compute the loss again after the step"
    )


def _refuse_trained(model, rank: int) -> None:
    """ValueError when another engine that was not closed trains parameters of `model` (a
    second zero.initialize on the same model): both would take the same gradients."""
    for name, param in model.named_parameters():
        if trained_by(param) is not None:
            raise ValueError(
                f"rank {rank}: parameter '{name}' of {type(model).__name__} is trained by a zero "
                "engine that was not closed: zero.initialize already laid this model out. A "
                "model belongs to one engine at a time: keep using that engine, or call its "
                "close() (DeepSpeed's destroy()) before zero.initialize again (under ZeRO "
                "stage 3 close() leaves the parameters partitioned: build or load the model "
                "again)"
            )


def refuse_released_forward(module, args) -> None:
    """Forward pre-hook left on a stage-3 model whose engine was destroyed (Engine.close)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    raise RuntimeError(
        f"rank {rank}: {type(module).__name__} was partitioned by a ZeRO stage-3 engine that was "
        "destroyed (engine.destroy() or close()): its parameters are 0-element placeholders "
        "and their values went with the engine; load the weights into a new model (from a "
        "checkpoint or a state dict saved before destroy) and train it with a new engine"
    )


def _refuse_placeholders(model, rank: int) -> None:
    """ValueError when parameters of `model` are a stage-3 engine's placeholders (0 elements,
    with the full size in ds_shape): another engine lays the model out, or a destroyed one
    took the values with it."""
    names = [
        name
        for name, param in model.named_parameters()
        if param.numel() == 0 and full_numel(param) > 0 and not is_partitioned(param)
    ]
    if names:
        raise ValueError(
            f"rank {rank}: parameters {listed(names)} of {type(model).__name__} are partitioned "
            "by a ZeRO stage-3 engine (0-element placeholders): a model can belong to one live "
            "engine, and a destroyed one took their values; build the model again (or load its "
            "weights) before zero.initialize"
        )


_TENSOR_HOOKS = ("_post_accumulate_grad_hooks", "_backward_hooks")


def _hook_names(obj) -> list[str]:
    if isinstance(obj, torch.Tensor):  # kept outside the instance __dict__, None until used
        return [name for name in _TENSOR_HOOKS if isinstance(getattr(obj, name, None), dict)]
    return [k for k, v in vars(obj).items() if "hook" in k and isinstance(v, dict)]


def _hook_tables(obj) -> dict:
    """Copies of the hook dictionaries torch keeps on a module (_forward_hooks,
    _state_dict_pre_hooks, ...) or a tensor (_post_accumulate_grad_hooks, ...)."""
    return {name: dict(getattr(obj, name)) for name in _hook_names(obj)}


def _set_hook_tables(obj, tables: dict) -> None:
    """Put back `tables` in place (a hook handle's remove() deletes from the same objects)."""
    for name in _hook_names(obj):
        table = getattr(obj, name)
        table.clear()
        table.update(tables.get(name, {}))


def fingerprint(model, config, optimizer) -> int:
    """32-bit hash of what every rank must have alike before the first collective: the
    parameters' and buffers' names, full shapes, dtypes and requires_grad, the leaf modules
    (zero.utils.set_z3_leaf_modules), the config keys that shape the layout, and what would
    make the ranks' updates differ without any collective noticing: the micro-batch size, the
    clipping, the scheduler block and the optimizer's type and hyper-parameters per param
    group (those of plain types: an object's repr may hold its address)."""
    params = [
        (n, tuple(full_shape(p)), str(p.dtype), p.requires_grad)
        for n, p in model.named_parameters()
    ]
    buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    leaves = [n for n, m in model.named_modules() if is_leaf(m)]
    zero_cfg = config.zero
    keys = (
        zero_cfg.stage,
        zero_cfg.reduce_bucket_size,
        zero_cfg.stage3_module_granularity_threshold,
        leaf_classes(zero_cfg),
        zero_cfg.stage3_param_persistence_threshold,
        zero_cfg.stage3_model_persistence_threshold,
        str(config.compute_dtype),
        config.gradient_accumulation_steps,
        config.train_micro_batch_size_per_gpu,
        config.gradient_clipping,
        repr(config.scheduler),
    )
    plain = (int, float, bool, str, type(None))

    def hyper(value):
        if isinstance(value, (tuple, list)):
            return all(hyper(v) for v in value)
        return isinstance(value, plain)

    groups = [
        sorted((k, v) for k, v in group.items() if k != "params" and hyper(v))
        for group in optimizer.param_groups
    ]
    update = (type(optimizer).__name__, groups)
    return zlib.crc32(repr((params, buffers, leaves, keys, update)).encode())


def leaf_classes(zero_cfg) -> tuple:
    """Module class names stage 3 fetches as one unit: stage3_module_classes and DeepSpeed's
    leaf_module.classes (its names and name_suffixes: mark_leaf_names)."""
    leaf = zero_cfg.leaf_module
    return tuple(zero_cfg.stage3_module_classes or ()) + (leaf.classes if leaf else ())


def mark_leaf_names(model, zero_cfg) -> None:
    """leaf_module.names / name_suffixes: mark those modules as stage-3 leaves; ValueError
    naming a name that matches no module (a misspelling would leave experts as units)."""
    leaf = zero_cfg.leaf_module
    if leaf is None or zero_cfg.stage != 3:
        return
    named = list(model.named_modules())
    ways = (
        ("names", leaf.names, str.__eq__, "named"),
        ("name_suffixes", leaf.name_suffixes, str.endswith, "named with the suffix"),
    )
    # leaf_module.classes: a class's own name or its fully qualified one, as DeepSpeed matches;
    # DeepSpeed warns (hooks then apply as usual) when no module is of any class listed.
    kinds = {
        m: (type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}") for _, m in named
    }
    of_class = [m for m, kind in kinds.items() if set(kind) & set(leaf.classes)]
    if leaf.classes and not of_class:
        logger.warning(
            "zero_optimization.leaf_module.classes: no module of %s is of a class in %s (the "
            "class name or its fully qualified one); no module is made a leaf by class",
            type(model).__name__,
            list(leaf.classes),
        )
    for module in of_class:
        mark_leaf(module)
    for key, wanted, matches, said in ways:
        for text in wanted:
            found = [m for n, m in named if matches(n, text)]
            if not found:
                raise ValueError(
                    f"zero_optimization.leaf_module.{key}: no module of {type(model).__name__} "
                    f"is {said} '{text}'"
                )
            for module in found:
                mark_leaf(module)
