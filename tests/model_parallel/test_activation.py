"""zero.checkpointing: recomputation gives the gradients of the plain model (dropout included)
in every combination of Pa, Pa+cpu and contiguous buffers, at model-parallel size 1 and 2, and
the kept activation bytes shrink as ZeRO-R says (counted from the kept tensors).

One 2-rank group is spawned; model-parallel sizes 1 and 2 and every option are swept inside it.
"""

import itertools
import time

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn

VOCAB, DIM, SEQ, BATCH, LAYERS = 11, 7, 5, 1, 3  # a block input has 35 elements: odd, so Pa pads
P_DROP = 0.2
MODES = ("reentrant", "non_reentrant")


class Block(nn.Module):
    """A tensor-parallel MLP block with dropout on the split hidden units (model-parallel RNG
    state) and on the replicated output (default RNG state)."""

    def __init__(self, mpu):
        from zero.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = ColumnParallelLinear(DIM, 4 * DIM, mpu)
        self.proj = RowParallelLinear(4 * DIM, DIM, mpu)

    def forward(self, x):
        from zero import checkpointing

        h = F.gelu(self.fc(self.norm(x)))
        with checkpointing.get_rng_tracker().fork():
            h = F.dropout(h, P_DROP, self.training)
        return x + F.dropout(self.proj(h), P_DROP, self.training)


class Net(nn.Module):
    def __init__(self, mpu):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(mpu) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x, y, mode="off"):
        from zero import checkpointing

        h = F.dropout(self.embed(x), P_DROP, self.training)
        for block in self.blocks:
            if mode == "off":
                h = block(h)
            elif mode == "reentrant":
                h = checkpointing.checkpoint(block, h)
            else:
                h = checkpointing.non_reentrant_checkpoint(block, h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=g
    )


def train(mpu, mode, options, steps=2):
    """Two forward/backward passes (gradients accumulate); kept-bytes stats after each forward."""
    from zero import checkpointing

    checkpointing.configure(mpu, **options)
    checkpointing.model_parallel_manual_seed(0, mpu)
    model = Net(mpu)
    checkpointing.model_parallel_manual_seed(1, mpu)  # dropout streams, same for every mode
    losses, after_forward, buffers = [], [], []
    for step in range(steps):
        loss = model(*batch(step), mode=mode)
        after_forward.append(checkpointing.memory_stats())
        loss.backward()
        losses.append(loss.item())
        arena = checkpointing._RUNTIME.arena
        buffers.append(None if arena is None else arena.buffer.data_ptr())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {
        "grads": grads,
        "losses": losses,
        "forward": after_forward,
        "backward": checkpointing.memory_stats(),
        "buffers": buffers,
    }


def option_sets():
    for pa, cpu, contiguous in itertools.product((False, True), repeat=3):
        options = {
            "partition_activations": pa,
            "checkpoint_in_cpu": cpu,
            "contiguous_checkpointing": contiguous,
        }
        if contiguous:
            options["num_checkpoints"] = LAYERS
        yield options


def summarize(result, reference):
    diff = max((result["grads"][n] - g).abs().max().item() for n, g in reference["grads"].items())
    return {
        "grad_diff": diff,
        "losses": result["losses"],
        "ref_losses": reference["losses"],
        "forward": result["forward"],
        "backward": result["backward"],
        "buffers": result["buffers"],
    }


