"""engine/planning/footprint.py: the activation formula against a hand computation and against what
autograd keeps for the example GPT, and the buffer terms against what the engine allocates
(single process: the same bucket and gather code paths as N ranks)."""

import gc
import os
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import zero
from zero import estimator
from zero.footprint import (
    Activations,
    BufferSettings,
    LayoutSummary,
    TransformerShape,
    activation_bytes,
    buffer_bytes,
    peak_bytes,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))


def test_activation_formula_by_hand():
    # s=4, b=2, h=8 (sbh = 64), a=2, V=16, fp32, 2 layers.
    shape = TransformerShape(
        num_layers=2, hidden=8, seq_len=4, micro_batch=2, vocab_size=16, num_heads=2
    )
    layer = 16 * 64 * 4 + (4 + 2) * 8 * 4  # 16 sbh elements + LayerNorm stats and log-sum-exp
    head = 2 * 64 * 4 + 4 * 8 * 16  # ln_f input and output + fp32 log-softmax
    mlp_backward = (5 * 64 + 4 * 8 * 8) * 4  # incoming + 4h-wide gradients, largest weight grad
    assert activation_bytes(shape, 4, checkpointing=False) == Activations(
        kept=2 * layer + head, working=max(2 * 4 * 8 * 16, mlp_backward - head)
    )
    # Checkpointing keeps each layer's input; backward recomputes one layer on top.
    assert activation_bytes(shape, 4, checkpointing=True) == Activations(
        kept=2 * 64 * 4 + head, working=layer + mlp_backward - head
    )


def test_kept_activations_match_autograd():
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, 256, (4, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, tokens)
    shape = TransformerShape(2, 32, 16, 4, 256, 2)
    kept = activation_bytes(shape, 4, checkpointing=False).kept
    # Not counted: the token indices, positions and ln_f statistics (0.3% here).
    assert kept <= sum(saved.values()) <= 1.01 * kept


def _engine(model, stage: int, bucket: int, accumulation: int = 1, reuse: int = 0):
    """reuse: stage3_max_reuse_distance (0: every unit released after its forward)."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": reuse,
        },
    }
    engine, _, _, _ = zero.initialize(model=model, config=config)
    return engine


def _chain(num_layers: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(num_layers)])


def test_stage2_staging_matches_engine():
    # Five buckets of one Linear each: at most two reducing and one filling hold staging.
    engine = _engine(_chain(5), stage=2, bucket=72)
    live = []

    def sample(param):
        live.append(
            sum(b.staging.numel() * 4 for b in engine.optimizer.buckets if b.staging is not None)
        )

    for param in engine.module.parameters():
        param.register_post_accumulate_grad_hook(sample)  # runs after the engine's own hook
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    layout = estimator.model_layout(_chain(5), 1, 2, estimator.Options(bucket_numel=72))
    assert layout.bucket_numels == (72,) * 5
    settings = BufferSettings(stage=2, num_shards=1, compute_bytes=4, reduce_bytes=4)
    assert max(live) == buffer_bytes(layout, settings)["gradient staging"] == 3 * 72 * 4


def test_gradient_buffers_live_from_first_gradient_to_end_of_step():
    # [Note: gradient lifetime]: no gradient buffer survives step(), so the next forward's
    # activations can use the memory; accumulation over micro-batches still works.
    for stage in range(4):
        engine = _engine(_chain(3), stage=stage, bucket=72, accumulation=2)
        buckets = engine.optimizer.buckets
        for step in range(2):
            assert all(b.grad_shard is None and b.accum is None for b in buckets), stage
            engine.backward(engine(torch.randn(2, 8)).square().mean())
            engine.step()  # not the boundary: the gradients stay
            held = [StorageWeakRef(b.grad_shard.untyped_storage()) for b in buckets]
            assert all(not ref.expired() for ref in held), stage  # before the boundary step
            engine.backward(engine(torch.randn(2, 8)).square().mean())
            engine.step()
            gc.collect()
            assert all(ref.expired() for ref in held), (stage, step)


def _gathered_storages(engine) -> list:
    """Weak references to every gathered buffer that a forward of `engine` creates."""
    storages = []

    def record(module, args):  # registered after the engine's pre-hook: the unit is gathered
        for bucket in engine.optimizer.buckets:
            if bucket.param_buffer is not None:
                storages.append(StorageWeakRef(bucket.param_buffer.untyped_storage()))

    for module in engine.module:
        module.register_forward_pre_hook(record)
    return storages


def _engine_grads(engine) -> dict:
    """Parameter name -> the reduced gradient the engine holds (world size 1: whole buckets)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {
        names[id(param)]: bucket.grad_shard[slot.offset : slot.offset + slot.numel].view(slot.shape)
        for bucket in engine.optimizer.buckets
        for slot, param in zip(bucket.layout.slots, bucket.params)
    }


def test_stage3_released_units_free_their_weights_until_backward():
    # Linear layers save a view of their weight for backward; under stage 3 that view must not
    # keep the unit's gathered buffer alive after the unit is released.
    engine = _engine(_chain(3), stage=3, bucket=72)
    storages = _gathered_storages(engine)
    x = torch.randn(2, 8, requires_grad=True)  # as a transformer layer's input: weights saved
    loss = engine(x).square().mean()
    gc.collect()
    assert len(storages) == 3 and all(storage.expired() for storage in storages)
    layout = estimator.model_layout(
        _chain(3), 1, 3, estimator.Options(bucket_numel=72, persistence_threshold=0)
    )
    settings = BufferSettings(
        3, num_shards=1, compute_bytes=4, reduce_bytes=4, prefetch_numel=0, reuse_numel=0
    )
    assert buffer_bytes(layout, settings)["gathered parameters"] == 72 * 4  # one unit at a time
    engine.backward(loss)
    reference = _chain(3)
    reference(x).square().mean().backward()
    grads = _engine_grads(engine)
    for name, param in reference.named_parameters():
        assert torch.equal(grads[name], param.grad), name


