"""Weights saved for backward, kept by reference to their gathered buffer instead of holding it.

[Note: saved weights]
Layers save their weights for backward (a linear layer saves a view of its weight), and a saved
view would keep the whole gathered buffer alive from the unit's forward to its backward, so a
released unit would free nothing. During engine(...) saved-tensor hooks replace a saved tensor
that lies in a gathered buffer with a reference (bucket, offset, shape, strides); backward's
unpack gathers the unit again if needed and hands out the same view of the new buffer. Inside a
checkpointed region the checkpoint's own hooks apply instead (they save nothing). The hooks are
active in engine.backward too, so a reentrant checkpoint's recomputation, whose forward runs
inside backward with no hooks of its own, saves weights by reference as well: a unit released
before such a weight is used is gathered again instead of handing backward a placeholder. (A
non-reentrant recomputation saves through torch's hooks; see [Note: frozen weights in
backward] in gatherer.py.) Buffers are never freed in place, so a view that anyone else keeps
stays valid (it just keeps its memory).
"""

from dataclasses import dataclass

import torch

from .units import UnitState


class SavedWeights:
    """ParamGatherer's saved-tensor hooks (mixed into it in gatherer.py, whose __init__ sets the
    state they use: device, units, comm, _gathered_storage; fetch() and release() gather again)."""

    def saved_weights(self):
        """Saved-tensor hooks for engine(...): see [Note: saved weights]. Hooks the caller
        installed around engine(...) (torch.autograd.graph.save_on_cpu) still handle every other
        saved tensor."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
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

        pack.gatherer = self  # see _saving_by_reference
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _saving_by_reference(self) -> bool:
        """True when tensors saved now go through saved_weights()'s hooks. Inside backward that
        means a reentrant checkpoint's recomputation, whose graph a nested backward runs; torch's
        non-reentrant recomputation saves through its own hooks, and its graph never runs."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and getattr(top[0], "gatherer", None) is self

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
