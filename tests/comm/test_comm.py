"""Communicator pieces that need no second rank; on 2-3 ranks, the gloo exchanges, the threads
destroy_process_group leaves, and destroy_process_group when a peer ended without it."""

import os
import threading
import time

import torch

from zero.comm import Communicator, wait_blocks_host


def test_only_nccl_on_cuda_tensors_waits_without_blocking_the_host():
    # Stage 3 never blocks on a gradient reduce-scatter during backward ([Note: two groups at
    # stage 3]); it must know that gloo blocks on CUDA tensors too (two ranks on one GPU).
    assert not wait_blocks_host("nccl", on_cuda=True)
    assert wait_blocks_host("gloo", on_cuda=True)
    assert wait_blocks_host("gloo", on_cuda=False)
    assert wait_blocks_host("nccl", on_cuda=False)


def test_backend_of_a_one_rank_communicator_is_none():
    comm = Communicator(None, 0, 1)
    assert comm.backend == ""
    assert comm.all_reduce(torch.ones(2)).blocks_host


def _exchanges(sizes):
    """On 3 gloo ranks: zero's reduce-scatter and all-gather (point-to-point exchanges, [Note:
    gloo exchanges]) beside torch's own collectives, several in flight at once, in place and
    not, on the default group and on a sibling group."""
    import torch.distributed as dist

    from zero.comm import communicator

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Communicator(None, rank, world)
    # Below _EXCHANGE_MIN_BYTES per peer slice gloo's own collective runs; at and above, the
    # exchange. The sizes tested below are small, so the threshold is lowered for them.
    small = torch.ones(world * 16)
    big = torch.ones(world * communicator._EXCHANGE_MIN_BYTES // 4)
    paths = []
    for full in (small, big):
        handle = comm.reduce_scatter(torch.empty(full.numel() // world), full, async_op=True)
        paths.append(len(handle._work._works) > 1)  # an exchange: a send and a receive per peer
        # [Note: watched reduce-scatters]: done() turns true without anyone waiting (stage 3
        # reaps finished gradient reductions during backward by polling it)
        deadline = time.monotonic() + 30
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.done()
        handle.wait()
    assert paths == [False, True], paths  # gloo's own work, then an exchange
    communicator._EXCHANGE_MIN_BYTES = 0  # the module that reads it, not a copy
    sibling = comm.sibling("test-exchanges")
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(world * n, generator=gen) for n in sizes]
    out = {"reduce_scatter": [], "expected_rs": [], "all_gather": [], "expected_ag": []}
    for group in (comm, sibling):
        handles, outputs = [], []
        for index, full in enumerate(inputs):
            n = full.numel() // world
            in_place = index % 2 == 1
            buffer = full.clone()
            target = buffer[rank * n : (rank + 1) * n] if in_place else torch.empty(n)
            handles.append(group.reduce_scatter(target, buffer, async_op=True))
            outputs.append(target)
        assert all(len(h._work._works) > 1 for h in handles)  # exchanges
        for handle in reversed(handles):  # waited out of order
            handle.wait()
        for target, full in zip(outputs, inputs):
            n = full.numel() // world
            parts = [torch.empty(world * n) for _ in range(world)]
            dist.all_gather(parts, full)
            expected = parts[rank][rank * n : (rank + 1) * n].clone()
            for peer in range(world):
                if peer != rank:
                    expected += parts[peer][rank * n : (rank + 1) * n]
            out["reduce_scatter"].append(target)
            out["expected_rs"].append(expected)
    for index, full in enumerate(inputs):
        n = full.numel() // world
        shard = full[:n].clone()
        gathered = torch.full((world * n,), float("nan"))
        if index % 2 == 1:  # in place: the shard is this rank's slice of the output
            gathered[rank * n : (rank + 1) * n] = shard
            comm.all_gather(gathered, gathered[rank * n : (rank + 1) * n])
        else:
            comm.all_gather(gathered, shard)
        expected = torch.empty(world * n)
        dist.all_gather_into_tensor(expected, shard)
        out["all_gather"].append(gathered)
        out["expected_ag"].append(expected)
    out["threads"] = _threads_after_destroy(sibling)
    return out


def _threads_after_destroy(sibling) -> dict:
    """zero.comm.destroy_process_group() after the collectives above (on the default group, on
    a side group, reduce-scatters waited by the watcher thread): the threads left, and what a
    collective on the destroyed side group raises."""
    import zero.comm

    def names() -> list[str]:
        native = []
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as file:
                native.append(file.read().strip())
        return native + [thread.name for thread in threading.enumerate()]

    before = names()
    zero.comm.destroy_process_group()
    try:
        sibling.reduce_scatter(torch.empty(4), torch.ones(4 * sibling.world_size))
        error = "no error"
    except RuntimeError as raised:
        error = str(raised)
    return {"before": before, "after": names(), "error": error}


def test_gloo_reduce_scatter_and_all_gather_are_exact_exchanges():
    from distributed import run_ranks

    sizes = [1, 7, 1000, 4097]
    for rank, result in enumerate(run_ranks(_exchanges, 3, sizes, timeout=120)):
        for got, expected in zip(result["reduce_scatter"], result["expected_rs"]):
            assert torch.equal(got, expected)  # own slice, then the peers' in rank order
        for got, expected in zip(result["all_gather"], result["expected_ag"]):
            assert torch.equal(got, expected)
        # [Note: threads at exit]: no gloo worker nor watcher is left to free a tensor while
        # the interpreter shuts down (which aborted finished runs)
        threads = result["threads"]
        ours = ("pt_gloo_runloop", "gloo_tcp_loop", "zero-reduce-watcher")
        assert {name for name in threads["before"] if name in ours} == set(ours)
        assert [name for name in threads["after"] if name in ours] == [], threads["after"]
        assert threads["error"].startswith(
            f"rank {rank}: zero's 'test-exchanges' process group over ranks [0, 1, 2] was "
            "destroyed by zero.comm.destroy_process_group()"
        ), threads["error"]


def _one_rank_leaves():
    """Rank 1 ends without destroy_process_group (as a rank that raised does); rank 0, done,
    calls it."""
    import torch.distributed as dist
    from distributed import abandon_group

    import zero.comm

    dist.init_process_group("gloo")
    abandon_group()  # neither rank takes part in run_ranks' closing barrier
    if dist.get_rank() == 1:
        return None
    start = time.monotonic()
    try:
        zero.comm.destroy_process_group()
    except RuntimeError as error:
        return str(error), time.monotonic() - start, dist.is_initialized()
    return "no error", time.monotonic() - start, dist.is_initialized()


def test_destroy_process_group_names_a_rank_that_ended_without_it():
    from distributed import run_ranks

    message, seconds, initialized = run_ranks(_one_rank_leaves, 2, timeout=60)[0]
    assert message.startswith("rank 0: another rank stopped before it reached"), message
    assert "only some ranks called" in message, message
    assert seconds < 30 and not initialized
