"""Reading a checkpoint back into an engine of any world size.

Owns: finding the checkpoint directory (`latest`, or an interrupted save's `<tag>.old`), reading
meta.json against its schema, GroupReader (any range of a param group, from the rank files that
hold it), and load: _verify checks on every rank everything this rank will read or apply
(validation.py; the ranks agree through agreement.py), then the values are read straight into
the engine and the training state is applied.
"""

import json
import logging
import os

import torch
from pydantic import ValidationError
from safetensors import safe_open

from ..errors import listed
from ..progress import progress
from . import rank_state
from .agreement import _on_every_rank
from .client_state import decode as decode_client_state
from .files import file_crc32
from .format import (
    FORMAT,
    LATEST,
    META,
    MODULE_FILE,
    CheckpointError,
    _check_tag,
    _dtype,
    _dtype_fits,
    _Meta,
    _schema_error,
    holds_gradients,
    optimizer_name,
    rank_file,
)
from .ownership import (
    _group_slots,
    _laid_out_ids,
    _module_tensors,
    _numel,
    non_persistent_buffer_names,
    owned_ranges,
)
from .validation import (
    _differences,
    _layout_problems,
    _training_state_problems,
    deepspeed_checkpoint_files,
    deepspeed_checkpoint_message,
    verify_checksums,
    verify_layout,
)

logger = logging.getLogger("zero")


def resolve(load_dir: str, tag: str | None) -> str:
    """The checkpoint directory for `tag`, or the one `latest` names. Raises CheckpointError."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            deepspeed = deepspeed_checkpoint_files(load_dir)
            if deepspeed:
                raise CheckpointError(deepspeed_checkpoint_message(load_dir, deepspeed))
            raise CheckpointError(f"{latest} does not exist; pass tag= or save with save_latest")
        try:
            with open(latest, "rb") as handle:
                tag = handle.read().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{latest}: unreadable ({error})") from None
    _check_tag(tag)
    path = os.path.join(load_dir, tag)
    if os.path.isfile(os.path.join(path, META)):
        return path
    old = path + ".old"
    if not os.path.lexists(path) and os.path.isfile(os.path.join(old, META)):
        # [Note: crash-safe publication] in files.py: a save of this tag stopped between its
        # two renames.
        logger.warning(
            "%s is missing and %s holds its previous version (a save of this tag was "
            "interrupted); loading that",
            path,
            old,
        )
        return old
    deepspeed = deepspeed_checkpoint_files(path)
    if deepspeed:
        raise CheckpointError(deepspeed_checkpoint_message(path, deepspeed))
    raise CheckpointError(f"{os.path.join(path, META)} does not exist: not a zero checkpoint")


def read_meta(path: str) -> dict:
    """Read meta.json, check it against the schema ([Note: meta.json schema] in format.py), and
    check the presence and size of every file it lists. Raises CheckpointError naming the file
    and key."""
    meta_path = os.path.join(path, META)
    try:
        limit = _meta_byte_limit(path)
        with open(meta_path, "rb") as handle:
            # [Note: meta.json size bound]; no more than the file holds either, since read(n)
            # allocates n bytes first (the bound grows with the checkpoint's tensor files).
            raw = handle.read(min(os.fstat(handle.fileno()).st_size, limit) + 1)
        if len(raw) > limit:
            raise CheckpointError(_meta_too_large(meta_path, limit))
        text = raw.decode("utf-8")
        meta = json.loads(text, parse_constant=_refuse_constant)
    except CheckpointError:
        raise
    except (OSError, ValueError, RecursionError) as error:  # JSON, UTF-8, NaN, depth
        raise CheckpointError(f"{meta_path}: unreadable ({error})") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise CheckpointError(f"{meta_path}: format {found!r}, expected {FORMAT!r}")
    try:
        _Meta.model_validate_json(text)
    except ValidationError as error:
        raise _schema_error(meta_path, error) from None
    for name, size in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing from the checkpoint")
        if os.path.getsize(file) != size:
            raise CheckpointError(
                f"{file} has {os.path.getsize(file)} bytes, the checkpoint recorded {size} "
                "(truncated or replaced)"
            )
    return meta


# [Note: meta.json size bound]
# meta.json grows with the model (a name and shape per parameter) and with world size x buckets
# (the owned ranges), never past the tensor files it describes, which hold at least an element
# per range and per parameter (a few bytes, times the optimizer state's kinds). A damaged or
# hostile meta.json can be anything: 5 million keys take minutes to parse and validate. So
# read_meta reads at most _META_BASE_BYTES (config, param groups, random states, client_state;
# 16 MiB of JSON parse in well under a second) plus the bytes of the directory's .safetensors
# files, and refuses a larger file before parsing anything (a real one is a small fraction of
# that bound).
_META_BASE_BYTES = 16 << 20  # the writer keeps client_state to half of it


def _meta_byte_limit(path: str) -> int:
    """The most bytes path/meta.json may have ([Note: meta.json size bound])."""
    data = 0
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name.endswith(".safetensors") and entry.is_file():
                data += entry.stat().st_size
    return _META_BASE_BYTES + data


def _meta_too_large(meta_path: str, limit: int) -> str:
    return (
        f"{meta_path}: more than {limit:,} bytes, the most a meta.json may have beside this "
        f"checkpoint's tensor files ({_META_BASE_BYTES >> 20} MiB plus their bytes; a real "
        "one is a small fraction of that). It is damaged or was not written by zero: load "
        "another checkpoint (an earlier tag), or restore this one's meta.json from a copy"
    )


def _refuse_constant(name: str):
    """json.loads' hook for NaN and Infinity, which zero never writes: a meta.json holding one
    was edited, and a non-finite lr or step would train NaN weights."""
    raise ValueError(f"non-finite number {name} (zero writes only finite numbers)")


def _open(path: str, name: str):
    """[Note: no file is mapped]: safetensors' positioned-read backend, not mmap."""
    file = os.path.join(path, name)
    try:
        return safe_open(file, framework="pt", backend="pread")
    except Exception as error:
        raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None


