// Decode matmuls on weights kept as exact blocks: y[B, N] = x[B, K] . W[N, K]^T (+ bias), float32.
//
// A checkpoint dequantized from a GGUF (tandem's default model comes as one) holds float32
// weights that are block-quantized values: each run of 32 along a row is q * d + m (4-bit q,
// float16 d and m: llama.cpp's Q4_1) or q * d (8-bit q: Q8_0). pack_q4_1 / pack_q8_0 find the
// blocks of such a weight, and give up unless every element is reproduced bit for bit, so the
// packed copy is the same weight in 6 (Q4_1) or 9 (Q8_0) bits an element instead of 32
// (the scales kept as float32). A
// decode step reads every weight once; reading 5 bits instead of 32 is where its time goes.
//
// The matmul rebuilds each block's 32 floats in registers (q * d + m is exact in float32: d
// has 11 significant bits and q at most 8, so the only rounding is the one the dequantizer
// made), once for all rows of x, and accumulates in float32 like a float32 matmul (the sum's
// order differs, as between any two float32 kernels). Portable C++ (GCC vector extensions of
// the registers' width) built with -march=native: AVX-512, AVX2, or plain C++ elsewhere.
#include "torch_ops.h"
#include <c10/util/Half.h>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

constexpr int64_t kBlock = 32;

// vreg: one register of floats at the machine's width (vec_math.h)
typedef vreg vf;
typedef vreg_i32 vi;
constexpr int kLanes = kRegLanes;
constexpr int kParts = kBlock / kLanes;  // registers a block of 32 fills: 2 (AVX-512) or 4

// rows of x per pass over kRows weight rows: AVX-512's 32 registers hold 2 x 8 accumulators,
// AVX2's 16 hold 8, a block's 4 registers, x and the nibble mask
constexpr int kGroup = 8;
#if defined(__AVX512F__)
constexpr int kRows = 2;
#else
constexpr int kRows = 1;
#endif

inline float as_half(float v) { return static_cast<float>(static_cast<c10::Half>(v)); }

// kLanes bytes (unsigned, or signed) widened to kLanes int32 lanes: one vpmovzxbd / vpmovsxbd
// (GCC's own conversion of a byte vector goes through scalar registers)
template <bool Signed>
inline vi widen_bytes(const void* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vi)(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vi)(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  vi v;
  for (int i = 0; i < kLanes; ++i)
    v[i] = Signed ? static_cast<const int8_t*>(p)[i] : static_cast<const uint8_t*>(p)[i];
  return v;
#endif
}

