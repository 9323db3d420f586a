// Torch bindings of fused_adam.cu: checks the tensor lists and hands raw pointers to the launcher.
//
// Same arguments as cpu_adam's adam_step, with lists of tensors instead of one tensor and the
// CUDA stream (torch.cuda.current_stream().cuda_stream) to launch on.

#include <torch/extension.h>

#include <cmath>
#include <vector>

int64_t fused_adam_num_items(const int64_t* numels, int num_tensors);
int64_t fused_adam_table_bytes(int num_tensors, int64_t num_items);
int fused_adam_launch(const int64_t* pointers, const int64_t* numels, int num_tensors,
                      int low_precision, void* host_table, void* device_table,
                      const float* coeffs, void* stream_handle);

namespace {

void check_cuda_fp32(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "fused_adam: ", name,
              " must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), "fused_adam: ", name,
              " must be contiguous float32");
  TORCH_CHECK(t.numel() == like.numel(), "fused_adam: ", name, " has ", t.numel(),
              " elements, its parameter ", like.numel());
}

}  // namespace

void adam_step(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
               std::vector<torch::Tensor> exp_avgs, std::vector<torch::Tensor> exp_avg_sqs,
               int64_t step, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool bias_correction, bool adamw_mode,
               c10::optional<std::vector<torch::Tensor>> low_precision_outs, int64_t stream) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "fused_adam: params, grads, exp_avgs and exp_avg_sqs must have equal lengths");
  TORCH_CHECK(step >= 1, "fused_adam: step must be >= 1, got ", step);
  if (n == 0) return;
  int low_precision = 0;
  if (low_precision_outs.has_value()) {
    TORCH_CHECK(low_precision_outs->size() == n, "fused_adam: one low-precision output per param");
    const auto dtype = (*low_precision_outs)[0].scalar_type();
    TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kHalf,
                "fused_adam: low-precision outputs must be bfloat16 or float16");
    low_precision = dtype == torch::kBFloat16 ? 1 : 2;
  }
  std::vector<int64_t> pointers(5 * n), numels(n);
  for (size_t t = 0; t < n; ++t) {
    check_cuda_fp32(params[t], params[t], "params");
    check_cuda_fp32(grads[t], params[t], "grads");
    check_cuda_fp32(exp_avgs[t], params[t], "exp_avgs");
    check_cuda_fp32(exp_avg_sqs[t], params[t], "exp_avg_sqs");
    int64_t out_ptr = 0;
    if (low_precision) {
      const auto& out = (*low_precision_outs)[t];
      TORCH_CHECK(out.device() == params[t].device() && out.is_contiguous() &&
                      out.numel() == params[t].numel() &&
                      out.scalar_type() == (*low_precision_outs)[0].scalar_type(),
                  "fused_adam: low-precision outputs must be contiguous, one dtype, on the "
                  "parameter's device with its element count");
      out_ptr = reinterpret_cast<int64_t>(out.data_ptr());
    }
    pointers[5 * t] = reinterpret_cast<int64_t>(params[t].data_ptr());
    pointers[5 * t + 1] = reinterpret_cast<int64_t>(grads[t].data_ptr());
    pointers[5 * t + 2] = reinterpret_cast<int64_t>(exp_avgs[t].data_ptr());
    pointers[5 * t + 3] = reinterpret_cast<int64_t>(exp_avg_sqs[t].data_ptr());
    pointers[5 * t + 4] = out_ptr;
    numels[t] = params[t].numel();
  }
  const int64_t items = fused_adam_num_items(numels.data(), static_cast<int>(n));
  const int64_t bytes = fused_adam_table_bytes(static_cast<int>(n), items);
  // Pageable host memory: cudaMemcpyAsync has staged it by the time it returns, so the table
  // may be freed at once. The device table is freed on the launch stream (the caching
  // allocator reuses it only for work ordered after the kernel).
  auto host_table = torch::empty({bytes}, torch::kUInt8);
  auto device_table = torch::empty({bytes}, params[0].options().dtype(torch::kUInt8));
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  const float coeffs[8] = {
      static_cast<float>(1.0 - beta1),
      static_cast<float>(beta2),
      static_cast<float>(1.0 - beta2),
      static_cast<float>(eps),
      adamw_mode ? 0.0f : static_cast<float>(weight_decay),
      adamw_mode ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f,
      static_cast<float>(-lr / bc1),
      static_cast<float>(1.0 / std::sqrt(bc2)),
  };
  const int err = fused_adam_launch(pointers.data(), numels.data(), static_cast<int>(n),
                                    low_precision, host_table.data_ptr(),
                                    device_table.data_ptr(), coeffs,
                                    reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "fused_adam: CUDA error ", err, " launching the kernel");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "Multi-tensor fused Adam/AdamW step on CUDA fp32 tensors",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("bias_correction"), py::arg("adamw_mode"),
        py::arg("low_precision_outs") = py::none(), py::arg("stream") = 0);
}
