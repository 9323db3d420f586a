"""Checks a checkpoint passes before a load changes any state, and DeepSpeed checkpoint detection.

Owns: the crc32 check of files against meta.json, the differences between the saved trained
parameters and the running model's, and the kinds of the saved training state (param groups, lr
scheduler) against this run's; _verify (reader.py) runs them on every rank before anything is
written. Also recognizes a DeepSpeed checkpoint directory, so that it is named as one.
"""

import logging
import os
import re

from .agreement import enter
from .files import file_crc32
from .format import LATEST, LAYOUT_METADATA, META, CheckpointError, _jsonable, layout_digest
from .safetensors_io import read_metadata

logger = logging.getLogger("zero")


def nothing_to_load(state, load_dir: str, tag) -> bool:
    """True when load_checkpoint without a tag finds no `latest` file in load_dir (nothing saved
    yet: a first run of an auto-resuming script): DeepSpeed then loads nothing and warns, and
    so does zero, naming a DeepSpeed checkpoint found there and its migration path. Collective:
    every rank must see the same (RankMismatchError otherwise)."""
    nothing = tag is None and not os.path.lexists(os.path.join(load_dir, LATEST))
    enter(state.comm, "load_checkpoint", int(nothing))
    if nothing:
        deepspeed = deepspeed_checkpoint_files(load_dir)
        logger.warning(
            "load_checkpoint: %s has no '%s' file: nothing was loaded (pass tag= to load a "
            "checkpoint by name)%s",
            load_dir,
            LATEST,
            "; it holds a DeepSpeed checkpoint: "
            + deepspeed_checkpoint_message(load_dir, deepspeed)
            if deepspeed
            else "",
        )
    return nothing


def verify_checksums(path: str, meta: dict, names) -> None:
    """Check the crc32 meta.json records for each file in `names` (none are recorded in
    checkpoints of zero versions before checksums: nothing to check). Raises CheckpointError
    naming the file. Reads each file once, in 4 MiB chunks."""
    recorded = meta.get("crc32")
    if recorded is None:
        return
    for name in sorted(names):
        file = os.path.join(path, name)
        found = file_crc32(file)
        if found != recorded[name]:
            raise CheckpointError(
                f"{file}: crc32 {found}, but {META} recorded {recorded[name]}: the file's bytes "
                "changed after it was saved (storage or copy corruption); restore it, or load "
                "another checkpoint"
            )


def verify_layout(path: str, meta: dict, names) -> None:
    """Check that each file in `names` records the layout meta.json describes ([Note: the layout
    bound to the bytes] in format.py); a file without the record (an older zero's) passes. Raises
    CheckpointError naming the file. Reads each file's header only."""
    described = layout_digest(meta)
    for name in sorted(names):
        file = os.path.join(path, name)
        recorded = read_metadata(file).get(LAYOUT_METADATA)
        if recorded is not None and recorded != described:
            raise CheckpointError(
                f"{file} was saved with another layout than {META} describes (sha256 "
                f"{str(recorded)[:12]}... recorded in the file, {described[:12]}... of {META}'s "
                "world_size, groups, ties, ranks and frozen parameters): meta.json was edited "
                "after the save (parameter names, shapes or order, or a rank's ranges, moved) or "
                "belongs to another checkpoint, and would load values into the wrong "
                "parameters. Restore the meta.json saved with these files; nothing was loaded"
            )


def _layout_problems(meta: dict, slots: list[list]) -> list[str]:
    """Differences between the saved trained parameters (names, shapes, param groups) and the
    engine's (`slots`, _group_slots); the order within a group may differ (GroupReader follows
    it)."""
    saved = [sorted((p["name"], tuple(p["shape"])) for p in group) for group in meta["groups"]]
    current = [sorted((s.name, s.shape) for s in group) for group in slots]
    if saved == current:
        return []
    saved_all = {n: s for g in saved for n, s in g}
    current_all = {n: s for g in current for n, s in g}
    return _differences(saved_all, current_all) or [
        "the trained parameters are grouped differently (same optimizer param groups are needed)"
    ]


def _differences(saved: dict, current: dict) -> list[str]:
    """Missing keys, unexpected keys and shape mismatches between name -> shape maps."""
    problems = []
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for name in sorted(set(saved) & set(current)):
        if tuple(saved[name]) != tuple(current[name]):
            problems.append(
                f"'{name}' has shape {tuple(saved[name])} in the checkpoint, "
                f"{tuple(current[name])} in the model"
            )
    return problems


