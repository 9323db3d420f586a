"""zero.optim: what turns reduced gradients into new weights.

Owns: the optimizer registry (DeepSpeed's optimizer types and torch's), learning-rate schedules
(DeepSpeed's WarmupLR, WarmupDecayLR, OneCycle, ...), and mixed precision with loss scaling.
May import: zero.comm and everything below it.
"""

from .optimizers import (
    UNSUPPORTED_OPTIMIZERS,
    build_optimizer,
    resolve_optimizer,
    supported_optimizer_types,
)

__all__ = [
    "UNSUPPORTED_OPTIMIZERS",
    "build_optimizer",
    "resolve_optimizer",
    "supported_optimizer_types",
]
