"""Ranks agree on the outcome of every step of a save or a load that may fail on one rank.

[Note: agreement on failure]
Every step that may fail on one rank (checking inputs, rank 0 preparing the directory, writing
files, rank 0 publishing; on load, verifying) runs through `_on_every_rank`: the ranks all-reduce
a failure flag, and the lowest failing rank broadcasts its message, so every rank raises at the
same point within one collective (none waits for a rank that gave up) and names the cause.
"""

import torch

from .format import CheckpointError

_MESSAGE_BYTES = 1024  # how much of a failing rank's message the other ranks receive


def enter(comm, method: str, arguments: int = 0) -> None:
    """Check that every rank calls collective `method` with equal `arguments` (a hash;
    comm.Agreement.enter, RankMismatchError otherwise). Nothing without a communicator or with
    agreement checks off."""
    if comm is not None and comm.agreement is not None:
        comm.agreement.enter(method, arguments)


def _on_every_rank(state, what: str, action):
    """Run action() on every rank and agree on the outcome ([Note: agreement on failure]): when
    it raises on any rank, the failing rank re-raises its error and every other rank raises
    CheckpointError carrying the lowest failing rank's message. Collective."""
    error = None
    try:
        result = action()
    except Exception as caught:
        error, result = caught, None
    failed = torch.zeros(state.comm.world_size, device=state.device)
    failed[state.comm.rank] = float(error is not None)
    state.comm.all_reduce(failed, op="max")
    if not failed.any():
        return result
    first = int(failed.nonzero()[0])
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    message = _share_text(state, text, first)
    if error is not None:
        raise error
    raise CheckpointError(f"rank {state.comm.rank}: rank {first} failed to {what}: {message}")


def _on_rank_0(state, what: str, action):
    return _on_every_rank(state, what, lambda: action() if state.comm.rank == 0 else None)


def _share_text(state, text: str, src: int) -> str:
    """Rank src's `text` (its first _MESSAGE_BYTES bytes in UTF-8) on every rank. Collective."""
    buffer = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    raw = text.encode("utf-8", "replace")[:_MESSAGE_BYTES]
    if state.comm.rank == src and raw:
        buffer[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buffer = buffer.to(state.device)
    state.comm.broadcast(buffer, src=src)
    return bytes(buffer.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")
