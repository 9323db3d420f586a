"""zero.checkpoint: saving and loading training state, and the files other tools read.

Owns: zero's checkpoint format (meta.json + safetensors shards per rank), the atomic writer, the
verifying reader (every rank checks before any state changes), consolidation into one fp32
state dict (`zero-to-fp32`), Hugging Face save_pretrained directories, and the full 16-bit state
dict that accelerate and the Trainer save. One module each, lower ones first (a module imports
only those above it in this list):
    format.py          file names, CheckpointError, tags, the meta.json schema, dtype tables
    ownership.py       which engine tensors go to which file; ranges in group coordinates
    files.py           creating, fsyncing, checksumming and publishing files; stale leftovers
    agreement.py       every rank agrees on each step that may fail on one rank
    validation.py      checks before a load changes state; DeepSpeed checkpoint detection
    rank_state.py      each rank's own state: random number generators, data loader
    reader.py          resolve, read_meta, GroupReader, load
    writer.py          save
    safetensors_io.py  Hugging Face's safetensors layout, read in parts and written as a stream
    consolidation.py   ConsolidatedReader, consolidate, write_consolidated, save_consolidated
    weights.py         load_weights: the weights alone, into an engine without an optimizer
    full_state.py      the full state dict in the compute dtype, gathered tensor by tensor
                       (DeepSpeed's _zero3_consolidated_16bit_state_dict)
    hf.py              load into a partitioned model, export from one (save_pretrained)
    zero_to_fp32.py    the zero-to-fp32 CLI and DeepSpeed's zero_to_fp32 functions
May import: zero.partition and everything below it.
"""

from .consolidation import (
    ConsolidatedReader,
    consolidate,
    consolidated_names,
    save_consolidated,
    write_consolidated,
)
from .files import file_crc32, publish_directory
from .format import LATEST, SAFETENSORS_DTYPES, CheckpointError
from .full_state import consolidated_16bit_state_dict, save_16bit_model
from .reader import load
from .validation import (
    deepspeed_checkpoint_files,
    deepspeed_checkpoint_message,
    nothing_to_load,
    verify_checksums,
)
from .weights import load_weights
from .writer import save

__all__ = [
    "LATEST",
    "SAFETENSORS_DTYPES",
    "CheckpointError",
    "ConsolidatedReader",
    "consolidate",
    "consolidated_16bit_state_dict",
    "consolidated_names",
    "deepspeed_checkpoint_files",
    "deepspeed_checkpoint_message",
    "file_crc32",
    "load",
    "load_weights",
    "nothing_to_load",
    "publish_directory",
    "save",
    "save_16bit_model",
    "save_consolidated",
    "verify_checksums",
    "write_consolidated",
]
