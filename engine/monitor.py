"""Step log, wall-clock timers, CSV/TensorBoard monitors and the comms ledger report.

The engine calls `timer(name)` around forward, backward and step and `on_step(engine)` once per
optimizer step (after the comm ledger closed the step). Everything here reads zero's counters;
nothing here issues a collective. Observers the engine adds to `StepMonitor.observers` (the
FLOPs profiler's StepProfile, profiling/flops_profiler.py) see the same calls: each is entered
as `observer.phase(name)` inside the timer and gets `observer.on_step(engine)` last.

[Note: step-time breakdown]
With wall_clock_breakdown the step time is split into forward, backward, reduce, all_gather and
optimizer. The engine times forward, backward and step ("optimizer"); the communicator measures,
per collective, how long the caller waited for it (comm/ledger.py CommLedger.waited). Whatever a
timed phase waited for gradient reductions (reduce-scatter, all-reduce) moves to `reduce`, and for
parameter all-gathers to `all_gather`, so the five add up to the timed wall time and the
communication shown is what did not overlap compute. Waiting needs the communicator:
attach(comm) binds it (the first on_step does it when the engine has not).

[Note: throughput]
samples/s = train_batch_size / (time between two optimizer-step boundaries), so data loading
counts. tokens/s needs the tokens per sample, which only the caller knows: set
`engine.monitor.tokens_per_sample = seq_len` once (0 leaves tokens/s and TFLOP/s out).
Achieved TFLOP/s = 6 * Psi * tokens / seconds / 1e12 for the whole job (dense transformer, 2
FLOPs per parameter per token forward and 4 backward; attention and recomputation not counted),
with Psi the trainable parameters this rank lays out (with tensor parallelism, its slice).
"""

import contextlib
import csv
import logging
import os
import time

import torch

from .planning.estimator import comm_psi

logger = logging.getLogger("zero")

PHASES = {"forward": "forward", "backward": "backward", "step": "optimizer"}  # timer -> phase
WAITS = {
    "reduce": ("reduce_scatter", "all_reduce", "all_to_all_q"),  # all_to_all_q: ZeRO++ qgZ
    "all_gather": ("all_gather", "all_gather_q"),  # all_gather_q: ZeRO++ qwZ
}
TIMERS = ("forward", "backward", "reduce", "all_gather", "optimizer")


class Timers:
    """Accumulated seconds per phase over one optimizer step ([Note: step-time breakdown]);
    CUDA-synchronized when `sync`. Without a ledger there is no reduce / all_gather split."""

    def __init__(self, sync: bool):
        self.sync = sync and torch.cuda.is_available()
        self.ledger = None  # the CommLedger whose waiting is split out (set by attach)
        self.reset()

    def _waited(self) -> dict[str, float]:
        waited = self.ledger.waited if self.ledger is not None else {}
        return {phase: sum(waited.get(op, 0.0) for op in ops) for phase, ops in WAITS.items()}

    @contextlib.contextmanager
    def time(self, name: str):
        phase = PHASES.get(name, name)
        if self.sync:
            torch.cuda.synchronize()
        before = self._waited()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            waited = {k: v - before[k] for k, v in self._waited().items()}
            self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
            if self.ledger is not None:
                self.seconds[phase] -= sum(waited.values())
                for key, seconds in waited.items():
                    self.seconds[key] += seconds

    def reset(self) -> None:
        names = TIMERS if self.ledger is not None else tuple(PHASES.values())
        self.seconds = dict.fromkeys(names, 0.0)


