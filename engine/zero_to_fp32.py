"""zero-to-fp32: consolidate a sharded zero checkpoint into one fp32 safetensors state dict.

    zero-to-fp32 CHECKPOINT_DIR OUTPUT.safetensors [--tag TAG] [--max_shard_size 5GB]
    zero-to-fp32 CHECKPOINT_DIR OUTPUT_DIR --hf [--config-from MODEL_DIR] [--dtype bf16]

Runs in one process on any machine; the world size the checkpoint was saved with does not matter.
With --hf, OUTPUT_DIR gets Hugging Face's layout (config.json, model.safetensors or shards of
--max_shard_size, default 5GB, with model.safetensors.index.json; tied weights once), which
AutoModelForCausalLM.from_pretrained reads: the model is built on the meta device from
config.json (of --config-from, else of CHECKPOINT_DIR) to learn its names, ties and persistent
buffers, and the tensors are streamed one at a time. Needs transformers.
"""

import argparse
import os
import shutil
import sys

from .checkpoint import CheckpointError, consolidate, save_consolidated
from .hf import checkpoint_to_pretrained
from .safetensors_io import parse_size

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
        state = consolidate(args.checkpoint_dir, tag=args.tag)
        files = save_consolidated(state, args.output, limit)
    except (CheckpointError, ValueError) as error:
        print(f"zero-to-fp32: error: {error}", file=sys.stderr)
        return 2
    total = sum(t.numel() for t in state.values())
    print(f"zero-to-fp32: {len(state)} tensors, {total:,} elements -> {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