class _DetachedUse(torch.nn.Module):
    """A layer that also uses its weight without gradient. Autograd runs later-created nodes
    first, so that product's backward runs after the weight's gradient has arrived and before
    the bias's (its other use was created first)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, h):
        bias = self.linear.bias * 2.0
        return bias + h @ self.linear.weight.detach().T + self.linear(h)


def test_stage3_weight_used_without_gradient_and_second_backward():
    # The detached product needs the weight after its unit was released by the gradients, and
    # retain_graph runs a second backward through the same saved weights.
    def chain():
        torch.manual_seed(0)
        return torch.nn.Sequential(_DetachedUse(), _DetachedUse())

    x = torch.randn(2, 8, requires_grad=True)
    reference = chain()
    reference(x).square().mean().backward()
    engine = _engine(chain(), stage=3, bucket=64, accumulation=2)  # weight, bias apart
    loss = engine(x).square().mean()
    engine.backward(loss, retain_graph=True)  # each backward adds half the gradient
    engine.step()
    engine.backward(loss)
    grads = _engine_grads(engine)
    for name, param in reference.named_parameters():
        assert torch.allclose(grads[name], param.grad, rtol=0, atol=1e-7), name


def test_peak_adds_runtime_and_allocator_to_the_largest_moment():
    layout = LayoutSummary(1000, (500, 500))
    settings = BufferSettings(stage=2, num_shards=2, compute_bytes=2, reduce_bytes=2)
    peak = peak_bytes(10_000, layout, settings, Activations(3000, 1000), runtime=7, allocator=5)
    # Both buckets stage (fewer than three); bf16 reduction receives into 1/N-size buffers.
    assert peak.buffers["gradient staging"] == 1000 * 2
    assert peak.buffers["receive buffers"] == 1000 // 2 * 2
    assert peak.backward == 4000 + 3000 > max(peak.end_of_backward, peak.step)
    assert peak.total == 10_000 + 7 + 5 + 7000


def test_stage3_frozen_units_are_released_during_backward():
    # Frozen layers above a trained one (as when the top of a model is frozen): backward runs
    # through them, and each must be released once its inputs' gradients are computed, not at
    # the end of backward.
    model = _chain(4)
    for layer in model[1:]:
        layer.requires_grad_(False)
    engine = _engine(model, stage=3, bucket=72)
    gathered_frozen = []

    def sample(param):  # the first layer's gradient: every frozen layer's backward is done
        gathered_frozen.append(sum(b.param_buffer is not None for b in engine.frozen.buckets))

    engine.module[0].weight.register_post_accumulate_grad_hook(sample)
    x = torch.randn(2, 8)
    engine.backward(engine(x).square().mean())
    engine.step()
    assert gathered_frozen == [0]


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def test_stage3_recomputation_is_not_recorded_as_forward_order():
    # Recomputations run inside backward; recorded as forward order, they would make the next
    # step's last forward prefetch every checkpointed unit and hold it until backward.
    engine = _engine(_Checkpointed(), stage=3, bucket=72)
    for _ in range(2):
        loss = engine(torch.randn(2, 8)).square().mean()
        assert all(b.param_buffer is None for b in engine.optimizer.buckets)
        engine.backward(loss)
        engine.step()
    assert [engine.gatherer.units[i].name for i in engine.gatherer._order] == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "head",
    ]


def test_stage3_units_within_the_reuse_distance_stay_gathered_until_backward():
    # Three units of 72 elements in a chain: from the second step on (the order is recorded),
    # the last unit (nothing gathered after it) and the middle one (2 x 72 = 144 < 200) stay
    # gathered from their forward to their backward; the first (288) is released.
    engine = _engine(_chain(3), stage=3, bucket=72, reuse=200)
    for step in range(3):
        loss = engine(torch.randn(2, 8, requires_grad=True)).square().mean()
        kept = [b.param_buffer is not None for b in engine.optimizer.buckets]  # last layer first
        assert kept == ([False] * 3 if step == 0 else [True, True, False]), (step, kept)
        engine.backward(loss)
        engine.step()
        assert all(b.param_buffer is None for b in engine.optimizer.buckets)
    layout = estimator.model_layout(
        _chain(3), 1, 3, estimator.Options(bucket_numel=72, persistence_threshold=0)
    )
    settings = BufferSettings(
        3, num_shards=1, compute_bytes=4, reduce_bytes=4, prefetch_numel=0, reuse_numel=200
    )
    assert buffer_bytes(layout, settings)["gathered parameters"] >= 2 * 72 * 4


def test_peak_at_backward_start_has_no_gradient_buffers_without_accumulation():
    # [Note: gradient lifetime]: at gradient_accumulation_steps 1 the gradients (2000 bytes of
    # the 10,000 of model states here) are made during backward, after the activations' peak.
    layout = LayoutSummary(1000, (500, 500))
    acts = Activations(3000, 1000)
    for gas, backward in ((1, 7000 - 2000), (2, 7000)):
        settings = BufferSettings(
            stage=2, num_shards=2, compute_bytes=2, reduce_bytes=2, gradient_accumulation_steps=gas
        )
        peak = peak_bytes(10_000, layout, settings, acts, gradients=2000)
        assert peak.backward == backward, gas
