"""Weights saved for backward, kept by reference to their gathered buffer instead of holding it.

[Note: saved weights]
Layers save their weights for backward (a linear layer saves a view of its weight), and a saved
view would keep the whole gathered buffer alive from the unit's forward to its backward, so a
released unit would free nothing. In the forward of a module that holds parameters directly
(nn.Linear, a norm, an experts block), run inside engine(...), saved-tensor hooks replace a
saved tensor that lies in a gathered buffer with a reference (bucket, offset, shape, strides);
backward's unpack gathers the unit again if needed and hands out the same view of the new
buffer. Code between those forwards saves as torch does: a custom autograd Function in a
parent's forward that saves a parameter (TRL's fused LM head) gets the Parameter itself back in
backward, with its ds_* attributes, as under DeepSpeed (torch hands back a plain tensor for
anything a hook packed), and may gather it there with zero.GatheredParameters; a gradient that
reaches a parameter whose unit is released gathers the unit first (torch accumulates it in the
parameter's layout, which a placeholder lacks). Inside a checkpointed region the checkpoint's
own hooks apply instead (they save nothing). The scope is open in engine.backward too, so a
reentrant checkpoint's recomputation, whose forward runs inside backward with no hooks of its
own, saves weights by reference as well: a unit released before such a weight is used is
gathered again instead of handing backward a placeholder. (A non-reentrant recomputation saves
through torch's hooks; see [Note: frozen weights in backward] in gatherer.py.) Buffers are
never freed in place, so a view that anyone else keeps stays valid (it just keeps its memory).
"""

import contextlib
from dataclasses import dataclass

import torch

from .units import UnitState