class ThroughputTimer:
    """Samples per second over optimizer steps; DeepSpeed's `engine.tput_timer`
    (deepspeed.utils.timer.ThroughputTimer), same methods, arguments and attribute names.

    The engine calls start() at the beginning of every training forward and
    stop(global_step=<accumulation boundary>) at the end of every engine.step(), so the time
    timed is each micro-batch's forward, backward and step; loading data between micro-batches
    is not ([Note: throughput] counts it, this timer does not, as DeepSpeed's). A start() only
    begins timing once `start_step` optimizer steps are done (the first steps allocate and
    compile), so avg_samples_per_sec() = batch_size / (seconds timed / optimizer steps timed),
    batch_size being train_batch_size (samples of the whole job per optimizer step).

    Args:
        config: the config's `timers.throughput` block (`enabled`: false makes start and stop do
            nothing; `synchronized`: wait for the CUDA device before each reading).
        batch_size: samples per optimizer step (None counts 1).
        start_step: optimizer steps left untimed at the start.
        steps_per_output: stop(report_speed=True) logs every this many optimizer steps (None:
            never).
        monitor_memory: the logged line adds host memory and swap use in percent (psutil).
        logging_fn: where the line goes (default: the "zero" logger's info).

    Not a collective: each rank times itself.
    """

    def __init__(
        self,
        config,
        batch_size,
        start_step=2,
        steps_per_output=None,
        monitor_memory=False,
        logging_fn=None,
    ):
        self.config = config
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or logger.info
        self.start_time = 0.0  # perf_counter() of the start() being timed; 0: none
        self.end_time = 0.0
        self.started = False
        self.initialized = False
        self.epoch_count = 0
        self.micro_step_count = 0  # in this epoch
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # seconds, over every timed micro-step
        self.step_elapsed_time = 0.0  # seconds, over the timed micro-steps of this step

    def _synchronize(self) -> None:
        if self.config.synchronized and torch.cuda.is_available():
            torch.cuda.synchronize()

    def update_epoch_count(self) -> None:
        """A new epoch begins: the micro-step count in the log line starts again at 0."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Begin a micro-step; timed once start_step optimizer steps are done (a start without
        a stop in between starts again)."""
        if not self.config.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self._synchronize()
            self.start_time = time.perf_counter()

    def stop(self, global_step=False, report_speed=True) -> None:
        """End the micro-step start() began (nothing without one); `global_step` says it ended
        an optimizer step. With report_speed, every steps_per_output optimizer steps, log the
        average and this step's samples/s."""
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if not self.start_time:
            return
        self._synchronize()
        self.end_time = time.perf_counter()
        elapsed = self.end_time - self.start_time
        self.start_time = 0.0
        self.total_elapsed_time += elapsed
        self.step_elapsed_time += elapsed
        if not global_step:
            return
        every = self.steps_per_output
        if report_speed and every and self.global_step_count % every == 0:
            self.logging(self._line())
        self.step_elapsed_time = 0.0

    def _line(self) -> str:
        current = self.batch_size / self.step_elapsed_time if self.step_elapsed_time else 0.0
        line = (
            f"throughput: epoch={self.epoch_count} micro_step={self.micro_step_count} "
            f"global_step={self.global_step_count} avg_samples/s={self.avg_samples_per_sec():.2f} "
            f"samples/s={current:.2f}"
        )
        if torch.cuda.is_available():
            line += (
                f" mem_allocated_GiB={torch.cuda.memory_allocated() / 2**30:.2f}"
                f" max_mem_allocated_GiB={torch.cuda.max_memory_allocated() / 2**30:.2f}"
            )
        if self.monitor_memory:
            import psutil

            line += (
                f" host_memory%={psutil.virtual_memory().percent}"
                f" swap%={psutil.swap_memory().percent}"
            )
        return line

    def avg_samples_per_sec(self) -> float:
        """batch_size / mean seconds of the timed optimizer steps (those after start_step); -inf
        before any step was timed (DeepSpeed's value for none)."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)


class CsvWriter:
    """csv_monitor: one plain CSV file per event, `step,value` rows, under output_path/job_name."""

    def __init__(self, output_path: str, job_name: str):
        self.directory = os.path.join(output_path or ".", job_name)
        os.makedirs(self.directory, exist_ok=True)

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            path = os.path.join(self.directory, name.replace("/", "_") + ".csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name])
                writer.writerow([step, value])

    def close(self) -> None:
        """Nothing to close: each write opens and closes its files."""


def summary_writer_class():
    """torch.utils.tensorboard.SummaryWriter; ImportError naming the package and the key when
    tensorboard is not installed. zero.initialize calls it on every rank before the first
    collective when tensorboard.enabled (only rank 0 writes), so no rank fails alone."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "config tensorboard.enabled needs the 'tensorboard' package: pip install "
            "tensorboard (or set tensorboard.enabled to false)"
        ) from None
    return SummaryWriter


class TensorBoardWriter:
    """tensorboard: torch.utils.tensorboard.SummaryWriter under output_path/job_name."""

    def __init__(self, output_path: str, job_name: str):
        writer = summary_writer_class()
        self.writer = writer(log_dir=os.path.join(output_path or ".", job_name))

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def memory_in_use(device: torch.device) -> int:
    """Bytes in use by this rank: CUDA allocated memory, else the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    import psutil

    return psutil.Process().memory_info().rss


def persistent_numel(gatherer) -> int:
    """Elements (unpadded) of stage 3's persistent unit's trainable parameters; 0 without a
    gatherer or one."""
    if gatherer is None:
        return 0
    return sum(
        b.layout.numel
        for u in gatherer.units
        if u.persistent
        for b in u.buckets
        if b.master is not None
    )


def _replica_psi(engine) -> float:
    """MiCS's replica all-reduce per optimizer step in Psi: 2 / mics_shard_size (0 without)."""
    groups = getattr(engine, "partition_groups", None)
    if groups is None or groups.replica is None:
        return 0.0
    return 2.0 / engine.optimizer.layout.num_shards