def _settled_stats() -> dict:
    """memory_stats() once no checkpoint is live, or after 30 s. A region that ran a collective
    is released when the collective library frees its copy of the thread's saved-tensor hooks,
    on the library's thread, shortly after the graph itself is dropped."""
    from zero import checkpointing

    deadline = time.monotonic() + 30
    while checkpointing.memory_stats()["live_checkpoints"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return checkpointing.memory_stats()


def edge_cases(mpu):
    """Evaluation keeps nothing; a too-small contiguous buffer says so; reset() recovers."""
    from zero import checkpointing

    out = {}
    checkpointing.configure(mpu, partition_activations=True)
    checkpointing.model_parallel_manual_seed(0, mpu)
    model = Net(mpu)
    with torch.no_grad():
        model(*batch(0), mode="reentrant")
    out["eval_stats"] = checkpointing.memory_stats()
    checkpointing.configure(mpu, contiguous_checkpointing=True, num_checkpoints=LAYERS - 1)
    try:
        model(*batch(0), mode="reentrant")
        out["overflow"] = None
    except RuntimeError as err:
        out["overflow"] = str(err)
    checkpointing.reset()
    checkpointing.configure(mpu, contiguous_checkpointing=True, num_checkpoints=LAYERS)
    pending = model(*batch(0), mode="non_reentrant")  # its backward never runs
    out["live_before_reset"] = checkpointing.memory_stats()["live_checkpoints"]
    checkpointing.reset()
    loss = model(*batch(1), mode="non_reentrant")
    out["live_after_reset"] = checkpointing.memory_stats()["live_checkpoints"]
    del pending  # a stale graph dies: it must not count against the new one
    loss.backward()
    out["after_reset"] = checkpointing.memory_stats()
    model(*batch(2), mode="non_reentrant")  # graph dropped at once: its bytes come back
    out["after_dropped_graph"] = _settled_stats()
    # non-reentrant: torch.autograd.grad works and inputs need not require grad
    x = torch.randn(BATCH, SEQ, DIM)
    ref = torch.autograd.grad(model.blocks[0](x).sum(), model.blocks[0].fc.weight)[0]
    got = torch.autograd.grad(
        checkpointing.non_reentrant_checkpoint(model.blocks[0], x).sum(),
        model.blocks[0].fc.weight,
    )[0]
    out["autograd_grad_shape_equal"] = got.shape == ref.shape
    return out


def sweep():
    import zero

    results = {}
    for mp in (1, 2):
        mpu = zero.mpu.initialize_model_parallel(mp)
        reference = train(mpu, "off", {})
        for mode, options in itertools.product(MODES, option_sets()):
            key = (mp, mode, *options.values())
            results[key] = summarize(train(mpu, mode, options), reference)
            results[key]["options"] = options
    results["edge"] = edge_cases(zero.mpu.initialize_model_parallel(2))
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(sweep, 2)


def kept_bytes(mp, partitioned):
    part = -(-SEQ * BATCH * DIM // mp) if partitioned else SEQ * BATCH * DIM
    return LAYERS * part * 4


def test_gradients_match_without_checkpointing(per_rank):
    cases = 0
    for results in per_rank:
        for key, res in results.items():
            if key == "edge":
                continue
            cases += 1
            assert res["grad_diff"] <= 1e-6, key
            assert res["losses"] == pytest.approx(res["ref_losses"], abs=1e-6), key
    assert cases == 2 * 2 * 2 * 8  # ranks x mp sizes x variants x option sets


def test_kept_bytes_shrink_with_pa_and_leave_the_device_with_cpu(per_rank):
    for results in per_rank:
        for key, res in results.items():
            if key == "edge":
                continue
            mp, options = key[0], res["options"]
            pa, cpu = options["partition_activations"], options["checkpoint_in_cpu"]
            expected = kept_bytes(mp, pa)
            for stats in res["forward"]:
                assert stats["live_checkpoints"] == LAYERS, key
                assert stats["host_bytes"] == (expected if cpu else 0), key
                assert stats["device_bytes"] == (0 if cpu else expected), key
            assert res["backward"]["live_checkpoints"] == 0, key
            assert res["backward"]["device_bytes"] == res["backward"]["host_bytes"] == 0, key
    # Pa at mp 2 keeps half (rounded up per tensor) of what mp 1 keeps
    assert kept_bytes(2, True) == LAYERS * 18 * 4 < kept_bytes(1, True)


def test_contiguous_buffer_is_allocated_once(per_rank):
    for results in per_rank:
        for key, res in results.items():
            if key == "edge" or not res["options"]["contiguous_checkpointing"]:
                continue
            mp, pa = key[0], res["options"]["partition_activations"]
            per_checkpoint = -(-kept_bytes(mp, pa) // LAYERS // 64) * 64
            assert res["forward"][0]["contiguous_capacity_bytes"] == LAYERS * per_checkpoint, key
            assert res["buffers"][0] == res["buffers"][1] is not None, key


def test_edge_cases(per_rank):
    for results in per_rank:
        edge = results["edge"]
        assert edge["eval_stats"]["num_forward"] == 0
        assert edge["eval_stats"]["device_bytes"] == 0
        assert "number_checkpoints" in edge["overflow"]
        assert edge["live_before_reset"] == edge["live_after_reset"] == LAYERS
        assert edge["after_reset"]["live_checkpoints"] == 0
        assert edge["after_reset"]["device_bytes"] == 0
        assert edge["after_dropped_graph"]["live_checkpoints"] == 0
        assert edge["autograd_grad_shape_equal"]


# ----- single process ---------------------------------------------------------------------------
def test_configure_needs_num_checkpoints_for_contiguous():
    from zero import checkpointing

    with pytest.raises(ValueError, match="number_checkpoints"):
        checkpointing.configure(None, contiguous_checkpointing=True)


def test_configure_reads_the_config_block_and_overrides():
    from zero import checkpointing

    block = {"partition_activations": True, "cpu_checkpointing": True, "profile": True}
    checkpointing.configure(None, {"activation_checkpointing": block}, checkpoint_in_cpu=False)
    s = checkpointing.settings()
    assert s.partition_activations and s.profile and not s.cpu_checkpointing


def test_initialize_applies_the_config_block():
    import zero
    from zero import checkpointing

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "activation_checkpointing": {
            "partition_activations": True,
            "contiguous_memory_optimization": True,
            "number_checkpoints": 4,
        },
    }
    zero.initialize(model=nn.Linear(3, 3), config=cfg)
    s = checkpointing.settings()
    assert s.partition_activations and s.contiguous_memory_optimization
    assert s.number_checkpoints == 4
    checkpointing.configure(None)  # back to defaults for the rest of this process


def test_rng_tracker_fork_leaves_default_state():
    from zero import checkpointing

    checkpointing.model_parallel_manual_seed(3)
    before = torch.get_rng_state()
    with checkpointing.get_rng_tracker().fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    with checkpointing.get_rng_tracker().fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # the forked stream advances
    checkpointing.get_rng_tracker().reset()
    with pytest.raises(ValueError, match="model_parallel_manual_seed"):
        checkpointing.get_rng_tracker().fork().__enter__()


def test_profile_times_forward_and_recompute():
    from zero import checkpointing

    checkpointing.configure(None, profile=True)
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    checkpointing.checkpoint(layer, x).sum().backward()
    stats = checkpointing.memory_stats()
    assert stats["num_forward"] == stats["num_recompute"] == 1
    assert stats["forward_seconds"] > 0 and stats["recompute_seconds"] > 0
