"""The FLOPs profiler: parameters, MACs, FLOPs and forward latency of every module of a model.

DeepSpeed's deepspeed.profiling.flops_profiler (FlopsProfiler, get_model_profile and the
*_to_string helpers) with its report's sections and columns, and the config's `flops_profiler`
block: StepProfile, attached to the engine's monitor, profiles one training forward at
`profile_step` and prints the report on global rank 0 (docs/observability.md, "FLOPs profiler").

[Note: counting]
FLOPs are counted by torch's own FlopCounterMode (torch.utils.flop_counter), a dispatch mode that
sees every aten op and counts matrix products, convolutions and attention kernels with torch's
formulas (2 FLOPs per multiply-accumulate; attention counted as its two full matrix products,
causal or not). It does not count element-wise ops (activations, norms, softmax, additions),
which DeepSpeed's profiler counts at one FLOP per element, so DeepSpeed's totals are a little
higher (docs/observability.md quotes both on one model). Every op torch counts is a product
of MACs, so MACs = FLOPs / 2 exactly. Torch's table lacks the fused CPU attention kernel
(aten._scaled_dot_product_flash_attention_for_cpu and its backward); CPU_ATTENTION adds them
with torch's own attention formulas, so CPU and CUDA count the same.

Per module: a forward pre-hook and a forward hook on every module read the counter's running
total and the clock; the difference is that call's FLOPs (inclusive of its submodules) and
latency, summed over the calls of the profiled run. Reading totals rather than the counter's
per-module table (keyed by names it derives itself) keeps shared modules and a profiled
submodule of a larger model exact. On CUDA each hook synchronizes the device first, as DeepSpeed
does, so latencies are the device's (and the profiled forward runs slower than an unprofiled one).

Parameters count each tensor's full size: under ZeRO stage 3 a parameter's data is a
0-element placeholder between uses, so its DeepSpeed attribute ds_numel is read instead.
"""

import contextlib
import logging
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from ..accelerator import get_accelerator

logger = logging.getLogger("zero")

__all__ = [
    "DEFAULT_PRECISION",
    "FlopsProfiler",
    "StepProfile",
    "attach",
    "bytes_to_string",
    "duration_to_string",
    "flop_counter",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]

DEFAULT_PRECISION = 2  # digits after the point in the report (DeepSpeed's)


# ----- counting --------------------------------------------------------------------------------
# torch.utils.flop_counter is imported on first use: the engine imports this module, and most
# runs never profile.
def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_shape, query_shape, key_shape, value_shape, *args, **kwargs):
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)


CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def flop_counter():
    """torch's FlopCounterMode (no printed table) with the CPU attention kernels added
    ([Note: counting]). A context manager; get_total_flops() is FLOPs (2 per MAC) so far."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)


def full_numel(param: torch.Tensor) -> int:
    """Elements of `param`'s full value: ds_numel under ZeRO stage 3 (whose data is a 0-element
    placeholder between uses), else numel()."""
    return getattr(param, "ds_numel", None) or param.numel()


# ----- numbers as DeepSpeed's report writes them ------------------------------------------------
_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6))


def number_to_string(num, units=None, precision=DEFAULT_PRECISION) -> str:
    """`num` scaled to a metric prefix: "1.23 G" (`units` forces one of T G M K m u; "" none)."""
    if units is None and not num:
        units, magnitude = "", 1.0
    elif units is None:
        units, magnitude = next(((u, m) for u, m in _PREFIXES if num >= m), _PREFIXES[-1])
    else:
        magnitude = dict(_PREFIXES).get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs, units=None, precision=DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops, units=None, precision=DEFAULT_PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def bytes_to_string(num_bytes, units=None, precision=DEFAULT_PRECISION) -> str:
    return f"{number_to_string(num_bytes, units, precision)}B"


def params_to_string(params, units=None, precision=DEFAULT_PRECISION) -> str:
    """Parameters with B (billions) where the other helpers write G: "1.3 B", "125.3 M"."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds, units=None, precision=DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


