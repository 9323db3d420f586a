"""Device, process-group backend and host-memory policy for one rank.

CUDA ranks use device cuda:LOCAL_RANK and the nccl backend; CPU ranks use the host and gloo.
Everything device-specific that the engine needs is asked of the Accelerator, so the stages never
branch on the device type themselves.

Scripts written for DeepSpeed ask ``get_accelerator()`` (deepspeed.accelerator.get_accelerator)
for device names, seeds, memory figures and the backend; it answers for the same device kind
that ``detect_accelerator`` picks (both call ``device_type``), so a script and the engine never
disagree about where a rank computes.
"""

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any

import psutil
import torch


def device_type() -> str:
    """The device kind of this process, "cuda" where torch sees a CUDA device, else "cpu": the
    one choice that detect_accelerator (the engine) and get_accelerator (scripts) share."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# The torch.distributed backend of each device kind, for the engine and for scripts alike.
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


@dataclass(frozen=True)
class Accelerator:
    """Where this rank computes and how it talks to other ranks.

    device: the torch.device holding parameters, gradients and (without offload) optimizer state.
    backend: the torch.distributed backend name for the data-parallel group ("nccl" or "gloo").
    """

    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-lock a host tensor so copies to the device can be asynchronous (CUDA only)."""
        if self.is_cuda and tensor.device.type == "cpu" and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def synchronize(self) -> None:
        """Wait for all queued device work (for timing; never needed for correctness)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def detect_accelerator(local_rank: int) -> Accelerator:
    """Pick cuda:local_rank with nccl when CUDA is available, else the CPU with gloo.

    Raises ValueError when CUDA is available but local_rank names no visible device.
    """
    if device_type() == "cuda":
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible; "
                "start at most one rank per GPU or set CUDA_VISIBLE_DEVICES"
            )
        torch.cuda.set_device(local_rank)
        return Accelerator(torch.device("cuda", local_rank), BACKENDS["cuda"])
    return Accelerator(torch.device("cpu"), BACKENDS["cpu"])


# ----- deepspeed.accelerator.get_accelerator -------------------------------------------------
class DeepSpeedAccelerator:
    """DeepSpeed's accelerator interface (deepspeed.accelerator.DeepSpeedAccelerator) for the
    device kind zero runs a rank on: ``CudaAccelerator`` or ``CpuAccelerator``.

    Methods follow DeepSpeed's CUDA_Accelerator / CPU_Accelerator (0.19): names, arguments and
    return values. Memory figures are in bytes. None of them is a collective. A DeepSpeed
    method zero does not provide (op builders, custom accelerators) raises AttributeError
    naming it.
    """

    _name = ""
    _communication_backend_name = ""

    def __init__(self) -> None:
        self._compile_backend = "inductor"

    # --- device
    def device_name(self, device_index: "int | str | None" = None) -> str:
        """ "cuda" or "cuda:<index>" on CUDA; always "cpu" on the CPU."""
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        """The torch.distributed backend zero uses on this device kind: "nccl" or "gloo"."""
        return self._communication_backend_name

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def random(self) -> Any:
        return torch.random

    def supported_dtypes(self) -> list:
        """float32, then float16 and bfloat16 where supported (DeepSpeed's order)."""
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives on this device kind."""
        return tensor.device.type == self._name

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Raises ValueError for a backend torch._dynamo does not list."""
        import torch._dynamo  # imported on use: loading dynamo takes seconds

        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(
                f"compile backend {backend!r} is not available on {self._name}; choose one of "
                f"{supported}."
            )
        self._compile_backend = backend

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the class does not define.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"zero's accelerator ({self._name}) has no {name!r}: zero provides DeepSpeed's "
            "device, seed, stream, memory, dtype and tensor methods of get_accelerator(), not "
            "its op builders or custom accelerators."
        )


class CudaAccelerator(DeepSpeedAccelerator):
    """DeepSpeed's CUDA_Accelerator: the torch.cuda calls behind each method, nccl backend."""

    _name = "cuda"
    _communication_backend_name = BACKENDS["cuda"]

    def is_synchronized_device(self) -> bool:
        return False

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index: int | None = None) -> None:
        return torch.cuda.synchronize(device_index)

    def communication_backend_version(self) -> Any:
        return torch.cuda.nccl.version()

    # --- random numbers
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if device_index is None:
            return torch.cuda.set_rng_state(new_state)
        return torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if device_index is None:
            return torch.cuda.get_rng_state()
        return torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # --- streams and events
    @property
    def Stream(self) -> type:
        return torch.cuda.Stream

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> type:
        return torch.cuda.Event

    # --- memory, in bytes
    def empty_cache(self) -> None:
        return torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        return torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        return torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        return torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory as the driver reports it (DeepSpeed reads it from NVML)."""
        return torch.cuda.mem_get_info(device_index)[0]

    # --- data types
    def is_bf16_supported(self) -> bool:
        if not torch.cuda.is_available():
            return True
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """Compute capability 7 and above; 6.x only with DS_ALLOW_DEPRECATED_FP16=1 (DeepSpeed)."""
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        allow_deprecated = os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1"
        return major >= 7 or (major == 6 and allow_deprecated)

    def is_triton_supported(self) -> bool:
        return self.is_available() and torch.cuda.get_device_capability()[0] >= 8

    # --- profiling ranges, lazy calls, graphs
    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> Any:
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> Any:
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> Any:
        return torch.cuda._lazy_call(callback)

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def export_envs(self) -> list[str]:
        return ["NCCL"]

    # --- host memory and tensor constructors
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True):
        """A page-locked copy of the host tensor ``tensor`` (make_copy, match_shape: DeepSpeed's
        arguments for its native pinned pool, which zero does not have; torch always copies)."""
        return tensor.pin_memory()

    BFloat16Tensor = property(lambda self: _on_cuda(torch.bfloat16))
    ByteTensor = property(lambda self: _on_cuda(torch.uint8))
    DoubleTensor = property(lambda self: _on_cuda(torch.double))
    FloatTensor = property(lambda self: _on_cuda(torch.float))
    HalfTensor = property(lambda self: _on_cuda(torch.half))
    IntTensor = property(lambda self: _on_cuda(torch.int))
    LongTensor = property(lambda self: _on_cuda(torch.long))


def _on_cuda(dtype: torch.dtype) -> Any:
    """DeepSpeed's CUDA tensor constructors: torch.tensor(data) of ``dtype`` on the device."""
    return functools.partial(torch.tensor, dtype=dtype, device="cuda")


