"""Predicted per-rank memory beyond model states: zero's buffers, a dense transformer's
activations, and the peak of one training step (used by zero-estimate, estimator.py).

All sizes are bytes per rank unless a name says elements. Model states (parameters, fp32
gradients, master weights, optimizer state) are memory.py's; nothing here repeats them.

[Note: activation formula]
For the pre-norm GPT of examples/gpt.py (fused qkv, causal attention with a fused kernel that keeps
no s x s scores, a 4h GELU MLP, dropout 0, lm_head over the vocabulary, loss in fp32), with
s = sequence length, b = micro-batch, h = hidden size, a = heads, V = vocabulary, L = layers and
c = bytes of the compute dtype, autograd keeps per layer

    16 s b h elements in the compute dtype: ln_1 input and output (2), q, k and v (3), attention
        output (1), ln_2 input and output (2), fc output = GELU input (4), GELU output (4);
    (4 + a) s b fp32 elements: LayerNorm mean and 1/std (2 norms x 2), attention log-sum-exp;

and for the head 2 s b h elements (ln_f input and output) plus the fp32 log-softmax of the
logits, 4 s b V bytes. With activation checkpointing a layer keeps only its input, s b h
elements, and backward recomputes one layer at a time, so one layer's full set is alive on top.

Backward adds a working set to what forward kept: at its start the loss gradient and the logits
gradient (2 x 4 s b V bytes) while the log-softmax output is still kept; later, in the last
layer's MLP, the incoming gradient (s b h), the gradient of the 4h-wide activation (4 s b h) and
the largest weight gradient (4 h^2), by then without the head's kept tensors. The peak is what
forward kept plus the larger of the two. The logits themselves (c s b V) live only between the
lm_head and the log-softmax, which the first term covers. Each dropout with p > 0 would add a
mask of s b h bytes (not counted).

[Note: buffers]
What zero allocates on top of model states (docs/memory.md), with P = padded Psi, N = shards:
- stage 2 (and 3) gradient staging: a bucket's full gradient in the reduce dtype, from its first
  gradient until its reduce-scatter is waited for; at most MAX_BUCKETS_IN_FLIGHT launched buckets
  plus one filling, so the (MAX_BUCKETS_IN_FLIGHT + 1) largest buckets. Receive buffers (1/N of a
  bucket each) exist when reducing in a dtype other than the accumulation dtype
  [data_types.grad_accum_dtype] or after the first micro-batch. Stages 0 and 1 accumulate into
  their accumulation buffer, a model state: nothing extra.
- stage 3 gathered parameters: the persistent unit always; during forward and backward the unit
  in use plus up to stage3_prefetch_bucket_size elements prefetched, never more than the model.
  The weights layers save for backward do not keep released units alive (engine/partition/
  saved_weights.py, [Note: saved weights]).
- gloo (CPU) copies the whole buffer of a reduce-scatter or all-gather while it runs; NCCL works
  in place.
- the optimizer step: Adam's update makes temporaries of the shard's size (torch's per-tensor
  loop on CPU: two of one bucket's shard; foreach on CUDA: one of all shards). With 2-byte
  gradient accumulation, the fp32 copy of every owned gradient shard (4 Psi / N bytes) exists
  from the start of the step to its end.

[Note: peak]
The step's peak is the largest of three moments: the start of backward (activations + working
set + buffers; the gradient buffers do not exist yet at gradient_accumulation_steps 1), the end
of backward (buffers and the last reductions in flight, activations
gone) and the optimizer step (temporaries, then the parameter all-gather). On top of it: the
runtime (memory that is not tensors: a CUDA context, or on CPU the kernels' and autograd's
workspaces; measure it once with a tiny model) and the allocator's retention.

[Note: CPU ranks]
On a CPU rank the tensors live in glibc's heap. After the first frees, glibc serves every block
up to 32 MiB from the heap (its dynamic mmap threshold) and keeps freed heap memory resident for
reuse, fragmented among live blocks, so the resident set exceeds the live tensors. Measured with
benchmarks/estimate_vs_rss.py (GPT sizes 128x4 to 384x12, stages 0-3, with and without
activation checkpointing; torch 2.13, glibc 2.36), the excess at the peak is 0.33-0.89 of the
activation bytes one step allocates (every layer's full set, checkpointed or not: recomputation
allocates it again), about GLIBC_RETENTION = 0.5 of them on average; it varies from run to run
with the order in which threads free blocks. Fixing glibc's mmap threshold makes the excess
vanish but slows a step 3.6-6.5x (every block is mapped and faulted in anew), so zero leaves the
allocator alone and the estimate counts the retention. The CUDA caching allocator's fragmentation
is what the fit check's headroom is for.
"""

