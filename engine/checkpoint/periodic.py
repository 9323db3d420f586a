"""Periodic checkpoints that bound lost work, written without stopping training, and resuming
from the newest one at whatever world size the job restarted with.

Owns: PeriodicCheckpointer (checkpoint.save_interval_steps / save_interval_minutes /
async_save), AsyncSave (one checkpoint being written in the background) and resume_latest
(checkpoint.auto_resume, Engine.resume_latest).

[Note: asynchronous periodic checkpoints]
At the step a checkpoint is due, every rank takes a snapshot (collective, on the training
thread): the checks and the tag agreement of writer.save, rank 0 creating `<tag>.tmp/`, then
each rank copies what its rank file holds (master shard, optimizer state, generators, data
loader position) into host memory it owns (pinned, filled without waiting for the device) and
rank 0 builds meta.json from the state of that same step. The step then returns. A background
thread per rank waits for the device copies, writes the rank file into `<tag>.tmp/` (fsynced,
crc32 measured as writer.save does) and then `rank<r>.written.json` with its size and crc32.
Rank 0's thread, once its own files are written, waits for every rank's `.written.json` (the
directory is shared, as for any multi-node checkpoint), removes them, writes meta.json and
publishes the directory and `latest` with the renames of [Note: crash-safe publication] in
files.py. No collective runs off the training thread, so the background work can never
interleave with the training collectives. A crash at any point leaves `latest` naming the
previous complete checkpoint; the next save removes the `.tmp` leftovers. At interpreter exit
the saves in flight are finished, unless the script ends on an uncaught exception: a rank whose
peer died must exit so that its agent can restart it, not wait for the peer's part.

A rank that fails to write leaves `rank<r>.failed.json` instead, rank 0 then abandons the tag
(logged on both), and training goes on; the next periodic save tries again (and removes the
abandoned `<tag>.tmp/`).
Before a new snapshot, a save_checkpoint/load_checkpoint or close, each rank waits for its own
thread (rank 0 for the publication too), so two saves never share a directory and `latest` only
moves forward.
"""

import atexit
import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass

import torch

from .agreement import _on_every_rank, _on_rank_0, _share_text
from .files import _create_json, _write_shard
from .format import LATEST, LAYOUT_METADATA, MODULE_FILE, CheckpointError, layout_digest, rank_file
from .reader import read_meta, resolve
from .validation import verify_checksums, verify_layout
from .writer import (
    _agree_on_tag,
    _check_inputs,
    _finish,
    _layout,
    _meta,
    _prepare,
    module_file_tensors,
    rank_file_tensors,
)

logger = logging.getLogger("zero")

_POLL_S = 0.05  # how often rank 0 looks for the other ranks' .written.json


def _written_marker(rank: int) -> str:
    return f"rank{rank}.written.json"


def _failed_marker(rank: int) -> str:
    return f"rank{rank}.failed.json"


def _write_note(directory: str, name: str, value) -> None:
    """A small JSON file that appears whole (written under a `.tmp...` name, then renamed), so
    rank 0, which polls for it, never reads half of it."""
    staging = os.path.join(directory, ".tmp" + name.replace(".", "_"))
    _create_json(staging, value)
    os.replace(staging, os.path.join(directory, name))


@dataclass
class _Snapshot:
    """What one rank writes for one checkpoint: host tensors, the meta.json draft (rank 0)."""

    save_dir: str
    tag: str
    rank: int
    world_size: int
    rank_tensors: dict
    rank_metadata: dict
    module_tensors: dict | None  # rank 0 only
    meta: dict | None  # rank 0 only; files and crc32 are filled in once every rank wrote
    device_event: object  # a device event the copies were queued before, or None
    wait_timeout_s: float
    digest: str  # [Note: the layout bound to the bytes] in format.py


