// cpu_adam: one fused pass of Adam / AdamW over fp32 master parameters on the host.
//
// Serves ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload", section 4.2: the CPU optimizer): the
// fp32 parameters, gradients and both moments live in host memory, and the step is bound by
// memory bandwidth, so everything an element needs is done in one pass while its cache line is
// resident: weight decay, both moments, bias correction, the update, and (optionally) the
// bf16 / fp16 copy of the new value that goes back to the device.
//
// The SIMD path is chosen at compile time by the builder (ops/builder.py) through
// ZERO_SIMD_AVX512 or ZERO_SIMD_AVX2; with neither, the plain loop is used (the compiler may
// still vectorize it). Every path ends in the same scalar tail, so any element count works.
//
// [Note: numerics]
// The order of operations follows torch.optim.Adam's single-tensor path so results agree to
// rounding: m = m + (1 - beta1) * (g - m)  (torch's lerp), v = beta2 * v + (1 - beta2) * g * g,
// denom = sqrt(v) / sqrt(1 - beta2^t) + eps, p = p - lr / (1 - beta1^t) * m / denom.
// Scalars are computed in double (as Python does) and rounded to float once per call.
// Fused multiply-adds and a reciprocal in place of one division make the result differ from
// torch by a few ulp per step, never systematically.

#include <torch/extension.h>

#include <omp.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(ZERO_SIMD_AVX512) || defined(ZERO_SIMD_AVX2)
#include <immintrin.h>
#endif

