"""zero-as-deepspeed: run a program written for DeepSpeed, unchanged, on zero.

    zero-as-deepspeed COMMAND [ARGS...]
    zero-as-deepspeed torchrun --nproc_per_node 1 train.py --deepspeed ds_config.json
    zero-as-deepspeed accelerate launch --config_file ds.yaml train.py
    zero-as-deepspeed torchrun --nproc_per_node 2 train.py --deepspeed ds_config.json
    zero-as-deepspeed deepspeed --num_gpus 2 main.py --deepspeed_config ds_config.json
    zero-as-deepspeed --print-path

Replaces itself with COMMAND (same process; COMMAND's exit code is the result) after putting the
doorway directory (zero.integrations.deepspeed.DOORWAY_DIR) first on PYTHONPATH, so that
`import deepspeed` and importlib.metadata.version("deepspeed") give zero's doorway in COMMAND
and every process it starts, and the doorway's bin/ first on PATH, so that `deepspeed` is
DeepSpeed's launcher command run by zrun. It also sets ZERO_AS_DEEPSPEED=1 and
ZERO_AS_DEEPSPEED_PYTHON (this Python, which bin/deepspeed runs). zrun forwards PYTHON* and
ZERO_* variables to every node. --print-path prints the directory, for setting PYTHONPATH
yourself.

When a real DeepSpeed is importable outside the doorway, it says so on stderr, once, with how to
run DeepSpeed instead: the doorway never shadows DeepSpeed silently.
"""

import os
import sys

from .deepspeed import DOORWAY_DIR, find_real_deepspeed, shadow_message

USAGE = "usage: zero-as-deepspeed COMMAND [ARGS...] | --print-path | --help"


def _prepend(directory: str, value: str | None) -> str:
    entries = [e for e in (value or "").split(os.pathsep) if e]
    if entries and os.path.realpath(entries[0]) == os.path.realpath(directory):
        return value
    return os.pathsep.join([directory, *entries])


def doorway_environment(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with the doorway first on PYTHONPATH, its bin/ first on PATH, and
    ZERO_AS_DEEPSPEED=1, ZERO_AS_DEEPSPEED_PYTHON=sys.executable (the doorway is not added a
    second time when it is already first)."""
    env = dict(environ)
    env["PYTHONPATH"] = _prepend(DOORWAY_DIR, environ.get("PYTHONPATH"))
    env["PATH"] = _prepend(os.path.join(DOORWAY_DIR, "bin"), environ.get("PATH", os.defpath))
    env["ZERO_AS_DEEPSPEED"] = "1"
    env["ZERO_AS_DEEPSPEED_PYTHON"] = sys.executable
    return env


def main(argv: list[str] | None = None) -> int:
    """Run zero-as-deepspeed with `argv` (default sys.argv[1:]). Does not return when COMMAND
    starts; returns 0 for --print-path and --help, 2 for a usage error, 127 when COMMAND is not
    found and 126 when it cannot be run (as a shell does), each with one line on stderr."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "--print-path":
        print(DOORWAY_DIR)
        return 0
    if argv[0].startswith("-"):
        print(f"zero-as-deepspeed: error: unknown option {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    real = find_real_deepspeed(DOORWAY_DIR, sys.path)
    if real is not None:
        print(f"zero-as-deepspeed: {shadow_message(real, DOORWAY_DIR)}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, doorway_environment(dict(os.environ)))
    except FileNotFoundError:
        print(f"zero-as-deepspeed: {argv[0]}: command not found", file=sys.stderr)
        return 127
    except PermissionError as error:
        print(f"zero-as-deepspeed: {argv[0]}: cannot run it ({error})", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(main())
