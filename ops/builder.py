"""Op builders: compile zero's C++/CUDA ops just in time and cache them across processes.

One `OpBuilder` subclass per op names its sources, compiler flags and the conditions it needs
(`is_compatible()`). `load()` compiles the sources with ninja through
`torch.utils.cpp_extension.load` into a cache directory keyed by the op, the torch and Python
versions and the SIMD level of this CPU, so a second process (another rank, the next run) imports
the finished library instead of building again.

[Note: the build cache]
The cache root is $ZERO_OPS_CACHE, else $XDG_CACHE_HOME/zero/ops, else ~/.cache/zero/ops. Each
build lives in <root>/<op>-torch<version>-py<version>-<simd>/ beside a stamp file written only
after a successful build; the stamp records a hash of the sources and flags. With a matching stamp
`load()` imports the library directly: ninja and the compiler are not even looked for, so a
machine that has the cache but no toolchain still runs the op. Concurrent first builds (several
ranks at once) are serialized by torch's lock file in the build directory.

This module imports nothing from zero, so setup.py can load it by path to prebuild the ops
(ZERO_BUILD_OPS=1).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
_STAMP = "zero_build.json"


class OpBuildError(RuntimeError):
    """An op cannot be built or loaded here; the message names the missing tool or condition."""


class SimdLevel(str, enum.Enum):
    """The widest SIMD path cpu_adam compiles for on this CPU."""

    AVX512 = "avx512"
    AVX2 = "avx2"
    SCALAR = "scalar"


class BuildState(str, enum.Enum):
    """Where an op stands in this process, as `zero-report` prints it."""

    INCOMPATIBLE = "incompatible"  # is_compatible() is False
    NOT_BUILT = "not built"  # compatible, nothing in the cache
    CACHED = "cached"  # a finished build with a matching stamp is in the cache
    LOADED = "loaded"  # imported in this process
    FAILED = "failed"  # load() raised in this process


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as py-cpuinfo reports them (lower case, e.g. 'avx2', 'fma').

    Cached per process: py-cpuinfo probes in a subprocess and takes about a second.
    """
    import cpuinfo

    return frozenset(flag.lower() for flag in cpuinfo.get_cpu_info().get("flags", []))


def simd_level() -> SimdLevel:
    """AVX-512 (avx512f), else AVX2 (with FMA and F16C), else scalar.

    $ZERO_CPU_SIMD (avx512, avx2 or scalar) overrides the detection, e.g. to test the scalar
    build on an AVX2 machine. Raises ValueError for any other value, or a level the CPU lacks.
    """
    flags = cpu_features()
    detected = SimdLevel.SCALAR
    if "avx512f" in flags:
        detected = SimdLevel.AVX512
    elif {"avx2", "fma", "f16c"} <= flags:
        detected = SimdLevel.AVX2
    forced = os.environ.get("ZERO_CPU_SIMD")
    if not forced:
        return detected
    order = [SimdLevel.SCALAR, SimdLevel.AVX2, SimdLevel.AVX512]
    try:
        level = SimdLevel(forced.lower())
    except ValueError:
        choices = ", ".join(level.value for level in SimdLevel)
        raise ValueError(f"ZERO_CPU_SIMD={forced!r}; use one of {choices}") from None
    if order.index(level) > order.index(detected):
        raise ValueError(
            f"ZERO_CPU_SIMD={forced!r} but this CPU supports at most {detected.value}; "
            "a build for it would crash with an illegal instruction"
        )
    return level


