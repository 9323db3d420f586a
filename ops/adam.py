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
        _check_hyperparameters(type(self).__name__, lr, betas, eps, weight_decay)
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

    def _check_param(self, param: torch.Tensor) -> None:
        _check_param(param, "cpu")

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
                self._check_param(param)
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
        small = param.numel() * param.element_size() < _HUGE_PAGE_MIN_BYTES
        if advise is None or small or param.device.type != "cpu":
            return torch.zeros_like(param, memory_format=torch.contiguous_format)
        moment = torch.empty_like(param, memory_format=torch.contiguous_format)
        advise(moment)
        return moment.zero_()


class FusedAdam(CPUAdam):
    """DeepSpeed's deepspeed.ops.adam.FusedAdam: Adam / AdamW, fused per device kind.

    CUDA parameters (fp32, contiguous) step in the compiled op fused_adam
    (ops/csrc/fused_adam.cu), one multi-tensor launch per group; it has no fallback, so
    OpBuildError (with the reason) is raised where CUDA or nvcc is missing (at construction when
    CUDA parameters are given, else at their first step). CPU parameters step through CPUAdam's
    path with the same math, its kernel chosen at the first CPU step: fp32 ones in the compiled
    cpu_adam op, else its pure-PyTorch reference (``adam_reference``) after one warning; bf16 /
    fp16 ones (which DeepSpeed's kernel also takes) in fp32 through the reference, the parameter
    and both moments (kept in the parameter's dtype, as DeepSpeed keeps them) stored back after
    each step. Outputs of step_with_copy must be on their parameter's device; on CUDA, one dtype
    (bf16 or fp16) per group.

    Args (DeepSpeed's names and order):
        params: tensors or param group dicts, as for torch.optim.Adam.
        lr, betas, eps, weight_decay: as torch.optim.Adam (weight_decay default 0).
        bias_correction: divide the moments by 1 - beta^t.
        adam_w_mode: True (default): decoupled weight decay, torch.optim.AdamW's update;
            False: L2 decay added to the gradient, torch.optim.Adam's.
        amsgrad: must be False; True raises NotImplementedError (a RuntimeError, as DeepSpeed
            raises).
        set_grad_none: kept as DeepSpeed's attribute; zero_grad() sets gradients to None either
            way (torch's default, which DeepSpeed's set_grad_none=False also reaches).
        adamw_mode: keyword only, CPUAdam's spelling of adam_w_mode (the two must agree).
        use_op: None (default): compiled ops, the CPU reference where cpu_adam cannot be built;
            True: compiled ops only; False: the CPU reference (CUDA parameters then raise
            ValueError, there is no CUDA reference).

    Raises ValueError for out-of-range hyper-parameters; TypeError, at the step, for a CUDA
    parameter that is not contiguous fp32 or a CPU one that is not contiguous fp32/bf16/fp16.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool | None = None,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        adamw_mode: bool | None = None,
        use_op: bool | None = None,
    ) -> None:
        if amsgrad:
            raise NotImplementedError(
                "FusedAdam(amsgrad=True): FusedAdam has no AMSGrad variant (neither has "
                "DeepSpeed's); use torch.optim.AdamW(amsgrad=True) instead."
            )
        if adam_w_mode is not None and adamw_mode is not None and adam_w_mode != adamw_mode:
            raise ValueError(
                f"FusedAdam: adam_w_mode={adam_w_mode} and adamw_mode={adamw_mode} disagree; "
                "give one of them (adam_w_mode is DeepSpeed's name)."
            )
        mode = next((m for m in (adam_w_mode, adamw_mode) if m is not None), True)
        self.set_grad_none = set_grad_none
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=mode,
            bias_correction=bias_correction,
            use_op=use_op,
        )

    @property
    def adam_w_mode(self) -> int:
        """DeepSpeed's attribute: 1 for decoupled weight decay (AdamW), 0 for L2."""
        return int(self.defaults["adamw_mode"])

    def _select(self, use_op: bool | None) -> None:
        # The CUDA op loads now when CUDA parameters are given (a missing toolchain fails here,
        # not at the first step); the CPU kernel loads at the first CPU step: zero.initialize
        # rebinds the groups to master shards, so CPU parameters at construction (a model not
        # yet moved to the GPU) may never step here, and cpu_adam's first build takes minutes.
        self._use_op = use_op
        self._fused = self._kernel_module = self._kernel = None
        if any(p.device.type == "cuda" for group in self.param_groups for p in group["params"]):
            self._fused_kernel()

    def _fused_kernel(self) -> Callable:
        if self._fused is None:
            if self._use_op is False:
                raise ValueError(
                    "FusedAdam: use_op=False has no CUDA path (there is no CUDA reference); "
                    "use use_op=None or True for CUDA parameters."
                )
            self._fused = get_builder("fused_adam").load().adam_step
        return self._fused

    def _host_kernel(self) -> Callable:
        if self._kernel is None:
            CPUAdam._select(self, self._use_op)
        return self._kernel

    @property
    def uses_op(self) -> bool:
        """True where CPU parameters step in the compiled cpu_adam op (CUDA ones always do)."""
        return self._kernel is not None and self._kernel is not adam_reference

    def _check_param(self, param: torch.Tensor) -> None:
        if param.device.type == "cuda":
            _check_param(param, "cuda")
        elif param.device.type != "cpu" or param.dtype not in _FUSED_ADAM_CPU_DTYPES:
            raise TypeError(
                f"FusedAdam steps float32 CUDA parameters and float32 / bfloat16 / float16 CPU "
                f"parameters, got {param.dtype} on {param.device}; move the parameter or cast "
                "it."
            )
        elif not param.is_contiguous():
            raise TypeError(
                f"FusedAdam: CPU parameters must be contiguous, got a {tuple(param.shape)} "
                f"{param.dtype} tensor that is not; step a contiguous copy."
            )

    def _update_group(self, group: dict, items: list[tuple]) -> None:
        on_cuda = [item for item in items if item[0].device.type == "cuda"]
        on_host = [item for item in items if item[0].device.type != "cuda"]
        if on_host:
            self._update_on_host(group, on_host)
        if on_cuda:
            self._update_fused(group, on_cuda)

    def _update_on_host(self, group: dict, items: list[tuple]) -> None:
        kernel = self._host_kernel()
        beta1, beta2 = group["betas"]
        hyper = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
        modes = (group["bias_correction"], group["adamw_mode"])
        for param, grad, exp_avg, exp_avg_sq, step, out in items:
            if param.dtype == torch.float32:
                kernel(param, grad, exp_avg, exp_avg_sq, step, *hyper, *modes, out)
                continue
            # A 16-bit parameter: the update runs in fp32 and each tensor is stored back in its
            # own dtype, as DeepSpeed's kernel loads, computes and stores element by element.
            wide = [t.float() for t in (param, exp_avg, exp_avg_sq)]
            adam_reference(wide[0], grad, wide[1], wide[2], step, *hyper, *modes)
            for narrow, value in zip((param, exp_avg, exp_avg_sq), wide):
                narrow.copy_(value)
            if out is not None:
                out.copy_(wide[0])

    def _update_fused(self, group: dict, items: list[tuple]) -> None:
        fused = self._fused_kernel()
        # Parameters join one launch per (step, has output): their bias corrections agree.
        buckets: dict[tuple[int, bool], list[tuple]] = {}
        for item in items:
            buckets.setdefault((item[4], item[5] is not None), []).append(item)
        beta1, beta2 = group["betas"]
        for (step, has_out), bucket in buckets.items():
            columns = list(zip(*bucket))
            fused(
                list(columns[0]), list(columns[1]), list(columns[2]), list(columns[3]), step,
                group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                group["bias_correction"], group["adamw_mode"],
                list(columns[5]) if has_out else None,
                torch.cuda.current_stream(columns[0][0].device).cuda_stream,
            )  # fmt: skip


_FUSED_ADAM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _select_module(use_op: bool | None) -> ModuleType | None:
    if use_op is False:
        return None
    builder = get_builder("cpu_adam")
    return builder.load() if use_op else builder.load_or_fallback()


def _check_hyperparameters(
    name: str, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    if lr < 0.0:
        raise ValueError(f"{name}: lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"{name}: betas must be two values in [0, 1), got {betas}")
    if eps < 0.0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")
    if weight_decay < 0.0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")


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