def comms_report(
    ledger_step: dict,
    psi: int,
    stage: int,
    gas: int,
    rank: int,
    persistent: int = 0,
    kept: int = 0,
    frozen: int = 0,
    replica_psi: float = 0.0,
) -> tuple[str, bool]:
    """The comms ledger of one optimizer step as text, and whether the total deviates from the
    paper's expectation (estimator.comm_psi, with `persistent` of the `psi` elements in stage 3's
    persistent unit, less the `kept` elements stage 3 kept gathered from a forward to its
    backward, [Note: reuse distance]) by more than 1%. `ledger_step`: op -> OpTotals. `psi`
    counts trainable parameters: the `frozen` elements stage 3 all-gathered for frozen ones are
    left out of the total and named beside it. `replica_psi`: MiCS's replica all-reduce per step,
    in Psi (2 / mics_shard_size; partition/hierarchy.py). Each op's bytes that crossed nodes
    are in the "inter bytes" column, their total in Psi on the last line (comm/topology.py)."""
    lines = [
        f"comms rank {rank}: {'op':<16}{'calls':>7}{'elements':>14}{'bytes':>15}"
        f"{'inter bytes':>15}{'ms':>10}"
    ]
    total = inter = 0
    for op, t in sorted(ledger_step.items()):
        total += t.elements
        inter += t.inter_elements
        lines.append(
            f"comms rank {rank}: {op:<16}{t.calls:>7}{t.elements:>14,}{t.bytes:>15,}"
            f"{t.inter_bytes:>15,}{t.seconds * 1e3:>10.2f}"
        )
    expected = comm_psi(stage, gas, persistent / psi, kept / gas / psi) if psi else 0.0
    expected += replica_psi
    measured = (total - frozen) / psi if psi else 0.0
    deviates = abs(measured - expected) > 0.01 * expected
    flag = "  DEVIATION > 1%" if deviates else ""
    notes = f", {persistent:,} persistent" if stage == 3 and persistent else ""
    notes += f", {kept:,} kept for backward" if kept else ""
    frozen_note = f" + {frozen:,} elements of frozen parameters" if frozen else ""
    notes += f", MiCS replica all-reduce {replica_psi:.4g} Psi" if replica_psi else ""
    lines.append(
        f"comms rank {rank}: total {measured:.4f} Psi (Psi={psi:,}){frozen_note}; "
        f"expected {expected:.4g} Psi (stage {stage}, gradient accumulation {gas}{notes}){flag}; "
        f"inter-node {inter / psi if psi else 0.0:.4f} Psi"
    )
    return "\n".join(lines), deviates


