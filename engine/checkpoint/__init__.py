"""zero.checkpoint: saving and loading training state, and the files other tools read.

Owns: zero's checkpoint format (meta.json + safetensors shards per rank), the atomic writer, the
verifying reader (every rank checks before any state changes), consolidation into one fp32
state dict (`zero-to-fp32`), and Hugging Face save_pretrained directories (hf.py: load into a
partitioned model, export from one).
May import: zero.partition and everything below it.
"""

from .core import (
    LATEST,
    SAFETENSORS_DTYPES,
    CheckpointError,
    ConsolidatedReader,
    consolidate,
    consolidated_names,
    deepspeed_checkpoint_files,
    deepspeed_checkpoint_message,
    file_crc32,
    load,
    publish_directory,
    save,
    save_consolidated,
    verify_checksums,
)

__all__ = [
    "LATEST",
    "SAFETENSORS_DTYPES",
    "CheckpointError",
    "ConsolidatedReader",
    "consolidate",
    "consolidated_names",
    "deepspeed_checkpoint_files",
    "deepspeed_checkpoint_message",
    "file_crc32",
    "load",
    "publish_directory",
    "save",
    "save_consolidated",
    "verify_checksums",
]
