"""zero-to-fp32: consolidate a sharded zero checkpoint into one fp32 safetensors state dict.

    zero-to-fp32 CHECKPOINT_DIR OUTPUT.safetensors [--tag TAG] [--max_shard_size 5GB]
    zero-to-fp32 CHECKPOINT_DIR OUTPUT_DIR --hf [--config-from MODEL_DIR] [--dtype bf16]

Runs in one process on any machine; the world size the checkpoint was saved with does not matter.
It reads and writes one tensor at a time (zero.checkpoint.write_consolidated), so it holds at
most about 1.5x the largest tensor beside the interpreter, never the model.

As a module it is also DeepSpeed's deepspeed.utils.zero_to_fp32 (importable as
zero.utils.zero_to_fp32): get_fp32_state_dict_from_zero_checkpoint,
load_state_dict_from_zero_checkpoint and convert_zero_checkpoint_to_fp32_state_dict, with
DeepSpeed's arguments, built on zero.checkpoint's consolidation (ConsolidatedReader).
With --hf, OUTPUT_DIR gets Hugging Face's layout (config.json, model.safetensors or shards of
--max_shard_size, default 5GB, with model.safetensors.index.json; tied weights once), which
AutoModelForCausalLM.from_pretrained reads: the model is built on the meta device from
config.json (of --config-from, else of CHECKPOINT_DIR) to learn its names, ties and persistent
buffers, and the tensors are streamed one at a time. Needs transformers.
"""

import argparse
import logging
import math
import os
import shutil
import sys

from ..errors import listed
from .consolidation import ConsolidatedReader, _stream, consolidate, consolidated_names
from .format import CheckpointError
from .hf import checkpoint_to_pretrained
from .ownership import non_persistent_buffer_names
from .safetensors_io import INDEX_FILE, SINGLE_FILE, parse_size

logger = logging.getLogger("zero")

# What --hf copies from the config directory beside the weights (config.json is rewritten).
HF_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
HF_FILES += ("special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")
HF_FILES += ("chat_template.jinja",)


def _check_output(output: str, checkpoint_dir: str) -> None:
    """The output must go to an existing directory outside the checkpoint it reads."""
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise ValueError(f"output directory {parent} does not exist")
    inside = os.path.commonpath([parent, os.path.abspath(checkpoint_dir)])
    if inside == os.path.abspath(checkpoint_dir):
        raise ValueError(
            f"output {output} is inside the checkpoint {checkpoint_dir}; write it elsewhere"
        )


def _config_dir(args) -> str:
    """The directory whose config.json describes the model: --config-from, else the checkpoint
    directory given (a save_dir, or the save_dir above a tag directory)."""
    if args.config_from is not None:
        candidates = [args.config_from]
    else:
        candidates = [args.checkpoint_dir, os.path.dirname(os.path.abspath(args.checkpoint_dir))]
    for directory in candidates:
        if os.path.isfile(os.path.join(directory, "config.json")):
            return directory
    raise ValueError(
        f"--hf: no config.json in {candidates[0]}; pass --config-from MODEL_DIR (the directory "
        "the model was loaded from, or where model.config.save_pretrained wrote it)"
    )


def _meta_model(config_dir: str):
    """The model config.json describes, built on the meta device (shapes, no values): its
    `architectures` class, else AutoModelForCausalLM."""
    import torch

    try:
        import transformers
    except ImportError:
        raise ValueError("--hf needs transformers: pip install transformers") from None
    config = transformers.AutoConfig.from_pretrained(config_dir)
    names = config.architectures or []
    model_class = getattr(transformers, names[0], None) if names else None
    with torch.device("meta"):
        if model_class is None:
            return transformers.AutoModelForCausalLM.from_config(config)
        return model_class(config)


def export_hf(args, limit) -> list[str]:
    """--hf: the checkpoint in Hugging Face's layout in args.output; returns its files."""
    config_dir = _config_dir(args)
    model = _meta_model(config_dir)
    checkpoint_to_pretrained(
        args.checkpoint_dir, model, args.output, args.tag, limit or "5GB", args.dtype or "fp32"
    )
    for name in HF_FILES:  # the model's own generation config over the default one
        source = os.path.join(config_dir, name)
        if os.path.isfile(source):
            shutil.copy2(source, os.path.join(args.output, name))
    return sorted(os.listdir(args.output))