namespace {

enum class LowPrecision { kNone, kBFloat16, kHalf };

struct Coeffs {
  float lr;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;  // L2 (Adam) only; 0 when adamw_mode
  float decay_factor;  // 1 - lr * weight_decay (AdamW) or 1
  float neg_step_size;  // -lr / (1 - beta1^t)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t)
};

// Chunk boundaries between threads fall on multiples of this many elements: a 64-byte cache line
// of the narrowest array (the 2-byte copy), so no line is written by two threads.
constexpr int64_t kLineElements = 32;
// Below this many elements one thread is faster than waking the team.
constexpr int64_t kParallelMin = 1 << 15;
// From this many elements on, the low-precision copy is written with streaming stores: the step
// then moves 64 MiB of fp32 arrays, more than a last-level cache, so the copy would not stay in
// cache for its reader anyway.
constexpr int64_t kStreamCopyMin = 1 << 22;

// [Note: one pass, plain stores]
// The step is bound by memory bandwidth for any tensor much larger than the cache: at 50M
// elements it runs as fast as traffic_only_step, which moves the same 28 bytes per element with
// no arithmetic (benchmarks/adam_throughput.py times both). So the loop only has to keep the
// memory system busy: each thread takes one contiguous chunk (one stream per array, what the
// hardware prefetchers follow) and touches every element once. Measured on the 2-core AMD
// development machine and kept out: non-temporal (streaming) stores of params and moments ran
// 2.5x slower (the loads have just brought those lines into the cache; streaming stores pay off
// only for lines that are written without being read); software prefetch, unrolling to a whole
// cache line per array, and dynamic scheduling under load changed nothing. In cache the loop is
// bound by the divider instead (one sqrt and one division per element, which parity with torch
// requires), at 2.5-3 Gelem/s per core.
//
// [Note: streaming the copy]
// The low-precision copy is the one array the step only writes. A plain store first reads each
// of its cache lines from memory (write-allocate), so the copy costs 4 bytes per element, not 2;
// a streaming store writes the line without reading it. For large tensors (kStreamCopyMin) the
// copy is streamed: at 50M elements the step with a bf16 copy ran 2-9% faster than with plain
// stores (A/B in one process on the loaded development machine), as 30 instead of 32 bytes per
// element predicts.

// Runs fn(begin, end) on one contiguous chunk per OpenMP thread (inline below kParallelMin).
// Equal chunks rather than fixed-size blocks: 64K-element blocks split a 200K-element tensor
// 128K / 72K between two threads; in cache, where the step is compute-bound, equal halves ran
// 1.25-1.6x faster for 70K to 300K elements.
template <typename Fn>
void parallel_chunks(int64_t n, const Fn& fn) {
  if (n < kParallelMin) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel
  {
    const int64_t num_threads = omp_get_num_threads();
    const int64_t thread = omp_get_thread_num();
    const int64_t lines = (n + kLineElements - 1) / kLineElements;
    const int64_t begin = std::min(n, lines * thread / num_threads * kLineElements);
    const int64_t end = std::min(n, lines * (thread + 1) / num_threads * kLineElements);
    fn(begin, end);
  }
}

inline uint16_t bf16_bits(float x) {
  // Round to nearest even, NaN to the canonical quiet NaN, as c10::BFloat16 does.
  if (std::isnan(x)) return UINT16_C(0x7FC0);
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  u += UINT32_C(0x7FFF) + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

template <LowPrecision L>
inline void store_low_scalar(void* out, int64_t i, float x) {
  if constexpr (L == LowPrecision::kBFloat16) {
    static_cast<uint16_t*>(out)[i] = bf16_bits(x);
  } else if constexpr (L == LowPrecision::kHalf) {
    static_cast<c10::Half*>(out)[i] = c10::Half(x);
  }
}

template <LowPrecision L, bool kL2>
void adam_scalar(float* p, const float* g, float* m, float* v, void* out, int64_t begin,
                 int64_t end, const Coeffs& c) {
  for (int64_t i = begin; i < end; ++i) {
    float param = p[i] * c.decay_factor;
    // Only Adam's L2 mode touches the gradient: 0 * inf would turn an inf parameter into NaN.
    float grad = kL2 ? std::fma(c.weight_decay, p[i], g[i]) : g[i];
    float exp_avg = std::fma(c.one_minus_beta1, grad - m[i], m[i]);
    float exp_avg_sq = std::fma(c.one_minus_beta2 * grad, grad, v[i] * c.beta2);
    float denom = std::fma(std::sqrt(exp_avg_sq), c.inv_bc2_sqrt, c.eps);
    param = std::fma(c.neg_step_size, exp_avg / denom, param);
    p[i] = param;
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
    store_low_scalar<L>(out, i, param);
  }
}

#if defined(ZERO_SIMD_AVX512)

constexpr int64_t kWidth = 16;

inline void stream_fence() { _mm_sfence(); }

template <bool kStream>
inline void store_bits(void* out, int64_t i, __m256i bits) {
  auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
  if constexpr (kStream) {
    _mm256_stream_si256(dst, bits);  // dst is 32-byte aligned (see adam_range)
  } else {
    _mm256_storeu_si256(dst, bits);
  }
}

template <LowPrecision L, bool kStream>
inline void store_low_simd(void* out, int64_t i, __m512 x) {
  if constexpr (L == LowPrecision::kBFloat16) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    store_bits<kStream>(out, i, _mm512_cvtepi32_epi16(r));
  } else if constexpr (L == LowPrecision::kHalf) {
    store_bits<kStream>(out, i, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
}

template <LowPrecision L, bool kL2, bool kStream>
void adam_simd(float* p, const float* g, float* m, float* v, void* out, int64_t begin,
               int64_t end, const Coeffs& c) {
  const __m512 decay = _mm512_set1_ps(c.decay_factor);
  const __m512 wd = _mm512_set1_ps(c.weight_decay);
  const __m512 b2 = _mm512_set1_ps(c.beta2);
  const __m512 omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(c.eps);
  const __m512 nss = _mm512_set1_ps(c.neg_step_size);
  const __m512 ibc2 = _mm512_set1_ps(c.inv_bc2_sqrt);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    const __m512 p0 = _mm512_loadu_ps(p + i);
    const __m512 g0 = _mm512_loadu_ps(g + i);
    const __m512 grad = kL2 ? _mm512_fmadd_ps(wd, p0, g0) : g0;
    const __m512 m0 = _mm512_loadu_ps(m + i);
    const __m512 exp_avg = _mm512_fmadd_ps(omb1, _mm512_sub_ps(grad, m0), m0);
    const __m512 exp_avg_sq = _mm512_fmadd_ps(_mm512_mul_ps(omb2, grad), grad,
                                              _mm512_mul_ps(_mm512_loadu_ps(v + i), b2));
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(exp_avg_sq), ibc2, eps);
    const __m512 param =
        _mm512_fmadd_ps(nss, _mm512_div_ps(exp_avg, denom), _mm512_mul_ps(p0, decay));
    _mm512_storeu_ps(p + i, param);
    _mm512_storeu_ps(m + i, exp_avg);
    _mm512_storeu_ps(v + i, exp_avg_sq);
    store_low_simd<L, kStream>(out, i, param);
  }
  adam_scalar<L, kL2>(p, g, m, v, out, i, end, c);
}

#elif defined(ZERO_SIMD_AVX2)

constexpr int64_t kWidth = 8;

inline void stream_fence() { _mm_sfence(); }

template <bool kStream>
inline void store_bits(void* out, int64_t i, __m128i bits) {
  auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
  if constexpr (kStream) {
    _mm_stream_si128(dst, bits);  // dst is 16-byte aligned (see adam_range)
  } else {
    _mm_storeu_si128(dst, bits);
  }
}

template <LowPrecision L, bool kStream>
inline void store_low_simd(void* out, int64_t i, __m256 x) {
  if constexpr (L == LowPrecision::kBFloat16) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    // packus works within 128-bit lanes; the permute brings the 8 halves together. Values are
    // at most 0xFFFF, so the unsigned saturation never changes one.
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    store_bits<kStream>(out, i, _mm256_castsi256_si128(r));
  } else if constexpr (L == LowPrecision::kHalf) {
    store_bits<kStream>(out, i, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
}

template <LowPrecision L, bool kL2, bool kStream>
void adam_simd(float* p, const float* g, float* m, float* v, void* out, int64_t begin,
               int64_t end, const Coeffs& c) {
  const __m256 decay = _mm256_set1_ps(c.decay_factor);
  const __m256 wd = _mm256_set1_ps(c.weight_decay);
  const __m256 b2 = _mm256_set1_ps(c.beta2);
  const __m256 omb1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 nss = _mm256_set1_ps(c.neg_step_size);
  const __m256 ibc2 = _mm256_set1_ps(c.inv_bc2_sqrt);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    const __m256 p0 = _mm256_loadu_ps(p + i);
    const __m256 g0 = _mm256_loadu_ps(g + i);
    const __m256 grad = kL2 ? _mm256_fmadd_ps(wd, p0, g0) : g0;
    const __m256 m0 = _mm256_loadu_ps(m + i);
    const __m256 exp_avg = _mm256_fmadd_ps(omb1, _mm256_sub_ps(grad, m0), m0);
    const __m256 exp_avg_sq = _mm256_fmadd_ps(_mm256_mul_ps(omb2, grad), grad,
                                              _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
    const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(exp_avg_sq), ibc2, eps);
    const __m256 param =
        _mm256_fmadd_ps(nss, _mm256_div_ps(exp_avg, denom), _mm256_mul_ps(p0, decay));
    _mm256_storeu_ps(p + i, param);
    _mm256_storeu_ps(m + i, exp_avg);
    _mm256_storeu_ps(v + i, exp_avg_sq);
    store_low_simd<L, kStream>(out, i, param);
  }
  adam_scalar<L, kL2>(p, g, m, v, out, i, end, c);
}

#else

constexpr int64_t kWidth = 1;

inline void stream_fence() {}

template <LowPrecision L, bool kL2, bool kStream>
void adam_simd(float* p, const float* g, float* m, float* v, void* out, int64_t begin,
               int64_t end, const Coeffs& c) {
  static_assert(!kStream, "the scalar build has no streaming stores");
  adam_scalar<L, kL2>(p, g, m, v, out, begin, end, c);
}

#endif

constexpr bool kHasStreamingStores = kWidth > 1;

// One thread's chunk. With kStream the low-precision copy is written with streaming stores
// (see [Note: streaming the copy]): the elements before its first vector-aligned address go
// through the scalar loop, and a fence makes the stores visible before the team's barrier.
template <LowPrecision L, bool kL2, bool kStream>
void adam_range(float* p, const float* g, float* m, float* v, void* out, int64_t begin,
                int64_t end, const Coeffs& c) {
  if constexpr (kStream && kHasStreamingStores && L != LowPrecision::kNone) {
    constexpr uintptr_t kAlign = kWidth * sizeof(uint16_t);
    const auto address = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(out) + begin);
    const auto to_aligned = static_cast<int64_t>((-address % kAlign) / sizeof(uint16_t));
    const int64_t head = std::min(end, begin + to_aligned);
    adam_scalar<L, kL2>(p, g, m, v, out, begin, head, c);
    adam_simd<L, kL2, true>(p, g, m, v, out, head, end, c);
    stream_fence();
  } else {
    adam_simd<L, kL2, false>(p, g, m, v, out, begin, end, c);
  }
}

