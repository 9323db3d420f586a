"""Block-wise symmetric int8 / int4 quantization: the kernels of ZeRO++'s quantized collectives.

ZeRO++ (Wang et al. 2023, arXiv 2306.10209) all-gathers stage-3 weights as int8 (qwZ, section
4.1; DeepSpeed key `zero_quantized_weights`) and reduces gradients as int4 over a hierarchical
all-to-all (qgZ, section 4.2; `zero_quantized_gradients`). Both cut a tensor into blocks of
`block_size` elements, each with its own fp32 scale, so one outlier costs precision only in its
block. The collectives themselves are zero.comm.quantized; this module holds the arithmetic:

- `quantize(input, block_size, bits)` -> (values, scales) and `dequantize(values, scales, ...)`,
  dispatched to the compiled op `quantize` (ops/csrc/quantize.cpp) for CPU tensors and
  `quantize_cuda` (ops/csrc/quantize.cu) for CUDA tensors; where the op cannot be built, the
  pure-PyTorch reference runs instead, after one warning.
- `quantize_reference` / `dequantize_reference`: the same arithmetic from torch's own ops; the
  ops match them bitwise ([Note: quantization numerics] in quantize.cpp).

Layout: the last dimension of `input` (numel elements) is a row; leading dimensions are rows.
Each row is cut into ceil(numel / block_size) blocks (the last may be shorter). bits 8: values
are int8 with the input's shape; bits 4: values are uint8 of shape (..., ceil(numel / 2)), two
per byte, element 2k in the low nibble (two's complement), and block_size must be even. Scales
are fp32 of shape (..., ceil(numel / block_size)). Symmetric: qmax = 2^(bits-1) - 1 (127, 7),
scale = max|block| / qmax, q = round-half-even(x * (qmax / max|block|)).

Error bound (fp32 output): |x - dequantize(quantize(x))| <= scale / 2 + max|block| * 2^-21 for
every element of a finite block, i.e. max|block| / (2 qmax) up to fp32 rounding; a bf16 / fp16
output adds its own rounding. A block holding inf or NaN has scale NaN and dequantizes to NaN
throughout (an overflow survives quantized communication).
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F

from .builder import get_builder

QMAX = {8: 127, 4: 7}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def num_blocks(numel: int, block_size: int) -> int:
    """Scales per row: ceil(numel / block_size)."""
    return -(-numel // block_size)


def value_bytes(numel: int, bits: int) -> int:
    """Bytes of one row's values: numel (int8) or ceil(numel / 2) (int4)."""
    return numel if bits == 8 else -(-numel // 2)


def quantized_nbytes(numel: int, block_size: int, bits: int, rows: int = 1) -> int:
    """Bytes of `rows` quantized rows of `numel` elements: values plus 4 bytes per block."""
    return rows * (value_bytes(numel, bits) + 4 * num_blocks(numel, block_size))


def _check_args(block_size: int, bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits={bits!r}: block-wise quantization supports 8 (int8) or 4 (int4)")
    if not isinstance(block_size, int) or block_size < 1 or (bits == 4 and block_size % 2):
        raise ValueError(
            f"block_size={block_size!r}: give a positive integer number of elements (even for "
            "int4, so every block starts on a byte)"
        )


def _check_float(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype not in _DTYPE_CODES:
        raise TypeError(f"{what} must be float32, bfloat16 or float16, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise TypeError(f"{what} must be contiguous; pass .contiguous()")


def _check_buffer(tensor, shape, dtype, device, what: str) -> None:
    if tensor.dtype != dtype or tensor.device != device or not tensor.is_contiguous():
        raise TypeError(
            f"{what} must be a contiguous {dtype} tensor on {device}, got {tensor.dtype} on "
            f"{tensor.device} (contiguous={tensor.is_contiguous()})"
        )
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")


def _rows_of(input: torch.Tensor) -> tuple[tuple[int, ...], int]:
    if input.dim() == 0:
        raise ValueError("quantize: input must have at least one dimension (its rows)")
    return tuple(input.shape[:-1]), input.shape[-1]


def _values_dtype(bits: int) -> torch.dtype:
    return torch.int8 if bits == 8 else torch.uint8


def quantize_reference(
    input: torch.Tensor, block_size: int, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch block-wise quantization; see the module docstring for shapes and numerics.

    input: float32 / bfloat16 / float16, any device, last dimension = one row. Returns (values,
    scales) on input's device. Raises ValueError for bits or block_size, TypeError for a dtype.
    """
    _check_args(block_size, bits)
    _check_float(input.contiguous(), "input")
    lead, numel = _rows_of(input)
    qmax, blocks = QMAX[bits], num_blocks(numel, block_size)
    x = input.reshape(math.prod(lead), numel).float()
    padded = F.pad(x, (0, blocks * block_size - numel)).view(x.shape[0], blocks, block_size)
    amax = padded.abs().amax(dim=-1)  # NaN propagates
    finite = torch.isfinite(amax)
    zero = ~finite | (amax == 0)
    qmax_t = torch.full_like(amax, float(qmax))
    # Tensor-by-tensor division: one correctly rounded quotient, as the ops compute it (a
    # Python-scalar divisor may become a multiplication by its reciprocal).
    scales = torch.where(finite, amax / qmax_t, torch.full_like(amax, float("nan")))
    inv = torch.where(zero, torch.zeros_like(amax), qmax_t / torch.where(zero, 1.0, amax))
    q = torch.round(padded * inv.unsqueeze(-1)).clamp_(-qmax, qmax)
    q = torch.where(zero.unsqueeze(-1), 0.0, q).view(x.shape[0], blocks * block_size)
    q = q[:, :numel].to(torch.int8)
    values = q if bits == 8 else _pack_int4(q)
    return values.reshape(lead + (values.shape[-1],)), scales.reshape(lead + (blocks,))


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    wide = F.pad(q.to(torch.int32), (0, q.shape[-1] % 2)) & 0xF
    pairs = wide.view(q.shape[0], wide.shape[1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def _unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    wide = packed.to(torch.int32)
    nibbles = torch.stack((wide & 0xF, wide >> 4), dim=-1)
    nibbles = nibbles.view(packed.shape[0], 2 * packed.shape[1])[:, :numel]
    return nibbles - 16 * (nibbles >= 8).to(torch.int32)


def dequantize_reference(
    values: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    block_size: int,
    bits: int = 8,
    dtype: torch.dtype = torch.float32,
    reduce: bool = False,
) -> torch.Tensor:
    """Pure-PyTorch inverse of `quantize_reference`: q * scale in fp32, cast to `dtype`.

    values / scales: as quantize returns them, rows = values.numel() // value_bytes(numel,
    bits). reduce False: returns (rows, numel) (1-D when values is 1-D); reduce True: the rows
    summed in row order in fp32 (each product rounded before its addition), shape (numel,).
    """
    _check_args(block_size, bits)
    vb, blocks = value_bytes(numel, bits), num_blocks(numel, block_size)
    rows = math.prod(values.shape[:-1])
    flat = values.reshape(rows, vb)
    q = flat.to(torch.int32) if bits == 8 else _unpack_int4(flat, numel)
    expanded = scales.reshape(rows, blocks).repeat_interleave(block_size, dim=-1)[:, :numel]
    products = q.float() * expanded
    if reduce:
        acc = products[0].clone() if rows else torch.zeros(numel, device=values.device)
        for row in products[1:]:
            acc = acc + row
        return acc.to(dtype)
    shape = (numel,) if values.dim() == 1 else tuple(values.shape[:-1]) + (numel,)
    return products.to(dtype).reshape(shape)


def _module(device: torch.device, use_op: bool | None) -> ModuleType | None:
    """The compiled op for tensors on `device`, or None for the reference."""
    if use_op is False:
        return None
    if device.type not in ("cpu", "cuda"):
        if use_op:
            raise TypeError(f"quantize: the compiled ops take CPU or CUDA tensors, not {device}")
        return None
    builder = get_builder("quantize" if device.type == "cpu" else "quantize_cuda")
    return builder.load() if use_op else builder.load_or_fallback()


def _launch(module: ModuleType, device: torch.device, name: str, *args) -> None:
    if device.type == "cpu":
        getattr(module, name)(*args)
        return
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        getattr(module, name)(*args, stream)


def quantize(
    input: torch.Tensor,
    block_size: int,
    bits: int = 8,
    *,
    values: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    use_op: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise symmetric quantization of `input` (ZeRO++ qwZ: bits 8; qgZ: bits 4).

    input: contiguous float32 / bfloat16 / float16 on CPU or CUDA; its last dimension (numel
    elements) is a row, leading dimensions are rows. values / scales: optional contiguous
    outputs on input's device (e.g. slices of a communication buffer), int8 (..., numel) for bits
    8 or uint8 (..., ceil(numel / 2)) for bits 4, and float32 (..., ceil(numel / block_size)).
    use_op: None: the compiled op, else the reference after one warning; True: the op or
    OpBuildError; False: the reference. Not a collective. Returns (values, scales). Raises
    ValueError for bits, block_size or an output's shape, TypeError for a dtype, device or
    layout.
    """
    _check_args(block_size, bits)
    _check_float(input, "input")
    lead, numel = _rows_of(input)
    values_shape = lead + (value_bytes(numel, bits),)
    scales_shape = lead + (num_blocks(numel, block_size),)
    if values is None:
        values = torch.empty(values_shape, dtype=_values_dtype(bits), device=input.device)
    if scales is None:
        scales = torch.empty(scales_shape, dtype=torch.float32, device=input.device)
    _check_buffer(values, values_shape, _values_dtype(bits), input.device, "values")
    _check_buffer(scales, scales_shape, torch.float32, input.device, "scales")
    module = _module(input.device, use_op)
    if module is None:
        ref_values, ref_scales = quantize_reference(input, block_size, bits)
        values.copy_(ref_values)
        scales.copy_(ref_scales)
        return values, scales
    rows = math.prod(lead)
    _launch(
        module, input.device, "quantize", input.data_ptr(), _DTYPE_CODES[input.dtype], rows,
        numel, block_size, bits, values.data_ptr(), scales.data_ptr(),
    )  # fmt: skip
    return values, scales


def dequantize(
    values: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    block_size: int,
    bits: int = 8,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    reduce: bool = False,
    use_op: bool | None = None,
) -> torch.Tensor:
    """values * scales per block, into `out` (or a new tensor of `dtype`); see `quantize`.

    values / scales: as `quantize` returns them for rows of `numel` elements (contiguous, one
    device). reduce False: out has values' leading shape + (numel,); reduce True: the rows are
    summed in row order in fp32 (qgZ's dequantize-and-reduce) and out has shape (numel,). out:
    contiguous float32 / bfloat16 / float16 on values' device; the fp32 result is rounded to
    its dtype (nearest even). use_op as for `quantize`. Not a collective. Raises ValueError for
    shapes, bits or block_size, TypeError for dtypes, devices or layout.
    """
    _check_args(block_size, bits)
    vb, blocks = value_bytes(numel, bits), num_blocks(numel, block_size)
    lead, _ = _rows_of(values)
    rows = math.prod(lead)
    _check_buffer(values, lead + (vb,), _values_dtype(bits), values.device, "values")
    _check_buffer(scales, lead + (blocks,), torch.float32, values.device, "scales")
    out_shape = (numel,) if reduce else lead + (numel,)
    if out is None:
        out = torch.empty(out_shape, dtype=dtype, device=values.device)
    _check_float(out, "out")
    _check_buffer(out, out_shape, out.dtype, values.device, "out")
    module = _module(values.device, use_op)
    if module is None:
        out.copy_(dequantize_reference(values, scales, numel, block_size, bits, out.dtype, reduce))
        return out
    _launch(
        module, values.device, "dequantize", values.data_ptr(), scales.data_ptr(), rows, numel,
        block_size, bits, out.data_ptr(), _DTYPE_CODES[out.dtype], reduce,
    )  # fmt: skip
    return out


def uses_op(device: torch.device | str = "cpu") -> bool:
    """Whether quantize / dequantize with use_op=None run the compiled op for tensors on
    `device` here (False: the reference). Builds or loads the op on first use."""
    return _module(torch.device(device), None) is not None
