"""ZeRO++'s quantized collectives: qwZ's int8 all-gather and qgZ's hierarchical reduce-scatter.

ZeRO++ (Wang et al. 2023, arXiv 2306.10209) cuts stage 3's communication by sending quantized
data: weights are all-gathered as block-wise int8 and dequantized on arrival (qwZ, section 4.1;
DeepSpeed key `zero_quantized_weights`), and gradients are reduced by two all-to-alls of
block-wise int4 values, first among the ranks of a node, then among the nodes, instead of one
reduce-scatter over every rank (qgZ, section 4.2; `zero_quantized_gradients`). The arithmetic is
zero.ops.quantize (compiled for CPU and CUDA, a pure-PyTorch reference elsewhere); this module
moves the quantized bytes through Communicators, so each ledger counts what is really sent.

The arithmetic comes in as an argument, `codec`: an object with zero.ops.quantize's `quantize`
and `dequantize` (the module zero.ops.quantize itself is one). zero.comm sits below the layers
that may use zero.ops (offload and up), so the caller that picks the policy (stage 3) passes it:
    quantized_all_gather(comm, output, shard, zero.ops.quantize)

Both functions are collectives: every rank of the Communicators involved calls them in the same
order with tensors of the same sizes.

[Note: qgZ's ordering]
W = N nodes x L ranks per node. The gradient (M elements, M a multiple of W * block_size) is W
chunks of S = M / W elements; a reduce-scatter over the W ranks gives rank r the sum of chunk r.
Rank r is (node n, local rank l) with r = n * L + l (ranks numbered node by node, as zrun and
torchrun number them); `intra` is the group of node n's ranks with intra.rank = l, `inter` the
group of the ranks with local rank l on every node with inter.rank = n.
1. Quantize the W chunks (blocks never straddle a chunk: S is a multiple of block_size) and
   swizzle them from chunk order (n', l') to (l', n'): row l' holds chunks n' * L + l' for
   n' = 0..N-1, which are the chunks owned by local rank l' on every node.
2. All-to-all in the node: local rank l' receives row l' from every rank of its node.
3. Dequantize and sum the L received rows (in local-rank order): this rank now holds its node's
   sum of chunks n' * L + l for every n', in node order.
4. Quantize those N chunks again; all-to-all among the nodes: node n' receives chunk n' * L + l.
5. Dequantize and sum the N received chunks (in node order): the sum over all W ranks of chunk
   n * L + l = r, the reduce-scatter's shard of rank r.
A level with one rank exchanges nothing and is skipped (no quantization there): on one node
qgZ is an intra-node quantized all-to-all only, with one rank per node an inter-node one only.

[Note: qgZ's tolerance]
Let q = 2^(bits-1) - 1 (7 for int4) and, for an element of the shard, A_k the largest magnitude
in rank k's block of block_size elements containing it. Step 3 is off by at most sum_k A_k / (2q)
over the node's ranks; step 4 quantizes a partial sum whose block maximum is at most
(1 + 1/(2q)) times that node's sum of A_k. So every element of the shard is within
    (2 + 1/(2q)) / (2q) * sum over all W ranks of A_k
of the exact sum (about 0.148 * sum A_k for int4, 0.0079 for int8), plus fp32 rounding
(relative 2^-20 of sum A_k); with one level skipped, half of that. Blocks with inf or NaN give
NaN in every element of that block (an overflow still reaches the loss scaler).

Bytes in the ledgers (Communicator conventions: an all-to-all counts its whole input buffer, this
rank's own slice included; the bytes crossing a link are (L - 1) / L and (N - 1) / N of them),
recorded under "all_gather_q" and "all_to_all_q" with the real bytes and, as elements, the
values they stand for (W * n; M and M / L; the scales add bytes, no elements):
    qwZ all_gather_q, n-element shard:  W * n * bits/8 values + 4 * W * ceil(n / block_size) scales
    qgZ intra all_to_all_q:             M * bits/8 + 4 * M / block_size
    qgZ inter all_to_all_q:             (M / L) * bits/8 + 4 * (M / L) / block_size
against W * n * element_size for a plain all-gather and M * element_size for a reduce-scatter
(M: the padded size when chunks are padded to whole blocks, see quantized_reduce_scatter).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .communicator import Communicator

DEFAULT_BLOCK_SIZE = 2048


class QuantizeCodec(Protocol):
    """What the collectives need of zero.ops.quantize (that module satisfies it): block-wise
    quantize into (values, scales) and dequantize, optionally summing rows."""

    def quantize(self, input, block_size, bits=8, *, values=None, scales=None, use_op=None):
        """(values, scales) of `input`'s rows; see zero.ops.quantize.quantize."""

    def dequantize(
        self, values, scales, numel, block_size, bits=8, *, out=None, dtype=torch.float32,
        reduce=False, use_op=None,
    ):  # fmt: skip
        """values * scales per block (reduce: summed over rows); zero.ops.quantize.dequantize."""