template <LowPrecision L, bool kL2>
void adam_all(float* p, const float* g, float* m, float* v, void* out, int64_t n,
              const Coeffs& c) {
  const bool stream = kHasStreamingStores && L != LowPrecision::kNone && n >= kStreamCopyMin;
  parallel_chunks(n, [&](int64_t begin, int64_t end) {
    if (stream) {
      adam_range<L, kL2, true>(p, g, m, v, out, begin, end, c);
    } else {
      adam_range<L, kL2, false>(p, g, m, v, out, begin, end, c);
    }
  });
}

template <LowPrecision L>
void dispatch_l2(bool l2, float* p, const float* g, float* m, float* v, void* out, int64_t n,
                 const Coeffs& c) {
  if (l2) {
    adam_all<L, true>(p, g, m, v, out, n, c);
  } else {
    adam_all<L, false>(p, g, m, v, out, n, c);
  }
}

void dispatch(LowPrecision kind, bool l2, float* p, const float* g, float* m, float* v,
              void* out, int64_t n, const Coeffs& c) {
  switch (kind) {
    case LowPrecision::kNone:
      return dispatch_l2<LowPrecision::kNone>(l2, p, g, m, v, out, n, c);
    case LowPrecision::kBFloat16:
      return dispatch_l2<LowPrecision::kBFloat16>(l2, p, g, m, v, out, n, c);
    case LowPrecision::kHalf:
      return dispatch_l2<LowPrecision::kHalf>(l2, p, g, m, v, out, n, c);
  }
}

