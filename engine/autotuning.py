"""The engine's side of `zrun --autotuning`: a trial measures itself, reports, and exits.

The tuner (launcher/autotuning/, docs/tuning.md) starts the user's script once per candidate
config with ZERO_AUTOTUNING_METRICS=PATH on every rank; without it nothing here runs. Optimizer
steps up to autotuning.start_profile_step warm up; the window up to end_profile_step is measured;
then each rank writes PATH.rank<R>.json and the job exits with code 0, as DeepSpeed's engine does
after end_profile_step. The record: step_seconds, samples_per_s, tflops, peak_bytes, and what the
planner needs about the model: num_params (Psi, the trainable elements this rank lays out), the
transformer's shape where the model's config names it (num_layers, hidden_size, num_heads,
vocab_size) and seq_len (the second dimension of the first 2-D tensor the first training
forward got).

step_seconds is the median of the window's optimizer steps, each timed on its own: one step
slowed by another process on a shared machine does not move it, as it moves a mean. A script
that ends before end_profile_step still reports the steps it measured, when the process exits,
with "complete": false (the tuner counts such a record only from a trial that exited with 0).

peak_bytes is torch.cuda.max_memory_allocated on CUDA, the process's peak resident set on CPU.
tflops counts 6 Psi FLOPs per token for the whole job, as the step log does (monitor.py [Note:
throughput]), with the monitor's tokens_per_sample, else the seq_len seen.
"""

import atexit
import json
import os
import resource
import statistics
import sys
import time

import torch

ENV_METRICS = "ZERO_AUTOTUNING_METRICS"
# Names of a transformer's shape in model.config: Hugging Face's first, then nanoGPT's.
SHAPE_NAMES = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
}


def peak_bytes(device: torch.device) -> int:
    """This rank's peak memory so far: CUDA allocated bytes, else the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def model_shape(model: torch.nn.Module) -> dict:
    """The shape entries SHAPE_NAMES finds in `model.config` (absent ones are left out)."""
    config = getattr(model, "config", None)
    shape = {}
    for key, names in SHAPE_NAMES.items():
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                shape[key] = value
                break
    return shape


def _seq_len(args, kwargs) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


class TrialProbe:
    """Measures one trial ([module docstring]); made by `attach_from_environment` when the
    Engine is built."""

    def __init__(self, path: str, engine):
        self.path = path
        self.shape = model_shape(engine.module)
        self.seq_len = None
        self.step_seconds = []  # each measured optimizer step's duration
        self._last = None  # when the previous measured step ended
        self._hook = engine.module.register_forward_pre_hook(
            lambda module, args, kwargs: self._on_forward(engine, args, kwargs), with_kwargs=True
        )
        if self._window(engine)[0] == 0:
            self._last = time.perf_counter()  # the window starts with the first step
        atexit.register(self._report_partial, engine)

    @classmethod
    def attach_from_environment(cls, engine) -> "TrialProbe | None":
        """A probe on `engine` when ENV_METRICS is set, else None."""
        path = os.environ.get(ENV_METRICS)
        return cls(path, engine) if path else None

    def _on_forward(self, engine, args, kwargs) -> None:
        if not (engine.module.training and torch.is_grad_enabled()):
            return  # an evaluation forward says nothing about training batches
        self.seq_len = _seq_len(args, kwargs)
        self._hook.remove()

    @staticmethod
    def _window(engine) -> tuple[int, int]:
        tuning = engine.config.autotuning
        return (3, 5) if tuning is None else (tuning.start_profile_step, tuning.end_profile_step)

    def on_step(self, engine) -> None:
        """Called by engine.step() after each optimizer step: from start_profile_step on, times
        each step; after end_profile_step - start_profile_step of them, reports and exits."""
        start, end = self._window(engine)
        if engine.global_steps < start or self.path is None:
            return
        self._synchronize(engine.device)
        now = time.perf_counter()
        if self._last is not None:
            self.step_seconds.append(now - self._last)
        self._last = now
        if len(self.step_seconds) >= end - start:
            self._write(engine, complete=True)
            self._exit(engine)

    def _report_partial(self, engine) -> None:
        # At exit of a script that ended inside the window: the steps it did measure. In a
        # process with several engines (DeepSpeed-Chat's actor and critic) the first to finish
        # its window reports; another's partial window is not written over it.
        if self.step_seconds and self.path is not None and not os.path.exists(self._file(engine)):
            self._write(engine, complete=False)

    def _file(self, engine) -> str:
        return f"{self.path}.rank{engine.comm.rank}.json"

    @staticmethod
    def _synchronize(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _write(self, engine, complete: bool) -> None:
        """This rank's record (the module docstring) at PATH.rank<R>.json."""
        step_seconds = statistics.median(self.step_seconds)
        samples_per_s = engine.config.train_batch_size / step_seconds
        tokens = engine.monitor.tokens_per_sample or self.seq_len or 0
        record = dict(
            step_seconds=step_seconds,
            samples_per_s=samples_per_s,
            tflops=6 * engine.monitor.psi * tokens * samples_per_s / 1e12 if tokens else None,
            peak_bytes=peak_bytes(engine.device),
            steps=[engine.global_steps - len(self.step_seconds), engine.global_steps],
            complete=complete,
            num_params=engine.optimizer.layout.numel,
            seq_len=self.seq_len,
            rank=engine.comm.rank,
            world_size=engine.comm.world_size,
            device=engine.device.type,
            **self.shape,
        )
        with open(self._file(engine), "w") as handle:
            json.dump(record, handle)
        self.path = None  # written once

    @staticmethod
    def _exit(engine) -> None:
        """End the process group on every rank (a collective: all ranks reach the same step)
        and exit with code 0."""
        sys.stdout.flush()
        from .comm.deepspeed import destroy_process_group, is_initialized

        if is_initialized():
            destroy_process_group()
        raise SystemExit(0)