class SavedWeights:
    """ParamGatherer's saved-tensor hooks (mixed into it in gatherer.py, whose __init__ sets the
    state they use: device, units, comm, root, buckets, _gathered_storage, _unit_of_param,
    _hooks, _scopes, _saving; fetch() and release() gather again)."""

    @contextlib.contextmanager
    def saved_weights(self):
        """The scope of engine(...) and engine.backward in which the forwards of modules that
        hold parameters directly save gathered weights by reference: see [Note: saved
        weights]. Hooks the caller installed around engine(...) (save_on_cpu) still handle
        every other saved tensor."""
        outer = _top_saved_hooks()
        outer_pack, outer_unpack = outer or (None, None)

        def pack(tensor):
            saved = self._pack(tensor)
            if saved is not tensor:
                return saved
            if outer_pack is not None:
                return _OuterSaved(outer_pack(tensor))
            # Not the tensor itself: an output saved by its own node would hold that node
            # through its grad_fn, a cycle through C++ the collector never frees (the graph of
            # a forward without backward would stay). Torch saves such outputs without grad_fn.
            return tensor.detach()

        def unpack(saved):
            if isinstance(saved, _OuterSaved):
                return outer_unpack(saved.value)
            return self._unpack(saved)

        self._scopes.append((outer, pack, unpack))
        try:
            yield
        finally:
            self._scopes.pop()

    def _install_saving_hooks(self) -> None:
        """Weights are saved by reference only in the forwards of the modules that hold them;
        a gradient reaching a parameter whose unit is released gathers the unit first."""
        for module in self.root.modules():
            if any(id(p) in self._unit_of_param for p in module.parameters(recurse=False)):
                exit_hook = module.register_forward_hook(self._exit_saving, always_call=True)
                self._hooks += [module.register_forward_pre_hook(self._enter_saving), exit_hook]
        for bucket in self.buckets:
            unit = self.units[bucket.layout.unit]
            for param in bucket.params:
                if param.requires_grad and not unit.persistent:
                    self._hooks.append(param.register_hook(self._gather_for_grad(unit)))

    def _gather_for_grad(self, unit):
        def hook(grad):
            if unit.state is not UnitState.GATHERED:  # every rank runs the same graph
                self.fetch(unit)

        return hook

    @contextlib.contextmanager
    def saving(self):
        """Save gathered weights by reference for the duration, as in the forward of a module
        holding parameters: around a compiled stage-3 block's forward (compiler.py), inside
        which the modules' own hooks are traced and do nothing."""
        self._enter_saving(None, ())
        try:
            yield
        finally:
            self._exit_saving(None, (), None)

    def _enter_saving(self, module, args):
        """Forward pre-hook of a module holding parameters directly: its saves go through the
        scope's hooks, unless hooks of someone else's (a non-reentrant checkpoint's) came on top
        of the scope's, or nothing is recorded for backward. Nothing while torch.compile traces
        (saving() opened them around the compiled block)."""
        if torch.compiler.is_compiling():
            return
        hooks = None
        if self._saving_by_reference():
            _, pack, unpack = self._scopes[-1]
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            hooks.__enter__()
        self._saving.append(hooks)

    def _exit_saving(self, module, args, output):
        if torch.compiler.is_compiling():
            return
        hooks = self._saving.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def _saving_by_reference(self) -> bool:
        """True when a module forward starting now saves gathered weights by reference: inside
        saved_weights() with grad enabled, where the hooks on top are still those the scope
        began with (inside backward that means a reentrant checkpoint's recomputation, whose
        graph a nested backward runs; torch's non-reentrant recomputation saves through its own
        hooks, and its graph never runs), and no module forward of ours has its hooks on."""
        if not self._scopes or not torch.is_grad_enabled():
            return False
        return _same_hooks(_top_saved_hooks(), self._scopes[-1][0])

    def _pack(self, tensor):
        if tensor.layout is not torch.strided or tensor.device != self.device:
            return tensor
        bucket = self._gathered_storage.get(tensor.untyped_storage().data_ptr())
        if bucket is None or tensor.dtype != bucket.param_buffer.dtype:
            return tensor
        offset, shape, stride = tensor.storage_offset(), tensor.shape, tensor.stride()
        return _SavedWeight(bucket, offset, shape, stride, bucket.generation)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedWeight):
            return saved
        bucket = saved.bucket
        if saved.generation != bucket.generation:
            raise self._stale(saved)
        if bucket.param_buffer is None or bucket.pending is not None:
            unit = self.units[bucket.layout.unit]
            if bucket.param_buffer is None and unit.state is not UnitState.SHARDED:
                # Released after its gradients arrived, yet a use without gradient needs it.
                self.release(unit, force=True)
            self.fetch(unit)
        return bucket.param_buffer.as_strided(saved.shape, saved.stride, saved.offset)

    def _stale(self, saved) -> RuntimeError:
        """The error for a weight saved before its shard was written ([Note: stale graphs] in
        stages.py), in torch's words for a plain model, naming the parameter."""
        slots = saved.bucket.layout.slots
        name = next((s.name for s in slots if s.offset <= saved.offset < s.offset + s.numel), "?")
        return RuntimeError(
            f"rank {self.comm.rank}: one of the variables needed for gradient computation has "
            f"been modified by an inplace operation: parameter '{name}' was updated (by "
            "engine.step() or a checkpoint load) after the forward that saved it for this "
            "backward. A loss computed before engine.step() cannot be backpropagated after it, "
            "with retain_graph=True neither (torch refuses it for a plain model too); compute "
            "the loss again after the step"
        )


@dataclass
class _SavedWeight:
    """What backward keeps of a saved tensor that lies in a gathered buffer."""

    bucket: object
    offset: int
    shape: torch.Size
    stride: tuple
    generation: int  # the bucket's generation when saved: a later one means stale values


@dataclass
class _OuterSaved:
    """A saved tensor as the caller's own saved-tensor hooks packed it."""

    value: object


def _top_saved_hooks():
    """The saved-tensor hooks on top of this thread's stack, (pack, unpack) or None. Torch has
    no public reader; the private one is what torch.utils.checkpoint itself reads."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _same_hooks(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] is b[0] and a[1] is b[1]