def _training_state_problems(meta, state, load_optimizer: bool, load_scheduler: bool) -> list:
    """What in the saved param groups and lr scheduler state this run could not apply."""
    problems = []
    if load_optimizer:
        saved, current = meta["param_groups"], state.optimizer.param_groups
        if len(saved) != len(current):
            problems.append(
                f"key 'param_groups' has {len(saved)} groups, the optimizer {len(current)}"
            )
        for index, (group, now) in enumerate(zip(saved, current)):
            now = _jsonable({k: v for k, v in now.items() if k != "params" and k in group})
            problems += _kind_problems(group, now, f"param_groups.{index}")
    scheduler = state.lr_scheduler
    if load_scheduler and scheduler is not None and meta["lr_scheduler"] is None:
        name = type(scheduler).__name__
        problems.append(
            f"the checkpoint was saved without an lr scheduler, and this run has {name}: there is "
            f"no schedule position to restore, and loading on would train with the saved "
            f"optimizer lr instead of {name}'s. Pass load_lr_scheduler_states=False to keep "
            f"{name} where it is (from its start in a new run; the param groups keep the lr it "
            "set), or resume from a checkpoint saved with the scheduler"
        )
    if load_scheduler and scheduler is not None and meta["lr_scheduler"] is not None:
        now = _jsonable(scheduler.state_dict())
        found = _kind_problems(meta["lr_scheduler"], now, "lr_scheduler")
        if not found:
            found = _scheduler_refuses(scheduler, meta["lr_scheduler"])
        problems += [
            f"{p} ({type(scheduler).__name__}'s state; pass load_lr_scheduler_states=False to "
            "keep this run's schedule)"
            for p in found
        ]
    return problems


def _scheduler_refuses(scheduler, saved: dict) -> list[str]:
    """Try the saved state on the scheduler and put its own back: the scheduler's own checks
    (a negative step count) must fail here, before the load changes anything, not after the
    weights were written."""
    own = scheduler.state_dict()
    try:
        scheduler.load_state_dict(saved)
    except (ValueError, TypeError, KeyError) as error:
        return [f"key 'lr_scheduler': {error}"]
    finally:
        scheduler.load_state_dict(own)
    return []


_JSON_KINDS = {bool: "a bool", int: "a number", float: "a number", str: "a string"}


def _json_kind(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _kind_problems(saved, current, key: str) -> list[str]:
    """Where `saved` (from JSON) differs in kind from `current` (this run's value, as JSON): a
    string for a number, a list of another length, an object lacking a key of this run's.
    None on either side matches anything."""
    kind = _json_kind(current)
    if kind is None or saved is None:
        return []
    if _json_kind(saved) != kind:
        return [f"key '{key}' is {saved!r}, this run has {kind} ({current!r})"]
    if kind == "a list":
        if len(saved) != len(current):
            return [f"key '{key}' has {len(saved)} entries, this run {len(current)}"]
        pairs = [(f"{key}.{i}", s, c) for i, (s, c) in enumerate(zip(saved, current))]
    elif kind == "an object":
        missing = sorted(set(current) - set(saved))
        if missing:
            return [f"key '{key}' lacks {missing}"]
        pairs = [(f"{key}.{k}", saved[k], c) for k, c in current.items()]
    else:
        return []
    return [p for where, s, c in pairs for p in _kind_problems(s, c, where)]


# ----- DeepSpeed checkpoints ------------------------------------------------------------------
# DeepSpeed's files in a checkpoint directory: mp_rank_00_model_states.pt (stages 0-2),
# zero_pp_rank_0_mp_rank_00_model_states.pt (stage 3), *_optim_states.pt (the optimizer shards).
_DEEPSPEED_FILE = re.compile(r".*_(model|optim)_states\.pt")


def deepspeed_checkpoint_files(path: str) -> list[str]:
    """The DeepSpeed checkpoint files in directory `path` (sorted; empty when there are none or
    `path` is not a readable directory)."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(n for n in names if _DEEPSPEED_FILE.fullmatch(n))


def deepspeed_checkpoint_message(path: str, files: list[str]) -> str:
    """What a DeepSpeed checkpoint is to zero, and how to carry its weights over."""
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    save_dir = os.path.dirname(os.path.abspath(path))
    return (
        f"{path} is a DeepSpeed checkpoint ({shown}), not a zero checkpoint: zero reads only its "
        "own format (safetensors and meta.json) and never unpickles .pt files, which can run "
        "code. To continue from it, consolidate its weights with DeepSpeed's own zero_to_fp32.py "
        f"(the copy DeepSpeed saved in {save_dir}, or deepspeed.utils.zero_to_fp32) into a state "
        "dict, e.g. `python zero_to_fp32.py SAVE_DIR OUT_DIR --safe_serialization`; load it into "
        "the model with model.load_state_dict(...) before zero.initialize; then train on and "
        "save zero checkpoints (the optimizer state, lr scheduler and step counters start "
        "afresh; see docs/checkpoints.md, 'Checkpoints from DeepSpeed')"
    )