def _num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _value_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else -(-numel // 2)


def _check_format(what: str, rank: int, block_size: int, bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"rank {rank}: {what}: bits={bits!r}; use 8 (int8) or 4 (int4)")
    if not isinstance(block_size, int) or block_size < 1 or (bits == 4 and block_size % 2):
        raise ValueError(
            f"rank {rank}: {what}: block_size={block_size!r}; give a positive number of "
            "elements (even for int4)"
        )


class QuantizedGatherHandle:
    """The pair of `quantized_all_gather(async_op=True)`: `wait()` finishes the two all-gathers
    and dequantizes into the output (idempotent)."""

    def __init__(self, handles, finish):
        self._handles = handles
        self._finish = finish

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def quantized_all_gather(
    comm: Communicator,
    output: torch.Tensor,
    input: torch.Tensor,
    codec: QuantizeCodec,
    block_size: int = DEFAULT_BLOCK_SIZE,
    bits: int = 8,
    async_op: bool = False,
) -> QuantizedGatherHandle:
    """qwZ: all-gather of block-wise quantized shards (ZeRO++ section 4.1).

    input: this rank's shard, n elements, contiguous float32 / bfloat16 / float16. output:
    contiguous, world_size * n elements of any of those dtypes; slice r receives rank r's shard
    after quantize -> all-gather -> dequantize, each element within max|block| / (2 * qmax)
    (qmax 127 for int8) of the original plus fp32 rounding and output-dtype rounding, the
    blocks being block_size elements of each shard (`codec`: zero.ops.quantize, or an object
    with its quantize / dequantize). Two all-gathers go through `comm` (values, then scales:
    see the module docstring for their bytes). With async_op the
    returned handle's wait() finishes them and dequantizes; `input` may then change as soon as
    this returns. A collective over comm's ranks. Raises ValueError for sizes, block_size or
    bits, TypeError for dtypes or layout.
    """
    world, rank, numel = comm.world_size, comm.rank, input.numel()
    _check_format("quantized_all_gather", rank, block_size, bits)
    if output.numel() != world * numel:
        raise ValueError(
            f"rank {comm.rank}: quantized_all_gather needs an output of world_size * "
            f"input.numel() = {world} * {numel} elements, got {output.numel()}"
        )
    if not output.is_contiguous():
        raise TypeError(f"rank {comm.rank}: quantized_all_gather's output must be contiguous")
    values_dtype = torch.int8 if bits == 8 else torch.uint8
    shape = (world, _value_bytes(numel, bits))
    values = torch.empty(shape, dtype=values_dtype, device=input.device)
    scales = torch.empty((world, _num_blocks(numel, block_size)), device=input.device)
    codec.quantize(input.reshape(-1), block_size, bits, values=values[rank], scales=scales[rank])
    handles = [
        comm.all_gather(values.view(-1), values[rank], async_op=True, quantized=world * numel),
        comm.all_gather(scales.view(-1), scales[rank], async_op=True, quantized=0),
    ]

    def finish() -> None:
        codec.dequantize(values, scales, numel, block_size, bits, out=output.view(world, numel))

    handle = QuantizedGatherHandle(handles, finish)
    if not async_op:
        handle.wait()
    return handle


def hierarchical_rank(intra: Communicator, inter: Communicator) -> int:
    """The chunk of the gradient `quantized_reduce_scatter` returns to this rank:
    inter.rank * intra.world_size + intra.rank ([Note: qgZ's ordering]). It equals the rank in
    the reduce-scatter's group when that group numbers ranks node by node. Not a collective."""
    return inter.rank * intra.world_size + intra.rank


def quantized_reduce_scatter(
    intra: Communicator,
    inter: Communicator,
    output: torch.Tensor,
    input: torch.Tensor,
    codec: QuantizeCodec,
    block_size: int = DEFAULT_BLOCK_SIZE,
    bits: int = 4,
) -> None:
    """qgZ: sum `input` over all ranks, this rank receiving its chunk in `output`, by a
    quantized all-to-all in the node and then one among the nodes (ZeRO++ section 4.2).

    intra: the Communicator of this rank's node (L ranks, intra.rank = local rank); inter: of
    the ranks with this local rank on each of the N nodes (inter.rank = node). input: M
    elements, M a multiple of N * L (as the flat layout pads its buckets), contiguous float32 /
    bfloat16 / float16; when S = M / (N * L) is not a multiple of block_size, every chunk is
    copied into a zero-padded one of S' = ceil(S / block_size) * block_size elements first
    (one transient buffer of N * L * S' elements; the ledger then counts M' = N * L * S').
    output: contiguous, S elements of any
    of those dtypes; it receives chunk hierarchical_rank(intra, inter) of the sum, the shard a
    reduce-scatter over the N * L ranks (numbered node by node) returns, within the tolerance
    of [Note: qgZ's tolerance]. bits: 4 (the paper's int4) or 8, at both levels; codec:
    zero.ops.quantize (or an object with its quantize / dequantize). Collective
    over both groups: every rank calls it. Raises ValueError for sizes, block_size or bits,
    TypeError for dtypes or layout.
    """
    nodes, local = inter.world_size, intra.world_size
    world, numel = nodes * local, input.numel()
    _check_format("quantized_reduce_scatter", hierarchical_rank(intra, inter), block_size, bits)
    if numel % world != 0 or output.numel() * world != numel:
        raise ValueError(
            f"rank {hierarchical_rank(intra, inter)}: quantized_reduce_scatter over {nodes} "
            f"node(s) x {local} rank(s) needs input.numel() a multiple of world_size = "
            f"{world} and output.numel() = input.numel() / {world}; got {numel} and "
            f"{output.numel()}: pad the gradient buffer to a multiple of {world} elements"
        )
    if not (input.is_contiguous() and output.is_contiguous()):
        raise TypeError(
            f"rank {hierarchical_rank(intra, inter)}: quantized_reduce_scatter's input and "
            "output must be contiguous; pass .contiguous() tensors"
        )
    chunk = numel // world
    if chunk % block_size:
        # Blocks must not straddle chunks: pad each chunk with zeros to whole blocks.
        padded = -(-chunk // block_size) * block_size
        source = input.new_zeros((world, padded))
        source[:, :chunk].copy_(input.view(world, chunk))
        result = output.new_empty(padded)
        quantized_reduce_scatter(intra, inter, result, source, codec, block_size, bits)
        output.view(-1).copy_(result[:chunk])
        return
    # Steps 1-3: this rank's node's sum of chunks n' * L + l for every node n', node-major.
    partial = _reduce_in_node(intra, codec, input.view(nodes, local, chunk), block_size, bits)
    # Steps 4-5.
    if nodes == 1:
        output.view(-1).copy_(partial.view(-1))
        return
    sent = codec.quantize(partial.view(nodes, chunk), block_size, bits)
    received = _exchange(inter, *sent, nodes * chunk)
    codec.dequantize(*received, chunk, block_size, bits, out=output.view(-1), reduce=True)


def _reduce_in_node(
    intra: Communicator, codec: QuantizeCodec, chunks: torch.Tensor, block_size: int, bits: int
) -> torch.Tensor:
    """Steps 1-3 of [Note: qgZ's ordering]: chunks is the input viewed (N, L, S); returns fp32
    (N, S), the node's sum of chunks (n', this local rank) for every n'."""
    nodes, local, chunk = chunks.shape
    if local == 1:
        return chunks[:, 0].float()
    values, scales = codec.quantize(chunks, block_size, bits)  # (N, L, bytes), (N, L, blocks)
    # Swizzle to (L, N, ...): row l' holds the chunks local rank l' owns on every node. The
    # quantized bytes are moved (1/4 to 1/8 of the gradient's), not the gradient.
    values = values.transpose(0, 1).contiguous()
    scales = scales.transpose(0, 1).contiguous()
    received_values, received_scales = _exchange(intra, values, scales, nodes * local * chunk)
    partial = codec.dequantize(
        received_values.view(local, -1),
        received_scales.view(local, -1),
        nodes * chunk,
        block_size,
        bits,
        reduce=True,
    )
    return partial.view(nodes, chunk)


def _exchange(
    comm: Communicator, values: torch.Tensor, scales: torch.Tensor, elements: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-to-all of rows: row p of values and scales goes to rank p; row p of the results came
    from rank p. Both collectives are in flight together. `elements`: the values the rows stand
    for (the ledger's "all_to_all_q" elements; the scales count bytes only)."""
    received_values, received_scales = torch.empty_like(values), torch.empty_like(scales)
    handles = [
        comm.all_to_all_single(
            received_values.view(-1), values.view(-1), async_op=True, quantized=elements
        ),
        comm.all_to_all_single(
            received_scales.view(-1), scales.view(-1), async_op=True, quantized=0
        ),
    ]
    for handle in handles:
        handle.wait()
    return received_values, received_scales
