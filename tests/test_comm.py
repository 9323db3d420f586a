"""Communicator pieces that need no second rank."""

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
