"""Several stage-3 engines in one process (a trained model beside an EMA or reference copy built
as an inference engine), on 2 ranks in one spawned group:

- zero.GatheredParameters([p, p_ema]) with p from the training engine and p_ema from the
  inference engine, both sharded before, gathers both: inside, each has its full shape and the
  values its own engine holds (before, only the first engine's were gathered and p_ema stayed a
  0-element placeholder);
- an EMA update written under GatheredParameters(..., modifier_rank=0) over both engines'
  parameters reaches the second engine's shards;
- the second engine generates what a plain model with the EMA weights generates.
"""

import copy
import os

import torch
from distributed import run_ranks
from test_generation import _llama  # a tiny Llama, weights far from their init

PROMPTS = ([[5, 6, 7, 8]], [[11, 12, 13]])  # rank r generates PROMPTS[r]
GREEDY = {"do_sample": False, "no_repeat_ngram_size": 1, "max_new_tokens": 4}


def _config(optimizer: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "agreement_timeout": 20,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_module_granularity_threshold": 300,  # several units per model
        },
    }
    if optimizer:
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
    return config


def several_engines():
    import zero

    rank = int(os.environ["RANK"])
    model = _llama()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    ema_model = copy.deepcopy(model).requires_grad_(False)
    engine, _, _, _ = zero.initialize(model=model, config=_config(optimizer=True))
    ema, _, _, _ = zero.initialize(model=ema_model, config=_config(optimizer=False))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()

    name = "model.layers.1.mlp.down_proj.weight"
    p, p_ema = engine.module.get_parameter(name), ema.module.get_parameter(name)
    before = (p.numel(), p_ema.numel())
    with zero.GatheredParameters([p, p_ema]):
        inside = {"p": p.detach().clone(), "p_ema": p_ema.detach().clone()}

    trained, averaged = list(engine.module.parameters()), list(ema.module.parameters())
    with zero.GatheredParameters(trained + averaged, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                for a, t in zip(averaged, trained):
                    a.mul_(0.5).add_(t, alpha=0.5)
    with zero.GatheredParameters(averaged):
        ema_state = {k: v.detach().clone() for k, v in ema.module.named_parameters()}
    with zero.GatheredParameters(trained):
        trained_state = {k: v.detach().clone() for k, v in engine.module.named_parameters()}

    reference = _llama()
    reference.load_state_dict(ema_state, strict=False)
    prompt = torch.tensor(PROMPTS[rank])
    with torch.no_grad():
        want = reference.eval().generate(prompt, **GREEDY)
    ema.eval()
    got = ema.generate(prompt, **GREEDY)
    return {
        "before": before,
        "inside": inside,
        "initial": initial[name],
        "trained": trained_state,
        "ema": ema_state,
        "initial_all": initial,
        "want": want.tolist(),
        "got": got.tolist(),
    }


def test_gathered_parameters_across_engines_and_generation():
    per_rank = run_ranks(several_engines, 2, timeout=180)
    name = "model.layers.1.mlp.down_proj.weight"
    for rank, out in enumerate(per_rank):
        assert out["before"] == (0, 0), out["before"]  # both sharded before the context
        inside = out["inside"]
        assert inside["p_ema"].shape == inside["p"].shape == out["initial"].shape, rank
        assert torch.equal(inside["p_ema"], out["initial"]), rank  # the EMA copy's own values
        assert torch.equal(inside["p"], out["trained"][name]), rank
        assert not torch.equal(inside["p"], out["initial"]), rank  # the step moved it
        for key, value in out["ema"].items():  # the update reached the EMA engine's shards
            want = 0.5 * out["initial_all"][key] + 0.5 * out["trained"][key]
            torch.testing.assert_close(value, want, rtol=0, atol=1e-6, msg=key)
        assert out["got"] == out["want"], (rank, out["got"], out["want"])
        assert len(out["got"][0]) > len(PROMPTS[rank][0]), out["got"]
