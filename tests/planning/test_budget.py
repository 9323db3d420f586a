"""The stage-3 fetch policy ([Note: memory-aware fetch policy] in planning/budget.py):
what it chooses from a budget, and the headroom it measures under RLIMIT_DATA. The engine's use
of it (units, prefetch and live limits of a real engine) is tested in test_inference_engine.py.
"""

import resource

import torch

from zero.planning.budget import (
    GATHERED_FRACTION,
    FetchSettings,
    _private_bytes,
    choose,
    headroom_bytes,
)

DEEPSPEED = FetchSettings(500_000_000, 50_000_000, 1_000_000_000, 1_000_000_000, "")
MIB = 2**20


def _choose(headroom, pending=0, numel=49_000_000, leaf=4_000_000, compute_bytes=4):
    return choose(
        headroom=headroom,
        bound_by="RLIMIT_DATA",
        model_numel=numel,
        largest_leaf_numel=leaf,
        compute_bytes=compute_bytes,
        pending_bytes=pending,
        defaults=DEEPSPEED,
    )


def test_room_for_the_whole_model_keeps_deepspeeds_values():
    chosen = _choose(headroom=int(49_000_000 * 4 / GATHERED_FRACTION))
    assert (chosen.unit_numel, chosen.max_live_numel) == (500_000_000, 1_000_000_000)
    assert "DeepSpeed's defaults" in chosen.reason


def test_a_budget_below_the_model_sets_every_limit_from_it():
    chosen = _choose(headroom=200 * MIB, pending=40 * MIB)
    budget = int(160 * MIB * GATHERED_FRACTION)  # what the model states leave, the fraction of it
    live = budget // 4
    assert (chosen.unit_numel, chosen.prefetch_numel, chosen.max_live_numel) == (
        live // 4,
        live // 2,
        live,
    )
    assert chosen.max_reuse_numel == 0
    assert "less 40 MiB of model states" in chosen.reason
    assert f"{budget // MIB} MiB" in chosen.reason


def test_live_limit_holds_two_of_the_largest_indivisible_module():
    chosen = _choose(headroom=2 * MIB, leaf=3_000_000, compute_bytes=2)
    assert chosen.max_live_numel == 6_000_000


def test_headroom_under_rlimit_data_is_the_limit_less_private_memory():
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_private_bytes() + 100 * MIB, hard))
    try:
        room, what = headroom_bytes(torch.device("cpu"))
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    assert what == "RLIMIT_DATA" and 95 * MIB <= room <= 100 * MIB, (what, room)


def test_buckets_keep_deepspeeds_sizes_while_four_whole_gradients_fit():
    from zero.planning.budget import BucketSettings, choose_buckets

    defaults = BucketSettings(500_000_000, 500_000_000, "")
    kwargs = dict(bound_by="RLIMIT_DATA", model_numel=10_000_000, grad_bytes=4, defaults=defaults)
    roomy = choose_buckets(
        headroom=int(4 * 40_000_000 / GATHERED_FRACTION), pending_bytes=0, **kwargs
    )
    assert (roomy.reduce_numel, roomy.allgather_numel) == (500_000_000, 500_000_000)
    tight = choose_buckets(headroom=100 * MIB, pending_bytes=20 * MIB, **kwargs)
    numel = int(80 * MIB * GATHERED_FRACTION) // (4 * 4)
    assert tight.reduce_numel == tight.allgather_numel == numel
    assert f"buckets of {numel:,} elements" in tight.reason


def test_stage_2_engine_sizes_its_buckets_from_rlimit_data():
    """zero.initialize at stage 2 with reduce_bucket_size unset, measured under a cap that
    leaves no room for four whole gradients: buckets shrink, the model is laid out in several
    and trains; with reduce_bucket_size set, the config's value stays."""
    import zero

    def build(cap=40 * MIB, **zero_optimization):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, **zero_optimization},
        }
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if cap:
            resource.setrlimit(resource.RLIMIT_DATA, (_private_bytes() + cap, hard))
        try:
            engine, *_ = zero.initialize(model=model, config=config)
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        return engine

    build(cap=0).close()  # the imports an initialize makes come before any cap
    engine = build()
    assert engine.bucket_sizes.reduce_numel < 1_050_624  # the model: 4 x 4 MiB do not fit
    assert len(engine.optimizer.buckets) > 1
    engine.backward(engine(torch.ones(2, 512)).square().mean())
    engine.step()
    engine.close()
    engine = build(reduce_bucket_size=10**8)
    assert engine.bucket_sizes.reduce_numel == 10**8 and len(engine.optimizer.buckets) == 1
    engine.close()