# [Note: no file is mapped]
# A mapped file that shrinks after it was opened (a copy or a cleanup job truncating it, a
# network file system) kills the reading process with SIGBUS when it touches a page past the new
# end: no message, no agreement, the other ranks wait. So every file is read with positioned
# reads (safetensors' "pread" backend), where a file that ends early is an exception; the reads
# after the checks run through _on_every_rank, so every rank raises, naming the file.


class GroupReader:
    """Reads any [begin, end) range of a param group's flat vector of one state kind from the
    rank files that hold it, touching only the overlapping slices.

    Ranges are in the saved order's group coordinates, or, given `order` (per group, the
    parameter names in the reading engine's layout order), in that order's: a checkpoint saved
    at another stage lays out the same parameters in another order ([Note: units laid out
    together] in partition/flat.py), and each parameter's elements are then read from where the
    saved order put them."""

    def __init__(self, path: str, meta: dict, order: list[list[str]] | None = None):
        self.path = path
        # per group: (begin in the reader's coordinates, numel, begin in the saved ones)
        self._moved: dict[int, list[tuple[int, int, int]]] = {}
        for group, params in enumerate(meta["groups"] if order is not None else ()):
            saved, offset = {}, 0
            for p in params:
                saved[p["name"]] = (offset, _numel(p["shape"]))
                offset += _numel(p["shape"])
            if [p["name"] for p in params] != order[group]:
                moved, begin = [], 0
                for name in order[group]:
                    at, numel = saved[name]
                    moved.append((begin, numel, at))
                    begin += numel
                self._moved[group] = moved
        self.pieces: dict[str, list[tuple[int, int, int, str]]] = {}
        for rank, groups in meta["ranks"].items():
            for group, ranges in groups.items():
                for index, (lo, hi) in enumerate(ranges):
                    self.pieces.setdefault(group, []).append((lo, hi, index, rank_file(int(rank))))
        self._handles: dict[str, object] = {}

    def _saved_ranges(self, group: int, begin: int, end: int):
        """(saved begin, saved end, offset into [begin, end)) covering [begin, end)."""
        moved = self._moved.get(group)
        if moved is None:
            yield begin, end, 0
            return
        for at, numel, saved_at in moved:
            a, b = max(at, begin), min(at + numel, end)
            if a < b:
                yield saved_at + a - at, saved_at + b - at, a - begin

    def files(self, group: int, begin: int, end: int) -> set[str]:
        """The rank files holding elements [begin, end) of a group (for any state kind)."""
        pieces = self.pieces.get(str(group), [])
        return {
            file
            for sa, sb, _ in self._saved_ranges(group, begin, end)
            for lo, hi, _, file in pieces
            if max(lo, sa) < min(hi, sb)
        }

    def _overlaps(self, group: int, kind: str, begin: int, end: int):
        """(a, b, piece_lo, file, key) for each saved piece overlapping [begin, end); raises
        CheckpointError when a tensor is missing, is not fp32 of the right size, or elements
        are uncovered."""
        covered, out = 0, []
        for lo, hi, index, file in self.pieces.get(str(group), []):
            a, b = max(lo, begin), min(hi, end)
            if a >= b:
                continue
            key = f"group{group}.{kind}.{index}"
            handle = self._handle(file)
            saved = handle.get_slice(key) if key in handle.keys() else None
            if saved is None or (saved.get_dtype(), saved.get_shape()) != ("F32", [hi - lo]):
                found = "missing" if saved is None else f"{saved.get_dtype()} {saved.get_shape()}"
                raise CheckpointError(
                    f"{os.path.join(self.path, file)}: tensor '{key}' is {found}, expected F32 "
                    f"[{hi - lo}]"
                )
            out.append((a, b, lo, file, key))
            covered += b - a
        if covered != end - begin:
            raise CheckpointError(
                f"{self.path}: group {group} elements [{begin}, {end}) of '{kind}' are not held "
                "by any rank file"
            )
        return out

    def check(self, group: int, kind: str, begin: int, end: int) -> None:
        for sa, sb, _ in self._saved_ranges(group, begin, end):
            self._overlaps(group, kind, sa, sb)

    def read_into(self, group: int, kind: str, begin: int, out: torch.Tensor) -> None:
        """Fill `out` (1-D, fp32) with elements [begin, begin + out.numel())."""
        for sa, sb, at in self._saved_ranges(group, begin, begin + out.numel()):
            for a, b, lo, file, key in self._overlaps(group, kind, sa, sb):
                try:
                    piece = self._handle(file).get_slice(key)[a - lo : b - lo]
                except Exception as error:  # safetensors' SafetensorError: the file shrank
                    raise CheckpointError(
                        f"{os.path.join(self.path, file)}: tensor '{key}' cannot be read "
                        f"({error}): the file changed after it was verified (truncated or "
                        "replaced while this load read it; [Note: no file is mapped])"
                    ) from None
                out[at + a - sa : at + b - sa].copy_(piece)

    def read(self, group: int, kind: str, begin: int, end: int) -> torch.Tensor:
        out = torch.empty(end - begin, dtype=torch.float32)
        self.read_into(group, kind, begin, out)
        return out

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = _open(self.path, file)
        return self._handles[file]


