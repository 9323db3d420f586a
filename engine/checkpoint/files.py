"""Checkpoint files on disk: created afresh, fsynced, checksummed, published by renames.

Owns: writing a checkpoint's files (their safetensors files all go through save_file here;
consolidated and Hugging Face files through safetensors_io.ShardedWriter), their crc32,
publishing a finished directory, and removing what interrupted saves left behind.

[Note: crash-safe publication]
Ranks write into `<tag>.tmp/` (created afresh by rank 0; nothing is written through a symbolic
link: stale paths are unlinked, never followed, and files are created with O_EXCL|O_NOFOLLOW).
Each rank reads its file back once for its size and crc32, and rank 0 collects them into
meta.json, written last. Publication is then a sequence of renames in save_dir:
`<tag>` -> `<tag>.old` (only when the tag exists), `<tag>.tmp` -> `<tag>`, remove `<tag>.old`,
then `latest.tmp` -> `latest`. At every point between two of these operations the tag `latest`
names is a complete checkpoint, except right after the first rename, when `<tag>` is missing and
`<tag>.old` holds its previous, complete version: `resolve` (reader.py) loads `<tag>.old` then,
and the next save keeps it until a new `<tag>` is in place. Directories are fsynced after their
renames.

Each version of a tag is whole, but a reader that opened `<tag>/meta.json` of one version may
open the rank files of the next when a save of the same tag is published in between. The
reader therefore notes the version it started on (the directory's inode and meta.json's crc32)
and checks it again once every file it reads is open: a change is a CheckpointError saying the
tag was replaced during the load (load again), never a checksum error blaming the storage, and
never a silent mix of two versions ([Note: a tag replaced during a load] in reader.py).
"""

import json
import logging
import os
import re
import shutil
import stat
import zlib

from safetensors.torch import save_file

logger = logging.getLogger("zero")

_CHUNK_BYTES = 4 << 20  # read size of the crc32 pass
# What a checkpoint directory can hold (safetensors writes `.tmpXXXXXX` and renames it).
# periodic.py's ranks leave rank<r>.written.json (or .failed.json) until rank 0 publishes.
_CHECKPOINT_ENTRY = re.compile(
    r"meta\.json|module\.safetensors|rank\d+\.safetensors|rank\d+\.(written|failed)\.json"
    r"|\.tmp\w+"
)


def _create(path: str) -> int:
    """A new file's descriptor (write-only); never opens an existing file or follows a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o666)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _write_shard(tensors: dict, path: str, metadata: dict | None = None) -> tuple[int, str]:
    """Write a checkpoint's safetensors file (with `metadata`, str -> str, in its header);
    returns its (size in bytes, crc32)."""
    os.close(_create(path))  # claims the name; fails on anything already there, links included
    save_file(tensors, path, metadata=metadata)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as any file the user creates (safetensors: 0600)
        os.fsync(fd)
        return os.fstat(fd).st_size, _crc32(fd)
    finally:
        os.close(fd)


def _crc32(fd: int) -> str:
    """crc32 (zlib.crc32, the CRC-32 of zip and gzip) of the file open as `fd`, 8 hex digits."""
    crc, buffer = 0, bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    os.lseek(fd, 0, os.SEEK_SET)
    while count := os.readv(fd, [buffer]):
        crc = zlib.crc32(view[:count], crc)
    return f"{crc:08x}"


def file_crc32(path: str) -> str:
    """crc32 of a file as 8 hex digits, as meta.json records it (read in 4 MiB chunks)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _crc32(fd)
    finally:
        os.close(fd)


def _create_json(path: str, value) -> None:
    with os.fdopen(_create(path), "w") as handle:
        json.dump(value, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    _remove_leftover(tmp)
    with os.fdopen(_create(tmp), "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(save_dir: str, tag: str) -> None:
    """Remove `<tag>.tmp` whatever it is, and what interrupted saves of other tags left:
    `<other>.tmp/`, and `<other>.old/` where `<other>` exists, when they are directories
    holding only checkpoint files (anything else there is left alone)."""
    with os.scandir(save_dir) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        path = os.path.join(save_dir, name)
        if name == tag + ".tmp" or _is_stale(save_dir, name):
            _remove_leftover(path)


def _is_stale(save_dir: str, name: str) -> bool:
    path = os.path.join(save_dir, name)
    if name.endswith(".tmp"):
        return _holds_only_checkpoint_files(path)
    if name.endswith(".old"):
        return os.path.isdir(path[: -len(".old")]) and _holds_only_checkpoint_files(path)
    return False


def _holds_only_checkpoint_files(path: str) -> bool:
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        return all(_CHECKPOINT_ENTRY.fullmatch(name) for name in os.listdir(path))
    except OSError:
        return False


def _remove_leftover(path: str) -> None:
    if os.path.lexists(path):
        logger.warning("rank 0: removing %s, left behind by an interrupted save", path)
        _remove(path)


def _remove(path: str) -> None:
    """Remove a file, link or directory tree, if there is one, without following links (a link
    to a directory is unlinked; rmtree never descends through links)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def publish_directory(tmp: str, final: str) -> None:
    """Move the finished directory into place ([Note: crash-safe publication]): an existing
    checkpoint of the same tag becomes `<tag>.old` until the new one is in place."""
    old = final + ".old"
    if os.path.lexists(final):
        _remove(old)  # left by an interrupted save after `<tag>` was complete again
        os.replace(final, old)
    # else: a `<tag>.old` left by an interrupted save is the only copy of the tag; kept.
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final))
    try:
        _remove(old)
    except OSError as error:
        logger.warning("rank 0: could not remove %s (%s); the next save removes it", old, error)