class AsyncSave:
    """One checkpoint written by a background thread ([Note: asynchronous periodic
    checkpoints]). ``wait()`` joins it and returns the error it met, if any."""

    def __init__(self, snapshot: _Snapshot):
        self.snapshot = snapshot
        self.error: BaseException | None = None
        self.started = time.monotonic()
        # A daemon, finished at exit by _finish_at_exit unless the process ends on an error: a
        # rank whose peer died must exit (so its agent can restart it), not wait for the peer's
        # part of the checkpoint.
        self._thread = threading.Thread(
            target=self._run, name=f"zero-save-{snapshot.tag}", daemon=True
        )
        _in_flight.add(self)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> BaseException | None:
        self._thread.join()
        return self.error

    def _run(self) -> None:
        snap = self.snapshot
        tmp = os.path.join(snap.save_dir, snap.tag + ".tmp")
        try:
            if snap.device_event is not None:
                snap.device_event.synchronize()
            written = {rank_file(snap.rank): self._write(tmp)}
            if snap.rank == 0:
                written[MODULE_FILE] = _write_shard(
                    snap.module_tensors,
                    os.path.join(tmp, MODULE_FILE),
                    {LAYOUT_METADATA: snap.digest},
                )
                self._publish(tmp, written)
            else:
                size, crc = written[rank_file(snap.rank)]
                _write_note(tmp, _written_marker(snap.rank), [size, crc])
        except BaseException as error:  # reported by wait() on the training thread
            self.error = error
            logger.error(
                "rank %d: checkpoint %s was not saved (%s: %s); %s still names the previous one",
                snap.rank,
                snap.tag,
                type(error).__name__,
                error,
                os.path.join(snap.save_dir, LATEST),
            )
            if snap.rank != 0:
                self._leave_failure_marker(tmp, error)
        finally:
            snap.rank_tensors = snap.module_tensors = {}  # free the host copies
            _in_flight.discard(self)

    def _write(self, tmp: str) -> tuple[int, str]:
        snap = self.snapshot
        path = os.path.join(tmp, rank_file(snap.rank))
        return _write_shard(snap.rank_tensors, path, snap.rank_metadata)

    def _leave_failure_marker(self, tmp: str, error: BaseException) -> None:
        # Without it rank 0 gives up after wait_timeout_s.
        with contextlib.suppress(OSError):
            _write_note(tmp, _failed_marker(self.snapshot.rank), str(error))

    def _publish(self, tmp: str, written: dict) -> None:
        snap = self.snapshot
        files = {name: size for name, (size, _) in written.items()}
        crcs = {name: crc for name, (_, crc) in written.items()}
        for rank in range(1, snap.world_size):
            size, crc = self._wait_for_rank(tmp, rank)
            files[rank_file(rank)], crcs[rank_file(rank)] = size, crc
        for rank in range(1, snap.world_size):
            os.unlink(os.path.join(tmp, _written_marker(rank)))
        meta = dict(snap.meta, files=files, crc32=crcs)
        _finish(meta, snap.save_dir, snap.tag, save_latest=True)
        elapsed = time.monotonic() - self.started
        logger.info("checkpoint %s saved in the background (%.2f s)", snap.tag, elapsed)

    def _wait_for_rank(self, tmp: str, rank: int) -> tuple[int, str]:
        deadline = time.monotonic() + self.snapshot.wait_timeout_s
        marker, failed = (os.path.join(tmp, f(rank)) for f in (_written_marker, _failed_marker))
        while True:
            if os.path.exists(marker):
                with open(marker) as handle:
                    size, crc = json.load(handle)
                return int(size), str(crc)
            if os.path.exists(failed):
                with open(failed) as handle:
                    raise CheckpointError(f"rank {rank} failed to write: {json.load(handle)}")
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"rank {rank} wrote no {rank_file(rank)} in {tmp} within "
                    f"{self.snapshot.wait_timeout_s:.0f} s (agreement_timeout); a save_dir on "
                    "a file system every node shares is needed for multi-node checkpoints"
                )
            time.sleep(_POLL_S)


_in_flight: set[AsyncSave] = set()


@atexit.register
def _finish_at_exit() -> None:
    """At interpreter exit: finish the background saves, unless the script ends on an uncaught
    exception (then the checkpoint being written is abandoned: `latest` names the last one)."""
    if getattr(sys, "last_value", None) is not None:
        for save in list(_in_flight):
            logger.warning(
                "rank %d: exiting on an error; checkpoint %s, being written, is abandoned",
                save.snapshot.rank,
                save.snapshot.tag,
            )
        return
    for save in list(_in_flight):
        save.wait()


