"""ZeRO++'s quantized collectives (zero.comm.quantized) on 4 gloo ranks as 2 nodes x 2 ranks.

One spawned group sweeps every case: Communicator.all_to_all_single (on a torch group and on
zero's own group) exact, with its ledger count; qwZ's quantized all-gather against the plain
all-gather within max|block| / 254 per element, and its ledger bytes (1 byte per element + 4 per
block); qgZ's hierarchical reduce-scatter against the plain reduce-scatter within the bound of
[Note: qgZ's tolerance], and its ledger bytes (bits/8 per element + 4 per block at each level),
also on one node and with one rank per node; NaN from an overflowing rank reaching its block.
"""

import math
import warnings

import pytest
import torch

from zero.ops import quantize as codec

pytestmark = pytest.mark.timeout(300)

NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL


def _groups(rank):
    """The world Communicator and this rank's intra-node and inter-node ones (ranks numbered
    node by node: rank = node * LOCAL + local)."""
    import torch.distributed as dist

    from zero.comm import Communicator

    node, local = divmod(rank, LOCAL)
    intra = inter = None
    for n in range(NODES):  # every rank creates every group, in the same order
        group = dist.new_group([n * LOCAL + i for i in range(LOCAL)])
        if n == node:
            intra = Communicator(group, local, LOCAL)
    for i in range(LOCAL):
        group = dist.new_group([n * LOCAL + i for n in range(NODES)])
        if i == local:
            inter = Communicator(group, node, NODES)
    return Communicator(None, rank, WORLD), intra, inter


def _bytes(comm, op):
    totals = comm.ledger.current.get(op)
    return 0 if totals is None else totals.bytes


def _check_all_to_all(world):
    rank = world.rank
    for comm in (world, world.sibling("test-all-to-all")):  # torch's group, zero's OwnGroup
        before = _bytes(comm, "all_to_all")
        sent = torch.arange(WORLD * 3, dtype=torch.int32) + 100 * rank
        received = torch.empty_like(sent)
        comm.all_to_all_single(received, sent, async_op=True).wait()
        expected = torch.cat([torch.arange(3) + 3 * rank + 100 * p for p in range(WORLD)])
        assert torch.equal(received, expected.to(torch.int32))
        comm.all_to_all_single(received, sent)  # synchronous
        assert torch.equal(received, expected.to(torch.int32))
        assert _bytes(comm, "all_to_all") - before == 2 * sent.numel() * 4


def _block_amax(x, block_size):
    """Per element: max |x| over its block of block_size (rows = last dimension)."""
    numel = x.shape[-1]
    blocks = math.ceil(numel / block_size)
    padded = torch.nn.functional.pad(x.abs().float(), (0, blocks * block_size - numel))
    amax = padded.view(-1, blocks, block_size).amax(-1, keepdim=True)
    return amax.expand(-1, blocks, block_size).reshape(x.shape[:-1] + (-1,))[..., :numel]


def _check_all_gather(world):
    from zero.comm.quantized import quantized_all_gather

    rank = world.rank
    for numel, block_size, dtype, bits in [
        (1001, 64, torch.float32, 8),
        (4096, 256, torch.bfloat16, 8),
        (37, 8, torch.float16, 4),
    ]:
        gen = torch.Generator().manual_seed(rank)
        shard = (torch.randn(numel, generator=gen) * 10 ** (rank - 1)).to(dtype)
        exact = torch.empty(WORLD * numel, dtype=dtype)
        world.all_gather(exact, shard)
        before = _bytes(world, "all_gather_q")
        out = torch.empty(WORLD * numel)
        handle = quantized_all_gather(world, out, shard, codec, block_size, bits, async_op=True)
        shard.zero_()  # the shard may change once the call returns
        handle.wait()
        blocks = math.ceil(numel / block_size)
        values = numel if bits == 8 else math.ceil(numel / 2)
        assert _bytes(world, "all_gather_q") - before == WORLD * (values + 4 * blocks)
        amax = _block_amax(exact.view(WORLD, numel), block_size).reshape(-1)
        bound = amax / (2 * (2 ** (bits - 1) - 1)) + amax * 2.0**-21
        error = (out - exact.float()).abs()
        assert bool((error <= bound).all()), (numel, dtype, (error - bound).max())
        # A bf16 output: the fp32 result rounded once more.
        out16 = torch.empty(WORLD * numel, dtype=torch.bfloat16)
        quantized_all_gather(world, out16, exact.view(WORLD, numel)[rank], codec, block_size, bits)
        assert torch.equal(out16, out.to(torch.bfloat16))