# ----- the profiler ------------------------------------------------------------------------------
class FlopsProfiler:
    """Parameters, MACs, FLOPs and forward latency of each module of `model` over the forward
    passes run between start_profile() and stop_profile(); DeepSpeed's
    deepspeed.profiling.flops_profiler.FlopsProfiler, same methods and arguments.

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(batch)
        prof.stop_profile()            # before backward: ops run while profiling are counted
        flops = prof.get_total_flops()
        prof.print_model_profile(profile_step=step)
        prof.end_profile()

    Counts follow [Note: counting]: FLOPs of matrix products, convolutions and attention,
    MACs = FLOPs / 2, parameters at full size (ds_numel at stage 3), latency in seconds between
    each module's forward pre-hook and forward hook. Hooks are added by start_profile and
    removed by stop_profile; the model is not otherwise changed. Not a collective.

    Args:
        model: the torch.nn.Module to profile.
        ds_engine: the zero Engine training `model` (its world size, batch size and the timed
            backward and step appear in the report), or None.
        recompute_fwd_factor: forward passes recomputed in backward (activation checkpointing;
            1.0 recomputes the whole forward): the report's backward counts
            2 + recompute_fwd_factor forward FLOPs.
    """

    def __init__(self, model, ds_engine=None, recompute_fwd_factor=0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.func_patched = False  # DeepSpeed's name: counting is on (nothing is patched here)
        self.flops = self.macs = self.params = 0  # set by print_model_profile, as DeepSpeed
        self._counter = None
        self._hooks = []
        self._ignored = ()
        self.reset_profile()

    def start_profile(self, ignore_list=None) -> None:
        """Reset the counts and start counting. `ignore_list`: module classes (exact types)
        left unhooked, as in DeepSpeed: such a module shows its children's sums (0 for a leaf)
        and its own work counts in the enclosing module and the totals."""
        self.end_profile()
        self.reset_profile()
        self._ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if type(module) in self._ignored:
                continue
            self._hooks.append(module.register_forward_pre_hook(self._enter))
            self._hooks.append(module.register_forward_hook(self._exit, always_call=True))
        self._counter = flop_counter()
        self._counter.__enter__()
        self.started = self.func_patched = True

    def stop_profile(self) -> None:
        """Stop counting; the counts stay readable until end_profile()."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.func_patched = False

    def reset_profile(self) -> None:
        """Zero every module's counts (parameters are read when reported)."""
        self._flops = defaultdict(int)  # module -> FLOPs of its calls, submodules included
        self._seconds = defaultdict(float)  # module -> seconds of its calls
        self._open = defaultdict(list)  # module -> (clock, counter total) of calls under way

    def end_profile(self) -> None:
        """Stop counting and drop the counts."""
        self.stop_profile()
        self.reset_profile()
        self.started = False

    def _total_now(self) -> int:
        return self._counter.get_total_flops() if self._counter is not None else 0

    def _enter(self, module, args) -> None:
        get_accelerator().synchronize()
        self._open[module].append((time.perf_counter(), self._total_now()))

    def _exit(self, module, args, output) -> None:
        if not self._open[module]:
            return  # entered before start_profile
        get_accelerator().synchronize()
        start, flops = self._open[module].pop()
        self._seconds[module] += time.perf_counter() - start
        self._flops[module] += self._total_now() - flops

    # ----- per module
    def module_flops(self, module) -> int:
        """FLOPs of `module`'s calls while profiling, its submodules' included; a module never
        called (a ModuleList) has the sum of its children's, as in DeepSpeed."""
        if module in self._flops:
            return self._flops[module]
        return sum(self.module_flops(child) for child in module.children())

    def module_macs(self, module) -> int:
        return self.module_flops(module) // 2

    def module_duration(self, module) -> float:
        """Seconds of `module`'s calls; a module never called (a ModuleList) has the sum of its
        children's, as in DeepSpeed."""
        seconds = self._seconds.get(module, 0.0)
        if not seconds:
            seconds = sum(self.module_duration(child) for child in module.children())
        return seconds

    @staticmethod
    def module_params(module) -> int:
        """Elements of `module`'s parameters (each shared one once), at full size."""
        return sum(full_numel(p) for p in module.parameters())

    # ----- totals
    def get_total_flops(self, as_string=False):
        """FLOPs of the model's forward passes while profiling (int; "1.23 G" as_string)."""
        flops = self.module_flops(self.model)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string=False):
        """Multiply-accumulates of the model's forward passes (FLOPs / 2)."""
        macs = self.module_macs(self.model)
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string=False):
        """Seconds spent in the model's forward passes while profiling."""
        seconds = self.module_duration(self.model)
        return duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string=False):
        """Parameters of the model on this rank, at full size (ZeRO stage 3: ds_numel); with
        tensor parallelism, this rank's slices."""
        params = self.module_params(self.model)
        return params_to_string(params) if as_string else params

    # ----- the report
    def print_model_profile(
        self, profile_step=1, module_depth=-1, top_modules=1, detailed=True, output_file=None
    ) -> None:
        """Print DeepSpeed's report (summary, aggregated profile by depth, and with `detailed`
        the model's tree with each module's figures) to stdout, or write it to `output_file`
        (its directory is created). Nothing when not profiling (before start_profile or after
        end_profile). `module_depth`: depths 0 .. module_depth-1 in the aggregated profile, all
        of them for -1; `top_modules`: modules listed per depth."""
        if not self.started:
            return
        text = self.model_profile_text(profile_step, module_depth, top_modules, detailed)
        _emit(text, output_file)

    def model_profile_text(
        self, profile_step=1, module_depth=-1, top_modules=1, detailed=True, latency=None
    ) -> str:
        """The report print_model_profile prints, as one string. `latency`: seconds of the
        profiled micro-batch's "forward", "backward" and "step" as the engine timed them (the
        summary then has DeepSpeed's backward, step and iteration lines); None: the forward
        latency is the model's own (its forward hooks) and those lines are left out."""
        self.flops, self.macs = self.get_total_flops(), self.get_total_macs()
        self.params = self.get_total_params()
        lines = ["", f"{' DeepSpeed Flops Profiler ':-^78}"]
        lines += [f"Profile Summary at step {profile_step}:", _NOTATIONS]
        lines += _summary(self, latency or {"forward": self.get_total_duration()})
        lines += ["", f"{' Aggregated Profile per GPU ':-^86}"]
        lines += self.aggregated_profile_lines(module_depth, top_modules)
        if detailed:
            lines += ["", f"{' Detailed Profile per GPU ':-^86}"]
            lines += [_DETAILED_HEADER, _tree(self, self.model)]
        lines.append(
            "------------------------------------------------------------------------------"
        )
        return "\n".join(lines)

    def print_model_aggregated_profile(self, module_depth=-1, top_modules=1) -> None:
        """Print the top `top_modules` module classes by parameters, MACs and forward latency at
        each depth (DeepSpeed's "Aggregated Profile per GPU")."""
        print("\n".join(self.aggregated_profile_lines(module_depth, top_modules)), flush=True)

    def aggregated_profile_lines(self, module_depth=-1, top_modules=1) -> list[str]:
        by_depth = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))  # class -> figures

        def walk(module, depth):
            if type(module) not in self._ignored:
                figures = by_depth[depth][type(module).__name__]
                figures[0] += self.module_macs(module)
                figures[1] += self.module_params(module)
                figures[2] += self.module_duration(module)
            for child in module.children():
                walk(child, depth + 1)

        walk(self.model, 0)
        depths = len(by_depth) if module_depth == -1 else min(module_depth, len(by_depth))
        lines = [
            f"Top {top_modules} modules in terms of params, MACs or fwd latency at different "
            "model depths:"
        ]
        for depth in range(depths):
            rows = by_depth[depth]
            lines += [
                f"depth {depth}:",
                f"    params      - {_top(rows, 1, top_modules, params_to_string)}",
                f"    MACs        - {_top(rows, 0, top_modules, macs_to_string)}",
                f"    fwd latency - {_top(rows, 2, top_modules, duration_to_string)}",
            ]
        return lines