def cache_root() -> Path:
    """The directory all op builds are cached under (see [Note: the build cache])."""
    if os.environ.get("ZERO_OPS_CACHE"):
        return Path(os.environ["ZERO_OPS_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "zero" / "ops"


def cxx_compiler() -> str:
    """The C++ compiler torch's extension build uses: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


def find_nvcc() -> str | None:
    """Path to nvcc: $CUDA_HOME/bin/nvcc, else nvcc on PATH, else None."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_arch_list() -> str:
    """The GPU architectures a CUDA op is compiled for, as torch.utils.cpp_extension picks them:
    $TORCH_CUDA_ARCH_LIST (e.g. "8.0;9.0+PTX"), else the visible devices' compute capabilities
    ("9.0"); "" when neither is known."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"].strip()
    import torch

    if not torch.cuda.is_available():
        return ""
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(capabilities))


class OpBuilder:
    """Describes one op: its sources under ops/csrc, flags and the conditions it needs.

    Subclasses set `name`, `sources` and `has_fallback`, and override `cflags()` /
    `is_compatible()` as needed. One instance per op per process (see `get_builder`) keeps the
    loaded module and the one fallback warning.
    """

    name: str = ""
    sources: tuple[str, ...] = ()
    has_fallback: bool = False

    def __init__(self) -> None:
        self._module: ModuleType | None = None
        self._error: OpBuildError | None = None
        self._warned = False

    # -- what to build -------------------------------------------------------------------

    def is_compatible(self) -> tuple[bool, str]:
        """(True, 'ok') where the op can work here, else (False, the reason)."""
        return True, "ok"

    def cflags(self) -> list[str]:
        return ["-O3"]  # torch adds its own -std (c++20 for torch 2.13)

    def cuda_cflags(self) -> list[str]:
        return []

    def ldflags(self) -> list[str]:
        return []

    def source_paths(self) -> list[Path]:
        return [CSRC_DIR / source for source in self.sources]

    def needs_cuda(self) -> bool:
        return any(source.endswith(".cu") for source in self.sources)

    def variant(self) -> str:
        """The part of the cache key that depends on the machine (the SIMD level for CPU ops)."""
        return simd_level().value

    # -- the cache -----------------------------------------------------------------------

    def module_name(self) -> str:
        return f"zero_{self.name}_{self.variant()}"

    def build_key(self) -> str:
        import torch

        torch_version = torch.__version__.replace("+", "_")
        py = f"{sys.version_info.major}{sys.version_info.minor}"
        return f"{self.name}-torch{torch_version}-py{py}-{self.variant()}"

    def build_dir(self) -> Path:
        return cache_root() / self.build_key()

    def library_path(self) -> Path:
        return self.build_dir() / f"{self.module_name()}.so"

    def fingerprint(self) -> str:
        """Hash of the sources and flags; a stamp with another one means rebuild."""
        digest = hashlib.sha256()
        for path in self.source_paths():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        flags = self.cflags() + self.cuda_cflags() + self.ldflags()
        digest.update(json.dumps(flags).encode())
        return digest.hexdigest()

    def is_cached(self) -> bool:
        stamp = self.build_dir() / _STAMP
        if not (stamp.exists() and self.library_path().exists()):
            return False
        try:
            return json.loads(stamp.read_text()).get("fingerprint") == self.fingerprint()
        except (OSError, ValueError):
            return False

    def state(self) -> BuildState:
        if self._module is not None:
            return BuildState.LOADED
        if self._error is not None:
            return BuildState.FAILED
        if not self.is_compatible()[0]:
            return BuildState.INCOMPATIBLE
        return BuildState.CACHED if self.is_cached() else BuildState.NOT_BUILT

    # -- building and loading ------------------------------------------------------------

    def missing_tools(self) -> list[str]:
        """Tools a build needs that this machine lacks, named for the error message."""
        from torch.utils.cpp_extension import is_ninja_available

        missing = []
        if not is_ninja_available():
            missing.append("ninja (pip install ninja)")
        if shutil.which(cxx_compiler()) is None:
            missing.append(f"C++ compiler {cxx_compiler()!r} (set $CXX or install g++)")
        if self.needs_cuda() and find_nvcc() is None:
            missing.append("nvcc (install the CUDA toolkit or set $CUDA_HOME)")
        return missing

    def load(self, verbose: bool | None = None) -> ModuleType:
        """Import the op, building it first unless the cache holds a matching build.

        verbose (default: $ZERO_OPS_VERBOSE=1) prints the compiler's output. Raises
        OpBuildError naming the reason: incompatible here, a missing tool, or a failed build.
        """
        if self._module is not None:
            return self._module
        try:
            self._module = self._load(verbose)
        except OpBuildError as error:
            self._error = error
            raise
        return self._module

    def _load(self, verbose: bool | None) -> ModuleType:
        ok, reason = self.is_compatible()
        if not ok:
            raise OpBuildError(f"op {self.name} is not compatible here: {reason}")
        if self.is_cached():
            return self._import_library()
        missing = self.missing_tools()
        if missing:
            raise OpBuildError(f"cannot build op {self.name}: missing {', '.join(missing)}")
        if verbose is None:
            verbose = os.environ.get("ZERO_OPS_VERBOSE") == "1"
        from torch.utils import cpp_extension

        self.build_dir().mkdir(parents=True, exist_ok=True)
        try:
            module = cpp_extension.load(
                name=self.module_name(),
                sources=[str(path) for path in self.source_paths()],
                extra_cflags=self.cflags(),
                extra_cuda_cflags=self.cuda_cflags(),
                extra_ldflags=self.ldflags(),
                build_directory=str(self.build_dir()),
                with_cuda=self.needs_cuda(),
                verbose=verbose,
            )
        except (RuntimeError, OSError, ImportError) as error:
            raise OpBuildError(
                f"building op {self.name} in {self.build_dir()} failed (rerun with "
                f"ZERO_OPS_VERBOSE=1 for the compiler output): {error}"
            ) from error
        stamp = {"fingerprint": self.fingerprint(), "simd": self.variant()}
        (self.build_dir() / _STAMP).write_text(json.dumps(stamp))
        return module

    def _import_library(self) -> ModuleType:
        import torch  # noqa: F401  (the library links against libtorch, which must be loaded)

        spec = importlib.util.spec_from_file_location(self.module_name(), self.library_path())
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ImportError as error:
            raise OpBuildError(
                f"op {self.name}: cached library {self.library_path()} failed to import ({error}); "
                f"delete {self.build_dir()} to rebuild"
            ) from error
        return module

    def load_or_fallback(self) -> ModuleType | None:
        """The op, or None (after one warning per process) where it cannot be built.

        For ops with a pure-PyTorch fallback: the caller uses its reference implementation
        on None.
        """
        assert self.has_fallback, f"op {self.name} has no fallback"
        try:
            return self.load()
        except OpBuildError as error:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"{error}; using the pure-PyTorch fallback (slower)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None


class CPUAdamBuilder(OpBuilder):
    """cpu_adam: ops/csrc/cpu_adam.cpp, SIMD path chosen by `simd_level()`, OpenMP threads."""

    name = "cpu_adam"
    sources = ("cpu_adam.cpp",)
    has_fallback = True

    _SIMD_FLAGS = {
        SimdLevel.AVX512: ["-mavx512f", "-mavx2", "-mfma", "-mf16c", "-DZERO_SIMD_AVX512"],
        SimdLevel.AVX2: ["-mavx2", "-mfma", "-mf16c", "-DZERO_SIMD_AVX2"],
        SimdLevel.SCALAR: [],
    }

    def is_compatible(self) -> tuple[bool, str]:
        if platform.system() not in ("Linux", "Darwin"):
            return False, f"needs Linux or macOS, found {platform.system()}"
        return True, f"ok ({simd_level().value})"

    def cflags(self) -> list[str]:
        # Explicit -m flags rather than -march=native: the cache is keyed by SIMD level only, so
        # a build must run on every CPU of that level (a home directory shared across nodes).
        return super().cflags() + ["-fopenmp"] + self._SIMD_FLAGS[simd_level()]

    def ldflags(self) -> list[str]:
        # Resolves to the libgomp torch already loaded (same soname): one OpenMP runtime.
        return ["-fopenmp"]


class FusedAdamBuilder(OpBuilder):
    """fused_adam: multi-tensor CUDA Adam (ops/csrc/fused_adam.cu); needs a CUDA torch and nvcc."""

    name = "fused_adam"
    sources = ("fused_adam.cpp", "fused_adam.cu")
    has_fallback = False

    def variant(self) -> str:
        """CUDA version and target architectures: a build for one GPU generation has no kernel
        for another ("no kernel image is available"), so a cache shared by machines with
        different GPUs keeps one build per architecture list."""
        import torch

        if not torch.version.cuda:
            return "nocuda"
        arch = re.sub(r"[^0-9A-Za-z]+", "_", cuda_arch_list()).strip("_") or "none"
        return f"cuda{torch.version.cuda}-sm{arch}"

    def is_compatible(self) -> tuple[bool, str]:
        import torch

        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} was built without CUDA"
        if find_nvcc() is None:
            return False, "nvcc not found (install the CUDA toolkit or set $CUDA_HOME)"
        if not torch.cuda.is_available():
            return False, "no CUDA device is visible"
        return True, f"ok (CUDA {torch.version.cuda})"

    def cuda_cflags(self) -> list[str]:
        return ["-O3"]  # no --use_fast_math: it changes sqrt and division rounding


class AioBuilder(OpBuilder):
    """aio: asynchronous file I/O for NVMe offload (ops/csrc/aio.cpp, used by ops/aio.py).

    io_uring and kernel AIO through raw syscalls (only the kernel's uapi headers
    linux/io_uring.h and linux/aio_abi.h are needed, no liburing / libaio), and a pread / pwrite
    thread pool; which of them works is decided at run time. Includes only pybind11, so the
    build takes seconds.
    """

    name = "aio"
    sources = ("aio.cpp",)
    has_fallback = True

    def variant(self) -> str:
        return platform.machine().lower() or "unknown"

    def is_compatible(self) -> tuple[bool, str]:
        if platform.system() != "Linux":
            return False, f"needs Linux (io_uring, kernel AIO, O_DIRECT), found {platform.system()}"
        return True, "ok"

    def cflags(self) -> list[str]:
        return ["-O2"]

    def ldflags(self) -> list[str]:
        return ["-pthread"]


class QuantizeBuilder(OpBuilder):
    """quantize: block-wise int8 / int4 quantization on the CPU (ops/csrc/quantize.cpp, used by
    ops/quantize.py for ZeRO++'s quantized collectives). Includes only pybind11 (seconds to
    build); SIMD flags as cpu_adam's so the loops vectorize, OpenMP over blocks."""

    name = "quantize"
    sources = ("quantize.cpp",)
    has_fallback = True

    def is_compatible(self) -> tuple[bool, str]:
        if platform.system() not in ("Linux", "Darwin"):
            return False, f"needs Linux or macOS, found {platform.system()}"
        return True, f"ok ({simd_level().value})"

    def cflags(self) -> list[str]:
        # No fused multiply-add contraction: the op must round as the pure-PyTorch reference does.
        simd = [flag for flag in CPUAdamBuilder._SIMD_FLAGS[simd_level()] if flag.startswith("-m")]
        return super().cflags() + ["-fopenmp", "-ffp-contract=off"] + simd

    def ldflags(self) -> list[str]:
        return ["-fopenmp"]


class QuantizeCudaBuilder(FusedAdamBuilder):
    """quantize_cuda: the quantize op's kernels for CUDA tensors (ops/csrc/quantize.cu, bound by
    quantize_cuda.cpp with pybind11 only); fused_adam's conditions and cache variant."""

    name = "quantize_cuda"
    sources = ("quantize_cuda.cpp", "quantize.cu")
    has_fallback = True


_BUILDER_CLASSES: dict[str, type[OpBuilder]] = {
    builder.name: builder
    for builder in (
        CPUAdamBuilder,
        FusedAdamBuilder,
        AioBuilder,
        QuantizeBuilder,
        QuantizeCudaBuilder,
    )
}
_BUILDERS: dict[str, OpBuilder] = {}


def op_names() -> list[str]:
    return list(_BUILDER_CLASSES)


def get_builder(name: str) -> OpBuilder:
    """The process-wide builder of op `name`; ValueError lists the ops for an unknown name."""
    if name not in _BUILDER_CLASSES:
        raise ValueError(f"unknown op {name!r}; ops: {', '.join(_BUILDER_CLASSES)}")
    if name not in _BUILDERS:
        _BUILDERS[name] = _BUILDER_CLASSES[name]()
    return _BUILDERS[name]


def build_all(verbose: bool = True) -> dict[str, str]:
    """Build every op compatible here (ZERO_BUILD_OPS=1, `zero-report --build`).

    Returns op name -> 'built', 'cached', or the reason it was skipped or failed; never raises
    for one op so the others still build.
    """
    results = {}
    for name in op_names():
        builder = get_builder(name)
        ok, reason = builder.is_compatible()
        if not ok:
            results[name] = f"skipped: {reason}"
            continue
        was_cached = builder.is_cached()
        try:
            builder.load(verbose=verbose)
            results[name] = "cached" if was_cached else "built"
        except OpBuildError as error:
            results[name] = f"failed: {error}"
    return results
