"""Tensor parallelism: parallel layers equal slices of plain nn.Linear, and the tensor-parallel GPT
of examples/gpt.py trained by ZeRO stages 0-2 on 2 (model) x 2 (data) ranks matches the plain
GPT trained in one process; with activation checkpointing (Pa + cpu + contiguous) as well.

One 4-rank group is spawned; every case runs inside it.
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))

MP, DP = 2, 2
STEPS, MICRO, SEQ = 3, 2, 8
CLIP = 0.5
# fp32, but the tensor-parallel model sums partial products in another order (all-reduce of
# row-parallel partial sums): parameters agree to rounding, amplified a little by Adam.
PARAM_TOL = 2e-5


def gpt_config(checkpointing=False):
    from gpt import GPTConfig

    return GPTConfig(
        vocab_size=32,
        block_size=SEQ,
        n_layer=2,
        n_head=2,
        n_embd=16,
        dropout=0.0,
        activation_checkpointing=checkpointing,
    )


def batch(step, dp_rank):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randint(0, 32, (MICRO, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def reference():
    """Plain GPT, one process: gradients averaged over the data-parallel ranks, clip, AdamW."""
    from gpt import GPT

    torch.manual_seed(0)
    model = GPT(gpt_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        for dp_rank in range(DP):
            (model(*batch(step, dp_rank)) / DP).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return model, norms


def zero_config(stage, checkpointing):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
    }
    if checkpointing:
        cfg["activation_checkpointing"] = {
            "partition_activations": True,
            "cpu_checkpointing": True,
            "contiguous_memory_optimization": True,
            "number_checkpoints": 2,
        }
    return cfg


def train_parallel(mpu, stage, checkpointing):
    from gpt import GPT

    import zero

    torch.manual_seed(0)
    model = GPT(gpt_config(checkpointing), mpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, _, _, _ = zero.initialize(
        model=model, optimizer=opt, config=zero_config(stage, checkpointing), mpu=mpu
    )
    norms = []
    for step in range(STEPS):
        engine.backward(engine(*batch(step, mpu.get_data_parallel_rank())))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    return engine, norms


def max_diff_to_reference(module, ref):
    """Largest |local - slice of reference| over all parameters of a tensor-parallel model."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    for mod_name, mod in module.named_modules():
        for name, param in mod.named_parameters(recurse=False):
            full = ref_params[f"{mod_name}.{name}" if mod_name else name].detach()
            want = mod.shard_of(name, full) if hasattr(mod, "shard_of") else full
            worst = max(worst, (param.detach() - want).abs().max().item())
    return worst


def layer_checks(mpu):
    """Column -> Row equals the plain pair; gradients equal the slices; stride 3 cuts q|k|v."""
    from zero import tensor_parallel as tp

    torch.manual_seed(1)
    plain_a, plain_b = torch.nn.Linear(6, 12), torch.nn.Linear(12, 6)
    torch.manual_seed(1)
    col = tp.ColumnParallelLinear(6, 12, mpu)
    row = tp.RowParallelLinear(12, 6, mpu)
    torch.manual_seed(1)
    fused = tp.ColumnParallelLinear(6, 12, mpu, stride=3)
    r = mpu.get_model_parallel_rank()
    # rows of q, k and v (4 each) -> this rank's 2 rows of each, in order
    fused_rows = plain_a.weight.view(3, 4, 6)[:, 2 * r : 2 * r + 2].reshape(6, 6)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    want = plain_b(F.gelu(plain_a(x)))
    got = row(F.gelu(col(x)))
    want.square().sum().backward()
    got.square().sum().backward()
    gathered = tp.ColumnParallelLinear(6, 12, mpu, gather_output=True)
    gathered.load_state_dict(plain_a.state_dict())  # full tensors are cut on load
    split_row = tp.RowParallelLinear(12, 6, mpu, input_is_parallel=False)
    split_row.load_state_dict(plain_b.state_dict())
    return {
        "forward": (got - want).abs().max().item(),
        "init_col": (col.weight - col.shard_of("weight", plain_a.weight)).abs().max().item(),
        "grad_col": (col.weight.grad - col.shard_of("weight", plain_a.weight.grad)).abs().max(),
        "grad_row": (row.weight.grad - row.shard_of("weight", plain_b.weight.grad)).abs().max(),
        "grad_row_bias": (row.bias.grad - plain_b.bias.grad).abs().max().item(),
        "gather_split": (split_row(F.gelu(gathered(x))) - want).abs().max().item(),
        "col_shape": tuple(col.weight.shape),
        "fused": (fused.weight - fused_rows).abs().max().item(),
    }


def sweep():
    import zero

    mpu = zero.mpu.initialize_model_parallel(MP)
    out = {"layers": layer_checks(mpu), "dp_rank": mpu.get_data_parallel_rank()}
    ref, ref_norms = reference()
    for stage, checkpointing in ((0, False), (1, False), (2, False), (2, True)):
        mp_calls = mpu.model_parallel.ledger.current.get("all_reduce")
        mp_before = 0 if mp_calls is None else mp_calls.calls
        engine, norms = train_parallel(mpu, stage, checkpointing)
        stats = engine.comm_stats()
        out[(stage, checkpointing)] = {
            "param_diff": max_diff_to_reference(engine.module, ref),
            "norms": norms,
            "ref_norms": ref_norms,
            "reduce_scatter": stats.get("reduce_scatter", {}).get("elements"),
            "local_padded": engine.optimizer.layout.padded_numel,
            "mp_all_reduces": mpu.model_parallel.ledger.current["all_reduce"].calls - mp_before,
            "ckpt": zero.checkpointing.memory_stats(),
        }
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(sweep, MP * DP)


def test_parallel_layers_equal_plain_slices(per_rank):
    for res in per_rank:
        layers = res["layers"]
        assert layers["col_shape"] == (6, 6)
        assert layers["init_col"] == 0.0
        for key in ("forward", "grad_col", "grad_row", "grad_row_bias", "gather_split", "fused"):
            assert float(layers[key]) <= 1e-6, (key, layers)


def test_tensor_parallel_gpt_matches_single_process(per_rank):
    assert [res["dp_rank"] for res in per_rank] == [0, 0, 1, 1]
    for res in per_rank:
        for case, got in res.items():
            if not isinstance(case, tuple):
                continue
            stage, checkpointing = case
            assert got["param_diff"] <= PARAM_TOL, (case, got["param_diff"])
            for norm, want in zip(got["norms"], got["ref_norms"]):
                assert norm == pytest.approx(want, rel=1e-5), case
            # ZeRO shards over the data-parallel group only: 1 x the local (sliced) model
            if stage > 0:
                assert got["reduce_scatter"] == got["local_padded"], case
            assert got["mp_all_reduces"] > 0, case
            if checkpointing:
                assert got["ckpt"]["num_recompute"] == 2 * STEPS, case
                assert got["ckpt"]["peak_device_bytes"] == 0, case
                # Pa: each rank keeps half of a (MICRO, SEQ, 16) fp32 input per block
                assert got["ckpt"]["peak_host_bytes"] == 2 * MICRO * SEQ * 16 * 4 // MP, case
