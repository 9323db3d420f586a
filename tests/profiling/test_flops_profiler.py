"""The FLOPs profiler (zero.profiling.flops_profiler): totals against the transformer formula,
per-module figures, DeepSpeed's report layout and number strings, the config block's report at
profile_step (one process; and on 2 ranks at stage 3, one spawn: full parameter sizes, rank 0
only), the doorway's deepspeed.profiling.flops_profiler, and DeepSpeed's own profiler on the
same model where deepspeed is installed."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from distributed import run_ranks

import zero
from zero.profiling.flops_profiler import (
    FlopsProfiler,
    duration_to_string,
    flop_counter,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples")
sys.path.insert(0, EXAMPLES)
from gpt import GPT, GPTConfig  # noqa: E402

LAYERS, WIDTH, CONTEXT, BATCH, VOCAB = 2, 64, 32, 3, 256


def gpt(n_layer=LAYERS, n_embd=WIDTH, block_size=CONTEXT):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block_size))


def tokens(batch=BATCH, context=CONTEXT):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch, context), generator=generator)


def row(label: str, value: str) -> str:
    """A summary line of DeepSpeed's report: the label in 70 columns, two spaces, the value."""
    return f"{label:<70}  {value}"


def forward_flops(n_layer, d, context, batch, vocab=VOCAB) -> int:
    """One forward of examples/gpt.py's GPT, derived from its shapes.

    Every matrix product of a (rows x k) by a (k x n) matrix costs 2 rows k n FLOPs (one multiply
    and one add per MAC). Per layer the linear maps are qkv (d x 3d), proj (d x d), fc (d x 4d)
    and proj (4d x d): 12 d^2 weights, applied to all batch * context tokens; the lm_head
    (d x vocab) once more. Biases, norms, GELU and softmax are element-wise (not counted).
    Embedding lookups multiply nothing. So the weights give 2 N T with N = 12 L d^2 + d vocab
    the weights used in products and T = batch * context tokens. Attention per layer and
    sequence: scores Q K^T (context x d by d x context) and the weighted sum A V (context x
    context by context x d), 2 context^2 d each, 4 context^2 d together (the full square: the
    causal mask does not change what torch's kernels compute or count).
    """
    weights = 12 * n_layer * d * d + d * vocab
    attention = 4 * n_layer * context**2 * d
    return 2 * weights * batch * context + attention * batch


def test_gpt_forward_matches_the_formula_and_training_is_three_forwards():
    model, idx = gpt(), tokens()
    flops, macs, params = get_model_profile(
        model, args=[idx], print_profile=False, as_string=False, warm_up=0
    )
    expected = forward_flops(LAYERS, WIDTH, CONTEXT, BATCH)
    assert flops == expected and macs * 2 == flops
    assert params == model.num_parameters()  # the tied lm_head counted once
    # Training, counted by torch itself: backward multiplies two matrices per forward product
    # (the gradients of both of its inputs), so the weights cost 2 N T + 4 N T = 6 N T, and
    # attention's two products 3 x 4 L T^2 d; the fused attention kernel's backward also
    # recomputes Q K^T (it keeps no T x T scores): 2 L T^2 d more. Hence training is 3 forwards
    # (the report's "fwd+bwd" factor, DeepSpeed's) plus that recomputation.
    model.train()
    with flop_counter() as counter:
        model(idx, idx).backward()
    weights = 12 * LAYERS * WIDTH**2 + WIDTH * VOCAB
    recompute = 2 * LAYERS * CONTEXT**2 * WIDTH * BATCH
    train = 6 * weights * BATCH * CONTEXT + 12 * LAYERS * CONTEXT**2 * WIDTH * BATCH
    assert train == 3 * expected
    assert counter.get_total_flops() == train + recompute