# ----- load -----------------------------------------------------------------------------------
def load(state, load_dir, tag, strict, load_optimizer, load_scheduler, module_only):
    """Read a checkpoint into the training state `state` (state.TrainingState); see
    Engine.load_checkpoint. Everything is verified on every rank (and the ranks agree on it)
    before any part of the state changes."""
    load_optimizer = load_optimizer and not module_only
    load_scheduler = load_scheduler and not module_only
    loading = (load_optimizer, load_scheduler, module_only)
    path, meta, reader, owned, kinds, module_values, saved, kept, version = _on_every_rank(
        state,
        f"verify the checkpoint in {load_dir}",
        lambda: _verify(state, load_dir, tag, strict, *loading),
    )
    _agree_on_version(state, path, version)
    if not module_only:  # first: a loader that refuses its state leaves everything unchanged
        _on_every_rank(
            state,
            f"restore the data loader's state from {path}",
            lambda: rank_state.apply_loader(state, meta, saved, path),
        )
    if kept and state.comm.rank == 0:
        logger.info(
            "load_checkpoint: %s was saved with exclude_frozen_parameters=True; the %d frozen "
            "parameters it left out keep this model's current values: %s",
            path,
            len(kept),
            listed(kept),
        )
    # Verified: from here on state changes. Values are read straight into their destinations;
    # a file that shrinks meanwhile is an error on every rank ([Note: no file is mapped]).
    _on_every_rank(
        state,
        f"read {path} (the engine's weights are partly loaded: load a checkpoint again "
        "before training)",
        lambda: _read_values(state, meta, reader, owned, kinds, load_optimizer, module_values),
    )
    with torch.no_grad():
        state.optimizer.refresh_params()  # collective: after every rank read its part
    if not module_only:
        _apply_training_state(state, meta, load_optimizer, load_scheduler)
        rank_state.apply_rng(state, meta, saved, path)
    return path, decode_client_state(meta["client_state"])


