"""zero.zero: DeepSpeed's deepspeed.zero namespace, so `import zero as deepspeed` scripts that
call deepspeed.zero.Init, deepspeed.zero.GatheredParameters,
deepspeed.zero.register_external_parameter and deepspeed.zero.ZeroParamStatus find them. Init and
GatheredParameters are the same objects as zero.Init and zero.GatheredParameters; ZeroParamStatus
is the type of the ds_status attribute zero sets on partitioned parameters
(engine/partition/ds_params.py).

[Note: external parameters]
DeepSpeed's stage 3 gathers a module's parameters around that module's forward only, so a
parameter used in another module's forward (a tied lm_head weight, `h @ embed.weight.T` in a
parent) must be registered on the module that uses it. zero's stage 3 needs no registration:
while the model's forward runs, UsageGuard (engine/partition/usage_guard.py) sees every op that
uses a released parameter, gathers its fetch unit there and keeps it until the end of backward. So
register_external_parameter only checks its arguments (a script's mistake stays visible) and
remembers the pair, so unregister_external_parameter can be checked as DeepSpeed checks it.
"""

import weakref

import torch

from .partition import gathered
from .partition.ds_params import ZeroParamStatus, is_zero_param
from .partition.gathered import GatheredParameters
from .partition.init import Init
from .partition.tiling import TiledLinear, TiledLinearReturnBias

__all__ = [
    "GatheredParameters",
    "Init",
    "TiledLinear",
    "TiledLinearReturnBias",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]

# module -> {id(parameter): parameter} registered on it (nothing reads it but unregister).
_EXTERNAL: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _check(caller: str, module, parameter) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"zero.zero.{caller}: module must be a torch.nn.Module, not {type(module).__name__}"
        )
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(
            f"zero.zero.{caller}: parameter must be a torch.nn.Parameter, not "
            f"{type(parameter).__name__} (register the module's parameter itself, not a tensor "
            "computed from it)"
        )


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's deepspeed.zero.register_external_parameter: declare that `module`'s forward
    uses `parameter`, a parameter of another module. Nothing else is needed with zero: stage 3
    gathers a parameter wherever the model's forward uses it ([Note: external parameters]), and
    stages 0-2 do not partition parameters. Callable before or after zero.initialize, at any
    stage; not a collective.

    Checks its arguments: TypeError when `module` is not a torch.nn.Module or `parameter` not
    a torch.nn.Parameter; ValueError when `parameter` is neither a parameter of `module` (its
    own or its submodules') nor one zero manages (of a model built under zero.Init or given to
    zero.initialize), since a parameter from outside the model would never be trained.
    """
    _check("register_external_parameter", module, parameter)
    ours = any(p is parameter for p in module.parameters())
    managed = is_zero_param(parameter) or gathered.owner(parameter) is not None
    if not (ours or managed):
        raise ValueError(
            f"zero.zero.register_external_parameter: the parameter of shape "
            f"{tuple(parameter.shape)} is not a parameter of {type(module).__name__} (nor of its "
            "submodules) nor of a model zero manages (built under zero.Init or given to "
            "zero.initialize): register a parameter of the model, on a module that contains "
            "it (the model itself will do)"
        )
    _EXTERNAL.setdefault(module, {})[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's deepspeed.zero.partition_parameters.unregister_external_parameter: undo
    register_external_parameter(module, parameter). Changes nothing in training (no
    registration is needed; [Note: external parameters]). TypeError for arguments of the wrong
    types, ValueError when the parameter is not registered on `module`."""
    _check("unregister_external_parameter", module, parameter)
    registered = _EXTERNAL.get(module, {})
    if registered.get(id(parameter)) is not parameter:
        raise ValueError(
            f"zero.zero.unregister_external_parameter: the parameter of shape "
            f"{tuple(parameter.shape)} is not registered on {type(module).__name__} (with "
            "register_external_parameter)"
        )
    del registered[id(parameter)]