inline float lanes_sum(vf v) {
  float total = 0.f;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// One weight row in Q4_1: 16 bytes a block (element i in the low nibble of byte i, element
// i + 16 in its high nibble), a scale and a minimum a block.
struct Q4Row {
  const uint8_t* qs;
  const float* d;
  const float* m;
  inline void block(int64_t j, vf (&w)[kParts]) const {
    const float scale = d[j], low = m[j];
    for (int h = 0; h < kParts / 2; ++h) {
      const vi v = widen_bytes<false>(qs + j * 16 + h * kLanes);
      w[h] = __builtin_convertvector(v & 15, vf) * scale + low;
      w[h + kParts / 2] = __builtin_convertvector(v >> 4, vf) * scale + low;
    }
  }
};

// One weight row in Q8_0: 32 signed bytes a block and a scale.
struct Q8Row {
  const int8_t* qs;
  const float* d;
  inline void block(int64_t j, vf (&w)[kParts]) const {
    const float scale = d[j];
    for (int p = 0; p < kParts; ++p)
      w[p] = __builtin_convertvector(widen_bytes<true>(qs + j * kBlock + p * kLanes), vf) * scale;
  }
};

// G rows of x against R weight rows (n, n + 1, ...): out[b * N + r] for b < G, r < R. Each
// block is rebuilt once for the G rows of x, and each load of x serves the R weight rows.
template <int G, int R, typename Row>
inline void dot_rows(const Row* row, const float* x, int64_t K, int64_t N, const float* add, float* out) {
  vf acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < G; ++b) acc[r][b] = vf{};
  const int64_t blocks = K / kBlock;
  for (int64_t j = 0; j < blocks; ++j) {
    vf w[R][kParts];
    for (int r = 0; r < R; ++r) row[r].block(j, w[r]);
    const float* xj = x + j * kBlock;
    for (int b = 0; b < G; ++b) {
      for (int p = 0; p < kParts; ++p) {
        const vf xp = load_vreg(xj + b * K + p * kLanes);
        for (int r = 0; r < R; ++r) acc[r][b] += w[r][p] * xp;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < G; ++b) out[b * N + r] = lanes_sum(acc[r][b]) + add[r];
}

// every row of x against R weight rows, kGroup rows of x at a time
template <int R, typename Row>
inline void dot_any(const Row* row, const float* x, int64_t rows, int64_t K, int64_t N, const float* add, float* out) {
  int64_t b = 0;
  for (; b + kGroup <= rows; b += kGroup) dot_rows<kGroup, R>(row, x + b * K, K, N, add, out + b * N);
  switch (rows - b) {
    case 0: break;
    case 1: dot_rows<1, R>(row, x + b * K, K, N, add, out + b * N); break;
    case 2: dot_rows<2, R>(row, x + b * K, K, N, add, out + b * N); break;
    case 3: dot_rows<3, R>(row, x + b * K, K, N, add, out + b * N); break;
    case 4: dot_rows<4, R>(row, x + b * K, K, N, add, out + b * N); break;
    case 5: dot_rows<5, R>(row, x + b * K, K, N, add, out + b * N); break;
    case 6: dot_rows<6, R>(row, x + b * K, K, N, add, out + b * N); break;
    default: dot_rows<7, R>(row, x + b * K, K, N, add, out + b * N); break;
  }
}

// weight rows [begin, end), kRows at a time, each against every row of x
template <typename Row, typename MakeRow>
inline void weight_rows(int64_t begin, int64_t end, MakeRow make_row, const float* x, int64_t rows, int64_t K,
                        int64_t N, const float* bias, float* out) {
  int64_t n = begin;
  for (; n + kRows <= end; n += kRows) {
    Row row[kRows];
    float add[kRows];
    for (int r = 0; r < kRows; ++r) row[r] = make_row(n + r), add[r] = bias ? bias[n + r] : 0.f;
    dot_any<kRows>(row, x, rows, K, N, add, out + n);
  }
  for (; n < end; ++n) {
    const Row row = make_row(n);
    const float add = bias ? bias[n] : 0.f;
    dot_any<1>(&row, x, rows, K, N, &add, out + n);
  }
}

void check_x(const at::Tensor& x, int64_t K, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == K,
              name, ": contiguous float32 x [rows, ", K, "]");
}

const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t N, const char* name) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N,
              name, ": float32 bias [out]");
  return bias->data_ptr<float>();
}

void check_scales(const at::Tensor& t, int64_t N, int64_t blocks, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == at::kFloat && t.size(0) == N &&
                  t.size(1) == blocks,
              name, ": float32 scales [out, in / 32]");
}

// x [rows, K] . W^T with W as Q4_1 blocks: qs uint8 [N, K / 2], d and m float32 [N, K / 32].
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.scalar_type() == at::kByte, "q4_1_linear: uint8 qs");
  const int64_t N = qs.size(0), K = qs.size(1) * 2, blocks = K / kBlock, rows = x.size(0);
  TORCH_CHECK(K % kBlock == 0, "q4_1_linear: in_features must be a multiple of 32");
  check_x(x, K, "q4_1_linear");
  check_scales(d, N, blocks, "q4_1_linear");
  check_scales(m, N, blocks, "q4_1_linear");
  const float* b = bias_ptr(bias, N, "q4_1_linear");
  auto out = at::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    const auto make_row = [&](int64_t n) { return Q4Row{qp + n * (K / 2), dp + n * blocks, mp + n * blocks}; };
    weight_rows<Q4Row>(begin, end, make_row, xp, rows, K, N, b, op);
  });
  return out;
}

// x [rows, K] . W^T with W as Q8_0 blocks: qs int8 [N, K], d float32 [N, K / 32].
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.scalar_type() == at::kChar, "q8_0_linear: int8 qs");
  const int64_t N = qs.size(0), K = qs.size(1), blocks = K / kBlock, rows = x.size(0);
  TORCH_CHECK(K % kBlock == 0, "q8_0_linear: in_features must be a multiple of 32");
  check_x(x, K, "q8_0_linear");
  check_scales(d, N, blocks, "q8_0_linear");
  const float* b = bias_ptr(bias, N, "q8_0_linear");
  auto out = at::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    const auto make_row = [&](int64_t n) { return Q8Row{qp + n * K, dp + n * blocks}; };
    weight_rows<Q8Row>(begin, end, make_row, xp, rows, K, N, b, op);
  });
  return out;
}

void check_weight(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kFloat, name,
              ": contiguous float32 weight [out, in]");
}

