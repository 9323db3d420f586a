"""zero.ops: JIT-compiled ops (ops/builder.py) and the optimizers built on them.

CPUAdam (ZeRO-Offload's host optimizer), FusedAdam (multi-tensor CUDA Adam) and AsyncFileIO
(ZeRO-Infinity's NVMe file I/O); see docs/ops.md.
"""

from .adam import CPUAdam, FusedAdam, adam_reference
from .aio import AsyncFileIO
from .builder import BuildState, OpBuilder, OpBuildError, get_builder, op_names

__all__ = [
    "AsyncFileIO",
    "BuildState",
    "CPUAdam",
    "FusedAdam",
    "OpBuildError",
    "OpBuilder",
    "adam_reference",
    "get_builder",
    "op_names",
]
