"""Hostfile parsing and resource selection: which hosts, and which slots on each, a job uses.

A hostfile lists one host per line as ``hostname slots=N`` (the DeepSpeed format); ``#`` starts
a comment and blank lines are ignored. A resource pool is an ordered mapping host -> slot ids
(``[0, ..., N-1]`` from the hostfile); --include/--exclude/--num_nodes/--num_gpus narrow it.
The order of the hostfile is the order of node ranks.
"""

import difflib
import os
import re

# DeepSpeed's launcher reads this file when --hostfile is not given; we do too, if it exists.
DEFAULT_HOSTFILE = "/job/hostfile"

_SLOTS_RE = re.compile(r"^slots=(\S+)$")
_DIGITS_RE = re.compile(r"^-?[0-9]+\Z")
# What a host name may contain: it goes into ssh/pdsh command lines, the agents' node list
# ("host:0,1@host2:0,1") and --include/--exclude, where "@", ":" and "," are separators.
_HOST_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

# No machine has more accelerators than this; a larger count is a typo, and building its slot
# list would exhaust memory (or overflow) instead of giving a readable error.
MAX_SLOTS_PER_HOST = 4096

ResourcePool = dict[str, list[int]]


def parse_hostfile(path: str) -> dict[str, int]:
    """Read a hostfile into an ordered mapping host -> number of slots.

    Raises:
        FileNotFoundError: the file does not exist (the message names it).
        ValueError: ``path`` is a directory, a line is malformed (missing or invalid ``slots=``,
            slots <= 0 or > MAX_SLOTS_PER_HOST, extra fields, a host listed twice) or the file
            names no host; the message quotes the file, the line number and the line.
    """
    if os.path.isdir(path):
        raise ValueError(f"hostfile '{path}' is a directory; give the path of a hostfile")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"hostfile '{path}' does not exist")
    with open(path, "rb") as f:
        lines = decode_lines(f.read(), f"hostfile '{path}'")
    hosts: dict[str, int] = {}
    first_line: dict[str, tuple[int, str]] = {}  # lowercased host -> (line number, spelling)
    for line_number, line in enumerate(lines, start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        host, num_slots = _parse_line(content, path, line_number, line)
        if host.lower() in first_line:  # host names are case-insensitive (RFC 4343)
            first, spelled = first_line[host.lower()]
            same = "" if spelled == host else f" (as '{spelled}'; host names ignore case)"
            reason = f"host '{host}' is listed twice{same} (lines {first} and {line_number})"
            raise _line_error(path, line_number, line, reason)
        hosts[host] = num_slots
        first_line[host.lower()] = (line_number, host)
    if not hosts:
        raise ValueError(f"hostfile '{path}' lists no host; expected lines 'hostname slots=N'")
    return hosts


def _parse_line(content: str, path: str, line_number: int, line: str) -> tuple[str, int]:
    fields = content.split()
    if len(fields) != 2:
        raise _line_error(path, line_number, line, "expected 'hostname slots=N'")
    host, slots_field = fields
    problem = host_name_problem(host)
    if problem:
        raise _line_error(path, line_number, line, problem)
    match = _SLOTS_RE.match(slots_field)
    if match is None:
        raise _line_error(path, line_number, line, "missing 'slots=N'" + _slots_hint(slots_field))
    num_slots = decimal_or_none(match.group(1))
    if num_slots is None:
        reason = f"slots must be an integer in decimal digits, got '{match.group(1)}'"
        raise _line_error(path, line_number, line, reason)
    if num_slots <= 0:
        raise _line_error(path, line_number, line, f"slots must be > 0, got {num_slots}")
    if num_slots > MAX_SLOTS_PER_HOST:
        reason = f"slots must be <= {MAX_SLOTS_PER_HOST} (slots per host), got {num_slots}"
        raise _line_error(path, line_number, line, reason)
    return host, num_slots


def decimal_or_none(text: str) -> int | None:
    """``text`` as an integer when it is ASCII digits (after an optional '-'), else None.
    Python's int() also takes '2_0' (20), ' 2', '+2' and non-ASCII digits."""
    return int(text) if _DIGITS_RE.match(text) else None


def decode_lines(data: bytes, what: str) -> list[str]:
    """The lines of a UTF-8 text file's bytes. Raises ValueError naming `what` and the first
    line that is not UTF-8 (a hostfile saved in another encoding, or a binary file)."""
    try:
        return data.decode("utf-8-sig").splitlines()  # a byte order mark (Windows editors) too
    except UnicodeDecodeError:
        for line_number, raw in enumerate(data.splitlines(), start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{what} line {line_number} is not UTF-8 text (byte 0x{raw[error.start]:02x} "
                    f"at column {error.start + 1}); save the file as UTF-8"
                ) from None
        raise


def host_name_problem(host: str) -> str | None:
    """Why `host` cannot be a node's name, or None when it can."""
    if _HOST_RE.match(host):
        return None
    if host.startswith("-"):
        return f"host name '{host}' starts with '-'"
    if "@" in host:
        return (
            f"host name '{host}' contains '@': give the host only and set the ssh user in "
            "~/.ssh/config (User)"
        )
    return (
        f"host name '{host}' may contain only letters, digits, '.', '-' and '_' (and not "
        "start with '.')"
    )


def _slots_hint(field: str) -> str:
    key, sep, value = field.partition("=")
    if sep and key != "slots" and difflib.get_close_matches(key, ["slots"], n=1, cutoff=0.6):
        return f" (did you mean 'slots={value}' instead of '{field}'?)"
    return ""


def _line_error(path: str, line_number: int, line: str, reason: str) -> ValueError:
    return ValueError(f"hostfile '{path}' line {line_number}: {reason}: '{line.strip()}'")


def parse_host_filter(spec: str, flag: str) -> dict[str, list[int] | None]:
    """Parse an --include/--exclude value ``host1:0,1@host2`` into host -> slot ids.

    ``None`` as a host's value means "all its slots".

    Raises:
        ValueError: an empty entry, a host repeated, or a slot id that is not a non-negative
            integer; the message names ``flag`` and the value.
    """
    result: dict[str, list[int] | None] = {}
    for entry in spec.split("@"):
        host, colon, slots = entry.strip().partition(":")
        if not host:
            raise ValueError(f"{flag} '{spec}': empty host in entry '{entry}'")
        if host.lower() in (h.lower() for h in result):
            raise ValueError(f"{flag} '{spec}': host '{host}' appears twice (names ignore case)")
        if colon and not slots.strip():
            raise ValueError(
                f"{flag} '{spec}': no slot ids after '{host}:'; write '{host}' for all its "
                f"slots or '{host}:0,1' for some"
            )
        result[host] = _parse_slot_ids(slots, spec, flag) if colon else None
    return result


def _parse_slot_ids(slots: str, spec: str, flag: str) -> list[int]:
    slot_ids = [decimal_or_none(s.strip()) for s in slots.split(",")]
    if None in slot_ids:
        raise ValueError(
            f"{flag} '{spec}': slot ids must be integers in decimal digits, got '{slots}'"
        )
    if any(s < 0 for s in slot_ids):  # type: ignore[operator]
        raise ValueError(f"{flag} '{spec}': slot ids must be >= 0, got '{slots}'")
    return slot_ids  # type: ignore[return-value]


def select_resources(
    pool: ResourcePool,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
    source: str = "the hostfile",
) -> ResourcePool:
    """Narrow a resource pool; the hostfile order is kept.

    ``include`` keeps only the named hosts (and slots), ``exclude`` drops them; ``num_nodes``
    keeps the first N hosts, ``num_gpus`` the first N slots of each host. ``source`` says where
    the pool came from, in messages ("the hostfile", "this machine (no hostfile)", ...).

    Raises:
        ValueError: include and exclude given together, either combined with num_nodes or
            num_gpus, a filter naming a host or slot not in the pool, a count <= 0 or larger
            than the pool, or nothing left after filtering.
    """
    for flag, value in (("--include", include), ("--exclude", exclude)):
        if value is not None and not value.strip():
            raise ValueError(f"{flag} is empty; name hosts such as 'worker-0:0,1@worker-1'")
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive; pass one of them")
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise ValueError("--include/--exclude cannot be combined with --num_nodes/--num_gpus")
    if include:
        pool = _apply_include(pool, parse_host_filter(include, "--include"), source)
    elif exclude:
        pool = _apply_exclude(pool, parse_host_filter(exclude, "--exclude"), source)
    if num_nodes is not None:
        pool = _first_nodes(pool, num_nodes)
    if num_gpus is not None:
        pool = _first_slots(pool, num_gpus)
    if not pool:
        raise ValueError("no host left after applying --include/--exclude")
    return pool


def _check_known(pool: ResourcePool, host_filter, flag: str, source: str):
    """``host_filter`` keyed by the pool's spelling of each host (names ignore case); a
    ValueError for a host or slot not in the pool."""
    spelled = {host.lower(): host for host in pool}
    known = {}
    for host, slot_ids in host_filter.items():
        if host.lower() not in spelled:
            raise ValueError(f"{flag}: host '{host}' is not in {source}: hosts {list(pool)}")
        host = spelled[host.lower()]
        unknown = sorted(set(slot_ids or []) - set(pool[host]))
        if unknown:
            raise ValueError(f"{flag}: host '{host}' has no slot {unknown}; slots {pool[host]}")
        known[host] = slot_ids
    return known


def _apply_include(pool: ResourcePool, host_filter, source: str) -> ResourcePool:
    host_filter = _check_known(pool, host_filter, "--include", source)
    return {
        host: sorted(set(host_filter[host])) if host_filter[host] else list(slot_ids)
        for host, slot_ids in pool.items()
        if host in host_filter
    }


def _apply_exclude(pool: ResourcePool, host_filter, source: str) -> ResourcePool:
    host_filter = _check_known(pool, host_filter, "--exclude", source)
    result: ResourcePool = {}
    for host, slot_ids in pool.items():
        if host in host_filter and host_filter[host] is None:
            continue
        dropped = set(host_filter.get(host) or [])
        kept = [s for s in slot_ids if s not in dropped]
        if kept:
            result[host] = kept
    return result


def _first_nodes(pool: ResourcePool, num_nodes: int) -> ResourcePool:
    if not 0 < num_nodes <= len(pool):
        raise ValueError(
            f"--num_nodes must be in 1..{len(pool)} (hosts available), got {num_nodes}"
        )
    return dict(list(pool.items())[:num_nodes])


def _first_slots(pool: ResourcePool, num_gpus: int) -> ResourcePool:
    if num_gpus <= 0:
        raise ValueError(f"--num_gpus must be > 0, got {num_gpus}")
    for host, slot_ids in pool.items():
        if num_gpus > len(slot_ids):
            raise ValueError(
                f"--num_gpus {num_gpus} exceeds the {len(slot_ids)} slots of host '{host}'"
            )
    return {host: slot_ids[:num_gpus] for host, slot_ids in pool.items()}