from dataclasses import dataclass

from ..partition.stages import MAX_BUCKETS_IN_FLIGHT

GLIBC_RETENTION = 0.5  # CPU ranks: resident heap beyond live tensors / activation bytes
BUFFERS = (
    "gradient staging",
    "receive buffers",
    "gathered parameters",
    "collective copies",
)


@dataclass(frozen=True)
class TransformerShape:
    """A dense GPT-style decoder and one micro-batch per rank (see [Note: activation formula]).

    num_layers: L; hidden: h; seq_len: s (tokens); micro_batch: b (sequences per rank per
    forward); vocab_size: V; num_heads: a. Raises ValueError for a non-positive size.
    """

    num_layers: int
    hidden: int
    seq_len: int
    micro_batch: int
    vocab_size: int
    num_heads: int = 1

    def __post_init__(self):
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"TransformerShape.{name}={value} must be positive")


@dataclass(frozen=True)
class Activations:
    """Activation bytes per rank: `kept` from forward until backward, `working` on top during
    backward; the peak is their sum."""

    kept: int
    working: int

    @property
    def peak(self) -> int:
        return self.kept + self.working


def activation_bytes(
    shape: TransformerShape, compute_bytes: int, checkpointing: bool
) -> Activations:
    """Activations of one micro-batch ([Note: activation formula]); compute_bytes is c."""
    s, b, h, v = shape.seq_len, shape.micro_batch, shape.hidden, shape.vocab_size
    sbh = s * b * h
    layer = 16 * sbh * compute_bytes + (4 + shape.num_heads) * s * b * 4
    head = 2 * sbh * compute_bytes + 4 * s * b * v
    if checkpointing:
        kept = shape.num_layers * sbh * compute_bytes + head
        recompute = layer
    else:
        kept = shape.num_layers * layer + head
        recompute = 0
    head_phase = 2 * 4 * s * b * v
    layer_phase = recompute + (5 * sbh + 4 * h * h) * compute_bytes - head
    return Activations(kept, max(head_phase, layer_phase))


@dataclass(frozen=True)
class LayoutSummary:
    """What the buffer terms need from a flat layout, in elements (padded).

    padded_numel: P. bucket_numels: every bucket, largest first. persistent_numel and
    unit_numels (largest first): stage 3's persistent unit and its other fetch units.
    """

    padded_numel: int
    bucket_numels: tuple[int, ...]
    persistent_numel: int = 0
    unit_numels: tuple[int, ...] = ()


@dataclass(frozen=True)
class BufferSettings:
    """The config keys the buffers depend on (DeepSpeed names in brackets); sizes in elements.

    compute_bytes, reduce_bytes: bytes per element of the compute dtype and of the gradient
    reduction [communication_data_type]. num_shards: N. gradient_accumulation_steps [same].
    allgather_numel [zero_optimization.allgather_bucket_size]. prefetch_numel
    [stage3_prefetch_bucket_size]. gloo: the backend copies collective buffers (CPU runs).
    accum_bytes: bytes per gradient element kept [data_types.grad_accum_dtype]: 4 or 2.
    reuse_numel [stage3_max_reuse_distance].
    """

    stage: int
    num_shards: int
    compute_bytes: int = 2
    reduce_bytes: int = 2
    gradient_accumulation_steps: int = 1
    allgather_numel: int = 500_000_000
    prefetch_numel: int = 50_000_000
    gloo: bool = False
    accum_bytes: int = 4
    reuse_numel: int = 1_000_000_000