def _check_reduce_scatter(world, intra, inter):
    from zero.comm import Communicator
    from zero.comm.quantized import hierarchical_rank, quantized_reduce_scatter

    rank = world.rank
    alone = Communicator(None, 0, 1)
    assert hierarchical_rank(intra, inter) == rank
    # (intra, inter, nodes, local): 2 x 2; one node of 4; 4 nodes of one rank.
    layouts = [(intra, inter, NODES, LOCAL), (world, alone, 1, WORLD), (alone, world, WORLD, 1)]
    for (a, b, nodes, local), bits, block_size in [
        (layouts[0], 4, 32),
        (layouts[0], 8, 64),
        (layouts[1], 4, 32),
        (layouts[2], 4, 32),
    ]:
        numel = WORLD * block_size * 3
        gen = torch.Generator().manual_seed(10 + rank)
        # Magnitudes differ by rank and by block, as gradients of different layers do.
        magnitude = torch.exp(torch.randn(numel // block_size, generator=gen) * 2 + rank)
        grad = torch.randn(numel, generator=gen) * magnitude.repeat_interleave(block_size)
        expected = torch.empty(numel // WORLD)
        world.reduce_scatter(expected, grad.clone())
        ledgers = {id(c): (c, _bytes(c, "all_to_all_q")) for c in (a, b)}
        out = torch.empty(numel // WORLD)
        quantized_reduce_scatter(a, b, out, grad, codec, block_size, bits)
        # [Note: qgZ's tolerance]: (2 + 1/(2q)) / (2q) * sum over ranks of each block's max.
        everyone = torch.empty(WORLD, numel)
        world.all_gather(everyone.view(-1), grad)
        amax = _block_amax(everyone, block_size).sum(0)
        amax = amax[rank * out.numel() : (rank + 1) * out.numel()]
        qmax = 2 ** (bits - 1) - 1
        levels = 2 if nodes > 1 and local > 1 else 1
        bound = amax * ((levels + 1 / (2 * qmax)) / (2 * qmax) + 2.0**-20)
        error = (out - expected).abs()
        assert bool((error <= bound).all()), (nodes, local, bits, (error - bound).max())
        assert error.max() > 0  # quantized: not the exact sum
        per_element = bits / 8 + 4 / block_size
        if local > 1:
            assert _bytes(a, "all_to_all_q") - ledgers[id(a)][1] == numel * per_element
        if nodes > 1:
            assert _bytes(b, "all_to_all_q") - ledgers[id(b)][1] == numel // local * per_element
    # An overflow on one rank reaches every element of its block, on the rank that owns it.
    grad = torch.ones(WORLD * 64)
    if rank == 3:
        grad[5] = float("inf")
    out = torch.empty(64)
    quantized_reduce_scatter(intra, inter, out, grad, codec, 32, 4)
    nan = out.isnan()
    assert bool(nan[:32].all()) if rank == 0 else not nan.any()
    assert not nan[32:].any()


def _sweep(op_built):
    import torch.distributed as dist

    from zero.ops.quantize import uses_op

    assert uses_op("cpu") == op_built  # the parent's build is found in the cache
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world, intra, inter = _groups(rank)
    _check_all_to_all(world)
    _check_all_gather(world)
    _check_reduce_scatter(world, intra, inter)
    return rank


def test_quantized_collectives_on_two_simulated_nodes():
    from distributed import run_ranks

    from zero.ops.builder import get_builder

    # Build (or load) the op once here, so the ranks find it in the cache; where it cannot be
    # built they run the reference, with the same results.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        op_built = get_builder("quantize").load_or_fallback() is not None
    assert run_ranks(_sweep, WORLD, op_built, timeout=180) == list(range(WORLD))


def test_one_rank_takes_the_same_path_without_counting():
    from zero.comm import Communicator
    from zero.comm.quantized import quantized_all_gather, quantized_reduce_scatter

    alone = Communicator(None, 0, 1)
    sent = torch.arange(6, dtype=torch.int32)
    received = torch.empty_like(sent)
    alone.all_to_all_single(received, sent)
    assert torch.equal(received, sent)
    shard = torch.randn(100)
    out = torch.empty(100)
    quantized_all_gather(alone, out, shard, codec, 32)  # quantized even here: the same numerics
    assert 0 < (out - shard).abs().max() <= shard.abs().max() / 254 * (1 + 2.0**-20)
    grad = torch.randn(64)
    quantized_reduce_scatter(alone, alone, out[:64], grad, codec, 32)  # no level to exchange over
    assert torch.equal(out[:64], grad)
    assert alone.ledger.current == {}
    # Chunks that are not whole blocks are padded to whole blocks (zeros), not refused.
    quantized_reduce_scatter(alone, alone, out[:50], grad[:50], codec, 32)
    assert torch.equal(out[:50], grad[:50])
    with pytest.raises(ValueError, match="multiple of world_size"):
        quantized_reduce_scatter(alone, alone, out[:40], grad[:50], codec, 32)