def _read_values(state, meta, reader, owned, kinds, load_optimizer, module_values) -> None:
    with torch.no_grad():
        _read_shards(state, meta, reader, owned, kinds, load_optimizer)
        for tensor, value in module_values:
            if state.frozen is not None and state.frozen.full_shape(tensor) is not None:
                state.frozen.write(tensor, value)  # stage 3: a partitioned frozen parameter
            else:
                tensor.copy_(value.to(tensor.dtype))
        if state.gatherer is not None:
            state.gatherer.forget_writes()  # the checkpoint's values replace them


# [Note: a tag replaced during a load]
# A save of the tag being loaded may publish a new version while a rank reads it ([Note:
# crash-safe publication] in files.py): the rank may then have read meta.json of one version
# and files of the other. _verify notes the version it starts on (the directory's inode and
# meta.json's crc32) and checks it again once every file it reads is open (safetensors maps the
# files: what an open handle reads no longer changes); any difference, or any failure while
# the version changed, is CheckpointError "replaced while this rank read it". Ranks that each
# read one whole version may still have read different ones: _agree_on_version compares the
# crc32 of every rank's meta.json before any state changes.


def _version(path: str):
    """(device, inode, meta.json crc32) of a checkpoint directory, or None when unreadable."""
    try:
        info = os.stat(path)
        return info.st_dev, info.st_ino, int(file_crc32(os.path.join(path, META)), 16)
    except OSError:
        return None


def _replaced(path: str) -> CheckpointError:
    tag = os.path.basename(path)
    return CheckpointError(
        f"{path} was replaced while this rank read it: a save_checkpoint of tag {tag!r} "
        "published a new version during this load (its files are whole; this read would mix "
        "the two versions). Load again; to avoid the race, load while no job saves this tag, or "
        "save under a new tag each time (the default global_step<N>)"
    )


def _agree_on_version(state, path: str, version) -> None:
    """[Note: a tag replaced during a load]: every rank raises CheckpointError when the ranks
    read different versions of meta.json. Collective."""
    if state.comm.world_size == 1:
        return
    crc = version[2]
    bounds = torch.tensor([crc, -crc], dtype=torch.int64, device=state.device)
    state.comm.all_reduce(bounds, op="max")
    if bounds[0].item() != -bounds[1].item():
        raise CheckpointError(
            f"rank {state.comm.rank}: the ranks read different versions of {path} (meta.json "
            f"crc32 {crc:08x} here): a save_checkpoint of tag {os.path.basename(path)!r} "
            "published a new version during this load; load again (nothing was changed)"
        )


def _verify(state, load_dir, tag, strict, load_optimizer, load_scheduler, module_only):
    """Resolve, read metadata, and check every file, key, range and value this rank will read
    or apply: meta.json against its schema, the size and crc32 of every file this rank reads
    (before it opens them), each tensor's dtype and shape, the training state's keys; and that
    no save replaced the tag meanwhile ([Note: a tag replaced during a load]). Returns what
    load applies, and the version read."""
    _refuse_mid_accumulation(state)
    path = resolve(load_dir, tag)
    version = _version(path)
    try:
        found = _verify_version(state, path, strict, load_optimizer, load_scheduler, module_only)
    except Exception as error:
        if _version(path) != version:
            raise _replaced(path) from error
        raise
    if version is None or _version(path) != version:
        raise _replaced(path)
    return (*found, version)


def _refuse_mid_accumulation(state) -> None:
    """Gradients accumulated since the last step belong to the weights a load replaces."""
    if holds_gradients(state):
        raise CheckpointError(
            f"rank {state.comm.rank}: load_checkpoint between the micro-batches of a gradient "
            "accumulation cycle: the gradients accumulated since the last optimizer step would "
            "be applied to the loaded weights. Call load_checkpoint before training, or after "
            "engine.step() at the accumulation boundary"
        )