# ----- DeepSpeed's deepspeed.utils.zero_to_fp32 functions ------------------------------------
def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag=None, exclude_frozen_parameters=False, lazy_mode=False
) -> dict:
    """The consolidated fp32 state dict of a zero checkpoint (zero.checkpoint.consolidate):
    every parameter and buffer under every name, tied ones as equal copies, trained values
    bitwise the fp32 master weights, on the CPU. DeepSpeed's function of the same name.

    Args:
        checkpoint_dir: the save_dir (its `latest` names the tag) or a tag directory itself.
        tag: the checkpoint tag (default: the one `latest` names).
        exclude_frozen_parameters: leave out parameters with requires_grad=False (buffers stay).
        lazy_mode: accepted for DeepSpeed's signature; the tensors are always read at once (a
            caller's `.contiguous()` on each works as with DeepSpeed's lazy tensors). For a
            model larger than host memory, use `zero-to-fp32`, which streams.

    Runs in one process, whatever world size and stage the checkpoint was saved with; every
    file's crc32 is checked. Raises CheckpointError (a ValueError) for a missing or damaged
    checkpoint, and for a DeepSpeed checkpoint (see docs/checkpoints.md).
    """
    del lazy_mode
    return consolidate(
        os.fspath(checkpoint_dir), tag=tag, exclude_frozen=bool(exclude_frozen_parameters)
    )


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load a zero checkpoint's consolidated fp32 weights into `model`, a plain torch module
    (not one zero.initialize or zero.Init manages), moved to the CPU as DeepSpeed does; returns
    the model. DeepSpeed's function of the same name.

    Every key is checked before anything is written: a checkpoint whose tensors do not match
    the model's state dict (missing or unexpected names; the model's non-persistent buffers
    may be in the checkpoint) is a CheckpointError naming them, with the model unchanged.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"load_state_dict_from_zero_checkpoint: model must be a torch.nn.Module, not "
            f"{type(model).__name__}"
        )
    _refuse_managed(model)
    logger.info("zero_to_fp32: consolidating %s", checkpoint_dir)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    expected = set(model.state_dict().keys())
    extra_ok = non_persistent_buffer_names(model)  # in the checkpoint, not in the state dict
    state = {k: v for k, v in state.items() if k in expected or k not in extra_ok}
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{checkpoint_dir} does not fit {type(model).__name__}: "
            + "; ".join(
                f"{what} {listed(names)}"
                for what, names in (("missing", missing), ("unexpected", unexpected))
                if names
            )
        )
    model = model.cpu()
    model.load_state_dict(state, strict=True)
    return model


def _refuse_managed(model) -> None:
    """A model whose parameters zero partitions or trains would take the values in its
    low-precision copy only (or not at all, at stage 3): refuse it."""
    from ..partition import gathered

    for name, param in model.named_parameters():
        if hasattr(param, "ds_shape") or gathered.owner(param) is not None:
            raise ValueError(
                f"load_state_dict_from_zero_checkpoint: parameter '{name}' is managed by zero "
                "(built under zero.Init or given to zero.initialize): pass a plain model, or "
                "resume the engine with engine.load_checkpoint"
            )


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization=False,
    tag=None,
    exclude_frozen_parameters=False,
) -> list[str]:
    """Write a zero checkpoint's consolidated fp32 state dict into `output_dir` as
    model.safetensors, or as model-0000i-of-0000n.safetensors shards of at most
    `max_shard_size` (None: one file) with model.safetensors.index.json. DeepSpeed's function
    of the same name; returns the file names written.

    zero writes safetensors only: safe_serialization=False (DeepSpeed's default, which writes a
    pickled pytorch_model.bin) writes the same safetensors files, with a warning. Streams one
    tensor at a time, never holding the model (zero.checkpoint.write_consolidated; tied names are
    written as copies, so load_state_dict(strict=True) takes the result). Raises
    CheckpointError for a missing or damaged checkpoint, ValueError for a bad max_shard_size.
    """
    if max_shard_size is None:
        limit = None
    elif isinstance(max_shard_size, int):
        limit = max_shard_size
    else:
        limit = parse_size(max_shard_size)
    if limit is not None and limit <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} must be positive (e.g. '5GB')")
    if not safe_serialization:
        logger.warning(
            "convert_zero_checkpoint_to_fp32_state_dict: zero writes safetensors only (no "
            "pickle): writing model.safetensors, not pytorch_model.bin; load it with "
            "safetensors.torch.load_file"
        )
    reader = ConsolidatedReader(os.fspath(checkpoint_dir), tag)
    names = consolidated_names(reader, bool(exclude_frozen_parameters))
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    output = os.path.join(output_dir, SINGLE_FILE)
    return [os.path.basename(f) for f in _stream(reader, names, output, limit, INDEX_FILE)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="zero-to-fp32", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint_dir", help="save_dir (follows `latest`) or a tag directory")
    parser.add_argument("output", help="output .safetensors file (with --hf: a directory)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the `latest` one)")
    parser.add_argument(
        "--max_shard_size",
        default=None,
        help="split into files of at most this size (e.g. 2GB), with an index",
    )
    parser.add_argument("--hf", action="store_true", help="write Hugging Face's layout")
    parser.add_argument(
        "--config-from", default=None, help="--hf: directory with the model's config.json"
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="--hf: saved dtype")
    args = parser.parse_args(argv)
    if not args.hf and (args.config_from or args.dtype):
        parser.error("--config-from and --dtype need --hf")
    try:
        limit = parse_size(args.max_shard_size) if args.max_shard_size else None
        if limit is not None and limit <= 0:
            raise ValueError(f"--max_shard_size {args.max_shard_size!r} must be positive")
        _check_output(args.output, args.checkpoint_dir)
        if args.hf:
            files = export_hf(args, limit)
            print(f"zero-to-fp32: {args.output}: {', '.join(files)}")
            return 0
        reader = ConsolidatedReader(args.checkpoint_dir, args.tag)
        names = consolidated_names(reader)
        files = _stream(reader, names, args.output, limit)  # one tensor at a time
    except (CheckpointError, ValueError) as error:
        print(f"zero-to-fp32: error: {error}", file=sys.stderr)
        return 2
    names += [alias for alias, canonical in reader.ties.items() if canonical in names]
    total = sum(math.prod(reader.shape(reader.ties.get(n, n))) for n in names)
    print(f"zero-to-fp32: {len(names)} tensors, {total:,} elements -> {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