// The Q4_1 blocks of w ({qs, d, m}), or {} unless every element of w is q * d + m (one float32
// rounding) with q in 0..15 and d, m float16 values, a d and m per 32 elements of a row. The
// minimum of a block is its m (its q is 0) and its maximum 15 * d + m (llama.cpp's quantizer
// maps a block's range onto 0..15), which gives d; every element is then checked.
std::vector<at::Tensor> pack_q4_1(const at::Tensor& w) {
  check_weight(w, "pack_q4_1");
  const int64_t N = w.size(0), K = w.size(1);
  if (K % kBlock != 0 || N == 0) return {};
  const int64_t blocks = K / kBlock;
  auto qs = at::empty({N, K / 2}, w.options().dtype(at::kByte));
  auto d = at::empty({N, blocks}, w.options());
  auto m = at::empty({N, blocks}, w.options());
  const float* wp = w.data_ptr<float>();
  uint8_t* qp = qs.data_ptr<uint8_t>();
  float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, N * blocks, 256, [&](int64_t begin, int64_t end) {
    uint8_t q[kBlock];
    for (int64_t i = begin; i < end && exact.load(std::memory_order_relaxed); ++i) {
      const float* v = wp + i * kBlock;  // rows are contiguous and K a multiple of 32
      float lo = v[0], hi = v[0];
      for (int64_t k = 1; k < kBlock; ++k) lo = std::min(lo, v[k]), hi = std::max(hi, v[k]);
      bool ok = std::isfinite(lo) && std::isfinite(hi) && as_half(lo) == lo;
      float scale = 0.f;
      if (ok) {
        // the maximum's float32 rounding can move (hi - lo) / 15 off d where |m| is far above
        // 15 * d: the nearest float16 and its two neighbours are tried
        const c10::Half nearest = static_cast<c10::Half>((hi - lo) / 15.f);
        ok = false;
        for (int step : {0, 1, -1}) {
          c10::Half candidate = nearest;
          candidate.x = static_cast<uint16_t>(candidate.x + step);
          scale = static_cast<float>(candidate);
          ok = scale >= 0.f && std::isfinite(scale);
          for (int64_t k = 0; ok && k < kBlock; ++k) {
            const float steps = scale > 0.f ? std::nearbyint((v[k] - lo) / scale) : 0.f;
            ok = steps >= 0.f && steps <= 15.f && steps * scale + lo == v[k];
            q[k] = static_cast<uint8_t>(steps);
          }
          if (ok) break;
        }
      }
      if (!ok) {
        exact.store(false, std::memory_order_relaxed);
        break;
      }
      for (int64_t k = 0; k < 16; ++k) qp[i * 16 + k] = static_cast<uint8_t>(q[k] | (q[k + 16] << 4));
      dp[i] = scale;
      mp[i] = lo;
    }
  });
  if (!exact.load()) return {};
  return {qs, d, m};
}

// The Q8_0 blocks of w ({qs, d}), or {} unless every element is q * d with q in -127..127 and
// d a float16 value, a d per 32 elements of a row (the block's largest magnitude is 127 * d).
std::vector<at::Tensor> pack_q8_0(const at::Tensor& w) {
  check_weight(w, "pack_q8_0");
  const int64_t N = w.size(0), K = w.size(1);
  if (K % kBlock != 0 || N == 0) return {};
  const int64_t blocks = K / kBlock;
  auto qs = at::empty({N, K}, w.options().dtype(at::kChar));
  auto d = at::empty({N, blocks}, w.options());
  const float* wp = w.data_ptr<float>();
  int8_t* qp = qs.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, N * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && exact.load(std::memory_order_relaxed); ++i) {
      const float* v = wp + i * kBlock;
      float amax = 0.f;
      for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float scale = as_half(amax / 127.f);
      bool ok = std::isfinite(amax) && std::isfinite(scale);
      for (int64_t k = 0; ok && k < kBlock; ++k) {
        const float steps = scale > 0.f ? std::nearbyint(v[k] / scale) : 0.f;
        ok = std::fabs(steps) <= 127.f && steps * scale == v[k];
        qp[i * kBlock + k] = static_cast<int8_t>(steps);
      }
      if (!ok) {
        exact.store(false, std::memory_order_relaxed);
        break;
      }
      dp[i] = scale;
    }
  });
  if (!exact.load()) return {};
  return {qs, d};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, taking tensors by reference (cpu_ops.cpp says why).
  const auto kNoGil = py::call_guard<py::gil_scoped_release>();
  m.def("q4_1_linear", &q4_1_linear, "x W^T (+ b), W as Q4_1 blocks", kNoGil);
  m.def("q8_0_linear", &q8_0_linear, "x W^T (+ b), W as Q8_0 blocks", kNoGil);
  m.def("pack_q4_1", &pack_q4_1, "the exact Q4_1 blocks of a float32 weight, or []", kNoGil);
  m.def("pack_q8_0", &pack_q8_0, "the exact Q8_0 blocks of a float32 weight, or []", kNoGil);
}