class StepMonitor:
    """Step log every steps_per_print, monitor events (rank 0), comms and memory reports."""

    def __init__(self, config, rank: int, psi: int, device: torch.device):
        self.config = config
        self.rank = rank
        self.psi = psi
        self.device = device
        self.tokens_per_sample = 0  # set by the caller (see [Note: throughput])
        # False: the script prints its own step line (examples/train.py prints format_step with
        # the loss of the whole global batch); events, comms and memory reports still go.
        self.step_log = True
        self.timers = Timers(sync=config.wall_clock_breakdown)
        self.writers = []
        if rank == 0:
            if config.csv_monitor.enabled:
                self.writers.append(
                    CsvWriter(config.csv_monitor.output_path, config.csv_monitor.job_name)
                )
            if config.tensorboard.enabled:
                self.writers.append(
                    TensorBoardWriter(config.tensorboard.output_path, config.tensorboard.job_name)
                )
        self.observers = []  # objects with phase(name) (a context manager) and on_step(engine)
        self._losses: list[torch.Tensor] = []
        self._last_boundary = time.perf_counter()
        self._memory_reported = False
        self.last = {}  # the figures of the last optimizer step, for tests and callers

    def attach(self, comm) -> None:
        """Split collective waiting out of the timers ([Note: step-time breakdown]); with
        wall_clock_breakdown, turns the communicator's timing on (all collectives)."""
        self.timers.ledger = comm.ledger
        self.timers.reset()
        if self.config.wall_clock_breakdown and comm.timing is None:
            comm.enable_timing()

    @contextlib.contextmanager
    def timer(self, name: str):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.timers.time(name))
            for observer in self.observers:
                stack.enter_context(observer.phase(name))
            yield

    def close(self) -> None:
        """Close the monitors' open files (TensorBoard's event file); later events are not
        written. Idempotent."""
        for writer in self.writers:
            writer.close()
        self.writers = []

    def record_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def throughput(self, seconds: float) -> dict:
        samples = self.config.train_batch_size
        figures = {"seconds": seconds, "samples_per_s": samples / seconds if seconds else 0.0}
        if self.tokens_per_sample:
            tokens = samples * self.tokens_per_sample
            figures["tokens_per_s"] = tokens / seconds if seconds else 0.0
            figures["tflops"] = 6 * self.psi * figures["tokens_per_s"] / 1e12
        return figures

    def on_step(self, engine) -> None:
        """Called by engine.step() at every optimizer step, after the comm ledger closed it."""
        now = time.perf_counter()
        figures = self.throughput(now - self._last_boundary)
        self._last_boundary = now
        every = self.config.steps_per_print
        printing = bool(every) and engine.global_steps % every == 0 and self.rank == 0
        printing = printing and self.step_log
        # Reading the loss waits for the device: only on steps that print or write events.
        wanted = self._losses and (printing or self.writers)
        loss = float(torch.stack(self._losses).float().mean()) if wanted else None
        self._losses = []
        figures.update(
            step=engine.global_steps,
            loss=loss,
            lr=engine.get_lr()[0] if engine.get_lr() else None,
            loss_scale=engine.loss_scale,
            grad_norm=engine.get_global_grad_norm(),
            skipped=engine.skipped_steps,
            memory=memory_in_use(self.device),
            timers=dict(self.timers.seconds),
        )
        self.last = figures
        if self.timers.ledger is None:
            self.attach(engine.comm)  # from the next step on, when the engine did not
        self.timers.reset()
        self._write_events(figures, engine.global_samples)
        if printing:
            logger.info(self.format_step(figures))
        if self.config.comms_logger.enabled and engine.world_size > 1:
            text, _ = comms_report(
                engine.comm.ledger.last_step,
                self.psi,
                self.config.zero.stage,
                self.config.gradient_accumulation_steps,
                self.rank,
                persistent_numel(engine.gatherer),
                engine.comm.ledger.last_kept,
                engine.comm.ledger.last_frozen,
                _replica_psi(engine),
            )
            logger.info(text)
        if self.config.memory_breakdown and not self._memory_reported:
            from .planning.memory import format_report

            self._memory_reported = True
            logger.info(format_report(engine.memory_report()))
        for observer in self.observers:
            observer.on_step(engine)

    def format_step(self, f: dict) -> str:
        """The step line of the figures `f` (self.last's keys): "step=10 loss=4.8747 lr=...".
        The loss is this rank's mean over its micro-batches of the step unless the caller puts
        another in `f`."""
        parts = [f"step={f['step']}"]
        if f["loss"] is not None:
            parts.append(f"loss={f['loss']:.4f}")
        parts += [f"lr={f['lr']:.3e}" if f["lr"] is not None else "lr=n/a"]
        parts += [f"loss_scale={f['loss_scale']:g}", f"skipped={f['skipped']}"]
        norm = f["grad_norm"]
        parts.append(f"grad_norm={norm:.4g}" if norm is not None else "grad_norm=n/a")
        parts.append(f"samples/s={f['samples_per_s']:.2f}")
        if "tokens_per_s" in f:
            parts += [f"tokens/s={f['tokens_per_s']:,.0f}", f"TFLOP/s={f['tflops']:.3f}"]
        if self.config.wall_clock_breakdown:
            parts += [f"{k}_ms={v * 1e3:.1f}" for k, v in f["timers"].items()]
        parts.append(f"mem_MiB={f['memory'] / 2**20:.1f}")
        return " ".join(parts)

    def _write_events(self, f: dict, samples: int) -> None:
        if not self.writers:
            return
        events = [
            ("Train/Samples/lr", f["lr"], samples),
            ("Train/Samples/loss_scale", f["loss_scale"], samples),
            ("Train/Samples/samples_per_s", f["samples_per_s"], samples),
        ]
        if f["loss"] is not None:
            events.append(("Train/Samples/train_loss", f["loss"], samples))
        if f["grad_norm"] is not None:
            events.append(("Train/Samples/grad_norm", f["grad_norm"], samples))
        if "tokens_per_s" in f:
            events.append(("Train/Samples/tokens_per_s", f["tokens_per_s"], samples))
        for writer in self.writers:
            writer.write([e for e in events if e[1] is not None])