def test_per_module_figures_and_report(tmp_path):
    model, idx = gpt(), tokens()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(idx)
    model(idx)  # two calls: figures add up
    prof.stop_profile()
    rows = BATCH * CONTEXT
    block = model.blocks[0]
    assert prof.module_flops(block.mlp.fc) == 2 * 2 * rows * WIDTH * 4 * WIDTH
    assert prof.module_macs(model.lm_head) == 2 * rows * WIDTH * VOCAB
    attention = 4 * CONTEXT**2 * WIDTH * BATCH * 2
    own = sum(prof.module_flops(m) for m in (block.attn.qkv, block.attn.proj))
    assert prof.module_flops(block.attn) == own + attention
    assert prof.get_total_flops() == 2 * forward_flops(LAYERS, WIDTH, CONTEXT, BATCH)
    assert prof.module_params(block.mlp) == sum(p.numel() for p in block.mlp.parameters())
    seconds = [prof.module_duration(m) for m in (model, model.blocks, block, block.mlp.fc)]
    assert all(s > 0 for s in seconds) and seconds[0] >= seconds[1] >= seconds[2] >= seconds[3]
    for figure in (prof.module_duration, prof.module_flops):  # a ModuleList is never called:
        assert figure(model.blocks) == sum(figure(b) for b in model.blocks)  # its children's
    out = tmp_path / "sub" / "profile.txt"
    prof.print_model_profile(profile_step=7, module_depth=2, top_modules=2, output_file=str(out))
    text = out.read_text()
    for line in (
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        "Profile Summary at step 7:",
        "params per GPU:  ",
        "fwd MACs per GPU:  ",
        "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:  ",
        "----------------------------- Aggregated Profile per GPU -----------------------------",
        "Top 2 modules in terms of params, MACs or fwd latency at different model depths:",
        "depth 1:",
        "------------------------------ Detailed Profile per GPU ------------------------------",
        f"  (lm_head): Linear({params_to_string(WIDTH * VOCAB)} = ",
        "in_features=64, out_features=256, bias=False)",
    ):
        assert line in text, line
    assert "depth 2:" not in text  # module_depth 2: depths 0 and 1
    assert f"{macs_to_string(prof.get_total_macs())} = 100% MACs" in text
    assert "bwd latency:" not in text  # no engine: forward only
    assert "depth 0:\n    params      - {'GPT': " in text
    prof.end_profile()
    assert prof.get_total_flops() == 0 and not prof.started
    assert not model._forward_hooks and not model.lm_head._forward_pre_hooks


def test_ignored_modules_keep_the_totals():
    model, idx = gpt(), tokens()
    flops, _, _ = get_model_profile(model, args=[idx], print_profile=False, as_string=False)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[torch.nn.Linear])
    model(idx)
    prof.stop_profile()
    assert prof.get_total_flops() == flops and prof.module_flops(model.lm_head) == 0
    assert "in_features=64, out_features=256" in prof.model_profile_text()


def test_strings_are_deepspeeds():
    assert number_to_string(1_234_567_890) == "1.23 G"
    assert number_to_string(0) == "0 "
    assert number_to_string(5e-4) == "500 u"
    assert flops_to_string(2.5e12) == "2.5 TFLOPS"
    assert macs_to_string(7_864_320) == "7.86 MMACs"
    assert params_to_string(1.3e9) == "1.3 B" and params_to_string(36) == "36"
    assert duration_to_string(0.01234) == "12.34 ms"
    assert number_to_string(1234, units="M", precision=3) == "0.001 M"
    flops, macs, params = get_model_profile(torch.nn.Linear(8, 4), input_shape=(2, 8), warm_up=0)
    assert (flops, macs, params) == ("128 ", "64 MACs", "36")
    with pytest.raises(TypeError, match="input_shape must be a non-empty tuple"):
        get_model_profile(torch.nn.Linear(8, 4), input_shape=[2, 8])
    with pytest.raises(ValueError, match="give input_shape, or args"):
        get_model_profile(torch.nn.Linear(8, 4))


CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "steps_per_print": 100,
}


def _train(engine, steps):
    for _ in range(steps * engine.config.gradient_accumulation_steps):
        idx = tokens()
        engine.backward(engine(idx, idx))
        engine.step()


