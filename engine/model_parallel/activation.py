"""zero.checkpointing: activation checkpointing with ZeRO-R's Pa, Pa+cpu and contiguous buffers.

    from zero import checkpointing
    h = checkpointing.checkpoint(block, h)                # reentrant (DeepSpeed's default)
    h = checkpointing.non_reentrant_checkpoint(block, h)  # saved-tensor hooks, no inner backward

A checkpointed function runs forward without keeping its intermediate activations; only its
inputs are kept, and backward runs it again (same CPU, device and model-parallel RNG states, so
dropout draws the same masks) to rebuild what it needs. The kept inputs are what ZeRO-R (paper,
section 6.1) shrinks, under the config block `activation_checkpointing` (applied by
zero.initialize; configure() sets the same options by hand, as in DeepSpeed):

- partition_activations (Pa): an input that is replicated over the model-parallel ranks (the
  input of a tensor-parallel transformer layer is) is kept as a 1/mp slice on each rank, padded
  when its size does not divide by mp, and all-gathered over the model-parallel group just before
  recomputation.
- cpu_checkpointing (Pa+cpu): the kept slices live in host memory (pinned where CUDA exists) and
  are copied back for recomputation: device bytes held for checkpoints drop to about zero.
- contiguous_memory_optimization (MD): the slices of number_checkpoints checkpoints are copied
  into one buffer allocated once (sized by the first checkpoint, grown only between steps), so
  long-lived checkpoints do not interleave with short-lived activations and fragment memory.
  The buffer rewinds by itself when the last live checkpoint is consumed by backward; reset()
  rewinds it by hand (after a forward whose backward never ran).

Only floating-point tensors that are not parameters are treated as activations; other arguments
are kept as they are. Checkpointing under torch.no_grad() (evaluation) just calls the function.

[Note: which variant]
checkpoint() is an autograd.Function whose backward runs a nested backward through the
recomputed graph; parameters receive their gradients inside it, so a parameter used both inside
and outside the region gets two gradient arrivals (ZeRO stage 2 refuses that), and at least one
input must require grad. non_reentrant_checkpoint() runs the function in the outer graph under
saved-tensor hooks that keep an index instead of each tensor; the first unpack in backward
recomputes the region once and hands the saved tensors back, so gradients flow through the one
autograd graph (no such restrictions).
"""

import contextlib
import threading
import time
from dataclasses import dataclass, field, fields

import torch
from torch import nn

MODEL_PARALLEL_RNG = "model-parallel-rng"
_ALIGN = 64  # bytes; keeps every slice of the contiguous buffer aligned for any dtype


# ----- settings -------------------------------------------------------------------------------
@dataclass
class CheckpointSettings:
    """The options of configure() (DeepSpeed key of the activation_checkpointing block)."""

    partition_activations: bool = False  # partition_activations
    cpu_checkpointing: bool = False  # cpu_checkpointing
    contiguous_memory_optimization: bool = False  # contiguous_memory_optimization
    number_checkpoints: int | None = None  # number_checkpoints
    synchronize: bool = False  # synchronize_checkpoint_boundary
    profile: bool = False  # profile


@dataclass
class CheckpointStats:
    """What checkpoints hold now and held at most (bytes), and time spent (seconds).

    device_bytes / host_bytes: kept checkpoint inputs not yet consumed by backward, on the compute
    device / in host memory (cpu_checkpointing), counted from the kept tensors themselves
    (padding included). contiguous_capacity_bytes: size of the contiguous buffer, if any.
    """

    device_bytes: int = 0
    host_bytes: int = 0
    live_checkpoints: int = 0
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    contiguous_capacity_bytes: int = 0
    num_forward: int = 0
    num_recompute: int = 0
    forward_seconds: float = 0.0
    recompute_seconds: float = 0.0

    def add(self, nbytes: int, host: bool, sign: int) -> None:
        if host:
            self.host_bytes += sign * nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        else:
            self.device_bytes += sign * nbytes
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)


class _Runtime:
    """Module state: the settings, the model-parallel communicator, the buffer and stats."""

    def __init__(self):
        from ..comm import Communicator

        self.settings = CheckpointSettings()
        self.mpu = None
        self.comm = Communicator(None, 0, 1)
        self.configured = False
        self.arena: ContiguousBuffer | None = None
        self.stats = CheckpointStats()
        # A checkpoint can be released from another thread: a collective launched inside a
        # non-reentrant region captures the thread's saved-tensor hooks (which own the region),
        # and the collective library frees that capture on its own thread. Stats and the
        # contiguous buffer change under this lock.
        self.lock = threading.RLock()
        # Bumped by configure() and reset(): checkpoints of an older generation no longer count.
        self.generation = 0


