"""The quantize op (ops/csrc/quantize.cpp; quantize.cu on CUDA) against its pure-PyTorch reference.

The op must match the reference bitwise: int8 / packed int4 values, fp32 scales (NaN where the
block holds inf or NaN), dequantized outputs in fp32 / bf16 / fp16, and row sums (qgZ's
dequantize-and-reduce). The reference itself is held to the stated error bound: every element
of a finite block within scale / 2 + max|block| * 2^-21 of the input, scale = max|block| / qmax.
Op tests skip, with the reason, where the op cannot be built.
"""

import itertools

import pytest
import torch

from zero.ops import quantize as q
from zero.ops.builder import OpBuildError, get_builder

# A cold build of the op takes about 10 s on 2 cores; later runs load it from the cache.
pytestmark = pytest.mark.timeout(300)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (shape, block_size): partial last blocks, block size 1 and 2, an odd row, empty rows, rows.
CASES = [
    ((1000,), 64),
    ((3, 1001), 10),
    ((5, 7), 2),
    ((2, 9), 1),
    ((4, 0), 4),
    ((0, 8), 4),
    ((2, 33), 64),
    ((2, 3, 257), 16),
]


def _op(device: str):
    name = "quantize" if device == "cpu" else "quantize_cuda"
    try:
        return get_builder(name).load()
    except OpBuildError as error:
        pytest.skip(f"op {name} cannot be built here: {error}")


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: quantize_cuda is only compiled and run where one is visible")
    _op(request.param)
    return request.param


def _data(shape, dtype, seed, special: bool):
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes: the per-block scales must follow them.
    scale = torch.exp(torch.randn(shape[:-1] + (1,), generator=gen) * 3)
    x = (torch.randn(shape, generator=gen) * scale).to(dtype)
    flat = x.view(-1)
    if special and flat.numel() > 40:
        flat[3] = float("inf")
        flat[20] = float("nan")
        flat[30:40] = 0.0  # in its own all-zero block for small block sizes
        flat[25] = -flat[26]  # both signs of one magnitude
    return x


def _same(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual.isnan(), expected.isnan())
    if actual.is_floating_point():
        actual, expected = actual.nan_to_num(0.0), expected.nan_to_num(0.0)
    assert torch.equal(actual.cpu(), expected.cpu())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_op_matches_reference(device, dtype, bits):
    for (shape, block_size), special in itertools.product(CASES, (False, True)):
        if bits == 4 and block_size % 2:
            continue
        x = _data(shape, dtype, seed=len(shape) * 100 + block_size, special=special).to(device)
        values, scales = q.quantize(x, block_size, bits, use_op=True)
        ref_values, ref_scales = q.quantize_reference(x, block_size, bits)
        _same(values, ref_values)
        _same(scales, ref_scales)
        numel = shape[-1]
        for out_dtype, reduce in itertools.product(DTYPES, (False, True)):
            args = (values, scales, numel, block_size, bits)
            got = q.dequantize(*args, dtype=out_dtype, reduce=reduce, use_op=True)
            want = q.dequantize_reference(*args, dtype=out_dtype, reduce=reduce)
            _same(got, want)


def test_ties_round_to_even_and_extremes_are_exact(device):
    # Block max 127: inv = 1, so x * inv lands on halves exactly; torch.round and the op both
    # round half to even (2.5 -> 2, 3.5 -> 4, -0.5 -> -0).
    x = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, -127.0, 126.5], device=device)
    values, scales = q.quantize(x, 8, 8, use_op=True)
    assert values.tolist() == [127, 2, 4, 0, -2, 0, -127, 126]
    assert scales.tolist() == [1.0]
    packed, _ = q.quantize(torch.tensor([7.0, -7.0, 0.5, 1.5], device=device), 4, 4, use_op=True)
    assert packed.tolist() == [0x97, 0x20]  # 7 | -7 << 4 (0x9), 0 | 2 << 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_input_is_read_exactly(device, dtype):
    # Each bit pattern in a block of its own (block_size 1): scale = |x| / 127 tests the op's
    # widening of every fp16 / bf16 value, subnormals, infinities and NaNs included.
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    values, scales = q.quantize(x.to(device), 1, 8, use_op=True)
    ref_values, ref_scales = q.quantize_reference(x, 1, 8)
    _same(values, ref_values)
    _same(scales, ref_scales)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_outputs_round_as_torch(device, dtype):
    # Scales from 2^-40 to 2^20 times every int8 value: fp16 subnormals, ties, overflow to inf.
    gen = torch.Generator().manual_seed(3)
    values = torch.arange(-127, 128, dtype=torch.int8).repeat(64)
    exponents = torch.rand(64, generator=gen) * 60 - 40
    scales = torch.exp2(exponents) * (1 + torch.rand(64, generator=gen) / 7)
    values, scales = values.to(device), scales.to(device)
    got = q.dequantize(values, scales, values.numel(), 255, 8, dtype=dtype, use_op=True)
    want = (values.float().view(64, 255) * scales[:, None]).view(-1).to(dtype)
    _same(got, want)


