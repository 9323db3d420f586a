// Python bindings of quantize.cu: raw addresses of contiguous CUDA tensors, the dtype code
// (0 fp32, 1 bf16, 2 fp16) and the stream to launch on (torch.cuda.current_stream().cuda_stream).
// Same functions and arguments as quantize.cpp's, plus `stream`; ops/quantize.py checks devices,
// dtypes and sizes and makes the tensors' device current before calling. Only pybind11 is
// included, as in quantize.cpp.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace py = pybind11;

int quantize_cuda_launch(const void* input, int dtype, int64_t rows, int64_t numel,
                         int64_t block_size, int bits, void* values, void* scales, void* stream);
int dequantize_cuda_launch(const void* values, const void* scales, int64_t rows, int64_t numel,
                           int64_t block_size, int bits, void* out, int dtype, bool reduce,
                           void* stream);

namespace {

void check(int64_t rows, int64_t numel, int64_t block_size, int bits, int dtype) {
  if (bits != 8 && bits != 4) throw std::invalid_argument("quantize_cuda: bits must be 8 or 4");
  if (block_size < 1 || (bits == 4 && block_size % 2 != 0))
    throw std::invalid_argument("quantize_cuda: block_size must be >= 1 (and even for int4)");
  if (rows < 0 || numel < 0) throw std::invalid_argument("quantize_cuda: negative size");
  if (dtype < 0 || dtype > 2)
    throw std::invalid_argument("quantize_cuda: dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
}

void launched(int error, const char* what) {
  if (error != 0)
    throw std::runtime_error(std::string("quantize_cuda: CUDA error ") + std::to_string(error) +
                             " launching " + what);
}

void quantize(uintptr_t input, int dtype, int64_t rows, int64_t numel, int64_t block_size,
              int bits, uintptr_t values, uintptr_t scales, uintptr_t stream) {
  check(rows, numel, block_size, bits, dtype);
  launched(quantize_cuda_launch(reinterpret_cast<const void*>(input), dtype, rows, numel,
                                block_size, bits, reinterpret_cast<void*>(values),
                                reinterpret_cast<void*>(scales), reinterpret_cast<void*>(stream)),
           "quantize");
}

void dequantize(uintptr_t values, uintptr_t scales, int64_t rows, int64_t numel,
                int64_t block_size, int bits, uintptr_t out, int dtype, bool reduce,
                uintptr_t stream) {
  check(rows, numel, block_size, bits, dtype);
  launched(dequantize_cuda_launch(reinterpret_cast<const void*>(values),
                                  reinterpret_cast<const void*>(scales), rows, numel, block_size,
                                  bits, reinterpret_cast<void*>(out), dtype, reduce,
                                  reinterpret_cast<void*>(stream)),
           "dequantize");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Block-wise symmetric int8 / int4 quantization (ZeRO++ qwZ, qgZ) on CUDA";
  m.def("quantize", &quantize, "Quantize rows x numel elements on `stream`", py::arg("input"),
        py::arg("dtype"), py::arg("rows"), py::arg("numel"), py::arg("block_size"),
        py::arg("bits"), py::arg("values"), py::arg("scales"), py::arg("stream"));
  m.def("dequantize", &dequantize, "Dequantize (or reduce over rows) on `stream`",
        py::arg("values"), py::arg("scales"), py::arg("rows"), py::arg("numel"),
        py::arg("block_size"), py::arg("bits"), py::arg("out"), py::arg("dtype"),
        py::arg("reduce"), py::arg("stream"));
}