def _top(rows: dict, column: int, count: int, show) -> dict:
    """The `count` classes with the most of `column` (0 MACs, 1 params, 2 seconds), shown."""
    ranked = sorted(rows.items(), key=lambda item: item[1][column], reverse=True)
    return {name: show(figures[column]) for name, figures in ranked[:count]}


_NOTATIONS = """Notations:
data parallel size (dp_size), model parallel size(mp_size),
number of parameters (params), number of multiply-accumulate operations(MACs),
number of floating-point operations (flops), floating-point operations per second (FLOPS),
fwd latency (forward propagation latency), bwd latency (backward propagation latency),
step (weights update latency), iter latency (sum of fwd, bwd and step latency)
"""

_DETAILED_HEADER = """Each module profile is listed after its name in the following order: 
params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, fwd FLOPS

Note: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. CrossEntropyLoss). They are not counted as submodules, thus not to be printed out. However they make up the difference between a parent's MACs (or latency) and the sum of its submodules'.
2. Number of floating-point operations is a theoretical estimation, thus FLOPS computed using that could be larger than the maximum system throughput.
3. The fwd latency listed in the top module's profile is directly captured at the module forward function in PyTorch, thus it's less than the fwd latency shown above which is captured by the engine. FLOPs are torch's FlopCounterMode count: matrix products, convolutions and attention (element-wise ops are not counted).
"""  # noqa: E501, W291