def test_config_block_prints_at_profile_step(tmp_path, capsys, zero_log):
    # zero_log: the "zero" logger gets a handler, so initialize does not bind one to capsys
    out = tmp_path / "profile.txt"
    block = {"enabled": True, "profile_step": 2, "module_depth": -1, "output_file": str(out)}
    engine, _, _, _ = zero.initialize(model=gpt(), config={**CONFIG, "flops_profiler": block})
    _train(engine, 2)
    assert not out.exists()  # steps 0 and 1 are not profiled
    _train(engine, 1)
    text = out.read_text()
    _train(engine, 2)
    assert out.read_text() == text  # once
    assert "Profile Summary at step 3:" in text  # DeepSpeed's label: the steps done by then
    expected = forward_flops(LAYERS, WIDTH, CONTEXT, BATCH)  # one micro-batch
    assert row("fwd flops per GPU: ", number_to_string(expected)) in text
    for line in (
        "world size:  ",
        "batch size per GPU:  ",
        "bwd latency:  ",
        "fwd+bwd FLOPS per GPU = 3 * fwd flops per GPU / (fwd+bwd latency):  ",
        "step latency:  ",
        "samples/second:  ",
        "depth 4:",
    ):
        assert line in text, line
    assert "DeepSpeed Flops Profiler" not in capsys.readouterr().out
    assert engine.flops_profiler is not None and not engine.flops_profiler.started
    assert not any(m._forward_hooks for m in engine.module.modules())
    factor = {"enabled": True, "profile_step": 0, "recompute_fwd_factor": 1.0, "detailed": False}
    engine, _, _, _ = zero.initialize(model=gpt(), config={**CONFIG, "flops_profiler": factor})
    _train(engine, 1)
    text = capsys.readouterr().out
    assert "bwd FLOPS per GPU = 3 * fwd flops per GPU / bwd latency:" in text
    assert "Detailed Profile" not in text


def _stage3_profile(tmp):
    # Each rank names its own file: only rank 0's may appear.
    output = f"{tmp}/rank{os.environ['RANK']}.txt"
    config = {
        **CONFIG,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": output},
    }
    model = gpt()
    full = model.num_parameters()
    engine, _, _, _ = zero.initialize(model=model, config=config)
    _train(engine, 2)
    shards = [p.numel() for p in engine.module.parameters()]
    return full, shards, sorted(os.listdir(tmp))


def test_stage3_counts_full_parameters_on_rank_0_only(tmp_path):
    (full, shards, files), _ = run_ranks(_stage3_profile, 2, str(tmp_path), timeout=180)
    assert set(shards) == {0}  # partitioned between uses
    assert files == ["rank0.txt"]
    text = (tmp_path / "rank0.txt").read_text()
    assert row("params per GPU: ", params_to_string(full)) in text
    assert "data parallel size:  " in text and "GPT(\n  " + params_to_string(full) in text
    assert number_to_string(forward_flops(LAYERS, WIDTH, CONTEXT, BATCH)) in text


def test_doorway_serves_the_profiler():
    code = """
        import json, torch
        from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
        from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler as Same
        import zero.profiling.flops_profiler as own
        flops = get_model_profile(torch.nn.Linear(8, 4), input_shape=(2, 8), as_string=False,
                                  print_profile=False)
        print(json.dumps([FlopsProfiler is Same is own.FlopsProfiler, list(flops)]))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "PYTHONPATH")}
    argv = [sys.executable, "-m", "zero.integrations.doorway_cli", sys.executable, "-c"]
    result = subprocess.run(
        [*argv, textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [True, [128, 64, 36]]


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None
    or "zero" in str(importlib.util.find_spec("deepspeed").origin),
    reason="DeepSpeed is not installed (pip install deepspeed==0.19.8 to compare)",
)
def test_same_model_under_deepspeeds_profiler():
    # DeepSpeed counts every matrix product as torch does, plus one FLOP per element of the
    # element-wise ops (GELU, LayerNorm, softmax, additions), which torch does not count.
    from deepspeed.profiling.flops_profiler import get_model_profile as deepspeeds

    model, idx = gpt(), tokens()
    ours = get_model_profile(model, args=[idx], print_profile=False, as_string=False)
    theirs = deepspeeds(model, args=[idx], print_profile=False, as_string=False)
    assert ours[2] == theirs[2]  # parameters
    assert ours[1] == theirs[1]  # MACs: the products alone, in both
    assert ours[0] <= theirs[0] <= 1.1 * ours[0]
