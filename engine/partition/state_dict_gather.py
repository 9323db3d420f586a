"""Stage 3: module.state_dict() returns full tensors.

Each module of a stage-3 model gets a state_dict pre-hook that holds the fetch units of its
parameters gathered while the call runs, and a post-hook that lets them go (the returned tensors
keep the gathered storage alive). A submodule's call inside its parent's finds them gathered.
`listing()` turns the gathering off while zero itself lists the entries (the streamed 16-bit
state dict reads the shards instead, checkpoint/full_state.py).
"""

import contextlib

from .. import doorway
from .init import guard_load_state_dict


class StateDictGather:
    """The state_dict hooks of one stage-3 engine's model (`gatherer`: its ParamGatherer).
    Registered on every module at construction; Engine.close removes them with the engine's
    other hooks."""

    def __init__(self, model, gatherer, config, comm):
        self.gatherer, self.config, self.comm = gatherer, config, comm
        self._listing = False  # zero lists entries without gathering
        # Under the doorway state_dict() gives DeepSpeed's 0-element placeholders instead of
        # gathering; zero's own saves (own_save()) still gather.
        self._placeholders = doorway.entered()
        self._own_save = False
        self._holds: list[list] = []
        for module in model.modules():
            # torch tags these hooks with attributes, which bound methods cannot take
            module.register_state_dict_pre_hook(lambda *args: self._gather(*args))
            module.register_state_dict_post_hook(lambda *args: self._release(*args))
            guard_load_state_dict(module)

    @contextlib.contextmanager
    def listing(self):
        """Inside, state_dict() lists keys and tensors (0-element placeholders for partitioned
        parameters) without gathering. Not a collective."""
        self._listing = True
        try:
            yield
        finally:
            self._listing = False

    @contextlib.contextmanager
    def own_save(self):
        """Inside, state_dict() gathers under the doorway too (zero's own saves: every rank
        calls them). Not a collective."""
        self._own_save = True
        try:
            yield
        finally:
            self._own_save = False

    def _gather(self, module, prefix, keep_vars) -> None:
        """Hold the units of `module`'s parameters gathered. Collective (every rank must call
        state_dict(), as for DeepSpeed's save_16bit_model) unless they are gathered already, or
        inside an open zero.GatheredParameters, where one rank may call it alone: it gathers
        nothing there and the parameters that context does not hold appear as 0-element
        placeholders (ParamGatherer.state_dict_units); so it is under the doorway, outside
        own_save(), as DeepSpeed's state_dict(). Raises RuntimeError when it would gather
        and zero_optimization.stage3_gather_16bit_weights_on_model_save is false."""
        if self._listing:
            return
        placeholders = self._placeholders and not self._own_save
        units, gathers = self.gatherer.state_dict_units(module.parameters(), placeholders)
        if gathers:
            if not self.config.zero.stage3_gather_16bit_weights_on_model_save:
                raise RuntimeError(
                    f"rank {self.comm.rank}: under ZeRO stage 3 the module's parameters are "
                    "partitioned; set zero_optimization.stage3_gather_16bit_weights_on_model_save "
                    "to true to gather them for state_dict(), call it inside "
                    "zero.GatheredParameters(model.parameters()), or use zero-to-fp32 on a "
                    "checkpoint"
                )
            if self.comm.agreement is not None:  # every rank calls state_dict() alike
                self.comm.agreement.enter("state_dict() (stage 3)", 0)
        self.gatherer.hold(units)
        self._holds.append(units)

    def _release(self, module, state_dict, prefix, local_metadata) -> None:
        # The module goes back to shards (units held by an enclosing zero.GatheredParameters
        # stay gathered).
        if not self._listing:
            self.gatherer.unhold(self._holds.pop())
