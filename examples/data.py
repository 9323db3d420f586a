"""Byte-level text data for the zero examples.

Tokens are raw bytes (vocab 256), so no tokenizer and no download is needed. The default corpus
is the Python standard library's own source, which exists wherever Python does.
"""

import math
import os
from pathlib import Path

import torch

DEFAULT_CORPUS_CAP_BYTES = 4 * 1024 * 1024
VAL_FRACTION = 0.1


def default_corpus_dir() -> Path:
    """The directory holding the standard library's top-level *.py files (that of `os`)."""
    return Path(os.__file__).resolve().parent


def read_default_corpus(cap_bytes: int = DEFAULT_CORPUS_CAP_BYTES) -> bytes:
    """Concatenate the sorted top-level *.py files of the standard library, up to cap_bytes.

    Deterministic for a given Python version. Ranks on different machines must run the same
    Python version, or their corpora differ.
    """
    chunks, size = [], 0
    for path in sorted(default_corpus_dir().glob("*.py")):
        data = path.read_bytes()
        chunks.append(data[: cap_bytes - size])
        size += len(chunks[-1])
        if size >= cap_bytes:
            break
    return b"".join(chunks)


def load_corpus(path: str | None) -> tuple[bytes, str]:
    """Return (raw bytes, description). path None means the standard-library corpus."""
    if path is None:
        return read_default_corpus(), f"{default_corpus_dir()}/*.py (Python stdlib source)"
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--data {path!r} is not a file; pass a text file or omit --data")
    return file.read_bytes(), str(file)


class ByteDataset:
    """Train/val split of a byte corpus with random-window batches.

    Windows are block_size + 1 contiguous bytes: x is the first block_size, y the same shifted
    by one. Each rank draws from its own torch.Generator seeded by (seed, rank), so the
    data-parallel ranks see different windows and a run is reproducible.
    """

    def __init__(self, raw: bytes, block_size: int, seed: int, rank: int = 0):
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        split = int(len(tokens) * (1 - VAL_FRACTION))
        self.train = tokens[:split]
        self.val = tokens[split:]
        self.block_size = block_size
        for name, part in (("train", self.train), ("val", self.val)):
            if len(part) <= block_size + 1:
                raise ValueError(
                    f"{name} split has {len(part)} bytes, too few for block_size={block_size}; "
                    "use a larger corpus or a smaller --block_size"
                )
        # Distinct, deterministic streams per rank (and per split, so eval never shifts training).
        self.generators = {
            name: torch.Generator().manual_seed(seed * 1_000_003 + rank * 2 + offset)
            for offset, name in enumerate(("train", "val"))
        }

    def get_batch(
        self, split: str, batch_size: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return x, y: int64 (batch_size, block_size) on device."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(
            len(data) - self.block_size - 1, (batch_size,), generator=self.generators[split]
        )
        offsets = torch.arange(self.block_size + 1)
        windows = data[starts[:, None] + offsets]
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        return x.to(device), y.to(device)

    def unigram_entropy(self) -> tuple[float, float]:
        """Byte unigram entropy of the training split as (bits per byte, nats per byte).

        A model that ignores context cannot beat this loss; the nats figure compares directly
        with the cross-entropy loss.
        """
        counts = torch.bincount(self.train, minlength=256).double()
        probs = counts[counts > 0] / counts.sum()
        nats = float(-(probs * probs.log()).sum())
        return nats / math.log(2), nats
