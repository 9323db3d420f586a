"""Blocks of DeepSpeed subsystems zero does not implement, and what an enabled one means.

[Note: enabled blocks zero does not implement]
Each block is accepted as a free dict (default null), so files written for DeepSpeed load
(DeepSpeed 0.19.8 itself refuses amp, elasticity, compression_training, sparse_attention,
curriculum_learning, progressive_layer_drop and eigenvalue whenever the key is present; zero
accepts them while they are off). Switched on, a block is judged by what DeepSpeed does with it:
- REFUSED: DeepSpeed would train something else (other precision, batch size, data, sequence
  lengths, dropped layers, compressed weights). Ignoring the block would train another run than
  the one asked for, so loading the config raises ConfigNotImplementedError naming the key and
  what to use instead, under zero's API and under the doorway alike (both load through Config).
- WARNED: the block only observes, or DeepSpeed reads it only
  through objects zero does not serve (deepspeed.pipe, deepspeed.ops.sparse_attention, whose
  import fails with its own error): training is the same, so one UserWarning says so.
A block counts as switched on when DeepSpeed would run it: its "enabled" key is truthy (as
DeepSpeed reads it); compression_training has no switch of its own, only one per technique, so
any "enabled" inside it counts.
"""

from collections.abc import Mapping
from typing import Any

REFUSED = {
    "amp": (
        "zero has no apex AMP and cannot reproduce its casts exactly (O1 casts ops by apex's own "
        "lists, which torch.autocast's differ from; O2 keeps batch norm in fp32 beside fp16 "
        "weights; zero does not autocast). Use fp16.enabled (fp16 weights, fp32 master weights "
        "and dynamic loss scaling: O2's scheme) or bf16.enabled instead; for O0 (fp32) remove "
        "the block."
    ),
    "elasticity": (
        "zero does not compute DeepSpeed's elastic batch size (from max_train_batch_size, "
        "micro_batch_sizes and min_gpus..max_gpus), so the job would train with another batch. "
        "Give train_batch_size and train_micro_batch_size_per_gpu and leave "
        "gradient_accumulation_steps out: zero derives it for each world size, and zrun "
        "--nnodes MIN:MAX with checkpoint.auto_resume keeps the global batch when nodes leave "
        "(docs/launcher.md, Elastic)."
    ),
    "compression_training": (
        "zero has no compression library (quantization-aware training, pruning, layer "
        "reduction), so the model would train uncompressed. Remove the block, or compress the "
        "model before zero.initialize."
    ),
    "data_efficiency": (
        "zero has no data-efficiency library (curriculum data sampling, random-LTD token "
        "routing), so the model would see other data than asked for. Remove the block and "
        "sample or route data in the training script."
    ),
    "curriculum_learning": (
        "zero does not pass curriculum_seqlen to the model's forward (DeepSpeed's legacy "
        "curriculum shortens sequences early in training), so every step would train on full "
        "sequences. Remove the block and shorten sequences in the script's data loader."
    ),
    "progressive_layer_drop": (
        "zero does not pass progressive_layer_drop and pld_theta to the model's forward, so no "
        "layer would be dropped. Remove the block, or drop layers in the model's forward."
    ),
}

WARNED = {
    "pipeline": (
        "zero has no pipeline parallelism; DeepSpeed reads this block only for a "
        "deepspeed.pipe.PipelineModule, which zero does not provide, so the model trains whole"
    ),
    "sparse_attention": (
        "DeepSpeed reads it only in its sparse attention modules (deepspeed.ops.sparse_attention"
        "), which zero does not provide; the model's own attention runs"
    ),
    "eigenvalue": (
        "zero does not compute Hessian eigenvalues (DeepSpeed uses them only to schedule MoQ "
        "quantization, which zero does not have); training is unchanged"
    ),
    "hybrid_engine": (
        "engine.generate() runs the model's own generate() (DeepSpeed's hybrid engine swaps in "
        "inference kernels for speed); training is unchanged"
    ),
}

BLOCKS = (*REFUSED, *WARNED)


def switch_key(name: str, block: Mapping[str, Any] | None) -> str | None:
    """The dotted key that switches block `name` on ("amp.enabled"), or None when it is off
    ([Note: enabled blocks zero does not implement])."""
    if not isinstance(block, Mapping):
        return None
    if name != "compression_training":
        return f"{name}.enabled" if block.get("enabled") else None
    return _nested_switch(name, block)


def _nested_switch(prefix: str, value) -> str | None:
    if isinstance(value, Mapping):
        if value.get("enabled"):
            return f"{prefix}.enabled"
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _nested_switch(f"{prefix}.{key}", item)
        if found:
            return found
    return None
