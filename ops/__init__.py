"""zero.ops: JIT-compiled ops (ops/builder.py) and the optimizers built on them.

CPUAdam (ZeRO-Offload's host optimizer) and FusedAdam (multi-tensor CUDA Adam); see docs/ops.md.
"""

from .adam import CPUAdam, FusedAdam, adam_reference
from .builder import BuildState, OpBuilder, OpBuildError, get_builder, op_names

__all__ = [
    "BuildState",
    "CPUAdam",
    "FusedAdam",
    "OpBuildError",
    "OpBuilder",
    "adam_reference",
    "get_builder",
    "op_names",
]