@pytest.mark.parametrize("bits", [8, 4])
def test_reference_error_bound(bits):
    qmax = q.QMAX[bits]
    for shape, block_size in CASES:
        if bits == 4 and block_size % 2:
            continue
        x = _data(shape, torch.float32, seed=block_size, special=False)
        values, scales = q.quantize_reference(x, block_size, bits)
        back = q.dequantize_reference(values, scales, shape[-1], block_size, bits)
        blocks = q.num_blocks(shape[-1], block_size)
        padded = torch.nn.functional.pad(x.abs(), (0, blocks * block_size - shape[-1]))
        amax = padded.view(shape[:-1] + (blocks, block_size)).amax(-1, keepdim=True)
        amax = amax.expand(shape[:-1] + (blocks, block_size)).reshape(padded.shape)
        amax = amax[..., : shape[-1]]
        bound = amax / (2 * qmax) + amax * 2.0**-21
        assert back.shape == x.shape and scales.shape == shape[:-1] + (blocks,)
        assert bool(((back - x).abs() <= bound).all())


def test_nonfinite_blocks_dequantize_to_nan_and_zero_blocks_to_zero():
    x = torch.tensor([1.0, float("inf"), 2.0, 3.0, 0.0, 0.0, 4.0, float("nan")])
    values, scales = q.quantize(x, 2, 8)
    assert scales[0].isnan() and scales[3].isnan() and scales[2] == 0
    back = q.dequantize(values, scales, 8, 2, 8)
    assert back[:2].isnan().all() and back[6:].isnan().all()
    assert back[4:6].tolist() == [0.0, 0.0] and back[3] == 3.0  # the block's max is exact
    assert abs(back[2] - 2.0) <= 3.0 / 254


def test_outputs_written_in_place_into_slices():
    x = torch.randn(2, 100)
    values = torch.zeros(3, 100, dtype=torch.int8)
    scales = torch.zeros(3, 4)
    q.quantize(x[1], 32, 8, values=values[2], scales=scales[2])
    ref_values, ref_scales = q.quantize_reference(x[1], 32, 8)
    assert torch.equal(values[2], ref_values) and torch.equal(scales[2], ref_scales)
    assert not values[:2].any() and not scales[:2].any()


def test_reference_fallback_and_sizes():
    x = torch.randn(3, 50, dtype=torch.bfloat16)
    values, scales = q.quantize(x, 16, 4, use_op=False)
    assert values.shape == (3, 25) and values.dtype == torch.uint8 and scales.shape == (3, 4)
    assert q.quantized_nbytes(50, 16, 4, rows=3) == values.numel() + 4 * scales.numel()
    assert q.quantized_nbytes(1001, 64, 8) == 1001 + 4 * 16
    out = q.dequantize(values, scales, 50, 16, 4, use_op=False, reduce=True)
    assert out.shape == (50,)


def test_errors_name_the_argument():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits=2"):
        q.quantize(x, 4, 2)
    with pytest.raises(ValueError, match="even for int4"):
        q.quantize(x, 3, 4)
    with pytest.raises(TypeError, match="contiguous"):
        q.quantize(torch.randn(10, 2).t(), 4)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        q.quantize(torch.arange(10), 4)
    with pytest.raises(ValueError, match=r"values must have shape \(10,\)"):
        q.quantize(x, 4, values=torch.empty(9, dtype=torch.int8))
    values, scales = q.quantize(x, 4)
    with pytest.raises(ValueError, match=r"scales must have shape \(3,\)"):
        q.dequantize(values, scales[:2], 10, 4)


def test_builders_are_registered():
    assert get_builder("quantize").has_fallback and get_builder("quantize_cuda").has_fallback
    ok, reason = get_builder("quantize_cuda").is_compatible()
    if not torch.cuda.is_available():
        assert not ok and reason
