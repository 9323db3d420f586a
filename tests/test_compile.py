"""engine.compile(): compiled zero trains as eager zero at every stage, without graph breaks or
recompiles caused by zero (engine/compiler.py, docs/performance.md "Compiling").

One 2-rank group sweeps the cases. Most use the "aot_eager" backend, which runs Dynamo and
AOTAutograd (where graph breaks and recompiles come from) without generating code; one small
case uses inductor. Graphs are counted by a backend that counts its calls before handing each
graph to aot_eager: a recompile is one more call.
"""

import os
import sys

import pytest
import torch
from distributed import full_params, run_ranks

import zero
from zero.config import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))

GAS, STEPS, MICRO, SEQ, VOCAB = 2, 3, 2, 8, 32


class CountingBackend:
    """A torch.compile backend: counts the graphs Dynamo hands it, compiles them with
    aot_eager (or inductor)."""

    def __init__(self, inner: str = "aot_eager"):
        self.inner = inner
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend(self.inner)(graph, example_inputs)


def _gpt(layers=3, checkpointing=False):
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    shape = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=2, n_embd=16)
    shape.activation_checkpointing = checkpointing
    return GPT(shape)


class _Mlp(torch.nn.Module):
    """Two MLP blocks of 144 elements each (the inductor case: few kernels to build)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
            for _ in range(2)
        )

    def forward(self, x, y):
        dtype = self.blocks[0][0].weight.dtype  # the engine's compute dtype
        h = torch.nn.functional.one_hot(x, VOCAB)[..., :8].to(dtype)
        for block in self.blocks:
            h = h + block(h)
        target = torch.nn.functional.one_hot(y, VOCAB)[..., :8].float()
        return torch.nn.functional.mse_loss(h.float(), target)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM._from_config(shape, attn_implementation="sdpa")


def _config(stage, dtype="fp32", offload=False, clip=1.0, unit=3400):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            # stage 3: each transformer block (about 3,300 elements) is a fetch unit
            "stage3_module_granularity_threshold": unit,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def _train(build, config, backend=None, llama=False):
    """Train STEPS optimizer steps of GAS micro-batches; returns (losses, full parameters,
    the backend's graph count before, after the first step and at the end, compiled block
    names, graph breaks)."""
    from torch._dynamo.utils import counters

    counters.clear()
    start = backend.graphs if backend is not None else None
    engine, *_ = zero.initialize(model=build(), config=config)
    if backend is not None:
        engine.compile(backend=backend)
    rank = engine.comm.rank
    g = torch.Generator().manual_seed(1 + rank)
    losses, after_first = [], None
    for step in range(STEPS):
        for _ in range(GAS):
            x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
            y = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
            loss = engine(input_ids=x, labels=y).loss if llama else engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if step == 0 and backend is not None:
            after_first = backend.graphs
    params = {n: p.float() for n, p in full_params(engine).items()}
    names = _compiled_modules(engine)
    breaks = sum(counters["graph_break"].values())
    end = backend.graphs if backend is not None else None
    engine.close()
    return losses, params, (start, after_first, end), names, breaks


def _compiled_modules(engine) -> list[str]:
    """Names of the modules whose forward engine.compile() replaced ("" is the model)."""
    return [n for n, m in engine.module.named_modules() if "forward" in vars(m)]


def _parity(build, config, backend, llama=False):
    """Eager and compiled runs of one case: max |difference| of losses and parameters, and the
    compiled run's new graphs (in its first step and in all), block names and graph breaks.
    Cases sharing `backend` reuse the graphs Dynamo cached for the same code."""
    eager = _train(build, config, llama=llama)
    compiled = _train(build, config, backend, llama=llama)
    start, after_first, end = compiled[2]
    loss_diff = max(abs(a - b) for a, b in zip(eager[0], compiled[0]))
    param_diff = max((eager[1][n] - compiled[1][n]).abs().max().item() for n in eager[1])
    initial = {n: p.detach().float() for n, p in build().named_parameters()}
    return {
        "loss_diff": loss_diff,
        "param_diff": param_diff,
        "moved": max((compiled[1][n] - initial[n]).abs().max().item() for n in eager[1]),
        "first_step_graphs": after_first - start,
        "graphs": end - start,
        "blocks": compiled[3],
        "breaks": compiled[4],
    }


def _api_checks() -> dict:
    """engine.compile()'s refusals, idempotence and is_compiled; a compiled model refused."""
    out = {}
    engine, *_ = zero.initialize(model=_gpt(1), config=_config(2))
    out["before"] = engine.is_compiled
    for key, call in {
        "schedule": lambda: engine.compile(schedule=[(0, ["prefetch"])]),
        "compiled_autograd": lambda: engine.compile(compiled_autograd_enabled=True),
        "bad_kwarg": lambda: engine.compile(compile_kwargs={"fulgraph": True}),
    }.items():
        try:
            call()
        except (NotImplementedError, TypeError) as error:
            out[key] = f"{type(error).__name__}: {error}"
    out["still_not_compiled"] = engine.is_compiled
    engine.compile(backend="aot_eager", compile_kwargs={"backend": "inductor"})
    first = engine.module.forward
    engine.compile(backend="inductor")  # idempotent: nothing changes
    out["idempotent"] = engine.module.forward is first and engine.is_compiled
    engine.close()
    out["restored"] = "forward" not in vars(engine.module)
    # stage 3, every parameter persistent (below stage3_param_persistence_threshold): the
    # model compiles whole
    config = _config(3)
    del config["zero_optimization"]["stage3_param_persistence_threshold"]
    engine, *_ = zero.initialize(model=_gpt(1), config=config)
    engine.compile(backend="aot_eager")
    x = torch.randint(0, VOCAB, (MICRO, SEQ))
    engine.backward(engine(x, x))
    engine.step()
    out["persistent_blocks"] = _compiled_modules(engine)
    engine.close()
    try:
        zero.initialize(model=torch.compile(_gpt(1), backend="aot_eager"), config=_config(2))
    except ValueError as error:
        out["optimized_module"] = str(error)
    return out


