"""CPUAdam: Adam / AdamW over fp32 master parameters in host memory, in one fused C++ pass.

The optimizer of ZeRO-Offload (Ren et al. 2021, section 4.2; DeepSpeed's `DeepSpeedCPUAdam`,
config key `zero_optimization.offload_optimizer`). param_groups and state match
torch.optim.Adam / AdamW (exp_avg, exp_avg_sq, a float32 scalar tensor `step` per parameter), so
state dicts move between them. The pass runs in the compiled op `cpu_adam` (ops/csrc/cpu_adam.cpp);
where it cannot be built, `adam_reference` (pure PyTorch, same numerics) runs instead, after
one warning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType

import torch

from .builder import get_builder

_LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
_HUGE_PAGE_MIN_BYTES = 8 << 20


def adam_reference(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    adamw_mode: bool,
    low_precision_out: torch.Tensor | None = None,
) -> None:
    """One Adam (adamw_mode False: L2 added to the gradient) or AdamW (decoupled decay) step.

    Pure PyTorch with the signature of the compiled `cpu_adam.adam_step`: updates params,
    exp_avg and exp_avg_sq (fp32, same shape) in place; step is the 1-based count after this
    update; writes params cast to low_precision_out's dtype (bf16 / fp16) when given. Follows
    torch.optim.Adam's single-tensor order of operations.
    """
    if adamw_mode:
        params.mul_(1.0 - lr * weight_decay)
    elif weight_decay != 0.0:
        grads = grads.add(params, alpha=weight_decay)
    exp_avg.lerp_(grads, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1.0 - beta2**step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    params.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if low_precision_out is not None:
        low_precision_out.copy_(params)


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW on CPU fp32 parameters, optionally writing bf16 / fp16 copies in the same pass.

    Args:
        params: fp32, contiguous CPU tensors (or param group dicts), as for torch.optim.Adam.
        lr, betas, eps, weight_decay: as torch.optim.Adam; every group may set its own, and lr
            may change between steps (schedulers write param_groups[i]['lr']).
        adamw_mode: True (the default, as DeepSpeed's `adam_w_mode`): decoupled weight decay as
            torch.optim.AdamW; False: L2 decay added to the gradient as torch.optim.Adam.
        bias_correction: divide the moments by 1 - beta^t (Kingma & Ba, Algorithm 1).
        use_op: True: the compiled op, raising OpBuildError where it cannot be built; False:
            the pure-PyTorch reference; None (default): the op, else the reference after one
            warning.

    Raises ValueError for out-of-range hyper-parameters; TypeError, at the step, for a parameter
    with a gradient that is not a contiguous fp32 CPU tensor. Any parameters are accepted at
    construction (as DeepSpeedCPUAdam): zero.initialize builds the optimizer over the model's
    parameters (bf16, or on the GPU after model.cuda()) and then steps it on fp32 host master
    shards only.
    """

    _device_type = "cpu"

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        *,
        use_op: bool | None = None,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        self._select(use_op)

    def _select(self, use_op: bool | None) -> None:
        self._kernel_module = _select_module(use_op)
        self._kernel = (
            adam_reference if self._kernel_module is None else self._kernel_module.adam_step
        )

    @property
    def uses_op(self) -> bool:
        """True where steps run in the compiled cpu_adam op, False on the reference."""
        return self._kernel is not adam_reference

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step over every parameter with a gradient; returns closure's loss."""
        return self.step_with_copy({}, closure)

    @torch.no_grad()
    def step_with_copy(
        self,
        low_precision_outputs: Mapping[torch.Tensor, torch.Tensor],
        closure: Callable[[], float] | None = None,
    ) -> float | None:
        """A step that also writes each updated parameter, cast, into low_precision_outputs[p].

        low_precision_outputs maps a parameter (by identity) to a contiguous bf16 or fp16 CPU
        tensor with the same number of elements: after the call it equals the updated fp32
        parameter cast to its dtype (round to nearest even), written in the same pass over
        memory. Parameters without an entry are updated only. Raises TypeError for an output
        of another dtype, ValueError for one of another size.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            items = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                _check_param(param, self._device_type)
                out = low_precision_outputs.get(param)
                if out is not None:
                    _check_low_precision_out(param, out)
                exp_avg, exp_avg_sq, step = self._state_for(param)
                items.append((param, _as_fp32_grad(param), exp_avg, exp_avg_sq, step, out))
            self._update_group(group, items)
        return loss

    def _update_group(self, group: dict, items: list[tuple]) -> None:
        beta1, beta2 = group["betas"]
        for param, grad, exp_avg, exp_avg_sq, step, out in items:
            self._kernel(
                param, grad, exp_avg, exp_avg_sq, step, group["lr"], beta1, beta2,
                group["eps"], group["weight_decay"], group["bias_correction"],
                group["adamw_mode"], out,
            )  # fmt: skip

    def _state_for(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        # torch.optim.Adam's layout: a float32 scalar tensor step, moments like the parameter.
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = self._new_moment(param)
            state["exp_avg_sq"] = self._new_moment(param)
        state["step"] += 1
        return state["exp_avg"], state["exp_avg_sq"], int(state["step"].item())

    def _new_moment(self, param: torch.Tensor) -> torch.Tensor:
        # Large moments are advised onto huge pages before first touch (see cpu_adam.cpp,
        # [Note: huge pages]); zeros_like would touch the pages at once.
        advise = getattr(self._kernel_module, "advise_huge_pages", None)
        if advise is None or param.numel() * param.element_size() < _HUGE_PAGE_MIN_BYTES:
            return torch.zeros_like(param, memory_format=torch.contiguous_format)
        moment = torch.empty_like(param, memory_format=torch.contiguous_format)
        advise(moment)
        return moment.zero_()


class FusedAdam(CPUAdam):
    """CPUAdam's interface for fp32 CUDA parameters: one multi-tensor kernel launch per group.

    Runs the compiled op fused_adam (ops/csrc/fused_adam.cu); there is no fallback, so the
    constructor raises OpBuildError (with the reason) where CUDA or nvcc is missing. Outputs of
    step_with_copy must be CUDA tensors of one dtype (bf16 or fp16) per group.
    """

    _device_type = "cuda"

    def _select(self, use_op: bool | None) -> None:
        if use_op is False:
            raise ValueError("FusedAdam: use_op=False; use CPUAdam for the reference path")
        self._fused = get_builder("fused_adam").load().adam_step
        self._kernel = self._kernel_module = None

    def _update_group(self, group: dict, items: list[tuple]) -> None:
        # Parameters join one launch per (step, has output): their bias corrections agree.
        buckets: dict[tuple[int, bool], list[tuple]] = {}
        for item in items:
            buckets.setdefault((item[4], item[5] is not None), []).append(item)
        beta1, beta2 = group["betas"]
        for (step, has_out), bucket in buckets.items():
            columns = list(zip(*bucket))
            self._fused(
                list(columns[0]), list(columns[1]), list(columns[2]), list(columns[3]), step,
                group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                group["bias_correction"], group["adamw_mode"],
                list(columns[5]) if has_out else None,
                torch.cuda.current_stream(columns[0][0].device).cuda_stream,
            )  # fmt: skip


def _select_module(use_op: bool | None) -> ModuleType | None:
    if use_op is False:
        return None
    builder = get_builder("cpu_adam")
    return builder.load() if use_op else builder.load_or_fallback()


def _check_hyperparameters(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    if lr < 0.0:
        raise ValueError(f"CPUAdam: lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"CPUAdam: betas must be two values in [0, 1), got {betas}")
    if eps < 0.0:
        raise ValueError(f"CPUAdam: eps must be >= 0, got {eps}")
    if weight_decay < 0.0:
        raise ValueError(f"CPUAdam: weight_decay must be >= 0, got {weight_decay}")


def _check_param(param: torch.Tensor, device_type: str) -> None:
    if (
        param.device.type != device_type
        or param.dtype != torch.float32
        or not param.is_contiguous()
    ):
        raise TypeError(
            f"parameters must be contiguous float32 {device_type} tensors (the fp32 master "
            f"copy), got {param.dtype} on {param.device} (contiguous={param.is_contiguous()}); "
            f"step an fp32 master copy instead"
        )


def _as_fp32_grad(param: torch.Tensor) -> torch.Tensor:
    grad = param.grad
    if grad.is_sparse:
        raise TypeError("CPUAdam: sparse gradients are not supported")
    # A bf16 / strided gradient costs one conversion copy; fp32 contiguous ones pass as they are.
    return grad.to(dtype=torch.float32, memory_format=torch.contiguous_format)


def _check_low_precision_out(param: torch.Tensor, out: torch.Tensor) -> None:
    if out.dtype not in _LOW_PRECISION_DTYPES or out.device != param.device:
        raise TypeError(
            f"low-precision outputs must be bfloat16 or float16 on the parameter's device "
            f"({param.device}), got "
            f"{out.dtype} on {out.device}"
        )
    if out.numel() != param.numel() or not out.is_contiguous():
        raise ValueError(
            f"a low-precision output must be contiguous with {param.numel()} elements "
            f"(its parameter's), got {out.numel()} (contiguous={out.is_contiguous()})"
        )


# DeepSpeed's name for the host Adam (deepspeed.ops.adam.DeepSpeedCPUAdam); FusedAdam has the
# same name in both.
DeepSpeedCPUAdam = CPUAdam
