"""engine/footprint.py: the activation formula against a hand computation and against what
autograd keeps for the example GPT, and the buffer terms against what the engine allocates
(single process: the same bucket and gather code paths as N ranks)."""

import os
import sys

import torch

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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))


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


def _engine(model, stage: int, bucket: int):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "stage3_param_persistence_threshold": 0,
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


def test_stage3_weights_kept_by_autograd_match_engine():
    # Stage 3 releases each unit after its forward, but the linear layers saved their weights
    # (views of the gathered buffers) for backward: those buffers stay alive until then.
    engine = _engine(_chain(3), stage=3, bucket=72)
    gathered, kept = set(), {}

    def pack(tensor):
        for bucket in engine.optimizer.buckets:
            if bucket.param_buffer is not None:
                gathered.add(bucket.param_buffer.untyped_storage().data_ptr())
        storage = tensor.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    # An input that requires grad (as a transformer layer's does): every layer keeps its weight.
    x = torch.randn(2, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(x).square().mean()
    assert all(b.param_buffer is None for b in engine.optimizer.buckets)  # all released
    layout = estimator.model_layout(
        _chain(3), 1, 3, estimator.Options(bucket_numel=72, persistence_threshold=0)
    )
    settings = BufferSettings(stage=3, num_shards=1, compute_bytes=4, reduce_bytes=4)
    held = sum(nbytes for ptr, nbytes in kept.items() if ptr in gathered)
    assert held == buffer_bytes(layout, settings)["kept by autograd"] == 3 * 72 * 4
    engine.backward(loss)
    engine.step()


def test_peak_adds_runtime_and_allocator_to_the_largest_moment():
    layout = LayoutSummary(1000, (500, 500))
    settings = BufferSettings(stage=2, num_shards=2, compute_bytes=2, reduce_bytes=2)
    peak = peak_bytes(10_000, layout, settings, Activations(3000, 1000), runtime=7, allocator=5)
    # Both buckets stage (fewer than three); bf16 reduction receives into 1/N-size buffers.
    assert peak.buffers["gradient staging"] == 1000 * 2
    assert peak.buffers["receive buffers"] == 1000 // 2 * 2
    assert peak.backward == 4000 + 3000 > max(peak.end_of_backward, peak.step)
    assert peak.total == 10_000 + 7 + 5 + 7000
