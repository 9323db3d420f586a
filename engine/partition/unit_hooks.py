"""The module hooks of stage 3's fetch units: a unit's forward gathers it and its end releases it
(or keeps it for backward), the first gradient at its outputs gathers it for backward, and the
gradients of its inputs say that its backward is over. The outermost forward of any module of
the model runs under UsageGuard (usage_guard.py). [Note: parameter lifecycle] in units.py
tells the whole story.
"""

import torch

from .init import tensors_in
from .units import Unit, UnitState
from .usage_guard import UsageGuard, decoding_loop_synced


class UnitHooks:
    """ParamGatherer's module and gradient hooks (mixed into it in gatherer.py, whose __init__
    sets the state they use: _hooks, _grad_hooks, _guard, _forward_depth, _generation_synced,
    _trace, _kept, _reuse, keeping; fetch() and release() gather and release)."""

    def _install_hooks(self) -> None:
        """Hook the module of every unit but the persistent one (gathered for good): its forward
        gathers the unit and the end of its forward releases it."""
        for unit in self.units:
            if unit.persistent:
                continue
            module = unit.module
            self._hooks.append(
                module.register_forward_pre_hook(self._pre_forward(unit), with_kwargs=True)
            )
            self._hooks.append(
                module.register_forward_hook(self._post_forward(unit), with_kwargs=True)
            )
        # The guard starts before any unit's pre-hook and ends after its release, in the forward
        # of any module that holds parameters (one without any uses none of ours).
        for module in self.root.modules():
            if next(module.parameters(), None) is None:
                continue
            self._hooks.append(module.register_forward_pre_hook(self._enter_guard, prepend=True))
            self._hooks.append(module.register_forward_hook(self._exit_guard, always_call=True))

    def _enter_guard(self, module, args) -> None:
        """A module's forward begins. The outermost one (the root's, whether engine(...) called
        it or the script did: engine.module(...), each step of Hugging Face's generate(); or a
        submodule's called on its own, as generate() calls an encoder) starts UsageGuard, so a
        tied weight used outside its unit's forward is gathered either way ([Note: parameter
        lifecycle] in units.py), and reads whether it runs in a decoding loop ([Note:
        generation] in usage_guard.py)."""
        if "parametrizations" in module._modules:
            self._accept_parametrized(module)
        self._forward_depth += 1
        if self._forward_depth > 1:
            return
        self._guard = UsageGuard(self)
        self._guard.__enter__()
        if self.comm.world_size > 1 and not torch.is_grad_enabled() and not in_backward():
            self._generation_synced = decoding_loop_synced()

    def _exit_guard(self, module, args, output) -> None:
        """The outermost forward ended (or raised): the guard stops. Without a backward to come
        (no grad, or eval mode) the units it pinned are released, and when no earlier forward
        waits for its backward either, the forward ends as engine(...) in eval mode does
        (release_all: [Note: generation] in usage_guard.py)."""
        self._forward_depth -= 1
        if self._forward_depth > 0 or self._guard is None:
            return
        guard, self._guard = self._guard, None
        guard.__exit__(None, None, None)
        self._generation_synced = None
        if (torch.is_grad_enabled() and module.training) or in_backward():
            return
        for unit in self.units:
            if unit.pinned:
                self.release(unit, force=True)
        waiting = self._kept or any(u.calls or u.backward for u in self.units)
        if not waiting:
            self.release_all()

    def _pre_forward(self, unit: Unit):
        def hook(module, args, kwargs):
            if in_backward():  # a recomputation: not part of the forward order
                self.fetch(unit)
                if torch.is_grad_enabled() and self._saving_by_reference():
                    # a reentrant checkpoint's: backward runs through what it builds
                    self._watch_backward(unit, _inputs_requiring_grad(args, kwargs))
                return
            self._trace.append(unit.index)
            self.fetch(unit, "forward")
            if torch.is_grad_enabled():
                inputs = _inputs_requiring_grad(args, kwargs)
                unit.backward = unit.backward or _has_backward(unit, inputs)
                self._watch_backward(unit, inputs)

        return hook

    def _watch_backward(self, unit: Unit, inputs: list) -> None:
        """[Note: end of a unit's backward]
        Once the gradients of a call's inputs are computed, that call's backward is done:
        autograd runs AccumulateGrad nodes before any other ready node, so every gradient the
        call gives the unit's parameters has arrived. When the last call of the micro-batch is
        done the unit is complete: parameters without a gradient (an expert that got no
        tokens on this rank) count as zero, its buckets are reduce-scattered and it is released
        at the same point of backward on every rank, whatever the data routed where. A call
        with a leaf among its inputs (whose AccumulateGrad has the same priority as the
        parameters') cannot tell when the parameters' gradients are in, and a call without
        inputs that require grad has no such point: the unit then completes as its gradients
        arrive or at the end of backward. The leaf's gradient still marks the end of the
        call's backward for its frozen weights ([Note: frozen weights in backward] in
        gatherer.py)."""
        if not inputs:
            unit.untracked = True
            return
        if not (unit.frozen or all(t.grad_fn is not None for t in inputs)):
            unit.untracked = True
        unit.calls += 1
        self._on_grads(inputs, lambda: self._call_done(unit), "all")

    def _on_grads(self, tensors: list, callback, mode: str) -> None:
        """Call callback() in backward once the gradients of `tensors` are computed (mode "all":
        every one backward computes; "any": the first), then remove the hook.

        [Note: graph hooks and the engine's lifetime]
        torch keeps a multi-grad hook on the graph's nodes, and in mode "all" the hook's closure
        holds those nodes: a reference cycle through C++ that the cycle collector frees one
        node per collection, so the graph, and through `callback` this gatherer with every
        bucket and shard, outlived the engine by as many collections as the model has units
        (a leak per zero.initialize / close cycle). Each hook removes itself once it ran, and
        close() removes those of a forward whose backward never came, so a graph the script
        keeps (its last loss) holds nothing of the engine."""
        handle = None

        def run(grads):
            handle.remove()
            callback()

        handle = torch.autograd.graph.register_multi_grad_hook(tensors, run, mode=mode)
        self._grad_hooks.add(handle)

    def close(self) -> None:
        """Remove every hook this gatherer added to the model and to forward graphs
        (Engine.close). Not a collective."""
        for handle in [*self._hooks, *self._grad_hooks]:
            handle.remove()
        self._hooks.clear()
        self._grad_hooks.clear()

    def _call_done(self, unit: Unit) -> None:
        unit.calls -= 1
        if unit.calls or unit.pinned or unit.persistent or unit.holds:
            return
        if unit.untracked:  # the trainable buckets complete as their gradients arrive
            self._release_frozen_when_done(unit)
            return
        if self.on_unit_done is not None:
            self.on_unit_done(unit)
        self.release(unit)

    def _post_forward(self, unit: Unit):
        def hook(module, args, kwargs, output):
            tensors = list(tensors_in(output))
            constant = any(t.is_floating_point() and not t.requires_grad for t in tensors)
            if constant and torch.is_grad_enabled() and not in_backward():
                output = self._keep_in_backward(unit, _inputs_requiring_grad(args, kwargs), output)
                tensors = list(tensors_in(output))
            outputs = [t for t in tensors if t.requires_grad]
            inputs = _inputs_requiring_grad(args, kwargs)
            if outputs and torch.is_grad_enabled() and _has_backward(unit, inputs):
                self._on_grads(outputs, lambda: self.fetch(unit, "backward"), "any")
            if in_backward():  # a recomputation's saved tensors are about to be used
                return output
            if self._keeps(unit):
                self._kept.add(unit.index)
            else:
                self.release(unit)
            return output

        return hook

    def _keeps(self, unit: Unit) -> bool:
        """Whether `unit`, at the end of a forward call, stays gathered for its backward ([Note:
        reuse distance] in gatherer.py)."""
        if not (self.keeping and unit.backward and torch.is_grad_enabled()):
            return False
        return self._reuse.get(unit.index, self.max_reuse_numel) < self.max_reuse_numel

    def _keep_in_backward(self, unit: Unit, inputs: list, output):
        """A floating-point output that does not require grad on this rank (a mixture-of-experts
        block none of whose experts got a token here returns zeros, beside router logits that
        may not reach the loss) would skip the unit's backward all-gather, and the backward of
        the units that computed its inputs, that ranks where it does require grad make. Such
        outputs are returned through an identity that depends on the call's inputs and gives
        them zero gradients, so every rank runs the same units' backward in the same order (the
        values are those without it)."""
        if unit.frozen:
            return output
        anchors = inputs or [torch.zeros((), requires_grad=True)]

        def keep(tensor):
            return tensor if tensor.requires_grad else _KeepInBackward.apply(tensor, *anchors)

        with self._own_ops():
            return _map_floats(output, keep)

    def _accept_parametrized(self, module) -> None:
        """[Note: parametrized parameters]
        torch.nn.utils.parametrize.register_parametrization calls param.set_(param) on the
        parameter it moves into `module.parametrizations` (peft's LoRA on a parameter, such as
        stacked experts' 3-D weights, registers one around every forward of the module). That
        raises the version counter without changing a value, and set_ bypasses torch function
        modes, so the write check (_check_not_modified) is told here instead: when `module`'s
        forward begins, a gathered parameter under a parametrization that still views its
        place in the gathered buffer takes its current version as its gathered value's. A
        set_() to other storage (a right_inverse that computes new values) is not accepted
        and raises at release as any lost write does."""
        with self._own_ops():
            for parametrization in module.parametrizations.values():
                self._accept_versions(parametrization._parameters.values())

    def _accept_versions(self, params) -> None:
        for param in params:
            unit = self.unit_of(param) if param is not None else None
            if unit is None or unit.state is not UnitState.GATHERED:
                continue
            for bucket in unit.buckets:
                for index, (slot, held) in enumerate(zip(bucket.layout.slots, bucket.params)):
                    if held is param and _views_slot(param, bucket, slot):
                        bucket.versions[index] = param._version