def _sweep() -> dict:
    torch.set_num_threads(1)
    results = {"api": _api_checks()}
    for name, build in (("gpt", _gpt), ("llama", _llama)):
        torch._dynamo.reset()
        backend = CountingBackend()  # stages 1-2 may reuse stage 0's graph
        for stage in (0, 1, 2, 3):
            results[(name, stage)] = _parity(build, _config(stage), backend, llama=name == "llama")
    # mixed precision, loss scaling, clipping, CPU offload, activation checkpointing
    backend = CountingBackend()
    results["fp16"] = _parity(_Mlp, _config(1, "fp16", clip=0.05), backend)
    results["bf16_offload"] = _parity(_Mlp, _config(2, "bf16", offload=True), backend)
    checkpointed = _config(3, offload=True)
    results["z3_checkpointing_offload"] = _parity(lambda: _gpt(2, True), checkpointed, backend)
    results["inductor"] = _parity(_Mlp, _config(3, unit=150), CountingBackend("inductor"))
    return results


@pytest.fixture(scope="module")
def sweep():
    return run_ranks(_sweep, 2, timeout=400)


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_matches_eager_without_breaks_or_recompiles(sweep, model, stage):
    for rank in sweep:
        case = rank[(model, stage)]
        assert case["loss_diff"] <= 1e-5 and case["param_diff"] <= 1e-5, case
        assert case["moved"] > 1e-3  # the steps changed the weights
        assert case["breaks"] == 0, case
        # no recompile after the first step
        assert case["graphs"] == case["first_step_graphs"], case
        if stage < 3:  # one graph (stages 1-2 may reuse stage 0's)
            assert case["blocks"] == [""] and case["graphs"] <= 1, case
    assert sweep[0][(model, 0)]["graphs"] == 1
    blocks = sweep[0][(model, 3)]["blocks"]
    if model == "gpt":  # lm_head uses wte's weight: it runs eagerly
        assert blocks == ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "ln_f"]
        # two embeddings, one graph the three blocks share, the final norm
        assert sweep[0][(model, 3)]["graphs"] == 4
    else:
        layers = ["model.layers.0", "model.layers.1"]
        assert blocks == ["model.embed_tokens", *layers, "model.norm", "lm_head"]


@pytest.mark.parametrize(
    "case, tolerance",
    [("fp16", 1e-2), ("bf16_offload", 5e-2), ("z3_checkpointing_offload", 1e-5)],
)
def test_precision_offload_and_checkpointing(sweep, case, tolerance):
    for rank in sweep:
        result = rank[case]
        assert result["loss_diff"] <= tolerance and result["param_diff"] <= tolerance, result
        assert result["graphs"] == result["first_step_graphs"], result


def test_inductor_stage3(sweep):
    for rank in sweep:
        result = rank["inductor"]
        assert result["loss_diff"] <= 1e-5 and result["param_diff"] <= 1e-5, result
        assert result["breaks"] == 0 and result["graphs"] == result["first_step_graphs"]


def test_compile_api(sweep):
    api = sweep[0]["api"]
    assert api["before"] is False and api["still_not_compiled"] is False
    assert (
        api["schedule"].startswith("NotImplementedError") and "without schedule" in api["schedule"]
    )
    assert api["compiled_autograd"].startswith("NotImplementedError")
    assert api["bad_kwarg"].startswith("TypeError") and "fulgraph" in api["bad_kwarg"]
    assert api["idempotent"] is True and api["restored"] is True
    assert api["persistent_blocks"] == [""]
    assert (
        "engine.compile()" in api["optimized_module"]
        and "OptimizedModule" in api["optimized_module"]
    )


def test_compile_block():
    base = {"train_micro_batch_size_per_gpu": 1}
    config = zero.load_config(
        {**base, "compile": {"deepcompile": True, "debug_log": True}}, world_size=1
    )
    assert config.compile.deepcompile and config.compile.keys_without_effect() == ["debug_log"]
    for block, match in [
        ({"offload_parameters": True}, r"compile\.offload_parameters.*offload_param"),
        ({"passes": ["z3", "autosp"]}, r"compile\.passes.*autosp"),
        ({"deepcompil": True}, r"Did you mean 'deepcompile'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            zero.load_config({**base, "compile": block}, world_size=1)
