"""zero-to-fp32: consolidate a sharded zero checkpoint into one fp32 safetensors state dict.

    zero-to-fp32 CHECKPOINT_DIR OUTPUT.safetensors [--tag TAG] [--max_shard_size 5GB]

Runs in one process on any machine; the world size the checkpoint was saved with does not matter.
"""

import argparse
import os
import sys

from .checkpoint import CheckpointError, consolidate, save_consolidated

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9 bytes; plain integers are bytes. Raises ValueError naming the value."""
    value = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if value.endswith(unit):
            number = value[: -len(unit)].strip()
            try:
                return int(float(number) * _UNITS[unit])
            except ValueError:
                break
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"--max_shard_size {text!r}: expected bytes such as 500MB or 2GB"
        ) from None


def _check_output(output: str, checkpoint_dir: str) -> None:
    """The output must go to an existing directory outside the checkpoint it reads."""
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise ValueError(f"output directory {parent} does not exist")
    inside = os.path.commonpath([parent, os.path.abspath(checkpoint_dir)])
    if inside == os.path.abspath(checkpoint_dir):
        raise ValueError(
            f"output {output} is inside the checkpoint {checkpoint_dir}; write it elsewhere"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="zero-to-fp32", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint_dir", help="save_dir (follows `latest`) or a tag directory")
    parser.add_argument("output", help="output .safetensors file")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the `latest` one)")
    parser.add_argument(
        "--max_shard_size",
        default=None,
        help="split into files of at most this size (e.g. 2GB), with an index",
    )
    args = parser.parse_args(argv)
    try:
        limit = parse_size(args.max_shard_size) if args.max_shard_size else None
        if limit is not None and limit <= 0:
            raise ValueError(f"--max_shard_size {args.max_shard_size!r} must be positive")
        _check_output(args.output, args.checkpoint_dir)
        state = consolidate(args.checkpoint_dir, tag=args.tag)
        files = save_consolidated(state, args.output, limit)
    except (CheckpointError, ValueError) as error:
        print(f"zero-to-fp32: error: {error}", file=sys.stderr)
        return 2
    total = sum(t.numel() for t in state.values())
    print(f"zero-to-fp32: {len(state)} tensors, {total:,} elements -> {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
