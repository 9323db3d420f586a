"""torch.compile for a zero engine: engine.compile() (DeepSpeed's engine.compile and its config
block `compile`, see docs/performance.md, "Compiling").

[Note: what is compiled]
Stages 0-2 compile the model's forward whole: `module.forward` becomes the compiled function,
so nn.Module.__call__ (and any hook on the root) stays outside the graph. zero adds no forward
hooks below stage 3, and gradients leave the graph through post-accumulate-grad hooks on the
parameters, which autograd runs after the compiled backward has produced each gradient: the
bucket copies and reduce-scatters happen between graphs, never inside one, so zero causes no
graph break. The parameters are views of zero's flat buffers whose storage the optimizer step
updates in place, so no step changes what the graph's guards check (no recompile per step).

Stage 3 compiles each block's forward separately, as torchtitan compiles each FSDP2 block. A
block is the module of a stage-3 fetch unit ([Note: fetch units] in partition/units.py) with no
other unit's module below it, all of whose parameters belong to its own unit or to the
persistent one (blocks()); gathering and releasing happen in the unit's forward pre- and
post-hooks, which run eagerly around the compiled forward (nn.Module.compile() would compile
__call__, hooks included). A parent whose children are units of their own and a module that
uses another unit's parameter (a tied lm_head) run eagerly; a model all of whose parameters
persist, or that is one unit, compiles whole. Three things keep a block's graph stable:
- A gathered parameter has its full shape, dtype and strides on every call; the storage differs
  from call to call (a new gathered buffer), which no guard checks: no recompile per step.
  The graph's saved weights go through the engine's saved-tensor hooks ([Note: saved weights]
  in partition/saved_weights.py), so the compiled backward reads the parameters gathered again
  for it.
- UsageGuard, zero's torch-function mode that gathers a parameter used outside its unit, is
  taken off the mode stack while a block's compiled forward runs: every parameter a block uses
  is gathered by its own unit's pre-hook, and Dynamo would otherwise trace the mode into every op.
- The guard's exit hook on each module inside the block is registered as always-called, and
  Dynamo specializes a traced hook call on that marker's hook id, which differs per block: every
  block would compile anew (recompile_limit is 8). The marker is lifted while the compiled
  forward runs and put back after it; inside the graph the enter/exit hooks' depth counting
  nets to zero, and Dynamo applies their effects only once the graph has run, so an exception
  leaves none to undo. All blocks of one class then share one graph.
"""

import contextlib
import inspect
import logging
import sys
from dataclasses import dataclass, field

import torch

from .partition.usage_guard import UsageGuard

logger = logging.getLogger("zero")


@dataclass
class Compiled:
    """What engine.compile() changed on the model, to put back (Engine.close): the modules
    whose forward is compiled, by name ("" is the root)."""

    backend: object
    kwargs: dict
    modules: list = field(default_factory=list)  # (name, module)

    @property
    def names(self) -> list[str]:
        """The compiled modules' names ("" for the whole model at stages 0-2)."""
        return [name for name, _ in self.modules]

    def restore(self) -> None:
        """Give every compiled module its own forward back. Not a collective; idempotent."""
        for _, module in self.modules:
            module.__dict__.pop("forward", None)
        self.modules.clear()


def compile_model(
    module, gatherer, config, backend, compile_kwargs, schedule, compiled_autograd, rank: int
) -> Compiled:
    """Compile `module` (the engine's model) in place: the whole forward at stages 0-2, each
    block's forward at stage 3 (`gatherer` is the stage-3 ParamGatherer, else None); see [Note:
    what is compiled]. `backend` and `compile_kwargs` go to torch.compile (mode, fullgraph,
    dynamic, options); nothing is traced until the next forward. Not a collective (every rank
    compiles its own graphs on its first forward, which every rank runs).

    Raises NotImplementedError for a DeepCompile `schedule` and for compiled_autograd_enabled;
    TypeError for a compile_kwargs key torch.compile does not take."""
    _refuse_deepcompile_only(schedule, compiled_autograd, rank)
    kwargs = _compile_kwargs(compile_kwargs, rank)
    _log_config(config.compile)
    compiled = Compiled(backend, kwargs)
    if gatherer is None:
        _compile_forward(module, backend, kwargs)
        compiled.modules.append(("", module))
    else:
        for name, block in blocks(module, gatherer):
            forward = torch.compile(block.forward, backend=backend, **kwargs)
            marked = _marked_exit_hooks(block, gatherer)
            block.forward = _BlockForward(forward, marked, gatherer.saving)
            compiled.modules.append((name, block))
    logger.info(
        "engine.compile: backend %s%s, compiled %s",
        backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend)),
        f" {kwargs}" if kwargs else "",
        "the whole forward"
        if gatherer is None or compiled.names == [""]
        else f"{len(compiled.modules)} stage-3 blocks",
    )
    return compiled


