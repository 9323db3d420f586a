// quantize: block-wise symmetric int8 / int4 quantization on the CPU (ZeRO++ qwZ and qgZ).
//
// The Python side (ops/quantize.py) hands over raw addresses of contiguous tensors and a dtype
// code; nothing here owns tensor memory, and only pybind11 is included, so the op builds in
// seconds instead of the minutes torch's headers take.
//
// Layout: `rows` rows of `numel` elements each. Every row is cut into blocks of `block_size`
// elements (the last block of a row may be shorter); each block has one fp32 scale, so a row has
// ceil(numel / block_size) scales. int8 values are one byte per element; int4 values are packed
// two per byte, element 2k in the low nibble and 2k + 1 in the high nibble (two's complement),
// a row taking ceil(numel / 2) bytes. block_size is even for int4, so every block starts on a
// byte boundary and blocks are independent.
//
// [Note: quantization numerics]
// qmax = 2^(bits - 1) - 1 (127 or 7). For a block with amax = max |x| (inputs widened to fp32
// exactly): inv = qmax / amax and scale = amax / qmax, both one correctly rounded fp32 division;
// q = nearest-even(x * inv) clamped to [-qmax, qmax]. An all-zero block has scale 0 and q 0.
// A block holding inf or NaN has scale NaN and q 0, so it dequantizes to NaN everywhere: an
// overflow survives quantized communication and the loss scaler still sees it. Dequantizing is
// q * scale in fp32, then rounded to the output dtype (nearest even); a reduction sums rows in
// row order, each product rounded before its addition (-ffp-contract=off: no fused
// multiply-add), so the pure-PyTorch reference, doing the same operations, matches bitwise.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float value) {
  uint32_t bits = float_to_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as torch writes it
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_fp16(float value) {
  const uint32_t bits = float_to_bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (magnitude < 0x38800000u) {
    // Below 2^-14: a subnormal in units of 2^-24 (scaling by a power of two is exact, the
    // rounding to an integer is the only one; 1024 is the smallest normal's encoding).
    const float units = std::nearbyint(bits_to_float(magnitude) * 16777216.0f);
    return sign | static_cast<uint16_t>(units);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to even.
  magnitude += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((magnitude >> 13) & 1u);
  return sign | static_cast<uint16_t>(magnitude >> 13);
}

inline float load(const void* data, int dtype, int64_t i) {
  switch (dtype) {
    case kBFloat16:
      return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case kFloat16:
      return fp16_to_float(static_cast<const uint16_t*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

inline void store(void* data, int dtype, int64_t i, float value) {
  switch (dtype) {
    case kBFloat16:
      static_cast<uint16_t*>(data)[i] = float_to_bf16(value);
      break;
    case kFloat16:
      static_cast<uint16_t*>(data)[i] = float_to_fp16(value);
      break;
    default:
      static_cast<float*>(data)[i] = value;
  }
}

struct Layout {
  int64_t rows, numel, block_size, blocks_per_row, value_row_bytes;
  int bits, qmax;

  Layout(int64_t rows_, int64_t numel_, int64_t block_size_, int bits_)
      : rows(rows_), numel(numel_), block_size(block_size_), bits(bits_) {
    if (bits != 8 && bits != 4) throw std::invalid_argument("quantize: bits must be 8 or 4");
    if (block_size < 1 || (bits == 4 && block_size % 2 != 0))
      throw std::invalid_argument("quantize: block_size must be >= 1 (and even for int4)");
    if (rows < 0 || numel < 0) throw std::invalid_argument("quantize: negative size");
    blocks_per_row = (numel + block_size - 1) / block_size;
    value_row_bytes = bits == 8 ? numel : (numel + 1) / 2;
    qmax = (1 << (bits - 1)) - 1;
  }
};

void check_dtype(int dtype) {
  if (dtype != kFloat32 && dtype != kBFloat16 && dtype != kFloat16)
    throw std::invalid_argument("quantize: dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
}

constexpr int64_t kChunk = 1024;  // elements widened (or summed) in a local buffer at a time

// Elements [begin, begin + count) widened to fp32 into buf (count <= kChunk); the dtype switch
// sits outside the loops so each loop vectorizes.
void widen(const void* input, int dtype, int64_t begin, int64_t count, float* buf) {
  switch (dtype) {
    case kBFloat16:
      for (int64_t i = 0; i < count; ++i)
        buf[i] = bf16_to_float(static_cast<const uint16_t*>(input)[begin + i]);
      break;
    case kFloat16:
      for (int64_t i = 0; i < count; ++i)
        buf[i] = fp16_to_float(static_cast<const uint16_t*>(input)[begin + i]);
      break;
    default:
      std::memcpy(buf, static_cast<const float*>(input) + begin, count * sizeof(float));
  }
}

// One block: its scale, and its values written at `values` (the block's first byte).
void quantize_block(const void* input, int dtype, int64_t begin, int64_t count, const Layout& l,
                    int8_t* values, float* scale) {
  float buf[kChunk];
  float amax = 0.0f;
  int finite = 1;
  for (int64_t c = 0; c < count; c += kChunk) {
    const int64_t n = std::min(kChunk, count - c);
    widen(input, dtype, begin + c, n, buf);
    for (int64_t i = 0; i < n; ++i) {
      const float a = std::fabs(buf[i]);
      finite &= a <= 3.40282347e38f ? 1 : 0;  // false for inf and NaN
      amax = a > amax ? a : amax;
    }
  }
  const float qmax = static_cast<float>(l.qmax);
  const bool zero = !finite || amax == 0.0f;
  *scale = finite ? amax / qmax : std::nanf("");
  const float inv = zero ? 0.0f : qmax / amax;
  auto* packed = reinterpret_cast<uint8_t*>(values);
  for (int64_t c = 0; c < count; c += kChunk) {
    const int64_t n = std::min(kChunk, count - c);
    widen(input, dtype, begin + c, n, buf);
    for (int64_t i = 0; i < n; ++i) {
      const float q = std::nearbyint(buf[i] * inv);
      buf[i] = zero ? 0.0f : std::min(qmax, std::max(-qmax, q));
    }
    if (l.bits == 8) {
      for (int64_t i = 0; i < n; ++i) values[c + i] = static_cast<int8_t>(buf[i]);
      continue;
    }
    // c is a multiple of kChunk (even), so the chunk starts on a byte.
    for (int64_t i = 0; i < n; i += 2) {
      const int low = static_cast<int>(buf[i]) & 0xf;
      const int high = i + 1 < n ? static_cast<int>(buf[i + 1]) & 0xf : 0;
      packed[(c + i) / 2] = static_cast<uint8_t>(low | (high << 4));
    }
  }
}

inline int value_at(const uint8_t* row, int bits, int64_t i) {
  if (bits == 8) return static_cast<int8_t>(row[i]);
  const int nibble = (row[i / 2] >> ((i & 1) * 4)) & 0xf;
  return nibble >= 8 ? nibble - 16 : nibble;
}

void quantize(uintptr_t input, int dtype, int64_t rows, int64_t numel, int64_t block_size,
              int bits, uintptr_t values, uintptr_t scales) {
  check_dtype(dtype);
  const Layout l(rows, numel, block_size, bits);
  const int64_t total = rows * l.blocks_per_row;
  const void* in = reinterpret_cast<const void*>(input);
  auto* out_values = reinterpret_cast<int8_t*>(values);
  auto* out_scales = reinterpret_cast<float*>(scales);
#pragma omp parallel for schedule(static) if (total * block_size > (1 << 16))
  for (int64_t b = 0; b < total; ++b) {
    const int64_t row = b / l.blocks_per_row, start = (b % l.blocks_per_row) * block_size;
    const int64_t count = std::min(block_size, numel - start);
    const int64_t byte = row * l.value_row_bytes + (bits == 8 ? start : start / 2);
    quantize_block(in, dtype, row * numel + start, count, l, out_values + byte, out_scales + b);
  }
}

// One row's terms q * scale for elements [begin, end) of a block: written into acc (first row)
// or added to it, each product rounded before the addition.
void add_terms(const uint8_t* row, int bits, float scale, int64_t begin, int64_t end, bool first,
               float* acc) {
  for (int64_t i = begin; i < end; ++i) {
    const float term = static_cast<float>(value_at(row, bits, i)) * scale;
    acc[i - begin] = first ? term : acc[i - begin] + term;
  }
}

void store_all(void* out, int dtype, int64_t offset, const float* acc, int64_t count) {
  switch (dtype) {
    case kBFloat16:
      for (int64_t i = 0; i < count; ++i)
        static_cast<uint16_t*>(out)[offset + i] = float_to_bf16(acc[i]);
      break;
    case kFloat16:
      for (int64_t i = 0; i < count; ++i)
        static_cast<uint16_t*>(out)[offset + i] = float_to_fp16(acc[i]);
      break;
    default:
      std::memcpy(static_cast<float*>(out) + offset, acc, count * sizeof(float));
  }
}

// reduce false: row r dequantized into row r of `out` (rows * numel elements).
// reduce true: the rows summed, in row order, into `out` (numel elements).
void dequantize(uintptr_t values, uintptr_t scales, int64_t rows, int64_t numel,
                int64_t block_size, int bits, uintptr_t out, int dtype, bool reduce) {
  check_dtype(dtype);
  const Layout l(rows, numel, block_size, bits);
  const auto* in_values = reinterpret_cast<const uint8_t*>(values);
  const auto* in_scales = reinterpret_cast<const float*>(scales);
  void* output = reinterpret_cast<void*>(out);
  const int64_t total = (reduce ? 1 : rows) * l.blocks_per_row;
#pragma omp parallel for schedule(static) if (total * block_size * (reduce ? rows : 1) > (1 << 16))
  for (int64_t b = 0; b < total; ++b) {
    const int64_t first_row = reduce ? 0 : b / l.blocks_per_row;
    const int64_t last_row = reduce ? rows : first_row + 1;
    const int64_t block = b % l.blocks_per_row, start = block * block_size;
    const int64_t end = std::min(numel, start + block_size);
    float acc[kChunk];
    for (int64_t begin = start; begin < end; begin += kChunk) {
      const int64_t stop = std::min(end, begin + kChunk);
      if (first_row == last_row) std::fill(acc, acc + (stop - begin), 0.0f);  // no rows
      for (int64_t r = first_row; r < last_row; ++r) {
        add_terms(in_values + r * l.value_row_bytes, bits, in_scales[r * l.blocks_per_row + block],
                  begin, stop, r == first_row, acc);
      }
      store_all(output, dtype, first_row * numel + begin, acc, stop - begin);
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Block-wise symmetric int8 / int4 quantization (ZeRO++ qwZ, qgZ) on the CPU";
  m.def("quantize", &quantize, py::call_guard<py::gil_scoped_release>(),
        "Quantize rows x numel elements at `input` into values and fp32 scales", py::arg("input"),
        py::arg("dtype"), py::arg("rows"), py::arg("numel"), py::arg("block_size"),
        py::arg("bits"), py::arg("values"), py::arg("scales"));
  m.def("dequantize", &dequantize, py::call_guard<py::gil_scoped_release>(),
        "Dequantize rows x numel elements into `out` (or their sum over rows: reduce)",
        py::arg("values"), py::arg("scales"), py::arg("rows"), py::arg("numel"),
        py::arg("block_size"), py::arg("bits"), py::arg("out"), py::arg("dtype"),
        py::arg("reduce"));
}