class _KeepInBackward(torch.autograd.Function):
    """`tensor`, copied, as a function of `inputs` (tensors that require grad) that gives
    them zero gradients."""

    @staticmethod
    def forward(ctx, tensor, *inputs):
        ctx.specs = [(t.shape, t.dtype, t.device) for t in inputs]
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.specs
        ]
        return None, *zeros


def _has_backward(unit: Unit, inputs: list) -> bool:
    """Whether a call of `unit` with `inputs` (those that require grad) has a backward: a unit
    of frozen parameters only whose inputs need no gradient computes nothing in backward, even
    when its outputs are made to require grad (transformers' enable_input_require_grads marks
    the frozen embeddings' output so under gradient checkpointing and LoRA), so it is neither
    gathered nor prefetched there. (If backward uses such a weight after all, through a tensor
    the module captured, the saved reference gathers it: [Note: saved weights] in
    saved_weights.py.)"""
    return bool(inputs) or not unit.frozen


def _inputs_requiring_grad(args, kwargs) -> list:
    return [t for t in (*tensors_in(args), *tensors_in(kwargs)) if t.requires_grad]


def _map_floats(value, fn):
    """`value` (a tensor, or lists, tuples and dicts of them) with fn applied to every
    floating-point tensor; other containers are returned as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() else value
    if type(value) in (list, tuple):
        return type(value)(_map_floats(v, fn) for v in value)
    if type(value) is dict:
        return {k: _map_floats(v, fn) for k, v in value.items()}
    return value


def _views_slot(param, bucket, slot) -> bool:
    """Whether `param` is exactly its slot's view of the bucket's gathered buffer."""
    buffer = bucket.param_buffer
    return (
        buffer is not None
        and param.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and param.storage_offset() == buffer.storage_offset() + slot.offset
        and param.shape == slot.shape
        and param.is_contiguous()
    )


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
