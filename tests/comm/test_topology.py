"""Node topology (comm/topology.py) and the ledger's intra/inter-node split, in one process.

The multi-rank checks (MiCS's and hpZ's traffic on 2 simulated nodes) are in
tests/partition/test_mics_hpz.py.
"""

import threading

import pytest
import torch
import torch.distributed as dist

from zero.comm import CommLedger, Communicator, inter_node_elements, read_topology
from zero.comm.topology import exchange_nodes


def test_ranks_per_node_from_the_environment(monkeypatch):
    monkeypatch.setenv("ZERO_RANKS_PER_NODE", "2")
    monkeypatch.setenv("GROUP_RANK", "7")  # the explicit variable wins
    topology = read_topology([0, 1, 2, 3, 4], 3)
    assert [topology.node_of(r) for r in range(5)] == [0, 0, 1, 1, 2]
    assert topology.num_nodes == 3 and topology.source == "ZERO_RANKS_PER_NODE=2"
    assert topology.local_count([0, 1, 2, 3], 3) == 2
    assert topology.spans_nodes([1, 2]) and not topology.spans_nodes([2, 3])


@pytest.mark.parametrize("raw", ["0", "two", "-1"])
def test_malformed_ranks_per_node_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("ZERO_RANKS_PER_NODE", raw)
    with pytest.raises(ValueError, match="ZERO_RANKS_PER_NODE"):
        read_topology([0, 1], 0)


def test_without_launcher_variables_one_node(monkeypatch):
    for name in ("ZERO_RANKS_PER_NODE", "GROUP_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    topology = read_topology([0, 1, 2, 3], 0)
    assert topology.num_nodes == 1 and not topology.spans_nodes([0, 3])


def test_nodes_of_different_sizes_are_exchanged_through_the_store():
    # 3 ranks on node "a", 1 on "b": arithmetic on LOCAL_WORLD_SIZE could not tell.
    store = dist.HashStore()
    keys = {0: "a", 1: "a", 2: "b", 3: "a"}
    found = {}

    def rank(r):
        found[r] = exchange_nodes([0, 1, 2, 3], r, keys[r], store)

    threads = [threading.Thread(target=rank, args=(r,)) for r in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert all(found[r] == {0: 0, 1: 0, 2: 1, 3: 0} for r in keys)


def test_inter_node_share_of_a_collective():
    # 2 nodes of 2 ranks, a 100-element buffer (paper units)
    assert inter_node_elements(100, 4, 2) == 50  # over all 4 ranks: half from the other node
    assert inter_node_elements(100, 2, 2) == 0  # within a node
    assert inter_node_elements(100, 2, 1) == 50  # a replica pair on two nodes
    assert inter_node_elements(100, 1, 1) == 0


def test_ledger_splits_by_tier_and_rolls_over_per_step():
    ledger = CommLedger()
    ledger.record("all_gather", 100, 2, inter_elements=50)
    ledger.record("all_reduce", 40, 4, inter_elements=0)
    ledger.end_step()
    gather = ledger.last_step["all_gather"]
    assert (gather.inter_bytes, gather.intra_bytes, gather.intra_elements) == (100, 100, 50)
    assert ledger.tiers() == {
        "intra_bytes": 100 + 160,
        "inter_bytes": 100,
        "intra_elements": 50 + 40,
        "inter_elements": 50,
    }
    assert ledger.current == {}


def test_one_rank_counts_nothing():
    comm = Communicator(None, 0, 1, read_topology([0], 0))
    out = torch.zeros(4)
    comm.all_gather(out, torch.ones(4))
    assert torch.equal(out, torch.ones(4)) and comm.ledger.current == {}
    assert comm.inter_node_elements(100) == 0