_RUNTIME = _Runtime()


def configure(
    mpu_,
    deepspeed_config=None,
    partition_activations=None,
    contiguous_checkpointing=None,
    num_checkpoints=None,
    checkpoint_in_cpu=None,
    synchronize=None,
    profile=None,
) -> None:
    """Set the checkpointing options (DeepSpeed's deepspeed.checkpointing.configure).

    Args:
        mpu_: a Megatron-style mpu or zero.mpu.ModelParallelGroups whose model-parallel group Pa
            partitions over; None for no model parallelism.
        deepspeed_config: a zero Config, a config dict or a config file path; its
            activation_checkpointing block gives the defaults the keyword arguments override.
        partition_activations, contiguous_checkpointing, num_checkpoints, checkpoint_in_cpu,
        synchronize, profile: override one option each (None keeps the config's value).

    Not collective. Drops the contiguous buffer. Raises ValueError when contiguous buffers are
    asked for without num_checkpoints (the buffer is sized by it).
    """
    from .mpu import model_parallel_comm

    settings = _settings_from(deepspeed_config)
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    for name, value in overrides.items():
        if value is not None:
            setattr(settings, name, value)
    if settings.contiguous_memory_optimization and not settings.number_checkpoints:
        raise ValueError(
            "activation_checkpointing.contiguous_memory_optimization needs "
            "number_checkpoints (the number of checkpointed layers per forward, e.g. n_layer); "
            f"got {settings.number_checkpoints!r}"
        )
    comm = model_parallel_comm(mpu_)
    with _RUNTIME.lock:
        _RUNTIME.settings = settings
        _RUNTIME.mpu = mpu_
        _RUNTIME.comm = comm
        _RUNTIME.arena = None
        _RUNTIME.stats = CheckpointStats()
        _RUNTIME.generation += 1
        _RUNTIME.configured = True


def _settings_from(source) -> CheckpointSettings:
    if source is None:
        return CheckpointSettings()
    from ..config import ActivationCheckpointingConfig, Config, load_config

    if isinstance(source, Config):
        block = source.activation_checkpointing
    elif isinstance(source, dict):
        block = ActivationCheckpointingConfig(**source.get("activation_checkpointing", {}))
    else:
        block = load_config(source).activation_checkpointing
    return CheckpointSettings(
        partition_activations=block.partition_activations,
        cpu_checkpointing=block.cpu_checkpointing,
        contiguous_memory_optimization=block.contiguous_memory_optimization,
        number_checkpoints=block.number_checkpoints,
        synchronize=block.synchronize_checkpoint_boundary,
        profile=block.profile,
    )


def is_configured() -> bool:
    """True once configure() ran (zero.initialize runs it when the config has the block)."""
    return _RUNTIME.configured


def settings() -> CheckpointSettings:
    """The options in force (a copy)."""
    current = _RUNTIME.settings
    return CheckpointSettings(**{f.name: getattr(current, f.name) for f in fields(current)})


def reset() -> None:
    """Rewind the contiguous buffer and forget live checkpoints (between steps; DeepSpeed's
    checkpointing.reset). Checkpoints of a forward whose backward has not run become invalid."""
    with _RUNTIME.lock:
        if _RUNTIME.arena is not None:
            _RUNTIME.arena.rewind()
        _RUNTIME.generation += 1
        stats = _RUNTIME.stats
        stats.device_bytes = stats.host_bytes = stats.live_checkpoints = 0


def memory_stats() -> dict:
    """CheckpointStats as a dict (bytes and seconds; see CheckpointStats)."""
    with _RUNTIME.lock:
        return dict(vars(_RUNTIME.stats))


def reset_peak_stats() -> None:
    with _RUNTIME.lock:
        stats = _RUNTIME.stats
        stats.peak_device_bytes, stats.peak_host_bytes = stats.device_bytes, stats.host_bytes


# ----- RNG ------------------------------------------------------------------------------------
def _device_rng_is_cuda() -> bool:
    return torch.cuda.is_available()


def _get_device_rng() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _device_rng_is_cuda() else torch.get_rng_state()