def blocks(module, gatherer) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the stage-3 blocks, outermost first ([Note: what is compiled]): a
    module without another unit's module below it, all of whose parameters belong to its own
    unit or to the persistent one, that is a unit's module or the root (a model all of whose
    parameters persist, or that is one unit, compiles whole)."""
    unit_of_module = {id(u.module): u for u in gatherer.units if not u.persistent}
    found = []

    def has_unit_below(parent) -> bool:
        return any(id(m) in unit_of_module for m in parent.modules() if m is not parent)

    def own(parent, unit) -> bool:
        owners = [gatherer.unit_of(p) for p in parent.parameters()]
        return all(o is None or o.persistent or o is unit for o in owners)

    def visit(name, parent) -> None:
        unit = unit_of_module.get(id(parent))
        if not has_unit_below(parent):
            if (unit is not None or parent is module) and own(parent, unit):
                found.append((name, parent))
            return
        for child_name, child in parent.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)
    return found


def _compile_forward(module, backend, kwargs) -> None:
    module.forward = torch.compile(module.forward, backend=backend, **kwargs)


class _BlockForward:
    """A block's compiled forward, run without UsageGuard on the mode stack, with the guard's
    inner exit hooks unmarked, and saving gathered weights by reference (`saving`, the
    gatherer's: the inner modules' own saving hooks are traced and do nothing) ([Note: what is
    compiled])."""

    def __init__(self, compiled, marked: list, saving):
        self.compiled = compiled
        self.marked = marked  # (always-called table, hook id) of the block's inner modules
        self.saving = saving

    def __call__(self, *args, **kwargs):
        with _without_usage_guard(), self._unmarked(), self.saving():
            return self.compiled(*args, **kwargs)

    @contextlib.contextmanager
    def _unmarked(self):
        for table, key in self.marked:
            table.pop(key, None)
        try:
            yield
        finally:
            for table, key in self.marked:
                table[key] = True


def _marked_exit_hooks(block, gatherer) -> list:
    """(module._forward_hooks_always_called, hook id) of the gatherer's always-called forward
    hooks on the modules inside `block` (not on the block itself: its hooks run eagerly)."""
    marked = []
    for inner in block.modules():
        if inner is block:
            continue
        for key in inner._forward_hooks_always_called:
            hook = inner._forward_hooks.get(key)
            if getattr(hook, "__self__", None) is gatherer:
                marked.append((inner._forward_hooks_always_called, key))
    return marked


@contextlib.contextmanager
def _without_usage_guard():
    """Take zero's UsageGuard off the top of the torch-function mode stack for the duration."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if isinstance(_get_current_function_mode(), UsageGuard):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def _refuse_deepcompile_only(schedule, compiled_autograd, rank: int) -> None:
    if schedule is not None:
        raise NotImplementedError(
            f"rank {rank}: engine.compile(schedule={schedule!r}): a schedule lists DeepCompile's "
            "graph passes, which zero does not implement. zero compiles the forward itself "
            "(stage 3: each block, gathered and released between the compiled blocks); call "
            "engine.compile() without schedule"
        )
    if compiled_autograd:
        raise NotImplementedError(
            f"rank {rank}: engine.compile(compiled_autograd_enabled=True): zero's gradient hooks "
            "reduce gradients between the compiled graphs' backwards, which compiled autograd "
            "would trace; call engine.compile() without it (AOTAutograd compiles each graph's "
            "backward already)"
        )


def _compile_kwargs(compile_kwargs, rank: int) -> dict:
    """compile_kwargs checked against torch.compile's parameters; `backend` dropped with a
    warning (DeepSpeed's rule: the backend argument wins)."""
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        logger.warning(
            "engine.compile: compile_kwargs['backend'] (%r) is ignored; pass backend= instead",
            kwargs.pop("backend"),
        )
    allowed = set(inspect.signature(torch.compile).parameters) - {"model", "backend"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise TypeError(
            f"rank {rank}: engine.compile: compile_kwargs {unknown} are not torch.compile "
            f"arguments; it takes {sorted(allowed)}"
        )
    return kwargs


def _log_config(block) -> None:
    """Say once what the config's `compile` block changes: deepcompile selects zero's own
    compile, and DeepCompile's tuning keys have no effect in zero."""
    if block is None:
        return
    if block.deepcompile:
        logger.info(
            "engine.compile: compile.deepcompile is true: zero compiles the forward itself (stage "
            "3: each block between eager gathers and releases); DeepCompile's passes do not run"
        )
    unused = block.keys_without_effect()
    if unused:
        logger.warning(
            "engine.compile: compile block keys %s have no effect in zero (DeepCompile's own "
            "scheduling and debugging); remove them",
            unused,
        )


def refuse_compiled_model(model, stage: int, rank: int) -> None:
    """ValueError for a model torch.compile wrapped (an OptimizedModule) and, at stage 3, for a
    module compiled by nn.Module.compile() (its compiled __call__ would trace zero's hooks):
    compile after zero.initialize, with engine.compile()."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # none without torch.compile
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        raise ValueError(
            f"rank {rank}: zero.initialize got a torch.compile'd model (OptimizedModule of "
            f"{type(model._orig_mod).__name__}); pass the model itself and call engine.compile() "
            "after zero.initialize (DeepSpeed's engine.compile): zero then compiles around its "
            "own hooks, and checkpoints keep the model's parameter names (no '_orig_mod.')"
        )
    if stage != 3:
        return
    compiled = [n or "<root>" for n, m in model.named_modules() if _called_compiled(m)]
    if compiled:
        raise ValueError(
            f"rank {rank}: modules {compiled[:5]} were compiled with nn.Module.compile(), whose "
            "compiled __call__ would trace ZeRO stage 3's gather and release hooks; build the "
            "model without it and call engine.compile() after zero.initialize (it compiles each "
            "block's forward, the hooks staying outside)"
        )


def _called_compiled(module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None
