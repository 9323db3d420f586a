"""UsageGuard: the torch function mode that catches a parameter used outside its fetch unit's
forward, and the errors for uses of parameters that stage 3 refuses.

[Note: generation]
A forward without a backward to come (no grad, or eval mode) ends as engine(...) in eval mode
does: every unit is released and its order is kept for the next forward's prefetch, so each
step of generate() prefetches what the last step ran. Each step all-gathers every unit, so the
ranks must run the same number of steps: transformers' synced_gpus=True keeps a rank that has
finished running forwards until every rank has. A forward inside transformers' decoding loop with
synced_gpus=False (its default, unless it sees DeepSpeed's HfDeepSpeedConfig) that would
all-gather raises on every rank before its first all-gather, instead of leaving the ranks that
finish later waiting for the others (unsynced_generation); engine.generate() passes
synced_gpus=True. The loop's synced_gpus is read from the caller's frames, which is all that
says a forward belongs to it.
"""

import sys

import torch
from torch.overrides import TorchFunctionMode

from .units import Unit


class UsageGuard(TorchFunctionMode):
    """Gathers the unit of a released parameter that an op uses outside the unit's own forward
    (tied weights, a parent's direct use of a child's weight, a parametrization evaluated by
    the module around it) and pins it when it holds trainable parameters (their gradients reach
    it in backward); reading a placeholder's dtype, device or requires_grad gathers nothing.
    Refuses a parameter zero does not manage (a module attached after zero.initialize, or one
    outside the engine's module): its gradient would never be reduced nor its value updated."""

    def __init__(self, gatherer):  # the model's ParamGatherer (gatherer.py)
        super().__init__()
        self.gatherer = gatherer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.gatherer.busy:
            return func(*args, **kwargs)
        if id(getattr(func, "__self__", func)) in _METADATA:
            return func(*args, **kwargs)  # a placeholder has the parameter's dtype, device, ...
        for value in (*args, *kwargs.values()):
            if not isinstance(value, torch.nn.Parameter):
                continue
            unit = self.gatherer.unit_of(value)
            if unit is None and value.numel() > 0:
                raise unmanaged_parameter(self.gatherer.comm.rank, value, self.gatherer.root)
            if unit is not None and value.numel() == 0:
                self.gatherer.fetch(unit)
                # A trainable parameter's gradient reaches its unit in backward; a frozen unit
                # goes with its own forward's release, the end of a forward without backward,
                # or the end of backward ([Note: parameter lifecycle] in units.py).
                unit.pinned = unit.pinned or not unit.frozen
        return func(*args, **kwargs)


# Tensor attributes and methods that read no values: a placeholder answers them as the full
# parameter would (same dtype, device, requires_grad, grad_fn), so UsageGuard gathers nothing
# for them. (Its shape differs: reading it gathers.)
_METADATA = frozenset(
    id(vars(torch._C.TensorBase)[name])
    for name in (
        "dtype",
        "device",
        "layout",
        "requires_grad",
        "requires_grad_",
        "is_leaf",
        "grad_fn",  # None for a parameter; register_parameter() reads it
        "is_floating_point",
        "is_complex",
        "is_cuda",
        "is_meta",
        "get_device",
        "element_size",
    )
)


def decoding_loop_synced() -> bool | None:
    """synced_gpus of the Hugging Face transformers decoding loop (or generate() call) that the
    current forward runs in: the innermost frame of a transformers function with a boolean
    local `synced_gpus` (GenerationMixin._sample, _beam_search, ..., or generate() itself with
    an explicit value); None when there is none ([Note: generation])."""
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        module = frame.f_globals.get("__name__", "")
        if "synced_gpus" in frame.f_code.co_varnames and module.startswith("transformers."):
            value = frame.f_locals.get("synced_gpus")
            if isinstance(value, bool):
                return value
        frame = frame.f_back
    return None


_MAX_FRAMES = 200  # frames searched for a decoding loop above a forward


def unsynced_generation(rank: int, world_size: int, unit: Unit) -> ValueError:
    """The error for a forward of transformers' decoding loop with synced_gpus=False that
    would all-gather `unit` ([Note: generation])."""
    return ValueError(
        f"rank {rank}: generate() runs with synced_gpus=False under ZeRO stage 3 on "
        f"{world_size} ranks: each step all-gathers the parameters (here unit '{unit.name}'), "
        "so a rank whose sequences finish first would stop taking part while the others wait "
        "for it. Pass synced_gpus=True (engine.generate(...) does by default; transformers turns "
        "it on by itself only under DeepSpeed's HfDeepSpeedConfig), or, if the model fits on "
        "one device, generate inside zero.GatheredParameters(model.parameters())"
    )


def unmanaged_parameter(rank: int, param, root: torch.nn.Module) -> RuntimeError:
    """The error for a parameter used in the model's forward that zero does not lay out."""
    name = next((n for n, p in root.named_parameters() if p is param), None)
    where = (
        f"parameter '{name}' was added to the model after zero.initialize"
        if name is not None
        else f"a parameter of shape {tuple(param.shape)} that is not part of the engine's module"
    )
    return RuntimeError(
        f"rank {rank}: {where} and is used in the model's forward: zero does not manage it, so its "
        "gradient would not be averaged across ranks nor its value updated (nor, under stage 3, "
        "partitioned). Attach every module before zero.initialize (build the engine over the "
        "whole model), or register a constant as a buffer"
    )
