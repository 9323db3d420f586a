"""A small GPT-style decoder for the zero examples.

Token and learned position embeddings, pre-norm transformer blocks (causal self-attention and
a 4x GELU MLP), a final LayerNorm and an lm_head tied to the token embedding. The engine wraps
it as any nn.Module. Two options use zero's ZeRO-R pieces: `GPT(config, mpu)` splits attention
heads and the MLP over the model-parallel ranks of `mpu` (zero.tensor_parallel; embeddings, norms
and the head stay replicated), and `activation_checkpointing=True` runs each block under
zero.checkpointing.checkpoint, configured by the zero config's activation_checkpointing block.
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Shape of the model. vocab_size 256 means raw bytes."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    activation_checkpointing: bool = False  # recompute each block in backward (zero.checkpointing)

    @property
    def hidden_size(self) -> int:
        """The width under the name Hugging Face configs use (engines size buffers from it)."""
        return self.n_embd


def _model_parallel_size(mpu) -> int:
    return 1 if mpu is None else mpu.get_model_parallel_world_size()


def _column(in_features, out_features, bias, mpu, stride=1) -> nn.Module:
    """nn.Linear, or its column-parallel split (output features over the mpu's ranks)."""
    if mpu is None:
        return nn.Linear(in_features, out_features, bias=bias)
    from zero.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear(in_features, out_features, mpu, bias=bias, stride=stride)


def _row(in_features, out_features, bias, mpu) -> nn.Module:
    """nn.Linear, or its row-parallel split (input features over the mpu's ranks)."""
    if mpu is None:
        return nn.Linear(in_features, out_features, bias=bias)
    from zero.tensor_parallel import RowParallelLinear

    return RowParallelLinear(in_features, out_features, mpu, bias=bias)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; with an mpu each model-parallel rank owns n_head / mp heads."""

    def __init__(self, config: GPTConfig, mpu=None):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(
                f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}; "
                "choose a head count that divides the width"
            )
        mp = _model_parallel_size(mpu)
        if config.n_head % mp != 0:
            raise ValueError(
                f"n_head={config.n_head} must be divisible by the model-parallel size {mp}"
            )
        self.n_head = config.n_head // mp
        self.width = config.n_embd // mp  # this rank's share of q, k and v
        self.dropout = config.dropout
        self.parallel = mpu is not None
        # stride 3: each rank keeps its heads' slice of q, of k and of v.
        self.qkv = _column(config.n_embd, 3 * config.n_embd, config.bias, mpu, stride=3)
        self.proj = _row(config.n_embd, config.n_embd, config.bias, mpu)
        self.resid_drop = nn.Dropout(config.dropout)

    def _head_rng(self):
        """Dropout on this rank's heads draws from the model-parallel RNG state, so ranks drop
        different units of different heads; everything replicated uses the default state."""
        if self.parallel and self.training and self.dropout > 0:
            from zero import checkpointing

            return checkpointing.get_rng_tracker().fork()
        return contextlib.nullcontext()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).split(self.width, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        with self._head_rng():
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        y = y.transpose(1, 2).reshape(batch, seq, self.width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, mpu=None):
        super().__init__()
        self.fc = _column(config.n_embd, 4 * config.n_embd, config.bias, mpu)
        self.proj = _row(4 * config.n_embd, config.n_embd, config.bias, mpu)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, mpu=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, mpu)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config, mpu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model.

    forward(idx, targets=None): idx and targets are int64 (batch, seq) with seq <= block_size.
    Returns the mean cross-entropy loss (a scalar, nats per token) when targets are given,
    otherwise the logits, float (batch, seq, vocab_size).

    mpu: a model-parallel unit (zero.mpu.initialize_model_parallel) for a tensor-parallel model.
    Built from the same seed, the tensor-parallel model holds exact slices of the plain one (its
    layers draw the full matrices and keep their slice), and load_state_dict accepts the plain
    model's state dict. Dropout with mp > 1 needs zero.checkpointing.model_parallel_manual_seed.
    """

    def __init__(self, config: GPTConfig, mpu=None):
        super().__init__()
        self.config = config
        self.mpu = mpu
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, mpu) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tied embeddings: one Parameter used by two modules (the engine must count it once).
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scales the projections that write into the residual stream by 1/sqrt(2 n_layer),
        # since each block adds two such terms and the stream's variance grows with depth.
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, module in self.named_modules():
            if name.endswith("proj"):
                _normal_init(module, residual_std, bias=False)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif hasattr(module, "weight") and not isinstance(module, nn.LayerNorm):
            _normal_init(module, 0.02, bias=True)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameter count (elements) of the full model, each shared parameter counted once
        (with an mpu: every model-parallel slice counted, as in the single-process model)."""
        from zero.init import full_numel  # also counts what zero.Init holds partitioned

        count = sum(full_numel(p) for p in self.parameters())
        if self.mpu is not None:
            from zero.tensor_parallel import partitioned_parameters

            sliced = sum(full_numel(p) for p in partitioned_parameters(self))
            count += (_model_parallel_size(self.mpu) - 1) * sliced
        if non_embedding:
            count -= full_numel(self.wpe.weight)
        return count

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds block_size={self.config.block_size}; "
                "use shorter windows or a larger --block_size"
            )
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            if self.config.activation_checkpointing and self.training:
                from zero import checkpointing

                x = checkpointing.checkpoint(block, x)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # Loss in fp32 even when the engine runs the model in fp16/bf16.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _normal_init(module: nn.Module, std: float, bias: bool) -> None:
    """N(0, std) weight (and zero bias when `bias`); a parallel layer draws its full matrix."""
    if hasattr(module, "init_full_"):
        module.init_full_(lambda w: nn.init.normal_(w, mean=0.0, std=std), bias=bias)
        return
    nn.init.normal_(module.weight, mean=0.0, std=std)
    if bias and module.bias is not None:
        nn.init.zeros_(module.bias)