def _emit(text: str, output_file) -> None:
    """Print `text`, or write it to `output_file` (its directory created)."""
    if not output_file:
        print(text, flush=True)
        return
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    with open(output_file, "w") as f:
        f.write(text + "\n")


def _row(label: str, value) -> str:
    return f"{label:<70}  {value!s:<8}"


def _summary(prof: FlopsProfiler, latency: dict) -> list[str]:
    """The summary lines: sizes, totals and latencies (the engine's, with an engine)."""
    engine, flops = prof.ds_engine, prof.flops
    lines, mp = [], 1
    if engine is not None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        mp = max(1, world // engine.world_size)
        lines += [
            _row("world size: ", world),
            _row("data parallel size: ", engine.world_size),
            _row("model parallel size: ", mp),
            _row("batch size per GPU: ", engine.train_micro_batch_size_per_gpu()),
        ]
    lines += [
        _row("params per GPU: ", params_to_string(prof.params)),
        _row("params of model = params per GPU * mp_size: ", params_to_string(prof.params * mp)),
        _row("fwd MACs per GPU: ", macs_to_string(prof.macs)),
        _row("fwd flops per GPU: ", number_to_string(flops)),
        _row("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp)),
    ]
    fwd = latency["forward"]
    lines += [
        _row("fwd latency: ", duration_to_string(fwd)),
        _row("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", _rate(flops, fwd)),
    ]
    if "backward" not in latency:
        return lines
    factor = 2 + prof.recompute_fwd_factor
    bwd, step = latency["backward"], latency["step"]
    iteration = fwd + bwd + step
    samples = engine.train_micro_batch_size_per_gpu() * engine.world_size
    lines += [
        _row("bwd latency: ", duration_to_string(bwd)),
        _row(
            f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
            _rate(factor * flops, bwd),
        ),
        _row(
            f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
            _rate((factor + 1) * flops, fwd + bwd),
        ),
        _row("step latency: ", duration_to_string(step)),
        _row("iter latency: ", duration_to_string(iteration)),
        _row(
            f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
            _rate((factor + 1) * flops, iteration),
        ),
        _row("samples/second: ", round(samples / iteration, DEFAULT_PRECISION)),
    ]
    return lines


def _rate(flops, seconds) -> str:
    return flops_to_string(flops / seconds if seconds else 0.0)


def _percent(part, whole) -> str:
    return f"{round(100 * part / whole, DEFAULT_PRECISION) if whole else 0:g}%"


def _figures(prof: FlopsProfiler, module) -> str:
    """One module's figures, as DeepSpeed writes them in front of the module's own extra_repr."""
    if type(module) in prof._ignored:
        return module.extra_repr()
    params, macs = prof.module_params(module), prof.module_macs(module)
    seconds = prof.module_duration(module)
    total_seconds = prof.get_total_duration()
    items = [
        f"{params_to_string(params)} = {_percent(params, prof.params)} Params",
        f"{macs_to_string(macs)} = {_percent(macs, prof.macs)} MACs",
        f"{duration_to_string(seconds)} = {_percent(seconds, total_seconds)} latency",
        flops_to_string(round(prof.module_flops(module) / seconds, 2) if seconds else 0),
    ]
    if module.extra_repr():
        items.append(module.extra_repr())
    return ", ".join(items)


def _tree(prof: FlopsProfiler, module) -> str:
    """`module`'s repr (torch's layout: children indented by two) with each module's figures in
    place of its extra_repr; the modules themselves are not changed."""
    children = [
        f"({name}): " + _tree(prof, child).replace("\n", "\n  ")
        for name, child in module.named_children()
    ]
    extra = _figures(prof, module).split("\n")
    body = [line for line in extra if line] + children
    if not children and len(body) <= 1:
        return f"{type(module).__name__}({''.join(body)})"
    return type(module).__name__ + "(\n  " + "\n  ".join(body) + "\n)"


def get_model_profile(
    model,
    input_shape=None,
    args=None,
    kwargs=None,
    print_profile=True,
    detailed=True,
    module_depth=-1,
    top_modules=1,
    warm_up=1,
    as_string=True,
    output_file=None,
    ignore_modules=None,
    mode="forward",
):
    """Profile one forward (mode "forward") or generate() call (mode "generate") of `model`
    after `warm_up` unprofiled ones; DeepSpeed's get_model_profile, same arguments.

    The model is called with `args` and `kwargs`, or, with `input_shape` (a tuple), with one
    uninitialized tensor of that shape in the dtype and on the device of its first parameter.
    The model is put in eval mode. Returns (flops, macs, params): ints, or with `as_string`
    DeepSpeed's strings ("1.23 G", "615.2 MMACs", "125.3 M"). Prints the report unless
    `print_profile` is false (to `output_file` when given).

    Raises TypeError when `model` is not a torch.nn.Module or `input_shape` is not a non-empty
    tuple; ValueError when neither `input_shape` nor `args`/`kwargs` are given, or `mode` is
    neither "forward" nor "generate". Not a collective (a model under ZeRO stage 3 gathers
    parameters in its forward: then every rank must call it).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, not {type(model)}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode {mode!r}; use 'forward' or 'generate'")
    args, kwargs = list(args or ()), dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise TypeError(
                f"get_model_profile: input_shape must be a non-empty tuple, not {input_shape!r}"
            )
        first = next(model.parameters(), None)
        like = {} if first is None else {"dtype": first.dtype, "device": first.device}
        args = [torch.empty(input_shape, **like)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model")
    call = model if mode == "forward" else model.generate
    model.eval()
    for _ in range(warm_up):
        call(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    call(*args, **kwargs)
    prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(warm_up, module_depth, top_modules, detailed, output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params


# ----- the config block --------------------------------------------------------------------------
def attach(engine) -> FlopsProfiler | None:
    """DeepSpeed's engine.flops_profiler: with the config's flops_profiler block enabled, a
    FlopsProfiler over engine.module whose StepProfile observes engine.monitor; else None.
    Called once by Engine.__init__ on every rank (only global rank 0 will profile)."""
    block = engine.config.flops_profiler
    if not block.enabled:
        return None
    profiler = FlopsProfiler(engine.module, engine, block.recompute_fwd_factor)
    engine.monitor.observers.append(StepProfile(profiler, block, engine))
    return profiler


class StepProfile:
    """The `flops_profiler` block: profile the first training forward of the optimizer step
    that starts when engine.global_steps == profile_step (DeepSpeed's rule: with the default 1,
    after one warm-up step), time that micro-batch's backward and the optimizer step that ends
    the step, and print the report when the step ends (DeepSpeed labels it with the steps done
    by then, profile_step + 1). Global rank 0 only; other ranks do nothing. An observer of the
    engine's StepMonitor: the monitor enters phase(name) around each timed phase ("forward",
    "backward", "step") and calls on_step(engine) at every optimizer step.

    Args:
        profiler: the FlopsProfiler over the engine's model (engine.flops_profiler).
        block: the config's flops_profiler block (profile_step, module_depth, top_modules,
            detailed, output_file).
        engine: the Engine (its global_steps and global_rank are read).
    """

    def __init__(self, profiler: FlopsProfiler, block, engine):
        self.profiler = profiler
        self.block = block
        self.engine = engine
        self.latency: dict[str, float] = {}  # phase -> seconds of the profiled micro-batch
        self.done = False

    def _due(self) -> bool:
        engine = self.engine
        return (
            not self.done
            and engine.global_rank == 0
            and engine.global_steps == self.block.profile_step
        )

    @contextlib.contextmanager
    def phase(self, name: str):
        profiling = name == "forward" and self._due() and not self.latency
        timing = profiling or (self.latency and name not in self.latency)
        if profiling:
            self.profiler.start_profile()
        start = time.perf_counter()
        try:
            yield
        finally:
            if profiling:
                self.profiler.stop_profile()
            if timing:
                get_accelerator().synchronize()
                self.latency[name] = time.perf_counter() - start

    def on_step(self, engine) -> None:
        if not self.latency:
            return
        self.latency.setdefault("backward", 0.0)
        self.latency.setdefault("step", 0.0)
        block = self.block
        try:
            text = self.profiler.model_profile_text(
                engine.global_steps,
                block.module_depth,
                block.top_modules,
                block.detailed,
                latency=self.latency,
            )
            _emit(text, block.output_file)
        finally:
            self.profiler.end_profile()
            self.latency, self.done = {}, True
