"""Optimizer registry: DeepSpeed's ``optimizer {type, params}`` block -> a torch.optim optimizer.

The engine builds the optimizer over each rank's owned shard of the fp32 master weights, so
the optimizer never sees the full model on one rank (stages 1-3); at stage 0 every rank owns
everything. This module only maps the config onto a constructor: it does not shard anything.

Type rules (DeepSpeed 0.16-0.19 semantics, matched case-insensitively):
- ``Adam`` -> ``torch.optim.AdamW`` (decoupled weight decay) unless ``params.adam_w_mode`` is
  false, then ``torch.optim.Adam`` (L2 penalty added to the gradient).
- ``AdamW`` -> ``torch.optim.AdamW`` (``adam_w_mode`` cannot turn it off, as in DeepSpeed).
- ``SGD`` and any other ``torch.optim.Optimizer`` subclass by its class name.
- DeepSpeed-only types (Lamb, OneBitAdam, ...) raise NotImplementedError.

See docs/optimizers.md for the table of types and parameters.
"""

import inspect
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import did_you_mean

# Types DeepSpeed accepts in optimizer.type that zero does not implement (and torch lacks).
_DEEPSPEED_ONLY_TYPES = (
    "Lamb",
    "OneBitAdam",
    "OneBitLamb",
    "ZeroOneAdam",
    "Lion",
    "MuAdam",
    "MuAdamW",
    "MuSGD",
)

# torch optimizers that cannot run under the engine, with the reason.
UNSUPPORTED_OPTIMIZERS = {
    "LBFGS": "it needs a closure that re-evaluates the model; the engine's step() takes none",
    "SparseAdam": "it needs sparse gradients, and the engine reduces gradients into dense buckets",
    "Adafactor": "it factorizes by parameter shape, and ZeRO steps on flat 1-D shards",
    "Muon": "it orthogonalizes 2-D parameters, and ZeRO steps on flat 1-D shards",
}

# DeepSpeed's Adam/AdamW keys that have no torch constructor argument. Their handling is in
# _translate_adam_params and documented in docs/optimizers.md.
_ADAM_DEEPSPEED_KEYS = ("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none")

# Words torch uses in its range-check messages, mapped to the parameter they concern.
_TORCH_MESSAGE_ALIASES = {"learning rate": "lr", "epsilon": "eps", "beta": "betas"}


def _torch_optimizer_classes() -> dict[str, type]:
    """Every public torch.optim.Optimizer subclass, by class name."""
    classes = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if (
            inspect.isclass(obj)
            and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer
            and not name.startswith("_")
        ):
            classes[name] = obj
    return classes


def supported_optimizer_types() -> list[str]:
    """The names optimizer.type accepts (any capitalisation), sorted, Adam/AdamW/SGD first."""
    first = ["Adam", "AdamW", "SGD"]
    rest = sorted(
        name
        for name in _torch_optimizer_classes()
        if name not in first and name not in UNSUPPORTED_OPTIMIZERS
    )
    return first + rest


def did_you_mean_any_case(name: str, candidates: Iterable[str]) -> str:
    """did_you_mean for case-insensitive names (registry types), in the candidate's spelling."""
    by_lower = {c.lower(): c for c in candidates}
    hint = did_you_mean(name.lower(), by_lower)
    if not hint:
        return ""
    return f" Did you mean '{by_lower[hint.split(chr(39))[1]]}'?"


def _check_type_name(type_name: Any, key: str) -> str:
    if not isinstance(type_name, str) or not type_name:
        raise ValueError(f"{key} must be a non-empty string, got {type_name!r}")
    return type_name


