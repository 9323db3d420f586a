"""The engine's phase within a micro-batch: IDLE -> FORWARD -> BACKWARD -> IDLE (engine.step, or
a backward that ends its micro-batch without a step: inside engine.no_sync() or after
set_gradient_accumulation_boundary(False))."""

import enum


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
