"""TiledLinear: a Linear layer stored as in_splits x out_splits separate tiles (ZeRO-3 tiling).

DeepSpeed's deepspeed.zero.TiledLinear (runtime/zero/tiling.py). Each tile is its own Linear
module with its own parameters, so at stage 3 each tile is partitioned, gathered and released on
its own: a layer too large to gather whole (a huge vocabulary projection) is computed one tile
at a time, and only one tile's full weight is resident at once.

[Note: the tiles]
The weight W (out_features x in_features) is cut along both dimensions at the points
``_split_points`` gives: the first (n mod k) parts are one element longer than the rest, as
DeepSpeed's partition_uniform cuts them. Tile (o, i) holds W[rows o, columns i]; only the last
input tile of each output row carries a bias (the row's slice of b), so the bias is added once.
Forward computes, for each output part o, sum over i of tile(o, i)(x[..., columns i]) and
concatenates the output parts along the last dimension: the same sums as x @ W.T + b, added
in a different order, so results agree with nn.Linear to rounding (exactly for in_splits 1).
"""

from collections.abc import Sequence
from typing import Any

import torch

from .gathered import GatheredParameters

__all__ = ["TiledLinear", "TiledLinearReturnBias"]


def _split_points(num_items: int, num_parts: int) -> list[int]:
    """[0, end of part 0, ..., num_items]: num_parts parts whose sizes differ by at most one, the
    longer ones first (DeepSpeed's partition_uniform). With num_items <= num_parts, parts past
    num_items are empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def _check_splits(name: str, splits: Any, features: int, what: str) -> None:
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= features:
        raise ValueError(
            f"TiledLinear: {name}={splits!r} must be a whole number from 1 to {what}={features} "
            "(each tile needs at least one feature)."
        )


class TiledLinear(torch.nn.Module):
    """A Linear layer split into in_splits x out_splits tiles (DeepSpeed's TiledLinear).

    Args:
        in_features, out_features, bias: as torch.nn.Linear.
        in_splits: tiles along the input dimension, 1 to in_features.
        out_splits: tiles along the output dimension, 1 to out_features.
        input_is_already_split: forward receives a sequence of in_splits tensors, the input's
            column parts (sizes as in [Note: the tiles]), instead of one tensor.
        combine_out_splits: True: forward returns one tensor (..., out_features); False: the
            list of out_splits output parts.
        linear_cls: the module class of each tile, called as
            ``linear_cls(tile_in, tile_out, bias=..., **kwargs)`` (default torch.nn.Linear).
        init_linear: a Linear whose weight and bias are copied into the tiles
            (``copy_params_from``).
        kwargs: passed to every ``linear_cls`` call (device=, dtype=, ...).

    Tile (o, i) is ``self.linears[o][i]``; ``in_parts`` / ``out_parts`` are the split points.
    Forward: input (..., in_features) of the tiles' dtype -> (..., out_features), equal to
    ``torch.nn.Linear`` with the same weight and bias up to the order of the additions.

    Raises:
        ValueError: in_splits or out_splits outside 1..features (DeepSpeed raises
            RuntimeError); in forward, a pre-split input with the wrong number of parts.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: type = torch.nn.Linear,
        init_linear: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        _check_splits("in_splits", in_splits, in_features, "in_features")
        _check_splits("out_splits", out_splits, out_features, "out_features")
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = _split_points(in_features, in_splits)
        self.out_parts = _split_points(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            row = torch.nn.ModuleList()
            tile_out = self.out_parts[o + 1] - self.out_parts[o]
            for i in range(in_splits):
                tile_in = self.in_parts[i + 1] - self.in_parts[i]
                # Only the row's last tile carries the bias, so it is added once.
                tile_bias = bias and i == in_splits - 1
                row.append(linear_cls(tile_in, tile_out, bias=tile_bias, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: "torch.Tensor | Sequence[torch.Tensor]") -> Any:
        if self.in_splits > 1 and not self.input_is_already_split:
            points = _split_points(input_.shape[-1], self.in_splits)
            sizes = [points[i + 1] - points[i] for i in range(self.in_splits)]
            inputs = self._split_global_input(input_, sizes)
        elif self.in_splits > 1:
            inputs = input_
            if len(inputs) != self.in_splits:
                raise ValueError(
                    f"TiledLinear: input_is_already_split, so forward takes in_splits="
                    f"{self.in_splits} input parts, got {len(inputs)}."
                )
        else:
            inputs = [input_]
        outputs = []
        for o in range(self.out_splits):
            reduced = None
            for i in range(self.in_splits):
                local = self.linears[o][i](inputs[i])
                reduced = self._reduce_local_output(i, o, reduced, local)
            outputs.append(reduced)
        if self.combine_out_splits:
            return self._combine_output_splits(outputs)
        return outputs

    def _split_global_input(self, input_: torch.Tensor, split_sizes: list[int]) -> Any:
        """The input's column parts (views) along its last dimension; subclasses override this
        for other input types (DeepSpeed's hook)."""
        return torch.split(input_, split_sizes, dim=-1)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Sum the partial output of tile (out_id, in_id) into the row's running result; the
        first one is cloned so the later additions never write into a tile's output."""
        if current_out is None:
            return new_out.clone()
        return current_out + new_out

    def _combine_output_splits(self, outputs: list) -> Any:
        """The output parts joined along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy ``other``'s weight (out_features, in_features) and bias (out_features,) into
        the tiles. ``other`` needs a bias exactly when this layer has one.

        At stage 3 (parameters built under zero.Init or given to zero.initialize) this is a
        collective: every data-parallel rank calls it, ``other`` is gathered to read it, and
        each tile takes rank 0's values (GatheredParameters with modifier_rank=0), as in
        DeepSpeed. Raises ValueError for a missing or mis-shaped weight or bias.
        """
        with GatheredParameters(list(other.parameters())):
            self._check_source(other)
            for o in range(self.out_splits):
                rows = slice(self.out_parts[o], self.out_parts[o + 1])
                for i in range(self.in_splits):
                    tile = self.linears[o][i]
                    cols = slice(self.in_parts[i], self.in_parts[i + 1])
                    with GatheredParameters(tile.weight, modifier_rank=0):
                        tile.weight.copy_(other.weight[rows, cols])
                    if tile.bias is not None:
                        with GatheredParameters(tile.bias, modifier_rank=0):
                            tile.bias.copy_(other.bias[rows])

    def _check_source(self, other: torch.nn.Module) -> None:
        weight = getattr(other, "weight", None)
        expected = (self.out_features, self.in_features)
        if weight is None or tuple(weight.shape) != expected:
            shape = None if weight is None else tuple(weight.shape)
            raise ValueError(
                f"TiledLinear.copy_params_from: needs a weight of shape {expected} "
                f"(out_features, in_features), got {shape}."
            )
        bias = getattr(other, "bias", None)
        if self.use_bias and (bias is None or tuple(bias.shape) != (self.out_features,)):
            shape = None if bias is None else tuple(bias.shape)
            raise ValueError(
                f"TiledLinear.copy_params_from: this layer has a bias, so the source needs one "
                f"of shape ({self.out_features},), got {shape}."
            )
        if not self.use_bias and bias is not None:
            raise ValueError(
                "TiledLinear.copy_params_from: this layer has no bias (bias=False) but the "
                "source has one; build the TiledLinear with bias=True."
            )


class TiledLinearReturnBias(TiledLinear):
    """TiledLinear over tiles that return (output, bias) pairs, as Megatron-LM's Linear layers
    do (DeepSpeed's TiledLinearReturnBias): forward returns (output, bias), the bias joined from
    the tiles that return one (None when none does)."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise TypeError(
                "TiledLinearReturnBias: each tile must return an (output, bias) pair; "
                f"linear_cls returned {type(new_out).__name__}."
            )
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, (old_bias if bias is None else bias)

    def _combine_output_splits(self, outputs: list) -> Any:
        tensor = super()._combine_output_splits([out[0] for out in outputs])
        biases = [out[1] for out in outputs if out[1] is not None]
        return tensor, (super()._combine_output_splits(biases) if biases else None)