def as_params(params: Mapping[str, Any] | None, key: str) -> dict[str, Any]:
    """A config ``params`` block as a new dict; None means empty. ValueError if not a mapping."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{key} must be a mapping of names to values, got {params!r}")
    for name in params:
        if not isinstance(name, str):
            raise ValueError(f"{key} keys must be strings, got {name!r}")
    return dict(params)


def resolve_optimizer(type_name: str, params: Mapping[str, Any] | None) -> tuple[type, dict]:
    """Map optimizer.type and optimizer.params to (torch optimizer class, constructor kwargs).

    Raises ValueError for unknown types, unknown parameter names and wrong value types (each
    message names the config key), NotImplementedError for DeepSpeed-only types.
    """
    type_name = _check_type_name(type_name, "optimizer.type")
    params = as_params(params, "optimizer.params")
    lowered = type_name.lower()
    for name in _DEEPSPEED_ONLY_TYPES:
        if lowered == name.lower() and not hasattr(torch.optim, name):
            raise NotImplementedError(
                f"optimizer type '{type_name}' (config key optimizer.type) is a DeepSpeed "
                f"optimizer that zero does not implement; use one of: "
                f"{', '.join(supported_optimizer_types())}"
            )
    for name, reason in UNSUPPORTED_OPTIMIZERS.items():
        if lowered == name.lower():
            raise NotImplementedError(
                f"optimizer type '{type_name}' (config key optimizer.type) is not supported: "
                f"{reason}"
            )
    canonical = {name.lower(): name for name in supported_optimizer_types()}.get(lowered)
    if canonical is None:
        supported = supported_optimizer_types()
        raise ValueError(
            f"unknown optimizer type '{type_name}' (config key optimizer.type)."
            f"{did_you_mean_any_case(type_name, supported)} Supported: {', '.join(supported)}"
        )
    if "max_grad_norm" in params:
        raise ValueError(
            "optimizer.params.max_grad_norm is not an optimizer parameter: set the top-level "
            "config key gradient_clipping instead (the engine clips the global gradient norm)"
        )
    if canonical in ("Adam", "AdamW"):
        cls, params = _translate_adam_params(canonical, params)
    else:
        cls = _torch_optimizer_classes()[canonical]
    kwargs = check_params(cls.__init__, params, "optimizer.params", skip=("self", "params"))
    return cls, kwargs


def _translate_adam_params(type_name: str, params: dict[str, Any]) -> tuple[type, dict]:
    """Apply DeepSpeed's Adam/AdamW keys and defaults; return the torch class and the rest.

    DeepSpeed's default Adam (FusedAdam / DeepSpeedCPUAdam) has weight_decay 0, unlike
    torch.optim.AdamW (0.01); with torch_adam true DeepSpeed passes the params to torch's class
    unchanged, so torch's defaults apply. We keep both behaviours so a config means the same.
    """
    extras = {key: params.pop(key) for key in _ADAM_DEEPSPEED_KEYS if key in params}
    for key, value in extras.items():
        if not isinstance(value, bool):
            raise ValueError(f"optimizer.params.{key} must be true or false, got {value!r}")
    if extras.get("bias_correction", True) is False:
        raise ValueError(
            "optimizer.params.bias_correction=false is not supported: torch's Adam and AdamW "
            "always correct the moment estimates; remove the key or set it to true"
        )
    adam_w_mode = extras.get("adam_w_mode", True)
    if type_name == "AdamW" and not adam_w_mode:
        warnings.warn(
            "optimizer.params.adam_w_mode=false is ignored for optimizer type AdamW (as in "
            "DeepSpeed); use type Adam with adam_w_mode false for L2-coupled weight decay",
            stacklevel=3,
        )
    cls = torch.optim.AdamW if type_name == "AdamW" or adam_w_mode else torch.optim.Adam
    if not extras.get("torch_adam", False):
        params.setdefault("weight_decay", 0.0)
    return cls, params


def build_optimizer(
    type_name: str, params: Mapping[str, Any] | None, param_groups: Any
) -> torch.optim.Optimizer:
    """Build the optimizer named by the config block ``optimizer {type, params}``.

    Args:
        type_name: optimizer.type, e.g. "Adam", "adamw", "SGD", "RMSprop" (case-insensitive).
        params: optimizer.params, DeepSpeed key names (see docs/optimizers.md); None = defaults.
        param_groups: what torch.optim constructors take: an iterable of tensors or a list of
            dicts with per-group overrides. In the engine these are the rank's owned fp32
            master shards. Not a collective.

    Returns a torch.optim.Optimizer. Where torch has a fused kernel for the class and the
    parameters' device (Adam, AdamW, SGD, Adagrad on CPU and CUDA) and optimizer.params names
    neither "fused" nor "foreach", it is built with fused=True: zero steps a few large flat shards,
    where the per-tensor loop (torch's CPU default) makes ~10 passes through memory per element
    and the fused kernel one (15x faster on a 5M-element CPU shard; results within 1 ulp of the
    loop's).

    Raises:
        ValueError: unknown type or parameter, wrong value type, or a value torch rejects; the
            message names the config key (optimizer.type / optimizer.params.<name>).
        NotImplementedError: a DeepSpeed-only type (Lamb, OneBitAdam, ...) or a torch optimizer
            the engine cannot drive (LBFGS, SparseAdam).
    """
    cls, kwargs = resolve_optimizer(type_name, params)
    if _takes_fused(cls, kwargs):
        try:
            return cls(param_groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass  # no fused kernel for these tensors (or a bad value: reported below)
    try:
        return cls(param_groups, **kwargs)
    except (TypeError, ValueError) as err:
        key = _guess_key(str(err), kwargs)
        where = f"optimizer.params.{key}" if key else "optimizer.params"
        raise ValueError(
            f"torch.optim.{cls.__name__} rejected {where} (optimizer.type '{type_name}', "
            f"params {kwargs}): {err}"
        ) from err


def _takes_fused(cls: type, kwargs: dict) -> bool:
    """Whether to ask `cls` for its fused implementation: it has one, and the config chose no
    implementation itself ("fused" / "foreach") nor asked for a differentiable step."""
    chosen = "fused" in kwargs or "foreach" in kwargs or kwargs.get("differentiable", False)
    return "fused" in inspect.signature(cls.__init__).parameters and not chosen


def _guess_key(message: str, names: Iterable[str]) -> str | None:
    """The parameter a torch range-check message is about, when the message makes it clear."""
    lowered = message.lower()
    for name in sorted(names, key=len, reverse=True):
        if re.search(rf"\b{re.escape(name)}\b", lowered):
            return name
    for words, name in _TORCH_MESSAGE_ALIASES.items():
        if words in lowered and name in names:
            return name
    return None


def check_params(
    fn: Callable,
    params: Mapping[str, Any],
    prefix: str,
    *,
    skip: Iterable[str] = ("self",),
    check_types: bool = True,
) -> dict[str, Any]:
    """Validate config params against ``fn``'s keyword arguments; return the kwargs to pass.

    Names must be keyword arguments of ``fn`` (less ``skip``); arguments without a default
    are required. With ``check_types``, each value must fit the kind of the argument's default
    (or its annotation when it has no default): bool, number, tuple of numbers (a JSON list is
    converted to a tuple), or string. Errors name ``<prefix>.<name>``, e.g.
    optimizer.params.lr. Shared by the optimizer and scheduler registries.
    """
    accepted = {
        name: p
        for name, p in inspect.signature(fn).parameters.items()
        if name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    kwargs = {}
    for name, value in params.items():
        if name not in accepted:
            raise ValueError(
                f"unknown parameter {prefix}.{name}.{did_you_mean(name, accepted)} "
                f"Accepted: {', '.join(accepted)}"
            )
        spec = accepted[name]
        kind = spec.annotation if spec.default is spec.empty else spec.default
        kwargs[name] = _check_value(f"{prefix}.{name}", value, kind) if check_types else value
    missing = [n for n, p in accepted.items() if p.default is p.empty and n not in kwargs]
    if missing:
        raise ValueError(f"missing required parameter {prefix}.{missing[0]}")
    return kwargs


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_value(key: str, value: Any, kind: Any) -> Any:
    """Check ``value`` against an argument's default (or annotation); return it normalised."""
    if isinstance(kind, bool) or kind in (bool, "bool"):
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if kind in (int, "int") and not isinstance(kind, bool):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    if isinstance(kind, int | float) or kind in (float, "float"):
        if not _is_number(value):
            raise ValueError(f"{key} must be a number, got {value!r} ({type(value).__name__})")
        return value
    if isinstance(kind, tuple):
        ok = isinstance(value, list | tuple) and len(value) == len(kind)
        if not ok or not all(
            _is_number(v) or (v is None and d is None) for v, d in zip(value, kind)
        ):
            raise ValueError(
                f"{key} must be a list of {len(kind)} numbers like {list(kind)}, got {value!r}"
            )
        return tuple(value)
    if isinstance(kind, str) and not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    return value