Coeffs make_coeffs(int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, bool bias_correction, bool adamw_mode) {
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  Coeffs c;
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.weight_decay = adamw_mode ? 0.0f : static_cast<float>(weight_decay);
  c.decay_factor = adamw_mode ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.neg_step_size = static_cast<float>(-lr / bc1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  return c;
}

void check_fp32(const torch::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "cpu_adam: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, "cpu_adam: ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "cpu_adam: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "cpu_adam: ", name, " has ", t.numel(),
              " elements, params has ", numel);
}

}  // namespace

// Updates params, exp_avg and exp_avg_sq in place; writes the updated params, cast, into
// low_precision_out when given. step is the 1-based step count after this update.
void adam_step(torch::Tensor params, torch::Tensor grads, torch::Tensor exp_avg,
               torch::Tensor exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool bias_correction, bool adamw_mode,
               c10::optional<torch::Tensor> low_precision_out) {
  const int64_t n = params.numel();
  check_fp32(params, "params", n);
  check_fp32(grads, "grads", n);
  check_fp32(exp_avg, "exp_avg", n);
  check_fp32(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1, got ", step);
  const Coeffs c = make_coeffs(step, lr, beta1, beta2, eps, weight_decay, bias_correction,
                               adamw_mode);
  float* p = params.data_ptr<float>();
  const float* g = grads.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  LowPrecision kind = LowPrecision::kNone;
  void* out_ptr = nullptr;
  if (low_precision_out.has_value()) {
    const torch::Tensor& out = *low_precision_out;
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.numel() == n,
                "cpu_adam: low_precision_out must be a contiguous CPU tensor of ", n,
                " elements");
    TORCH_CHECK(out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kHalf,
                "cpu_adam: low_precision_out must be bfloat16 or float16, got ",
                out.scalar_type());
    kind = out.scalar_type() == torch::kBFloat16 ? LowPrecision::kBFloat16 : LowPrecision::kHalf;
    out_ptr = out.data_ptr();
  }
  dispatch(kind, !adamw_mode && weight_decay != 0.0, p, g, m, v, out_ptr, n, c);
}

