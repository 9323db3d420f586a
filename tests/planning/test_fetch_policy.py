"""The stage-3 fetch policy ([Note: memory-aware fetch policy] in planning/fetch_policy.py):
what it chooses from a budget, and the headroom it measures under RLIMIT_DATA. The engine's use
of it (units, prefetch and live limits of a real engine) is tested in test_inference_engine.py.
"""

import resource

import torch

from zero.planning.fetch_policy import FetchSettings, _private_bytes, choose, headroom_bytes

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
    chosen = _choose(headroom=2 * 49_000_000 * 4)
    assert (chosen.unit_numel, chosen.max_live_numel) == (500_000_000, 1_000_000_000)
    assert "DeepSpeed's defaults" in chosen.reason


def test_a_budget_below_the_model_sets_every_limit_from_it():
    chosen = _choose(headroom=200 * MIB, pending=40 * MIB)  # budget (200 - 40) / 2 = 80 MiB
    live = 80 * MIB // 4
    assert (chosen.unit_numel, chosen.prefetch_numel, chosen.max_live_numel) == (
        live // 4,
        live // 2,
        live,
    )
    assert chosen.max_reuse_numel == 0
    assert "less 40 MiB of model states" in chosen.reason and "80 MiB" in chosen.reason


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
