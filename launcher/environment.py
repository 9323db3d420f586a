"""The environment every rank of a job gets on top of its node's own: exported variables with the
documented prefixes, ``.zero_env`` files and --env flags, in increasing precedence.

[Note: values arrive byte for byte]
Values go to remote nodes as arguments of ``env`` (``env K=V ... python -m zero.launcher.agent``),
never as shell text: the ssh and pdsh runners quote every word with shlex.quote, srun and mpirun
get an argument vector, so spaces, quotes, '$', '=', parentheses and JSON are never interpreted.
"""

import os
import re

from .hostfile import decode_lines

# Variables of the head's environment that every node gets (DeepSpeed exports a similar list).
EXPORT_PREFIXES = (
    "PYTHON",
    "NCCL_",
    "GLOO_",
    "CUDA_",
    "OMP_",
    "TORCH_",
    "MKL_",
    "KMP_",
    "UCX_",
    "FI_",
    "HF_",
    "ZERO_",
)
ENV_FILE_NAME = ".zero_env"

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def exported_variables(environ: dict[str, str]) -> dict[str, str]:
    """The variables of ``environ`` whose name starts with one of EXPORT_PREFIXES."""
    return {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}


def read_env_file(path: str) -> dict[str, str]:
    """Read ``KEY=VALUE`` lines; the value is everything after the first '=' (kept verbatim, no
    quotes removed, no whitespace stripped). Blank lines and lines starting with '#' are skipped.

    Raises:
        ValueError: a line without '=' or with an invalid name; quotes the file and line number.
    """
    result: dict[str, str] = {}
    with open(path, "rb") as f:
        lines = decode_lines(f.read(), f"'{path}'")
    for line_number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            key, value = split_assignment(line)
        except ValueError as error:
            raise ValueError(f"'{path}' line {line_number}: {error}") from None
        result[key] = value
    return result


def split_assignment(text: str) -> tuple[str, str]:
    """Split ``KEY=VALUE`` on the first '='.

    Raises:
        ValueError: no '=', or KEY is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*).
    """
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    if not _NAME_RE.match(key):
        raise ValueError(f"invalid variable name {key!r} in {text!r}; use letters, digits, '_'")
    return key, value


def env_file_paths(cwd: str | None = None, home: str | None = None) -> list[str]:
    """The .zero_env files read, lowest precedence first: ~/.zero_env, then ./.zero_env."""
    cwd = os.path.abspath(cwd or os.getcwd())
    home = os.path.abspath(home or os.path.expanduser("~"))
    paths = [os.path.join(home, ENV_FILE_NAME)]
    if cwd != home:
        paths.append(os.path.join(cwd, ENV_FILE_NAME))
    return [p for p in paths if os.path.isfile(p)]


def job_environment(
    environ: dict[str, str], env_files: list[str], env_flags: list[str]
) -> dict[str, str]:
    """What every rank gets on top of its node's environment: exported variables, then each
    file of ``env_files`` in order, then ``env_flags`` (``KEY=VALUE`` strings); later wins.

    Raises:
        ValueError: a malformed env file line or --env value.
    """
    result = exported_variables(environ)
    for path in env_files:
        result.update(read_env_file(path))
    for flag in env_flags:
        try:
            key, value = split_assignment(flag)
        except ValueError as error:
            raise ValueError(f"--env: {error}") from None
        result[key] = value
    return result