class PeriodicCheckpointer:
    """Saves a checkpoint to checkpoint.save_dir every save_interval_steps optimizer steps
    and/or at the first step save_interval_minutes after the previous one (rank 0's clock,
    broadcast: one 1-element broadcast per step when minutes are set).

    ``after_step(state, save)`` runs at the end of every optimizer step (Engine.step);
    collective there. With async_save the step waits only for the snapshot (see [Note:
    asynchronous periodic checkpoints]); without it, for the whole write (writer.save).
    """

    def __init__(self, checkpoint_config, wait_timeout_s: float):
        self.save_dir = checkpoint_config.save_dir
        self.every_steps = checkpoint_config.save_interval_steps
        self.every_s = (
            None
            if checkpoint_config.save_interval_minutes is None
            else 60.0 * checkpoint_config.save_interval_minutes
        )
        self.async_save = checkpoint_config.async_save
        self.wait_timeout_s = wait_timeout_s
        self.pending: AsyncSave | None = None
        self.last_save = time.monotonic()
        self.blocking_s: list[float] = []  # per checkpoint: how long step() waited for it
        self.failures = 0  # background saves that did not publish (logged as they failed)

    @classmethod
    def from_config(cls, config) -> "PeriodicCheckpointer | None":
        """None when neither interval is set."""
        block = config.checkpoint
        if block.save_interval_steps is None and block.save_interval_minutes is None:
            return None
        return cls(block, config.agreement_timeout)

    def after_step(self, state, save) -> None:
        """Save when due: a snapshot of the training state `state` written in the background
        (async_save), else save(save_dir), the engine's save_checkpoint. Collective: every rank
        calls it at the same optimizer step."""
        if not self._due(state):
            return
        began = time.monotonic()
        self.wait()
        if self.async_save:
            self.pending = AsyncSave(snapshot(state, self.save_dir, self.wait_timeout_s))
        else:
            save(self.save_dir)
        self.last_save = time.monotonic()
        self.blocking_s.append(self.last_save - began)

    def _due(self, state) -> bool:
        due = self.every_steps is not None and state.counters.global_steps % self.every_steps == 0
        if self.every_s is None:
            return due
        late = time.monotonic() - self.last_save >= self.every_s
        flag = torch.tensor([float(late or due)], device=state.device)
        if state.comm.world_size > 1:
            state.comm.broadcast(flag, src=0)
        return bool(flag.item())

    def wait(self) -> None:
        """Finish the checkpoint being written, if any (this rank's part; rank 0: also its
        publication). Not a collective, and it raises nothing: a failed background write was
        logged (ERROR) on the rank that met it and on rank 0, `latest` still names the previous
        checkpoint, and the count is in ``failures`` (raising on one rank while the others go
        on into a collective would stop the job)."""
        pending, self.pending = self.pending, None
        if pending is not None and pending.wait() is not None:
            self.failures += 1


def snapshot(state, save_dir: str, wait_timeout_s: float) -> _Snapshot:
    """Copy what this rank's checkpoint files hold into host memory and prepare `<tag>.tmp/`
    (tag global_step{N}). Collective; raises CheckpointError on every rank, before anything is
    written, as writer.save does."""
    tag = f"global_step{state.counters.global_steps}"
    scheduler_state, loader_state, client_state = _on_every_rank(
        state, "check the checkpoint tag and state", lambda: _check_inputs(state, tag, {})
    )
    tag = _agree_on_tag(state, tag)
    _on_rank_0(state, f"prepare {os.path.join(save_dir, tag)}.tmp", lambda: _prepare(save_dir, tag))
    rank = state.comm.rank
    digest = layout_digest(_layout(state, None))
    tensors, metadata = rank_file_tensors(state, loader_state, True, digest)
    frozen = _frozen_full_values(state)
    module_tensors = meta = None
    if rank == 0:
        module_tensors = module_file_tensors(state, frozen, {}, True)
        meta = _meta(state, tag, client_state, scheduler_state, {}, {}, None)
    event = None
    if state.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
    return _Snapshot(
        save_dir,
        tag,
        rank,
        state.comm.world_size,
        tensors,
        metadata,
        module_tensors,
        meta,
        event,
        wait_timeout_s,
        digest,
    )


def _frozen_full_values(state) -> dict:
    # Stage 3 partitions frozen parameters too; rank 0 needs their full values (a collective).
    return state.frozen.full_values() if state.frozen is not None else {}