def _set_device_rng(state: torch.Tensor) -> None:
    if _device_rng_is_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states for regions that must draw differently on each model-parallel
    rank (dropout on a tensor-parallel slice), while the default generator stays identical on
    all of them (dropout on replicated activations).

    The states are of the device generator: CUDA where available, else the CPU generator.
    """

    def __init__(self):
        self._states: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self._states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create state `name` from `seed`. Raises ValueError if it exists."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists; call reset() first")
        if _device_rng_is_cuda():
            saved = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(seed)
            self._states[name] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved)
        else:
            self._states[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from state `name` inside the block; the default generator is left untouched."""
        if name not in self._states:
            raise ValueError(
                f"RNG state {name!r} does not exist; call "
                "zero.checkpointing.model_parallel_manual_seed(seed) once before training"
            )
        outside = _get_device_rng()
        _set_device_rng(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_device_rng()
            _set_device_rng(outside)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (DeepSpeed name: get_cuda_rng_tracker)."""
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker


def model_parallel_manual_seed(seed: int, mpu=None) -> None:
    """Seed the default generators with `seed` (equal on all ranks) and the tracker's
    model-parallel state with a seed distinct per model-parallel rank. Not collective.

    mpu: the model-parallel unit (default: the one given to configure()).
    """
    from .mpu import model_parallel_comm

    rank = model_parallel_comm(mpu if mpu is not None else _RUNTIME.mpu).rank
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 1013 * (rank + 1))


model_parallel_cuda_manual_seed = model_parallel_manual_seed


@dataclass
class _RNGSnapshot:
    cpu: torch.Tensor
    cuda: torch.Tensor | None
    tracker: dict = field(default_factory=dict)

    @staticmethod
    def capture() -> "_RNGSnapshot":
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return _RNGSnapshot(torch.get_rng_state(), cuda, _TRACKER.get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        _TRACKER.set_states(self.tracker)


@contextlib.contextmanager
def _replay(snapshot: _RNGSnapshot):
    """Run the block with the RNG states of `snapshot`, then put the current ones back."""
    current = _RNGSnapshot.capture()
    snapshot.restore()
    try:
        yield
    finally:
        current.restore()


# ----- kept inputs ----------------------------------------------------------------------------
def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class ContiguousBuffer:
    """One byte buffer that the checkpoints of a forward pass fill front to back (MD).

    Sized number_checkpoints x the bytes of the first checkpoint; reallocated larger only while
    no checkpoint is live (a longer sequence in a later step). Rewinds when the last live
    checkpoint is released.
    """

    def __init__(self, num_checkpoints: int, device: torch.device, pinned: bool):
        self.num_checkpoints = num_checkpoints
        self.device = device
        self.pinned = pinned
        self.buffer: torch.Tensor | None = None
        self.offset = 0
        self.live = 0

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def open(self, nbytes: int) -> None:
        """Reserve room for one checkpoint of `nbytes` (aligned) bytes."""
        if self.live == 0:
            self.offset = 0
            if self.capacity < nbytes * self.num_checkpoints:
                self.buffer = None  # free the old buffer before allocating the new one
                self.buffer = torch.empty(
                    nbytes * self.num_checkpoints,
                    dtype=torch.uint8,
                    device=self.device,
                    pin_memory=self.pinned,
                )
        if self.offset + nbytes > self.capacity:
            raise RuntimeError(
                f"the contiguous activation buffer ({self.capacity} bytes for "
                f"number_checkpoints={self.num_checkpoints}) is full at checkpoint "
                f"{self.live + 1}; raise activation_checkpointing.number_checkpoints to the "
                "number of checkpointed calls per forward, or call zero.checkpointing.reset() "
                "after a forward whose backward was skipped"
            )
        self.live += 1

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        view = self.buffer[self.offset : self.offset + nbytes].view(dtype)
        self.offset += _aligned(nbytes)
        return view

    def close(self) -> None:
        self.live -= 1
        if self.live == 0:
            self.offset = 0

    def rewind(self) -> None:
        self.live = 0
        self.offset = 0


@dataclass
class _Kept:
    """One activation input as kept: `data` is the whole tensor or this rank's padded 1/mp slice
    (`partitioned`), on the device or in host memory (`host`)."""

    data: torch.Tensor
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool
    host: bool

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _is_activation(value) -> bool:
    return (
        torch.is_tensor(value) and value.is_floating_point() and not isinstance(value, nn.Parameter)
    )


class _KeptInputs:
    """The inputs of one checkpoint as kept until recomputation, under the current settings."""

    def __init__(self, args: tuple):
        self.settings = _RUNTIME.settings
        self.comm = _RUNTIME.comm
        self.arena = None
        self.generation = _RUNTIME.generation
        self.released = False
        self.items = []
        partition = self.settings.partition_activations and self.comm.world_size > 1
        copy = partition or self.settings.cpu_checkpointing
        copy = copy or self.settings.contiguous_memory_optimization
        tensors = [a for a in args if _is_activation(a)]
        with _RUNTIME.lock:
            if copy and tensors:
                self.arena = self._open_arena(tensors, partition)
            for arg in args:
                if not _is_activation(arg):
                    self.items.append(arg)
                elif copy:
                    self.items.append(self._keep_copy(arg, partition))
                else:
                    kept = _Kept(
                        arg.detach(), arg.shape, arg.device, arg.requires_grad, False, False
                    )
                    self.items.append(kept)
            for item in self._kept():
                _RUNTIME.stats.add(item.nbytes, item.host, +1)
            _RUNTIME.stats.live_checkpoints += 1

    def _kept(self):
        return [item for item in self.items if isinstance(item, _Kept)]

    def _part_numel(self, tensor: torch.Tensor, partition: bool) -> int:
        mp = self.comm.world_size if partition else 1
        return -(-tensor.numel() // mp)

    def _open_arena(self, tensors, partition: bool):
        if not self.settings.contiguous_memory_optimization:
            return None
        arena = _RUNTIME.arena
        if arena is None:
            device = torch.device("cpu") if self.settings.cpu_checkpointing else tensors[0].device
            pinned = self.settings.cpu_checkpointing and torch.cuda.is_available()
            arena = _RUNTIME.arena = ContiguousBuffer(
                self.settings.number_checkpoints, device, pinned
            )
        nbytes = sum(_aligned(self._part_numel(t, partition) * t.element_size()) for t in tensors)
        arena.open(nbytes)
        _RUNTIME.stats.contiguous_capacity_bytes = arena.capacity
        return arena

    def _keep_copy(self, tensor: torch.Tensor, partition: bool) -> _Kept:
        host = self.settings.cpu_checkpointing
        part = self._part_numel(tensor, partition)
        flat = tensor.detach().reshape(-1)
        begin = min(self.comm.rank * part, flat.numel()) if partition else 0
        end = min(begin + part, flat.numel())
        if self.arena is not None:
            data = self.arena.take(part, tensor.dtype)
        else:
            device = torch.device("cpu") if host else tensor.device
            pinned = host and torch.cuda.is_available()
            data = torch.empty(part, dtype=tensor.dtype, device=device, pin_memory=pinned)
        # A copy, never a view: a view would keep the full activation's storage alive.
        data[: end - begin].copy_(flat[begin:end], non_blocking=True)
        data[end - begin :].zero_()
        return _Kept(data, tensor.shape, tensor.device, tensor.requires_grad, partition, host)

    def restore(self) -> list:
        """The inputs again, full size on their device: detached leaves that require grad as the
        originals did. Collective over the model-parallel group when partitioned."""
        if self.released:
            raise RuntimeError(
                "a checkpointed region was recomputed twice (backward with retain_graph=True, or "
                "a second backward through the same graph); zero.checkpointing keeps its inputs "
                "for one recomputation only"
            )
        out = []
        for item in self.items:
            if isinstance(item, _Kept):
                item = self._restore_one(item)
            elif torch.is_tensor(item):
                # A parameter or integer tensor: a fresh leaf, so the nested backward of the
                # reentrant variant hands its gradient back through the Function, not twice.
                item = item.detach().requires_grad_(item.requires_grad)
            out.append(item)
        return out

    def _restore_one(self, item: _Kept) -> torch.Tensor:
        data = item.data.to(item.device, non_blocking=True)
        if item.partitioned:
            full = torch.empty(
                data.numel() * self.comm.world_size, dtype=data.dtype, device=item.device
            )
            self.comm.all_gather(full, data)
            data = full
        numel = item.shape.numel()
        tensor = data[:numel].view(item.shape) if data.numel() != numel else data.view(item.shape)
        if self.arena is not None and tensor.data_ptr() == item.data.data_ptr():
            tensor = tensor.clone()  # the contiguous slot is reused once released
        return tensor.detach().requires_grad_(item.requires_grad)

    def release(self) -> None:
        """Give the kept bytes (and contiguous space) back. Idempotent."""
        with _RUNTIME.lock:
            if self.released:
                return
            self.released = True
            if self.generation == _RUNTIME.generation:
                for item in self._kept():
                    _RUNTIME.stats.add(item.nbytes, item.host, -1)
                _RUNTIME.stats.live_checkpoints -= 1
                if self.arena is not None:
                    self.arena.close()
            self.items = []

    def __del__(self):
        # A graph freed without backward (evaluation with grad on, an exception) still returns
        # its bytes and contiguous space.
        if _RUNTIME is not None:  # module state is gone at interpreter shutdown
            self.release()


# ----- the two variants -----------------------------------------------------------------------
@contextlib.contextmanager
def _boundary(kind: str):
    """Synchronize and time one checkpoint forward or recomputation, as configured."""
    settings, stats = _RUNTIME.settings, _RUNTIME.stats
    if settings.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter() if settings.profile else 0.0
    yield
    if settings.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()
    if settings.profile:
        elapsed = time.perf_counter() - start
        setattr(stats, f"{kind}_seconds", getattr(stats, f"{kind}_seconds") + elapsed)
    setattr(stats, f"num_{kind}", getattr(stats, f"num_{kind}") + 1)


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


class CheckpointFunction(torch.autograd.Function):
    """The reentrant checkpoint (see checkpoint())."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.rng = _RNGSnapshot.capture()
        with _boundary("forward"):
            outputs = run_function(*args)  # grad mode is off inside autograd.Function.forward
            ctx.kept = _KeptInputs(args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "zero.checkpointing.checkpoint does not work with torch.autograd.grad(); use "
                "loss.backward() (or engine.backward) or non_reentrant_checkpoint"
            )
        with _boundary("recompute"):
            inputs = ctx.kept.restore()
            ctx.kept.release()
            with _replay(ctx.rng), torch.enable_grad():
                outputs = _as_tuple(ctx.run_function(*inputs))
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grads)
            if torch.is_tensor(out) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        input_grads = [
            inp.grad if torch.is_tensor(inp) and inp.requires_grad else None for inp in inputs
        ]
        return (None, *input_grads)