class CpuAccelerator(DeepSpeedAccelerator):
    """DeepSpeed's CPU_Accelerator: the host as the device, gloo backend.

    Memory figures are this process's resident set size (RSS), in bytes, with a peak that the
    reset methods restart, as DeepSpeed reports them; total and available memory are the
    machine's. ``device()`` returns torch.device("cpu") (DeepSpeed returns None).
    ``device_count()`` is $LOCAL_SIZE, else $LOCAL_WORLD_SIZE (set by zrun and torchrun), else
    1 (DeepSpeed counts NUMA nodes).
    """

    _name = "cpu"
    _communication_backend_name = BACKENDS["cpu"]

    def __init__(self) -> None:
        super().__init__()
        self._peak_rss = _rss()

    def is_synchronized_device(self) -> bool:
        return True

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> int:
        """The local rank ($LOCAL_RANK, else 0), as DeepSpeed's CPU accelerator reports it."""
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            count = int(os.environ.get(key, "0") or 0)
            if count > 0:
                return count
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    # --- random numbers (the CPU generator serves every "device")
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        return torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    # --- streams and events: none on the host
    Stream = property(lambda self: None)
    Event = property(lambda self: None)

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> None:
        return None

    def default_stream(self, device_index: int | None = None) -> None:
        return None

    # --- memory, in bytes (process RSS)
    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: int | None = None) -> int:
        rss = _rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self.memory_allocated()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._peak_rss = _rss()

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        rss = self.memory_allocated()
        return {"allocated_bytes.all.current": rss, "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        return psutil.virtual_memory().available

    # --- data types
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has float16 kernels on this CPU (DeepSpeed's test)."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def is_triton_supported(self) -> bool:
        return False

    # --- profiling ranges, lazy calls, graphs: nothing to do on the host
    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        return None

    def range_pop(self, domain: Any = None) -> None:
        return None

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    def create_graph(self) -> None:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        return None

    def export_envs(self) -> list[str]:
        return []

    # --- host memory and tensor constructors
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True):
        """``tensor`` itself: nothing is page-locked for a CPU device (DeepSpeed does the same)."""
        return tensor

    BFloat16Tensor = property(lambda self: torch.BFloat16Tensor)
    ByteTensor = property(lambda self: torch.ByteTensor)
    DoubleTensor = property(lambda self: torch.DoubleTensor)
    FloatTensor = property(lambda self: torch.FloatTensor)
    HalfTensor = property(lambda self: torch.HalfTensor)
    IntTensor = property(lambda self: torch.IntTensor)
    LongTensor = property(lambda self: torch.LongTensor)


def _rss() -> int:
    return psutil.Process().memory_info().rss


_ACCELERATORS = {"cuda": CudaAccelerator, "cpu": CpuAccelerator}
_accelerator: DeepSpeedAccelerator | None = None


def get_accelerator() -> DeepSpeedAccelerator:
    """This process's accelerator object (deepspeed.accelerator.get_accelerator).

    A ``CudaAccelerator`` where torch sees a CUDA device, else a ``CpuAccelerator``: the device
    kind zero's engine runs the rank on (``device_type``, shared with detect_accelerator). The
    same object is returned on every call. Not a collective.

    Raises:
        ValueError: $DS_ACCELERATOR names another kind than zero runs on (DeepSpeed lets it
            choose the accelerator; zero's choice follows CUDA's availability), or a kind zero
            does not support (xpu, npu, hpu, mps, ...).
    """
    global _accelerator
    if _accelerator is None:
        kind = device_type()
        asked = os.environ.get("DS_ACCELERATOR")
        if asked is not None and asked != kind:
            why = (
                "zero supports cuda and cpu"
                if asked not in _ACCELERATORS
                else f"zero runs this process on {kind} (CUDA is "
                f"{'' if kind == 'cuda' else 'not '}available)"
            )
            raise ValueError(
                f"DS_ACCELERATOR={asked!r}, but {why}. Unset DS_ACCELERATOR (to run on the CPU "
                "where CUDA exists, set CUDA_VISIBLE_DEVICES='')."
            )
        _accelerator = _ACCELERATORS[kind]()
    return _accelerator