def resume_latest(state, save_dir: str, load):
    """Load the checkpoint to resume in save_dir ([Note: what auto_resume resumes]) with
    load(save_dir, tag=tag) (the engine's load_checkpoint) into the training state `state`,
    saved at any world size; a save_dir without checkpoints (a first run) loads nothing.
    Returns (checkpoint directory, client_state), or (None, None) when nothing was loaded.

    Collective: every rank calls it; rank 0 decides what to resume and tells the others. The
    global batch (train_batch_size) must be the one the checkpoint was saved with:
    gradient_accumulation_steps is derived anew for the new world size when the config gives
    train_batch_size and train_micro_batch_size_per_gpu only. Raises ValueError naming both
    sizes when train_batch_size differs, CheckpointError (every rank) when `latest` is not a
    file and the newest global_step<N> checkpoint is not complete and intact, or `latest` is a
    directory, and what Engine.load_checkpoint raises. Logs (rank 0) the step resumed at, the
    previous and the new world size and gradient accumulation steps, and
    TORCHELASTIC_RESTART_COUNT when set.
    """
    chosen = _on_rank_0(
        state, f"choose the checkpoint to resume in {save_dir}", lambda: _tag_to_resume(save_dir)
    )
    tag = chosen or ""
    if state.comm.world_size > 1:
        tag = _share_text(state, tag, src=0)  # a checked tag fits the message buffer whole
    if not tag:
        logger.info("auto_resume: no checkpoint in %s yet; starting from step 0", save_dir)
        return None, None
    meta = read_meta(resolve(save_dir, tag))
    saved = meta["config"]
    config = state.config
    if saved.get("train_batch_size") != config.train_batch_size:
        raise ValueError(
            f"rank {state.comm.rank}: cannot resume {save_dir} with the same global batch: it was "
            f"saved with train_batch_size {saved.get('train_batch_size')} on "
            f"{meta['world_size']} ranks (micro-batch {saved.get('train_micro_batch_size_per_gpu')}"
            f", gradient_accumulation_steps {saved.get('gradient_accumulation_steps')}), this run "
            f"has train_batch_size {config.train_batch_size} on {state.comm.world_size} ranks "
            f"(micro-batch {config.train_micro_batch_size_per_gpu}, gradient_accumulation_steps "
            f"{config.gradient_accumulation_steps}). Give train_batch_size "
            f"{saved.get('train_batch_size')} and train_micro_batch_size_per_gpu, without "
            "gradient_accumulation_steps, so zero derives it for each world size (train_batch_size "
            "must be a multiple of micro-batch x world size)"
        )
    path, client_state = load(save_dir, tag=tag)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    logger.info(
        "resumed from %s at step %d: world size %d -> %d, gradient_accumulation_steps %s -> %d%s",
        path,
        state.counters.global_steps,
        meta["world_size"],
        state.comm.world_size,
        saved.get("gradient_accumulation_steps"),
        config.gradient_accumulation_steps,
        f" (restart {restart} of the elastic job)" if restart not in (None, "0") else "",
    )
    return path, client_state


# [Note: what auto_resume resumes]
# A regular file `latest` names the tag, as for load_checkpoint. Without one (missing, or a link
# to nothing: a cleanup job or a copy that dropped it), starting from step 0 would have the
# periodic saves write over the checkpoints already there, so the newest global_step<N> is
# resumed, once its meta.json, sizes, crc32s and layout pass (validation.py); when it does not
# pass, or is not complete, the resume is refused rather than falling back to an older one,
# whose run would write over the newest at its step. A directory `latest` is refused: no save
# could replace it. Rank 0 alone looks and shares the tag, so ranks that see save_dir at
# different moments still resume the same checkpoint.
_PERIODIC_TAG = re.compile(r"global_step(0|[1-9][0-9]*)(\.old)?")


def _tag_to_resume(save_dir: str) -> str | None:
    """Rank 0: the tag to resume in save_dir, or None for a first run; see [Note: what
    auto_resume resumes]. Raises CheckpointError."""
    latest = os.path.join(save_dir, LATEST)
    if os.path.isfile(latest):
        return os.path.basename(resolve(save_dir, None)).removesuffix(".old")
    if os.path.isdir(latest):
        raise CheckpointError(
            f"{latest} is a directory; a save cannot replace it with the file that names the "
            "newest checkpoint. Remove or rename it, then start again"
        )
    names = os.listdir(save_dir) if os.path.isdir(save_dir) else []
    steps = [int(m.group(1)) for m in map(_PERIODIC_TAG.fullmatch, names) if m]
    if not steps:
        return None
    tag = f"global_step{max(steps)}"
    why = "is missing" if not os.path.lexists(latest) else "is a link to nothing"
    try:
        path = resolve(save_dir, tag)
        meta = read_meta(path)
        verify_checksums(path, meta, meta["files"])
        verify_layout(path, meta, meta["files"])
    except CheckpointError as error:
        raise CheckpointError(
            f"{latest} {why} and the newest checkpoint, {tag}, does not pass its checks "
            f"({error}); resuming an older one would have this run write over {tag}. Restore "
            f"{tag}, or remove it (or write the tag to resume into {latest})"
        ) from None
    logger.warning("auto_resume: %s %s; resuming the newest checkpoint, %s", latest, why, tag)
    return tag


__all__ = ["AsyncSave", "PeriodicCheckpointer", "resume_latest", "snapshot"]