// Moves the bytes adam_step moves, with none of its arithmetic: params, exp_avg and exp_avg_sq
// each += scale * grads, in one pass with the same threading (read four arrays, write three:
// 28 bytes per element). With scale 0 and finite grads the values stay as they are, so a
// benchmark can time it on an optimizer's own tensors as the memory-bandwidth bound of a step.
void traffic_only_step(torch::Tensor params, torch::Tensor grads, torch::Tensor exp_avg,
                       torch::Tensor exp_avg_sq, double scale) {
  const int64_t n = params.numel();
  check_fp32(params, "params", n);
  check_fp32(grads, "grads", n);
  check_fp32(exp_avg, "exp_avg", n);
  check_fp32(exp_avg_sq, "exp_avg_sq", n);
  float* __restrict__ p = params.data_ptr<float>();
  const float* __restrict__ g = grads.data_ptr<float>();
  float* __restrict__ m = exp_avg.data_ptr<float>();
  float* __restrict__ v = exp_avg_sq.data_ptr<float>();
  const float s = static_cast<float>(scale);
  parallel_chunks(n, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const float step = s * g[i];
      p[i] += step;
      m[i] += step;
      v[i] += step;
    }
  });
}

// Asks the kernel to back the 2 MiB-aligned interior of t with transparent huge pages; returns
// the bytes advised (0 where unsupported). Call before first touching the memory.
//
// [Note: huge pages] The step streams four arrays through memory; with 4 KiB pages the hardware
// prefetchers restart at every page boundary and each page costs a TLB miss. On this project's
// 2-core AMD machine huge-page-backed arrays stepped ~15% faster in a standalone test; a later
// interleaved A/B of all four arrays on huge against 4 KiB pages, on the same machine under
// load, showed no difference either way. Only memory the optimizer allocates itself (the
// moments) is advised; the caller owns the rest.
int64_t advise_huge_pages(torch::Tensor t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t begin = (base + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (base + t.nbytes()) & ~(kHuge - 1);
  if (end <= begin) return 0;
  if (madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) != 0) return 0;
  return static_cast<int64_t>(end - begin);
#else
  (void)t;
  return 0;
#endif
}

std::string simd_path() {
#if defined(ZERO_SIMD_AVX512)
  return "avx512";
#elif defined(ZERO_SIMD_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "Fused Adam/AdamW step over contiguous fp32 tensors",
        py::arg("params"), py::arg("grads"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("bias_correction"), py::arg("adamw_mode"),
        py::arg("low_precision_out") = py::none());
  m.def("advise_huge_pages", &advise_huge_pages,
        "madvise(MADV_HUGEPAGE) the 2 MiB-aligned interior of a CPU tensor; returns bytes");
  m.attr("stream_copy_min_numel") = kStreamCopyMin;
  m.def("traffic_only_step", &traffic_only_step,
        "x += scale * grads for params, exp_avg, exp_avg_sq: adam_step's memory traffic only",
        py::arg("params"), py::arg("grads"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("scale"));
  m.def("simd_path", &simd_path, "The SIMD path compiled in: avx512, avx2 or scalar");
  m.def("max_threads", &omp_get_max_threads, "OpenMP threads a step may use");
}
