// quantize (CUDA): the kernels of quantize.cpp for tensors on the GPU, same layout and numerics
// (see [Note: quantization numerics] in quantize.cpp).
//
// Quantize: one thread block per quantization block; each thread widens its strided elements to
// fp32, the block's |max| and "any non-finite" are reduced through shared memory, and the
// threads then write their values (int4: one byte, two neighbouring elements, per thread step).
// Dequantize: a grid-stride loop over elements (int4: over bytes), each summing its rows in row
// order when reducing. Products and sums use __fmul_rn / __fadd_rn so nvcc cannot contract them
// into a fused multiply-add, which would round differently from the CPU op and the reference.
//
// Only the CUDA runtime is included (no torch headers); quantize_cuda.cpp binds these launchers
// to Python with raw addresses and the stream to launch on.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr int kMaxGrid = 65535 * 8;

__device__ __forceinline__ float load(const void* data, int dtype, int64_t i) {
  if (dtype == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
  if (dtype == 2) return __half2float(static_cast<const __half*>(data)[i]);
  return static_cast<const float*>(data)[i];
}

__device__ __forceinline__ void store(void* data, int dtype, int64_t i, float value) {
  if (dtype == 1) {
    static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(value);
  } else if (dtype == 2) {
    static_cast<__half*>(data)[i] = __float2half_rn(value);
  } else {
    static_cast<float*>(data)[i] = value;
  }
}

struct Layout {
  int64_t rows, numel, block_size, blocks_per_row, value_row_bytes;
  int bits, qmax;
};

__device__ __forceinline__ int quantize_one(float x, float inv, float qmax, bool zero) {
  if (zero) return 0;
  const float q = rintf(__fmul_rn(x, inv));
  return static_cast<int>(fminf(qmax, fmaxf(-qmax, q)));
}

__global__ void quantize_kernel(const void* input, int dtype, Layout l, int8_t* values,
                                float* scales) {
  __shared__ float amax_shared[kThreads];
  __shared__ int finite_shared;
  for (int64_t b = blockIdx.x; b < l.rows * l.blocks_per_row; b += gridDim.x) {
    const int64_t row = b / l.blocks_per_row, start = (b % l.blocks_per_row) * l.block_size;
    const int64_t count = min(l.block_size, l.numel - start);
    const int64_t base = row * l.numel + start;
    float amax = 0.0f;
    int finite = 1;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
      const float a = fabsf(load(input, dtype, base + i));
      finite &= isfinite(a) ? 1 : 0;
      amax = a > amax ? a : amax;
    }
    if (threadIdx.x == 0) finite_shared = 1;
    amax_shared[threadIdx.x] = amax;
    __syncthreads();
    if (!finite) atomicAnd(&finite_shared, 0);
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
      if (threadIdx.x < stride) {
        const float other = amax_shared[threadIdx.x + stride];
        amax_shared[threadIdx.x] = other > amax_shared[threadIdx.x] ? other : amax_shared[threadIdx.x];
      }
      __syncthreads();
    }
    amax = amax_shared[0];
    const bool all_finite = finite_shared != 0;
    const float qmax = static_cast<float>(l.qmax);
    const bool zero = !all_finite || amax == 0.0f;
    const float inv = zero ? 0.0f : __fdiv_rn(qmax, amax);
    if (threadIdx.x == 0) scales[b] = all_finite ? __fdiv_rn(amax, qmax) : __int_as_float(0x7fc00000);
    const int64_t byte = row * l.value_row_bytes + (l.bits == 8 ? start : start / 2);
    if (l.bits == 8) {
      for (int64_t i = threadIdx.x; i < count; i += blockDim.x)
        values[byte + i] = static_cast<int8_t>(quantize_one(load(input, dtype, base + i), inv, qmax, zero));
    } else {
      auto* packed = reinterpret_cast<uint8_t*>(values) + byte;
      for (int64_t k = threadIdx.x; 2 * k < count; k += blockDim.x) {
        const int low = quantize_one(load(input, dtype, base + 2 * k), inv, qmax, zero) & 0xf;
        const int high = 2 * k + 1 < count
                             ? quantize_one(load(input, dtype, base + 2 * k + 1), inv, qmax, zero) & 0xf
                             : 0;
        packed[k] = static_cast<uint8_t>(low | (high << 4));
      }
    }
    __syncthreads();  // the shared memory is reused by the next block of this loop
  }
}

__device__ __forceinline__ int value_at(const uint8_t* row, int bits, int64_t i) {
  if (bits == 8) return static_cast<int8_t>(row[i]);
  const int nibble = (row[i / 2] >> ((i & 1) * 4)) & 0xf;
  return nibble >= 8 ? nibble - 16 : nibble;
}

__global__ void dequantize_kernel(const uint8_t* values, const float* scales, Layout l, void* out,
                                  int dtype, bool reduce) {
  const int64_t out_rows = reduce ? 1 : l.rows;
  const int64_t total = out_rows * l.numel;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t first_row = reduce ? 0 : e / l.numel;
    const int64_t last_row = reduce ? l.rows : first_row + 1;
    const int64_t i = e % l.numel, block = i / l.block_size;
    float acc = 0.0f;
    for (int64_t r = first_row; r < last_row; ++r) {
      const float term = __fmul_rn(static_cast<float>(value_at(values + r * l.value_row_bytes, l.bits, i)),
                                   scales[r * l.blocks_per_row + block]);
      acc = r == first_row ? term : __fadd_rn(acc, term);
    }
    store(out, dtype, e, acc);
  }
}

Layout make_layout(int64_t rows, int64_t numel, int64_t block_size, int bits) {
  Layout l;
  l.rows = rows;
  l.numel = numel;
  l.block_size = block_size;
  l.bits = bits;
  l.blocks_per_row = (numel + block_size - 1) / block_size;
  l.value_row_bytes = bits == 8 ? numel : (numel + 1) / 2;
  l.qmax = (1 << (bits - 1)) - 1;
  return l;
}

}  // namespace

// Both return cudaGetLastError() after the launch (0: launched). Sizes are checked by the caller.
int quantize_cuda_launch(const void* input, int dtype, int64_t rows, int64_t numel,
                         int64_t block_size, int bits, void* values, void* scales, void* stream) {
  const Layout l = make_layout(rows, numel, block_size, bits);
  const int64_t blocks = rows * l.blocks_per_row;
  if (blocks == 0) return 0;
  const int grid = static_cast<int>(blocks < kMaxGrid ? blocks : kMaxGrid);
  quantize_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      input, dtype, l, static_cast<int8_t*>(values), static_cast<float*>(scales));
  return static_cast<int>(cudaGetLastError());
}

int dequantize_cuda_launch(const void* values, const void* scales, int64_t rows, int64_t numel,
                           int64_t block_size, int bits, void* out, int dtype, bool reduce,
                           void* stream) {
  const Layout l = make_layout(rows, numel, block_size, bits);
  const int64_t total = (reduce ? 1 : rows) * numel;
  if (total == 0) return 0;
  const int64_t wanted = (total + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(wanted < kMaxGrid ? wanted : kMaxGrid);
  dequantize_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(values), static_cast<const float*>(scales), l, out, dtype,
      reduce);
  return static_cast<int>(cudaGetLastError());
}
