"""SLURM node lists: ``node[01-03,07],gpu-a`` -> ['node01', 'node02', 'node03', 'node07', 'gpu-a'].

``scontrol show hostnames`` gives the same answer where SLURM is installed; this parser covers the
syntax SLURM itself prints (zero-padded ranges, several bracket groups, comma-separated names).
"""

import re
import shutil
import subprocess

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list into host names, in SLURM's order.

    Raises:
        ValueError: unbalanced brackets or a malformed range, naming the list.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist, nodelist):
        hosts += _expand_item(item, nodelist)
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``scontrol show hostnames`` when available)."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        result = subprocess.run(
            [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
        if result.returncode == 0 and result.stdout.split():
            return result.stdout.split()[0]
    return expand_nodelist(nodelist)[0]


def _split_top_level(text: str, nodelist: str) -> list[str]:
    # Commas inside brackets separate ranges, outside they separate host names.
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"node list {nodelist!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"node list {nodelist!r}: unbalanced brackets")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str, nodelist: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, ranges, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand_item(rest, nodelist) if rest else [""]
    return [prefix + number + tail for number in _expand_ranges(ranges, nodelist) for tail in tails]


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    numbers = []
    for part in ranges.split(","):
        match = _RANGE_RE.match(part.strip())
        if match is None:
            raise ValueError(f"node list {nodelist!r}: bad range {part!r} (expected N or N-M)")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"node list {nodelist!r}: range {part!r} is decreasing")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers
