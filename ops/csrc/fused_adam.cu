// fused_adam: Adam / AdamW over many fp32 CUDA tensors in one kernel launch.
//
// The same step as cpu_adam.cpp (see its [Note: numerics]) for parameters that stay on the GPU.
// Launching one kernel per tensor costs a launch (~5 us) per parameter; instead the host builds a
// table of (tensor, chunk) work items and one launch covers every tensor: block b handles the
// kChunk elements of work item b. The table is uploaded into one device buffer per call.
//
// This file uses only the CUDA runtime (no torch headers) so nvcc compiles it quickly and on
// its own; fused_adam.cpp holds the torch bindings and passes raw pointers and the stream.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 1 << 16;

struct Coeffs {
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float decay_factor;
  float neg_step_size;
  float inv_bc2_sqrt;
};

// One row per tensor; work items point into it.
struct TensorRow {
  float* params;
  const float* grads;
  float* exp_avg;
  float* exp_avg_sq;
  void* low_precision_out;
  int64_t numel;
};

struct WorkItem {
  int32_t tensor;
  int32_t chunk;
};

template <int kLowPrecision>  // 0 none, 1 bf16, 2 fp16
__global__ void adam_kernel(const TensorRow* rows, const WorkItem* items, Coeffs c) {
  const WorkItem item = items[blockIdx.x];
  const TensorRow row = rows[item.tensor];
  const int64_t begin = static_cast<int64_t>(item.chunk) * kChunk;
  const int64_t end = min(row.numel, begin + kChunk);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float p0 = row.params[i];
    // Only Adam's L2 mode touches the gradient: 0 * inf would turn an inf parameter into NaN.
    const float grad = c.weight_decay != 0.0f ? fmaf(c.weight_decay, p0, row.grads[i]) : row.grads[i];
    const float m0 = row.exp_avg[i];
    const float exp_avg = fmaf(c.one_minus_beta1, grad - m0, m0);
    const float exp_avg_sq = fmaf(c.one_minus_beta2 * grad, grad, row.exp_avg_sq[i] * c.beta2);
    const float denom = fmaf(sqrtf(exp_avg_sq), c.inv_bc2_sqrt, c.eps);
    const float param = fmaf(c.neg_step_size, exp_avg / denom, p0 * c.decay_factor);
    row.params[i] = param;
    row.exp_avg[i] = exp_avg;
    row.exp_avg_sq[i] = exp_avg_sq;
    if constexpr (kLowPrecision == 1) {
      static_cast<__nv_bfloat16*>(row.low_precision_out)[i] = __float2bfloat16_rn(param);
    } else if constexpr (kLowPrecision == 2) {
      static_cast<__half*>(row.low_precision_out)[i] = __float2half_rn(param);
    }
  }
}

}  // namespace

// Number of work items the tensors need (the host sizes its table with it).
int64_t fused_adam_num_items(const int64_t* numels, int num_tensors) {
  int64_t items = 0;
  for (int t = 0; t < num_tensors; ++t) items += (numels[t] + kChunk - 1) / kChunk;
  return items;
}

// Fills `table` (host memory, see fused_adam.cpp for the size) with rows then work items,
// copies it to `device_table` on `stream` and launches. Returns the CUDA error code.
int fused_adam_launch(const int64_t* pointers, const int64_t* numels, int num_tensors,
                      int low_precision, void* host_table, void* device_table,
                      const float* coeffs, void* stream_handle) {
  auto* rows = static_cast<TensorRow*>(host_table);
  for (int t = 0; t < num_tensors; ++t) {
    rows[t] = TensorRow{reinterpret_cast<float*>(pointers[5 * t]),
                        reinterpret_cast<const float*>(pointers[5 * t + 1]),
                        reinterpret_cast<float*>(pointers[5 * t + 2]),
                        reinterpret_cast<float*>(pointers[5 * t + 3]),
                        reinterpret_cast<void*>(pointers[5 * t + 4]), numels[t]};
  }
  auto* items = reinterpret_cast<WorkItem*>(rows + num_tensors);
  int64_t num_items = 0;
  for (int t = 0; t < num_tensors; ++t) {
    const int64_t chunks = (numels[t] + kChunk - 1) / kChunk;
    for (int64_t k = 0; k < chunks; ++k) items[num_items++] = WorkItem{t, static_cast<int32_t>(k)};
  }
  if (num_items == 0) return 0;
  const size_t bytes = sizeof(TensorRow) * num_tensors + sizeof(WorkItem) * num_items;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  cudaError_t err = cudaMemcpyAsync(device_table, host_table, bytes, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return static_cast<int>(err);
  const auto* d_rows = static_cast<const TensorRow*>(device_table);
  const auto* d_items = reinterpret_cast<const WorkItem*>(d_rows + num_tensors);
  const Coeffs c{coeffs[0], coeffs[1], coeffs[2], coeffs[3],
                 coeffs[4], coeffs[5], coeffs[6], coeffs[7]};
  const dim3 grid(static_cast<unsigned>(num_items));
  if (low_precision == 1) {
    adam_kernel<1><<<grid, kThreads, 0, stream>>>(d_rows, d_items, c);
  } else if (low_precision == 2) {
    adam_kernel<2><<<grid, kThreads, 0, stream>>>(d_rows, d_items, c);
  } else {
    adam_kernel<0><<<grid, kThreads, 0, stream>>>(d_rows, d_items, c);
  }
  return static_cast<int>(cudaGetLastError());
}

// Bytes the host and device tables need for these tensors.
int64_t fused_adam_table_bytes(int num_tensors, int64_t num_items) {
  return static_cast<int64_t>(sizeof(TensorRow)) * num_tensors +
         static_cast<int64_t>(sizeof(WorkItem)) * num_items;
}