def _mid_cycle(meta: dict) -> list[str]:
    """[Note: saved at an accumulation boundary] in format.py: an older checkpoint saved between
    the micro-batches of a cycle, without the gradients accumulated in it."""
    gas = meta["config"].get("gradient_accumulation_steps")
    steps = meta["counters"]["micro_steps"]
    if meta.get("at_accumulation_boundary") or not isinstance(gas, int) or gas < 1:
        return []
    if steps % gas == 0:
        return []
    return [
        f"counters.micro_steps is {steps}, not a multiple of the saved config's "
        f"gradient_accumulation_steps ({gas}): an older zero saved this checkpoint between the "
        "micro-batches of a gradient accumulation cycle and did not save the gradients "
        "accumulated in it, so resuming would step without them. Resume from a checkpoint "
        "saved after engine.step() at the boundary, or pass load_module_only=True to load its "
        "weights alone"
    ]


def _verify_version(state, path, strict, load_optimizer, load_scheduler, module_only):
    meta = read_meta(path)
    slots = _group_slots(state)
    layout_problems = [f"{META}: {p}" for p in _layout_problems(meta, slots)]
    order = [[s.name for s in group] for group in slots]
    reader = GroupReader(path, meta, None if layout_problems else order)
    shard = state.optimizer.layout.shard_of(state.comm.rank)
    owned = [
        (group, lo, hi, bucket)
        for group, ranges in owned_ranges(state.optimizer.buckets, shard).items()
        for lo, hi, bucket in ranges
    ]
    wants_loader = not module_only and state.stateful_loader() is not None
    files = {MODULE_FILE} | {f for g, lo, hi, _ in owned for f in reader.files(g, lo, hi)}
    files |= rank_state.files_to_read(meta, state.comm.rank, wants_loader)
    if state.config.checkpoint.verify_checksums:
        verify_checksums(path, meta, files)
    verify_layout(path, meta, files)
    laid_out = _laid_out_ids(state)
    module_values, module_problems, kept = _read_module_file(path, state, laid_out, strict, meta)
    problems = layout_problems + module_problems + _trained_but_excluded(meta, slots)
    if problems:
        raise CheckpointError(f"{path} does not fit the model: {'; '.join(problems)}")
    current = optimizer_name(state.optimizer.optimizer)
    if load_optimizer and meta["optimizer"] != current:
        raise CheckpointError(
            f"{os.path.join(path, META)}: optimizer {meta['optimizer']!r} was saved, this run uses "
            f"{current!r}; pass load_optimizer_states=False to load the weights only"
        )
    problems = _training_state_problems(meta, state, load_optimizer, load_scheduler)
    problems += [] if module_only else _mid_cycle(meta)
    if problems:
        raise CheckpointError(f"{os.path.join(path, META)}: {'; '.join(problems)}")
    kinds = ["master"] + (meta["sharded_state"] if load_optimizer else [])
    for group, lo, hi, _ in owned:
        for kind in kinds:
            reader.check(group, kind, lo, hi)
    saved = rank_state.read(path, meta, state, wants_loader, _open)
    return path, meta, reader, owned, kinds, module_values, saved, kept


def _trained_but_excluded(meta: dict, slots: list[list]) -> list[str]:
    """Parameters the checkpoint left out as frozen that this run trains ([Note: frozen
    parameters left out] in format.py): their values are nowhere."""
    trained = {slot.name for group in slots for slot in group}
    names = sorted(trained.intersection(meta.get("excluded_frozen") or ()))
    if not names:
        return []
    return [
        f"{META}: {listed(names)} were left out as frozen parameters (the save passed "
        "exclude_frozen_parameters=True), but this run trains them; freeze them "
        "(requires_grad_(False)) before zero.initialize, or load a checkpoint that holds them"
    ]


def _full_shape(state, tensor) -> tuple:
    """The tensor's shape; for a stage-3 partitioned frozen parameter, its full shape."""
    shape = state.frozen.full_shape(tensor) if state.frozen is not None else None
    return tuple(tensor.shape) if shape is None else tuple(shape)


