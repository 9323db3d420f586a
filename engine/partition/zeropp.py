"""ZeRO++'s quantized collectives as policies of the partition core: qwZ and qgZ.

[Note: quantized weights (qwZ)]
ZeRO++ (Wang et al., arXiv 2306.10209, section 4.1; DeepSpeed's zero_optimization.
zero_quantized_weights): stage 3's parameter all-gathers send each rank's shard as block-wise
int8 (blocks of 2048 elements, one fp32 scale each) and dequantize on arrival into the compute
dtype (zero.comm.quantized.quantized_all_gather). Only the gathered copy is approximate: the
shards, the fp32 master weights and the optimizer are untouched, so the error does not
accumulate across steps; forward and backward see weights within max|block| / 254 of the
shard's values. Gathers whose result outlives the step stay exact: the persistent unit (small
parameters gathered once per step, replicated in DeepSpeed) and hold() (zero.GatheredParameters,
module.state_dict(): what a script reads, modifies or saves is the real weight).
zero_quantized_nontrainable_weights (DeepSpeed's mixed-precision ZeRO++, for LoRA) quantizes the
gathers of frozen parameters only; DeepSpeed also keeps their shards in memory as int8, which
zero does not (the shard stays in the compute dtype, 2 bytes per element at rest): the
communication is the same, the resident bytes are not.

[Note: quantized gradients (qgZ)]
ZeRO++ section 4.2 (zero_quantized_gradients): a gradient bucket's reduce-scatter becomes two
block-wise int4 all-to-alls, one among the ranks of a node, one among the nodes
(zero.comm.quantized.quantized_reduce_scatter; [Note: qgZ's ordering] there). It serves stage 3
and stage 2 (one reduction path). The groups come from the node topology of the reduction group
(comm/topology.py): the group's ranks must be numbered node by node with the same number of
ranks on every node (zrun and torchrun number them so); on one node the inter-node level is
skipped. Blocks are 2048 elements, or one per chunk when a rank's chunk of the bucket is
smaller (a chunk above 2048 elements is padded to whole blocks). The result replaces the
reduce-scatter's shard: each element is within the bound of
[Note: qgZ's tolerance] of the exact sum. A block holding inf or NaN on any rank reduces to NaN,
so the overflow check of fp16 (and bf16 with check_grad_overflow) still sees it: the step's
global norm is NaN and the step is skipped. On gloo (CPU) the call blocks until the node's and
the nodes' exchanges are done; on NCCL it only orders the CUDA stream.
"""

from dataclasses import dataclass

import torch

from ..comm import Communicator, Handle
from ..comm.quantized import (
    DEFAULT_BLOCK_SIZE,
    hierarchical_rank,
    quantized_all_gather,
    quantized_reduce_scatter,
)

WEIGHT_BITS = 8  # qwZ: int8 (ZeRO++ section 4.1)
GRADIENT_BITS = 4  # qgZ: int4 (ZeRO++ section 4.2)


@dataclass(frozen=True)
class QuantizedWeights:
    """qwZ's policy ([Note: quantized weights (qwZ)]): which buckets' all-gathers are quantized.
    `codec`: zero.ops.quantize (the engine passes it). `trainable`: zero_quantized_weights;
    `frozen`: zero_quantized_weights or zero_quantized_nontrainable_weights."""

    codec: object
    trainable: bool
    frozen: bool
    block_size: int = DEFAULT_BLOCK_SIZE
    bits: int = WEIGHT_BITS

    def applies(self, bucket) -> bool:
        """Whether `bucket` (trainable: it has a master; frozen: none) is gathered quantized."""
        return self.frozen if bucket.master is None else self.trainable

    def all_gather(self, comm: Communicator, output: torch.Tensor, shard: torch.Tensor):
        """Start the quantized all-gather of `shard` (n elements) into `output` (world * n, the
        compute dtype); returns the handle whose wait() dequantizes. Collective over comm."""
        return quantized_all_gather(
            comm, output, shard, self.codec, self.block_size, self.bits, async_op=True
        )


@dataclass(frozen=True)
class QuantizedGradients:
    """qgZ's policy ([Note: quantized gradients (qgZ)]): the node's and the nodes' groups of the
    gradient reduction and the codec (zero.ops.quantize)."""

    intra: Communicator
    inter: Communicator
    codec: object
    block_size: int = DEFAULT_BLOCK_SIZE
    bits: int = GRADIENT_BITS

    def chunk_block_size(self, chunk: int) -> int:
        """The block size for chunks of `chunk` elements: `block_size`, or for a smaller chunk
        the chunk itself (rounded up to even for int4), so a small bucket is not padded to a
        whole block of 2048 elements per rank ([Note: quantized gradients (qgZ)])."""
        return max(2, min(self.block_size, chunk + chunk % 2))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """In place of reduce_scatter(output, input): input (world * n elements) summed over
        the ranks, this rank's n-element chunk into output. Returns a finished Handle (on gloo
        the call blocks; on NCCL the stream is ordered). Collective over both groups."""
        block_size = self.chunk_block_size(output.numel())
        quantized_reduce_scatter(
            self.intra, self.inter, output, input, self.codec, block_size, self.bits
        )
        return Handle()


def quantized_weights(zero_config, codec) -> QuantizedWeights | None:
    """qwZ's policy from zero_optimization's zero_quantized_weights and
    zero_quantized_nontrainable_weights (None when both are off). Not a collective."""
    trainable = zero_config.zero_quantized_weights
    frozen = trainable or zero_config.zero_quantized_nontrainable_weights
    if not frozen:
        return None
    return QuantizedWeights(codec, trainable, frozen)


def check_node_order(comm: Communicator) -> None:
    """qgZ returns chunk inter.rank * L + intra.rank to each rank ([Note: qgZ's ordering] in
    zero.comm.quantized), the reduce-scatter's chunk only when `comm`'s ranks are numbered node
    by node, L on every node. Raises NotImplementedError, naming the rank and the nodes,
    otherwise. Not a collective."""
    ranks = comm.global_ranks()
    topology = comm.topology
    if topology is not None and topology.ranks_per_node(ranks) is None:
        nodes = [topology.node_of(r) for r in ranks]
        raise NotImplementedError(
            f"rank {comm.rank}: zero_optimization.zero_quantized_gradients needs the "
            f"data-parallel ranks numbered node by node with the same number on every node; "
            f"the nodes of ranks {ranks} are {nodes} (from {topology.source}). Start the job "
            "with zrun or torchrun (which number ranks so), give every node the same number of "
            "ranks, "
            "or set zero_quantized_gradients to false."
        )


def quantized_gradients(
    zero_config, comm: Communicator, codec, timeout_s=None
) -> QuantizedGradients | None:
    """qgZ's policy over the gradient reduction's Communicator `comm` (None when
    zero_quantized_gradients is off): its node group and its inter-node group, made with
    Communicator.node_groups (a single rank's group exchanges nothing). Collective over comm's
    ranks (each makes the groups it belongs to). Raises NotImplementedError as
    check_node_order."""
    if not zero_config.zero_quantized_gradients:
        return None
    check_node_order(comm)
    intra, inter = comm.node_groups(timeout_s)
    assert hierarchical_rank(intra, inter) == comm.rank, (comm.rank, intra.rank, inter.rank)
    return QuantizedGradients(intra, inter, codec)
