// Skinny bfloat16 matmul for decode: y[B, N] = x[B, K] . W[N, K]^T (+ bias), B small.
// y is bfloat16, or float32 when asked (logits: bfloat16 output would round them to steps of
// 0.125 near 20 and turn real margins into ties).
//
// Decode reads every weight once per step, so the kernel's job is to stream W at memory
// speed: each thread takes a range of rows, loads 32 bf16 weights at a time and multiplies
// them with every input row using AVX-512 BF16 dot products (16 fp32 accumulators per input
// row, reduced at the end). Inputs are bf16 already; accumulation is fp32.
#include "torch_ops.h"
#include <immintrin.h>

namespace {

constexpr int64_t kMaxBatch = 8;

// R rows at a time: each x vector load serves R rows and R*B accumulators keep the
// loads of several weight rows in flight.
template <int B, int R, typename out_t>
void rows_block(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
                out_t* y, int64_t K, int64_t N, int64_t n0) {
  const int64_t k_vec = K / 32 * 32;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_vec; k += 32) {
    __m512bh xv[B];
    for (int b = 0; b < B; ++b)
      xv[b] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + b * K + k));
    for (int r = 0; r < R; ++r) {
      const at::BFloat16* w_ptr = w + (n0 + r) * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(w_ptr + R * K), _MM_HINT_T0);  // next block's row
      __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w_ptr));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wv, xv[b]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const at::BFloat16* w_row = w + (n0 + r) * K;
    for (int b = 0; b < B; ++b) {
      float sum = _mm512_reduce_add_ps(acc[r][b]);
      for (int64_t k = k_vec; k < K; ++k) sum += static_cast<float>(w_row[k]) * static_cast<float>(x[b * K + k]);
      if (bias != nullptr) sum += static_cast<float>(bias[n0 + r]);
      y[b * N + n0 + r] = static_cast<out_t>(sum);
    }
  }
}

template <int B, typename out_t>
void rows_kernel(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
                 out_t* y, int64_t K, int64_t N, int64_t row_begin, int64_t row_end) {
  constexpr int R = B <= 2 ? 4 : 2;
  int64_t n = row_begin;
  for (; n + R <= row_end; n += R) rows_block<B, R, out_t>(x, w, bias, y, K, N, n);
  for (; n < row_end; ++n) rows_block<B, 1, out_t>(x, w, bias, y, K, N, n);
}

template <int B, typename out_t>
void run(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, out_t* y,
         int64_t K, int64_t N) {
  // grain: enough rows per task that a thread streams a few hundred KB at a time
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    rows_kernel<B, out_t>(x, w, bias, y, K, N, begin, end);
  });
}

template <typename out_t>
void dispatch_batch(int64_t B, const at::BFloat16* xp, const at::BFloat16* wp, const at::BFloat16* bias,
                    out_t* yp, int64_t K, int64_t N) {
  switch (B) {
    case 1: run<1, out_t>(xp, wp, bias, yp, K, N); break;
    case 2: run<2, out_t>(xp, wp, bias, yp, K, N); break;
    case 3: run<3, out_t>(xp, wp, bias, yp, K, N); break;
    case 4: run<4, out_t>(xp, wp, bias, yp, K, N); break;
    case 5: run<5, out_t>(xp, wp, bias, yp, K, N); break;
    case 6: run<6, out_t>(xp, wp, bias, yp, K, N); break;
    case 7: run<7, out_t>(xp, wp, bias, yp, K, N); break;
    default: run<8, out_t>(xp, wp, bias, yp, K, N); break;
  }
}

}  // namespace

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "gemv_bf16: x [B, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bfloat16 only");
  TORCH_CHECK(x.size(1) == w.size(1), "gemv_bf16: K mismatch ", x.size(1), " vs ", w.size(1));
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxBatch, "gemv_bf16: batch must be 1..", kMaxBatch);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "gemv_bf16: contiguous inputs only");
  const at::BFloat16* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == w.size(0),
                "gemv_bf16: bias must be contiguous bfloat16 [N]");
    bias_ptr = bias->data_ptr<at::BFloat16>();
  }
  const int64_t B = x.size(0), K = x.size(1), N = w.size(0);
  auto* xp = x.data_ptr<at::BFloat16>();
  auto* wp = w.data_ptr<at::BFloat16>();
  if (float_out) {
    auto y = at::empty({B, N}, x.options().dtype(at::kFloat));
    dispatch_batch<float>(B, xp, wp, bias_ptr, y.data_ptr<float>(), K, N);
    return y;
  }
  auto y = at::empty({B, N}, x.options());
  dispatch_batch<at::BFloat16>(B, xp, wp, bias_ptr, y.data_ptr<at::BFloat16>(), K, N);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL while it computes (cpu_ops.cpp says why).
  const auto kNoGil = py::call_guard<py::gil_scoped_release>();
  m.def("gemv_bf16", &gemv_bf16, "skinny bfloat16 matmul (AVX-512 BF16)", kNoGil, py::arg("x"), py::arg("w"),
        py::arg("bias"), py::arg("float_out") = false);
}