def _read_module_file(path: str, state, laid_out: set[int], strict: bool, meta: dict):
    """([(tensor, saved value)], problems, kept names) for every tensor ZeRO does not lay out
    (frozen and empty parameters, buffers), checked against module.safetensors. Kept: the frozen
    parameters the checkpoint left out that are frozen here too ([Note: frozen parameters left
    out] in format.py), which keep their current values."""
    handle = _open(path, MODULE_FILE)
    targets, seen = {}, set()
    for name, tensor in _module_tensors(state.module):
        if id(tensor) not in laid_out and id(tensor) not in seen:
            seen.add(id(tensor))
            targets[name] = tensor
    skip = non_persistent_buffer_names(state.module)  # older checkpoints hold them too
    saved = {n: handle.get_slice(n).get_shape() for n in handle.keys() if n not in skip}
    excluded = set(meta.get("excluded_frozen") or ())
    kept = [
        name
        for name, tensor in targets.items()
        if name in excluded
        and name not in saved
        and isinstance(tensor, torch.nn.Parameter)
        and not tensor.requires_grad
    ]
    for name in kept:
        del targets[name]
    problems = _differences(saved, {n: _full_shape(state, t) for n, t in targets.items()})
    if not strict:
        problems = [p for p in problems if "shape" in p]
    for name, tensor in targets.items():
        dtype = handle.get_slice(name).get_dtype() if name in saved else None
        if dtype is not None and not _dtype_fits(dtype, tensor.dtype):
            problems.append(f"'{name}' is {dtype} in the checkpoint, {tensor.dtype} in the model")
    values = [
        (tensor, handle.get_tensor(name)) for name, tensor in targets.items() if name in saved
    ]
    return values, [f"{MODULE_FILE}: {p}" for p in problems], kept


def _read_shards(state, meta, reader, owned, kinds, load_optimizer: bool) -> None:
    opt_state = state.optimizer.optimizer.state
    for group, lo, hi, bucket in progress(owned, "load", rank=state.global_rank, unit="range"):
        with state.optimizer.resident(bucket, write=True):  # nvme: read, change, write back
            for kind in kinds:
                if kind == "master":
                    target = bucket.master
                else:
                    per_param = opt_state.setdefault(bucket.master, {})
                    if kind not in per_param:
                        per_param[kind] = torch.zeros_like(bucket.master)
                    target = per_param[kind]
                _read_to_device(reader, group, kind, lo, target[: hi - lo])
        if load_optimizer:
            for key, item in meta["scalar_state"].get(str(group), {}).items():
                value = item["value"]
                if item["tensor"]:
                    value = torch.tensor(value, dtype=_dtype(item["tensor"]))
                opt_state.setdefault(bucket.master, {})[key] = value


def _read_to_device(reader, group: int, kind: str, begin: int, target: torch.Tensor) -> None:
    if target.device.type == "cpu" and target.dtype == torch.float32:
        reader.read_into(group, kind, begin, target)
    else:
        target.copy_(reader.read(group, kind, begin, begin + target.numel()))


def _apply_training_state(state, meta, load_optimizer: bool, load_scheduler: bool) -> None:
    if load_optimizer:
        # A scheduler whose state is not loaded keeps driving the lr: the param groups keep the
        # values it wrote ([Note: a scheduler that is not loaded]).
        kept = _scheduled_keys(state.lr_scheduler) if not load_scheduler else ()
        for group, saved in zip(state.optimizer.param_groups, meta["param_groups"]):
            for key, value in saved.items():
                if key == "params" or key not in group or key in kept:
                    continue  # only the hyper-parameters this optimizer has: never its tensors
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
        state.scaler.load_state_dict(meta["loss_scaler"])
    if load_scheduler and state.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        state.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    state.counters.load_state_dict(meta["counters"])


def _scheduled_keys(scheduler) -> tuple[str, ...]:
    """[Note: a scheduler that is not loaded]
    With load_lr_scheduler_states=False (which a checkpoint saved without a scheduler needs),
    this run's scheduler keeps its own position, and the param-group values it writes stay its
    own: "lr", and the momentum a one-cycle schedule cycles ("betas" or "momentum"). Restoring
    the saved lr instead would run the first step after the load at the old run's lr and the
    next ones at the scheduler's. The other hyper-parameters (weight decay, eps...) load."""
    if scheduler is None:
        return ()
    keys = ("lr",)
    if getattr(scheduler, "cycle_momentum", False):  # zero's OneCycle, torch's OneCycleLR
        keys += ("betas", "momentum")
    return keys