def checkpoint(function, *args):
    """Run `function(*args)` without keeping its activations; recompute them in backward.

    DeepSpeed's deepspeed.checkpointing.checkpoint: the reentrant variant (autograd.Function).
    Returns what `function` returns (a tensor or a tuple; tensors in it get gradients). At least
    one tensor argument must require grad for gradients to flow. With partition_activations, the
    floating-point arguments must be equal on all model-parallel ranks, and the backward is
    collective over the model-parallel group. See the module docstring for the options.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    return CheckpointFunction.apply(function, *args)


class _Recomputation:
    """Saved-tensor hooks of one non-reentrant region: pack keeps an index, the first unpack
    recomputes the region once (capturing its saved tensors in the same order)."""

    def __init__(self, function, args):
        self.function = function
        self.rng = _RNGSnapshot.capture()
        self.kept = _KeptInputs(args)
        self.num_packed = 0
        self.saved: list | None = None

    def pack(self, tensor):
        index = self.num_packed
        self.num_packed += 1
        return index

    def unpack(self, index):
        if self.saved is None:
            self._recompute()
        tensor = self.saved[index]
        if tensor is None:
            self.kept.restore()  # raises: this region's tensors were already handed out
        self.saved[index] = None
        return tensor

    def _recompute(self) -> None:
        captured = []

        def keep(tensor):
            captured.append(tensor)
            return tensor

        with _boundary("recompute"):
            inputs = self.kept.restore()
            self.kept.release()
            with (
                _replay(self.rng),
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
            ):
                self.function(*inputs)
        if len(captured) != self.num_packed:
            raise RuntimeError(
                f"recomputation saved {len(captured)} tensors where forward saved "
                f"{self.num_packed}: the checkpointed function must run the same operations "
                "each time (no data-dependent branches on random or global state)"
            )
        self.saved = captured


def non_reentrant_checkpoint(function, *args):
    """Like checkpoint(), through saved-tensor hooks instead of a nested backward.

    Gradients flow through the outer autograd graph, so parameters used inside and outside the
    region, inputs that do not require grad and torch.autograd.grad() all work. The kept inputs
    obey the same Pa / Pa+cpu / contiguous options. Recomputes once per region (no second
    backward through it).
    """
    if not torch.is_grad_enabled():
        return function(*args)
    region = _Recomputation(function, args)
    hooks = torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack)
    with _boundary("forward"), hooks:
        return function(*args)