def buffer_bytes(layout: LayoutSummary, settings: BufferSettings) -> dict[str, int]:
    """Bytes of each buffer of [Note: buffers] (keys: BUFFERS) at the start of backward, where
    the activations peak. Stages 0 and 1 have none."""
    st = settings
    in_flight = layout.bucket_numels[: MAX_BUCKETS_IN_FLIGHT + 1]
    terms = dict.fromkeys(BUFFERS, 0)
    if st.stage < 2:
        return terms
    terms["gradient staging"] = sum(in_flight) * st.reduce_bytes
    if st.reduce_bytes != st.accum_bytes or st.gradient_accumulation_steps > 1:
        terms["receive buffers"] = sum(in_flight) // st.num_shards * st.reduce_bytes
    if st.gloo:
        # The bucket still filling is not reducing yet: at most the others are in flight.
        launched = in_flight[: min(MAX_BUCKETS_IN_FLIGHT, len(layout.bucket_numels) - 1)]
        terms["collective copies"] = sum(launched) * st.reduce_bytes
    if st.stage == 3:
        sharded = layout.padded_numel - layout.persistent_numel
        largest = layout.unit_numels[0] if layout.unit_numels else 0
        # The units kept from their forward into backward ([Note: reuse distance] in
        # partition/gatherer.py): those with fewer than reuse_numel elements gathered after them,
        # twice the units that follow them in forward, so at most reuse_numel / 2 plus one unit.
        kept = st.reuse_numel // 2 + largest if st.reuse_numel > 0 else 0
        window = min(sharded, largest + st.prefetch_numel + kept)
        terms["gathered parameters"] = (layout.persistent_numel + window) * st.compute_bytes
    return terms


def step_bytes(layout: LayoutSummary, settings: BufferSettings) -> int:
    """Bytes on top of model states during the optimizer step and the parameter all-gather that
    follows it (stages 0-2): Adam's temporaries, or gloo's copy of the buckets being gathered."""
    st = settings
    shard = layout.padded_numel // st.num_shards
    largest_shard = layout.bucket_numels[0] // st.num_shards
    optimizer = 4 * max(shard, 2 * largest_shard)
    if st.accum_bytes != 4:  # step()'s fp32 copy of the 2-byte gradient shards
        optimizer += 4 * shard
    gathered = 0
    if st.gloo and st.stage in (1, 2) and st.num_shards > 1:
        gathered = min(layout.padded_numel, max(st.allgather_numel, layout.bucket_numels[0]))
    persistent = layout.persistent_numel * st.compute_bytes if st.stage == 3 else 0
    return max(optimizer, gathered * st.compute_bytes) + persistent


def end_of_backward_bytes(layout: LayoutSummary, settings: BufferSettings) -> int:
    """Bytes on top of model states at the end of backward, activations freed: the gradient
    buckets still reducing and gloo's copies of them. Stage 1 launches all of its buckets then
    and reduces its accumulation buffer in place (no staging)."""
    st = settings
    if st.stage == 0 or st.num_shards == 1:
        return 0
    if st.stage == 1:
        return st.accum_bytes * layout.padded_numel if st.gloo else 0
    reducing = sum(layout.bucket_numels[:MAX_BUCKETS_IN_FLIGHT])
    copies = reducing if st.gloo else 0
    persistent = layout.persistent_numel * st.compute_bytes if st.stage == 3 else 0
    return (reducing + copies) * st.reduce_bytes + persistent


@dataclass(frozen=True)
class Peak:
    """Predicted peak bytes per rank on the device, and its parts ([Note: peak])."""

    model_states: int
    buffers: dict
    activations: Activations | None
    end_of_backward: int
    step: int
    runtime: int = 0
    allocator: int = 0
    fresh_gradients: int = 0  # gradient bytes in model_states not yet made when backward starts

    @property
    def backward(self) -> int:
        acts = self.activations.peak if self.activations else 0
        return acts + sum(self.buffers.values()) - self.fresh_gradients

    @property
    def total(self) -> int:
        moments = max(self.backward, self.end_of_backward, self.step)
        return self.model_states + self.runtime + self.allocator + moments


def peak_bytes(
    model_states: int,
    layout: LayoutSummary,
    settings: BufferSettings,
    activations: Activations | None = None,
    runtime: int = 0,
    allocator: int = 0,
    gradients: int = 0,
) -> Peak:
    """The peak of one training step ([Note: peak]); model_states, runtime and allocator (the
    allocator's retention, [Note: CPU ranks]) in bytes on the device; gradients: the bytes of
    the gradient buffers within model_states (made during backward, partition/stages.py [Note:
    gradient lifetime], so absent at its start unless earlier micro-batches' sums are kept)."""
    fresh = gradients if settings.gradient_accumulation_steps == 1 else 0
    return Peak(
        model_states,
        buffer_bytes(layout, settings),
        activations,
        end_of_backward_bytes(layout, settings),
        step_bytes(layout, settings),
        runtime,
        allocator,
        fresh,
    )
