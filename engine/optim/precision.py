"""Loss scaling for fp16 training (DeepSpeed keys fp16.*).

[Note: overflow policy]
Gradients are checked once per optimizer step, after they are reduced, through the same all-reduce
that sums the squared gradient norm: a non-finite global sum means some rank saw inf or nan in
some partition. An overflowing step is skipped (parameters and optimizer state untouched, the lr
scheduler not stepped). With dynamic scaling the scale is divided by 2 once `hysteresis`
overflows have been seen (consecutive overflows when consecutive_hysteresis is true, otherwise
since the last scale change) and multiplied by 2 after `loss_scale_window` steps without one.
The scale never goes below min_loss_scale: an overflow at the minimum still skips the step and
logs a warning, and training continues (DeepSpeed stops with an exception instead; a run whose
every step overflows at the minimum shows it in skipped_steps).
"""

import logging

logger = logging.getLogger("zero")


class LossScaler:
    """Static (`dynamic=False`) or dynamic loss scale. `scale` is the current factor (a float).

    Follows DeepSpeed's fp16 keys: loss_scale (0 = dynamic), initial_scale_power,
    loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale.
    """

    def __init__(
        self,
        scale: float = 1.0,
        dynamic: bool = False,
        window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
    ):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.hysteresis_left = hysteresis
        self.steps_since_change = 0

    @classmethod
    def from_config(cls, config) -> "LossScaler":
        """Build from a Config: a dynamic or static scaler for fp16, a unit scale otherwise."""
        fp16 = config.fp16
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale == 0:
            return cls(
                scale=2.0**fp16.initial_scale_power,
                dynamic=True,
                window=fp16.loss_scale_window,
                hysteresis=fp16.hysteresis,
                consecutive_hysteresis=fp16.consecutive_hysteresis,
                min_scale=fp16.min_loss_scale,
            )
        return cls(scale=fp16.loss_scale)

    def update(self, overflow: bool, rank: int = 0) -> None:
        """Advance by one optimizer step that did (`overflow`) or did not overflow."""
        if not self.dynamic:
            return
        if overflow:
            self.steps_since_change = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            elif self.scale > self.min_scale:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                logger.warning(
                    "rank %d: gradient overflow with the loss scale at min_loss_scale=%g; "
                    "the step is skipped",
                    rank,
                    self.min_scale,
                )
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        self.steps_since_change += 1
        if self.steps_since_change % self.window == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "steps_since_change": self.steps_since_change,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.steps_since_change = int(state["steps_since_change"])
