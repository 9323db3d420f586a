"""`zero-report`: what zero's ops need and where they stand on this machine.

Prints, per op, whether it is compatible here (and why not), its build state and cache path,
the NVMe I/O backend AsyncFileIO uses and whether O_DIRECT works in the current directory and
$TMPDIR, then the torch, CUDA, nvcc and C++ compiler versions and the CPU features the builds
key on.
`zero-report --build` first builds every compatible op (as ZERO_BUILD_OPS=1 does at install).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile

from .builder import (
    BuildState,
    cache_root,
    cpu_features,
    cxx_compiler,
    find_nvcc,
    get_builder,
    op_names,
    simd_level,
)

_SIMD_FLAGS = ("avx512f", "avx512bw", "avx2", "fma", "f16c", "sse4_2", "neon", "asimd")


def _tool_version(command: list[str]) -> str:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"not found ({error.__class__.__name__})"
    lines = [line for line in (result.stdout or result.stderr).splitlines() if line.strip()]
    if result.returncode != 0 or not lines:
        return "not found"
    # nvcc names its release on a line of its own, compilers on their first line.
    release = [line for line in lines if "release" in line]
    return (release or lines)[0].strip()


def _io_lines() -> list[str]:
    """The AsyncFileIO backend in use (op aio loaded only if it is already built) and O_DIRECT."""
    from .aio import available_backends, best_backend, direct_io_supported

    builder = get_builder("aio")
    if builder.state() in (BuildState.CACHED, BuildState.LOADED):
        backend = f"{best_backend()} (available: {', '.join(available_backends())})"
    else:
        backend = f"python (op aio {builder.state().value}; zero-report --build builds it)"
    lines = ["nvme i/o (zero.ops.aio.AsyncFileIO)", f"  backend: {backend}"]
    directories = {"current directory": os.getcwd()}
    directories["$TMPDIR"] = tempfile.gettempdir()
    for label, directory in directories.items():
        works = "yes" if direct_io_supported(directory) else "no"
        lines.append(f"  O_DIRECT in {label} ({directory}): {works}")
    return lines


def report_lines() -> list[str]:
    """The report as lines of text (no trailing newlines)."""
    import torch

    lines = ["zero ops", f"  cache root: {cache_root()}"]
    for name in op_names():
        builder = get_builder(name)
        ok, reason = builder.is_compatible()
        lines.append(f"  {name}: {'compatible' if ok else 'incompatible'} - {reason}")
        lines.append(f"    state: {builder.state().value}")
        lines.append(f"    cache: {builder.build_dir()}")
    lines += _io_lines()
    nvcc = find_nvcc()
    lines += [
        "versions",
        f"  python: {platform.python_version()}",
        f"  torch: {torch.__version__} (CUDA {torch.version.cuda or 'none'}, "
        f"device visible: {torch.cuda.is_available()})",
        f"  nvcc: {_tool_version([nvcc, '--version']) if nvcc else 'not found'}",
        f"  c++ compiler ({cxx_compiler()}): {_tool_version([cxx_compiler(), '--version'])}",
        f"  ninja: {_tool_version(['ninja', '--version'])}",
        "cpu",
        f"  {platform.machine()}, {torch.get_num_threads()} torch threads",
        f"  simd level: {simd_level().value}",
        f"  features: {' '.join(f for f in _SIMD_FLAGS if f in cpu_features()) or 'none'}",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-report", description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build every compatible op first")
    args = parser.parse_args(argv)
    try:
        if args.build:
            from .builder import build_all

            for name, result in build_all(verbose=False).items():
                print(f"build {name}: {result}")
        print("\n".join(report_lines()))
    except ValueError as error:  # a bad ZERO_* setting
        print(f"zero-report: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
