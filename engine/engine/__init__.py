"""zero.engine: the Engine zero.initialize returns, and how it is put together.

    engine.py             Engine: holds the parts, runs forward, backward and step through them
    builder.py            config in, parts out (layout, optimizer, fetch units, buckets, ...)
    guards.py             misuse checks on the model, its parameters and the training calls
    deepspeed_api.py      DeepSpeed's getters, aliases and fallthrough (a mixin of Engine)
    generation.py         engine.generate at stage 3
    phase.py              Phase: where the engine is within a micro-batch
May import every subpackage below it (.importlinter).
"""

from .engine import Engine
from .phase import Phase

__all__ = ["Engine", "Phase"]
