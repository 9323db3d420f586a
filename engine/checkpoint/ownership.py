"""Which of an engine's tensors a checkpoint holds, and in which file.

Owns: the ranges of each param group a rank owns and writes to its rank file, in group
coordinates (owned_ranges), and the tensors ZeRO lays out (their values live in the rank files)
as opposed to the rest (frozen and empty parameters, buffers), which module.safetensors holds.

[Note: world-size independent coordinates]
Within a param group the flat layout packs parameters in a fixed order; buckets only cut that
sequence and add padding. Ranges are therefore recorded in "group coordinates": the offset of an
element in the unpadded concatenation of the group's parameters. These coordinates do not depend
on the world size or the bucket size, so a rank of a new run computes the ranges it owns, and
reads exactly those elements from whichever old rank files hold them (safetensors slices).
"""


def owned_ranges(buckets, shard: int) -> dict[int, list[tuple[int, int, "object"]]]:
    """Per param group, [(begin, end, bucket)] in group coordinates that `shard` owns (padding
    excluded), in layout order."""
    out: dict[int, list] = {}
    group_start: dict[int, int] = {}
    for bucket in buckets:
        layout = bucket.layout
        start = group_start.get(layout.group, 0)
        lo, hi = layout.owned_range(shard)
        hi = min(hi, layout.numel)
        if hi > lo:
            out.setdefault(layout.group, []).append((start + lo, start + hi, bucket))
        group_start[layout.group] = start + layout.numel
    return out


def _written_shard(layout, rank: int) -> int | None:
    """The shard data-parallel rank `rank` writes, or None when it writes nothing: only the
    first num_shards ranks write (stage 0: rank 0; MiCS: the first shard group, whose shards
    the other replicas hold too, [Note: MiCS] in partition/hierarchy.py)."""
    return layout.shard_of(rank) if rank < layout.num_shards else None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _group_buckets(state, group: int):
    return [b for b in state.optimizer.buckets if b.layout.group == group]


def _group_slots(state) -> list[list]:
    """Per param group, the trained parameters' layout Slots in the engine's layout order."""
    return [
        [s for b in _group_buckets(state, g) for s in b.layout.slots]
        for g in range(state.optimizer.layout.num_groups)
    ]


def _laid_out_ids(state) -> set[int]:
    """ids of the parameters ZeRO partitions (their values live in the rank files)."""
    return {id(p) for b in state.optimizer.buckets for p in b.params}


def _module_tensors(module):
    """Parameters and persistent buffers, as torch's state_dict() holds them: a non-persistent
    buffer (a rotary embedding's inv_freq) is the module's own to rebuild, and a consolidated
    state dict holding one would not load with strict=True."""
    skip = non_persistent_buffer_names(module)
    yield from module.named_parameters(remove_duplicate=False)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if name not in skip:
            yield name, buffer


def non_persistent_buffer_names(module) -> set[str]:
    """Qualified names of the non-persistent buffers of `module` and its submodules."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules(remove_duplicate=False)
        for name in sub._non_persistent_buffers_set
    }
