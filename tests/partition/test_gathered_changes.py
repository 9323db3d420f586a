"""In-place changes inside zero.GatheredParameters without modifier_rank (issue 42): a change
one rank makes, or every rank makes, is a RuntimeError on every rank at every stage; before, a
one-rank change at fp32 stages 1-2 left half of it in the master weights for good. A block that
only reads, and one with modifier_rank, go on as before.

One group of 2 ranks is spawned; every case runs inside it.
"""

import os

import torch
from distributed import run_ranks

CHANGED = "ranks changed parameters in place inside zero.GatheredParameters without modifier_rank"


def _engine(stage: int, dtype: str):
    import zero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "agreement_timeout": 60,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = zero.initialize(model=model, config=config)
    return engine


def _sweep():

    import zero

    rank, out = int(os.environ["RANK"]), {}
    for stage, dtype in ((0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32")):
        engine = _engine(stage, dtype)
        weight = engine.module[0].weight
        for case in ("rank 0 only", "every rank"):
            try:
                with zero.GatheredParameters(list(engine.module.parameters())), torch.no_grad():
                    if case == "every rank" or rank == 0:
                        weight[0].add_(1.0)
                out[stage, dtype, case] = None
            except RuntimeError as error:
                out[stage, dtype, case] = str(error)
        with zero.GatheredParameters(list(engine.module.parameters())):  # reads only
            before = [p.detach().float().clone() for p in engine.module.parameters()]
        with zero.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
            if rank == 0:
                weight.mul_(2.0)
        with zero.GatheredParameters([weight]):
            out[stage, dtype, "published"] = weight.detach().float().clone()
        out[stage, dtype, "before"] = before[0]
    return out


def test_changes_without_modifier_rank_are_an_error_on_every_rank():
    results = run_ranks(_sweep, 2, timeout=300)
    for rank, out in enumerate(results):
        for stage, dtype in ((0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32")):
            one = out[stage, dtype, "rank 0 only"]
            assert one is not None and f"1 of 2 {CHANGED}" in one, (rank, stage, dtype, one)
            assert f"rank {rank}:" in one
            assert ("this rank changed parameter 0" in one) == (rank == 0), one
            every = out[stage, dtype, "every rank"]
            assert every is not None and f"2 of 2 {CHANGED}" in every, (rank, stage, every)
            # modifier_rank still publishes rank 0's change on every rank.
            published, other = out[stage, dtype, "published"], results[1 - rank]
            assert torch.equal(published, other[stage, dtype, "published"]), (stage, dtype)
