// Fused CPU ops for a decode step. Each replaces several torch calls whose fixed per-call
// cost dominates on decode-sized tensors. Portable C++ built with -march=native (the compiler
// vectorises the inner loops for what this CPU has: AVX2, AVX-512); float32, bfloat16 and
// float16 through one template; all arithmetic in float32.
#include "torch_ops.h"
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

#define DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

// Reductions live outside the dispatch macro so their simd pragmas apply.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected [rows, features] with unit stride");
}

// Loads n values as float32. bfloat16 widens by a shift of its bits (no rounding involved),
// written on integers so that the compiler vectorises it (vpmovzxwd + vpslld on AVX2 and
// AVX-512 alike); float16 and float32 go through their own conversions.
template <typename T>
inline void load_f32(const T* src, float* dst, int64_t n) {  // float16, float64
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void load_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_f32(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// exp(x) for x <= 0 (softmax after subtracting the max), written so that a loop over it
// vectorises: 2^(x log2 e) split into an integer part (the exponent bits) and a fraction in
// [0, 1) (a degree-6 polynomial, fitted here to a relative error of 1.1e-7, float32's own
// rounding). Inputs below -87 give 0-ish denormals' neighbour 2^-126 * p, harmless after
// the max has been subtracted.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.4426950408889634f;
  const float whole = std::floor(t);
  const float f = t - whole;
  float p = 2.168343198718503e-4f;
  p = p * f + 1.2437946861609817e-3f;
  p = p * f + 9.679985232651234e-3f;
  p = p * f + 5.548214912414551e-2f;
  p = p * f + 2.4023030698299408e-1f;
  p = p * f + 6.931468844413757e-1f;
  p = p * f + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(whole) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}


inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float sum16(vec16 v) {
  const vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}


// Stores n float32 values as T, rounded to nearest even as static_cast<T> rounds; for
// bfloat16 written on integers (c10's rounding: NaN becomes 0x7FC0) so that it vectorises.
template <typename T>
inline void store_f32(const float* src, T* dst, int64_t n) {  // float16, float64
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}
inline void store_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_f32(const float* src, c10::BFloat16* dst, int64_t n) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(src);
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits[i];
    const uint16_t rounded = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    out[i] = (b & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0) : rounded;
  }
}

// y += x
inline void add_f32(const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// y = y * a * w
inline void scale_mul_f32(float a, const float* w, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] * a * w[i];
}

// g = silu(g) * u. silu(g) = g / (1 + e^-g) = g e^g / (1 + e^g): with e = exp(-|g|) <= 1
// either form needs only exp_nonpositive, so the loop vectorises.
// A register of lanes at a time (the plain loop does not vectorise; vreg: vec_math.h), the tail
// with the same steps one by one.
inline void silu_mul_f32(const float* u, float* g, int64_t n) {
  int64_t i = 0;
  for (; i + kRegLanes <= n; i += kRegLanes) {
    const vreg x = load_vreg(g + i);
    const vreg e = exp_nonpositive_lanes<vreg, vreg_i32>(x < 0.f ? x : -x);
    const vreg y = x * (x >= 0.f ? 1.f : e) / (1.f + e) * load_vreg(u + i);
    std::memcpy(g + i, &y, sizeof(y));
  }
  for (; i < n; ++i) {
    const float e = exp_nonpositive(-std::fabs(g[i]));
    g[i] = g[i] * (g[i] >= 0.f ? 1.f : e) / (1.f + e) * u[i];
  }
}

// Elementwise ops work through float32 buffers of this many values: in L1 beside their inputs.
constexpr int64_t kChunk = 512;

}  // namespace

// residual += delta (rounded to the model dtype, as an eager add would), then
// out = rms_norm(residual) * weight. With delta None: out = rms_norm(residual), residual kept.
at::Tensor add_rms_norm_(const at::Tensor& residual, const c10::optional<at::Tensor>& delta,
                         const at::Tensor& weight, double eps) {
  check_rows(residual, "add_rms_norm_");
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  TORCH_CHECK(weight.numel() == hidden && weight.is_contiguous() && weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: weight must be [hidden] in the residual's dtype");
  if (delta.has_value()) {
    check_rows(*delta, "add_rms_norm_ delta");
    TORCH_CHECK(delta->sizes() == residual.sizes() && delta->scalar_type() == residual.scalar_type(),
                "add_rms_norm_: delta must match the residual");
  }
  auto out = at::empty({rows, hidden}, residual.options());
  DISPATCH(residual.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* add = delta.has_value() ? delta->data_ptr<scalar_t>() : nullptr;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t res_stride = residual.stride(0);
    const int64_t add_stride = delta.has_value() ? delta->stride(0) : 0;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(hidden), scratch(hidden), weights(hidden);
      load_f32(w, weights.data(), hidden);
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* res_row = res + r * res_stride;
        load_f32(res_row, buf.data(), hidden);
        if (add != nullptr) {
          load_f32(add + r * add_stride, scratch.data(), hidden);
          add_f32(scratch.data(), buf.data(), hidden);
          store_f32(buf.data(), res_row, hidden);  // rounded, and the norm reads it rounded
          load_f32(res_row, buf.data(), hidden);
        }
        const float sum_sq = dot_f32(buf.data(), buf.data(), hidden);
        const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + static_cast<float>(eps));
        scale_mul_f32(inv, weights.data(), buf.data(), hidden);
        store_f32(buf.data(), o + r * hidden, hidden);
      }
    });
  });
  return out;
}

// gate_up: [rows, 2 * I] (gate then up) -> silu(gate) * up: [rows, I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: the last dimension must be even");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  DISPATCH(gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      float g[kChunk], u[kChunk];
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i0 = 0; i0 < inter; i0 += kChunk) {
          const int64_t n = std::min(kChunk, inter - i0);
          load_f32(in + r * stride + i0, g, n);
          load_f32(in + r * stride + inter + i0, u, n);
          silu_mul_f32(u, g, n);
          store_f32(g, o + r * inter + i0, n);
        }
      }
    });
  });
  return out;
}

// In place: rotate heads [0, num_heads) of x [tokens, heads, head_dim] (interleaved pairs
// (x_2j, x_2j+1)) by the angles of each token's position: cos/sin [max_pos, head_dim / 2].
void rope_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope_: x must be [tokens, heads, head_dim] with unit stride");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0), "rope_: int64 positions [tokens]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) * 2 == x.size(2), "rope_: float32 cos/sin [max_pos, head_dim / 2]");
  TORCH_CHECK(num_heads <= x.size(1), "rope_: num_heads exceeds the heads of x");
  const int64_t tokens = x.size(0), half = x.size(2) / 2, max_pos = cos.size(0);
  auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "rope_: position ", p[t], " outside [0, ", max_pos, ")");
  }
  DISPATCH(x.scalar_type(), "rope_", [&] {
    scalar_t* data = x.data_ptr<scalar_t>();
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* ct = c + p[t] * half;
        const float* st = s + p[t] * half;
        for (int64_t h = 0; h < num_heads; ++h) {
          scalar_t* v = data + t * token_stride + h * head_stride;
          for (int64_t j = 0; j < half; ++j) {
            const float x0 = static_cast<float>(v[2 * j]), x1 = static_cast<float>(v[2 * j + 1]);
            v[2 * j] = static_cast<scalar_t>(x0 * ct[j] - x1 * st[j]);
            v[2 * j + 1] = static_cast<scalar_t>(x1 * ct[j] + x0 * st[j]);
          }
        }
      }
    });
  });
}

inline void axpy_f32(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Empty partial results [acc..., m, l] for num_heads query heads: acc 0, max -inf, sum 0.
inline void init_partials(float* parts, int64_t num_heads, int64_t head_dim) {
  for (int64_t g = 0; g < num_heads; ++g) {
    std::fill(parts + g * (head_dim + 2), parts + g * (head_dim + 2) + head_dim, 0.f);
    parts[g * (head_dim + 2) + head_dim] = -INFINITY;
    parts[g * (head_dim + 2) + head_dim + 1] = 0.f;
  }
}

// Positions per partial result. A sequence's context is cut into splits of this many
// positions, each attended on its own (online softmax within it), then merged: long contexts
// at small batches keep both cores busy. The cut depends only on the sequence's own length,
// so a sequence's result does not depend on the batch around it or the thread count.
constexpr int64_t kSplitPositions = 256;

// Positions [first, last) of one sequence, through its block table (nullptr: none).
struct Span {
  const int64_t* table = nullptr;
  int64_t first = 0, last = 0;
};

// One (sequence, KV head, split): the group's query heads against positions [first, last).
// Writes, per query head g: the running max m, the sum of exp(s - m) l, and acc = sum of
// exp(s - m) * v, into part[g * (head_dim + 2) ...] as [acc..., m, l].
template <typename scalar_t>
void attend_split(const float* qf, const scalar_t* cache, const int64_t* table, int64_t block_size,
                  int64_t slot_stride, int64_t k_offset, int64_t v_offset, int64_t group, int64_t head_dim,
                  int64_t first, int64_t last, float* part, float* scratch) {
  float* kv = scratch;                           // [head_dim]: one K or V row as float32
  float* s = scratch + head_dim;                 // [group, block_size]: one block's scores
  const int64_t stride = head_dim + 2;
  init_partials(part, group, head_dim);
  for (int64_t start = first; start < last;) {
    const int64_t block = table[start / block_size];
    const int64_t offset = start % block_size;
    const int64_t count = std::min(block_size - offset, last - start);
    const scalar_t* base = cache + (block * block_size + offset) * slot_stride;
    if (start + count < last) {  // the next block's rows, while this one computes
      const scalar_t* next = cache + table[(start + count) / block_size] * block_size * slot_stride;
      const int64_t rows = std::min(block_size, last - start - count);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(scalar_t)); byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(next + i * slot_stride + k_offset) + byte);
          __builtin_prefetch(reinterpret_cast<const char*>(next + i * slot_stride + v_offset) + byte);
        }
    }
    for (int64_t i = 0; i < count; ++i) {
      load_f32(base + i * slot_stride + k_offset, kv, head_dim);
      for (int64_t g = 0; g < group; ++g) s[g * block_size + i] = dot_f32(qf + g * head_dim, kv, head_dim);
    }
    for (int64_t g = 0; g < group; ++g) {  // online softmax: rescale once per block
      float* row = s + g * block_size;
      float* acc = part + g * stride;
      float block_max = row[0];
      for (int64_t i = 1; i < count; ++i) block_max = std::max(block_max, row[i]);
      const float m_old = acc[head_dim], m_new = std::max(m_old, block_max);
      const float correction = std::exp(m_old - m_new);  // 0 on the first block (m_old = -inf)
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < count; ++i) {
        row[i] = exp_nonpositive(row[i] - m_new);
        total += row[i];
      }
      if (correction != 1.f) {
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
      }
      acc[head_dim] = m_new;
      acc[head_dim + 1] = acc[head_dim + 1] * correction + total;
    }
    for (int64_t i = 0; i < count; ++i) {
      load_f32(base + i * slot_stride + v_offset, kv, head_dim);
      for (int64_t g = 0; g < group; ++g) axpy_f32(s[g * block_size + i], kv, part + g * stride, head_dim);
    }
    start += count;
  }
}

// Largest block (slots) the fixed-size path takes: its score buffer is sized for it.
constexpr int64_t kMaxFixedBlock = 32;

// 16 values of a row as float32, in registers (bfloat16 widens by a shift of its bits).
template <typename scalar_t>
inline vec16 row16(const scalar_t* p) {
  vec16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
template <>
inline vec16 row16<float>(const float* p) { return load16(p); }
template <>
inline vec16 row16<c10::BFloat16>(const c10::BFloat16* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const u32x16 wide = __builtin_convertvector(bits, u32x16) << 16;
  vec16 v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// The group's G query heads of one KV head against one block's rows [i, i + count): each K
// and V row is widened once, in registers, and used for all G heads; the G accumulators stay
// in registers across the block. acc: G x (D + 2) as [acc..., m, l]; q: G x D, scaled.
template <typename scalar_t, int D, int G>
inline void attend_block(const float* q_heads, const scalar_t* base, int64_t slot_stride, int64_t k_offset,
                         int64_t v_offset, int64_t count, float* parts, float* s) {
  constexpr int NV = D / 16;
  vec16 q[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) q[g][c] = load16(q_heads + g * D + c * 16);
  for (int64_t i = 0; i < count; ++i) {  // scores: s[g * kMaxFixedBlock + i]
    const scalar_t* k = base + i * slot_stride + k_offset;
    vec16 kr[NV];
    for (int c = 0; c < NV; ++c) kr[c] = row16<scalar_t>(k + c * 16);
    for (int g = 0; g < G; ++g) {
      vec16 total = q[g][0] * kr[0];
      for (int c = 1; c < NV; ++c) total += q[g][c] * kr[c];
      s[g * kMaxFixedBlock + i] = sum16(total);
    }
  }
  for (int g = 0; g < G; ++g) {  // online softmax: rescale once per block
    float* row = s + g * kMaxFixedBlock;
    float* acc = parts + g * (D + 2);
    float block_max = row[0];
    for (int64_t i = 1; i < count; ++i) block_max = std::max(block_max, row[i]);
    const float m_old = acc[D], m_new = std::max(m_old, block_max);
    const float correction = std::exp(m_old - m_new);  // 0 on the first block (m_old = -inf)
    vec16 sums = {};
    for (int64_t c = 0; c < count; c += 16) {  // lanes at and past count are zeroed
      vec16 lane;
      for (int j = 0; j < 16; ++j) lane[j] = static_cast<float>(c + j);
      const vec16 e = exp16_nonpositive(load16(row + c) - m_new);
      const vec16 kept = lane < static_cast<float>(count) ? e : 0.f;
      std::memcpy(row + c, &kept, sizeof(kept));
      sums += kept;
    }
    acc[D] = m_new;
    acc[D + 1] = acc[D + 1] * correction + sum16(sums);
    if (correction != 1.f)
      for (int d = 0; d < D; ++d) acc[d] *= correction;
  }
  vec16 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = load16(parts + g * (D + 2) + c * 16);
  for (int64_t i = 0; i < count; ++i) {
    const scalar_t* v = base + i * slot_stride + v_offset;
    vec16 vr[NV];
    for (int c = 0; c < NV; ++c) vr[c] = row16<scalar_t>(v + c * 16);
    for (int g = 0; g < G; ++g) {
      const float weight = s[g * kMaxFixedBlock + i];
      for (int c = 0; c < NV; ++c) acc[g][c] += weight * vr[c];
    }
  }
  for (int g = 0; g < G; ++g) std::memcpy(parts + g * (D + 2), acc[g], sizeof(acc[g]));
}

// Every line of positions [start, last) that lie in start's block (all KV heads, keys and values).
template <typename scalar_t>
inline void prefetch_block(const scalar_t* cache, const int64_t* table, int64_t block_size, int64_t slot_stride,
                           int64_t start, int64_t last) {
  const int64_t offset = start % block_size;
  const char* rows = reinterpret_cast<const char*>(cache + (table[start / block_size] * block_size + offset) *
                                                   slot_stride);
  const int64_t bytes = std::min(block_size - offset, last - start) * slot_stride * sizeof(scalar_t);
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(rows + byte);
}

// attend_split for head_dim D and group size G known at compile time, over every KV head of
// the sequence: one (sequence, split) walks its blocks once, and each block's rows (all KV
// heads, keys and values: [block_size, 2 * kv_heads, D], contiguous) are read in order while
// they are hot. parts: [kv_heads * G, D + 2] as in attend_split. Blocks of at most 32 slots.
template <typename scalar_t, int D, int G>
void attend_split_fixed(const float* qf, const scalar_t* cache, const int64_t* table, int64_t block_size,
                        int64_t kv_heads, int64_t first, int64_t last, float* parts, const Span& then) {
  const int64_t slot_stride = 2 * kv_heads * D, stride = D + 2;
  alignas(64) float s[G * kMaxFixedBlock];  // one block's scores, then probabilities, per query head
  init_partials(parts, kv_heads * G, D);
  for (int64_t start = first; start < last;) {
    const int64_t block = table[start / block_size];
    const int64_t offset = start % block_size;
    const int64_t count = std::min(block_size - offset, last - start);
    const scalar_t* base = cache + (block * block_size + offset) * slot_stride;
    // the next block, every line of it, while this one computes; after the last, the first
    // block of the task that follows on this thread
    if (start + count < last)
      prefetch_block(cache, table, block_size, slot_stride, start + count, last);
    else if (then.table != nullptr)
      prefetch_block(cache, then.table, block_size, slot_stride, then.first, then.last);
    for (int64_t h = 0; h < kv_heads; ++h)
      attend_block<scalar_t, D, G>(qf + h * G * D, base, slot_stride, h * D, (kv_heads + h) * D, count,
                                   parts + h * G * stride, s);
    start += count;
  }
}

// The compiled-in (head_dim, group) pairs; false: use attend_split.
template <typename scalar_t, int D>
bool attend_fixed_group(int64_t group, const float* qf, const scalar_t* cache, const int64_t* table,
                        int64_t block_size, int64_t kv_heads, int64_t first, int64_t last, float* parts,
                        const Span& then) {
  return with_group(group, [&](auto g) {
    attend_split_fixed<scalar_t, D, decltype(g)::value>(qf, cache, table, block_size, kv_heads, first, last, parts,
                                                        then);
  });
}

#if defined(__AVX512BF16__)
// bfloat16 caches on CPUs with AVX512_BF16 (any block size): the scores are computed straight
// from the bf16 query and key bits with vdpbf16ps (each product of two bf16 values is exact in
// float32, and the sums are float32), without widening every key row; the scale is applied to
// the sums. Measured on a 2-core Xeon with AMX, 64 sequences of 600 positions, (9, 3) heads of
// 64, one layer's cache per call, 30 layers: 2.55 ms per layer through attend_split_fixed,
// about 2.0 ms here (0.96 ms with the cache hot in L2: what is left is waiting for memory).

// Sixteen accumulators -> one vector whose lane i holds the sum of acc[i]'s sixteen lanes.
inline __m512 transpose_sum16(const __m512* acc) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i)  // quarters [a, a, b, b]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters [a, b, c, d]: keys 4i .. 4i + 3
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // in quarter k: keys [k, 4 + k, k, 4 + k] (+ 8i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2 * i], quarters[2 * i + 1]),
                             _mm512_unpackhi_ps(quarters[2 * i], quarters[2 * i + 1]));
  // lane 4k + p: key 4p + k
  const __m512 mixed = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, mixed);
}

// Scores of one query head (D bf16 values at q, unscaled) against up to 16 key rows.
template <int D>
inline __m512 scores16(const uint16_t* q, const uint16_t* keys, int64_t slot_stride, int64_t count, float scale) {
  constexpr int NC = D / 32;  // 32 bf16 per register
  __m512bh qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    __m512 a = _mm512_setzero_ps();
    if (i < count)
      for (int c = 0; c < NC; ++c)
        a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(keys + i * slot_stride + c * 32));
    acc[i] = a;
  }
  return _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
}

// Rows attended per softmax update in the bfloat16 path: up to this many 16-row tiles, from
// consecutive positions (one tile per 16-slot block, two per 32-slot block).
constexpr int kMaxTiles = 4;

// A run of up to kMaxTiles tiles of one sequence's context: where each tile's first row
// starts in the cache, and how many rows it has (16, except at the end of the context).
struct TileRun {
  const uint16_t* base[kMaxTiles];
  int64_t rows[kMaxTiles];
  int count = 0;
};

// Prefetches the rows of a run a few cache lines at a time, spread through the computation
// of the run before it, so that the loads overlap the arithmetic instead of stalling it in
// one burst (software prefetches wait for a free fill buffer).
struct RunPrefetcher {
  const char* base[kMaxTiles];
  int64_t bytes[kMaxTiles];
  int count = 0, tile = 0;
  int64_t offset = 0;

  void reset(const TileRun& run, int64_t row_bytes) {
    count = run.count, tile = 0, offset = 0;
    for (int t = 0; t < count; ++t) {
      base[t] = reinterpret_cast<const char*>(run.base[t]);
      bytes[t] = run.rows[t] * row_bytes;
    }
  }
  inline void issue(int lines) {
    for (; lines > 0 && tile < count; --lines) {
      __builtin_prefetch(base[tile] + offset, 0, 1);
      offset += 64;
      if (offset >= bytes[tile]) ++tile, offset = 0;
    }
  }
};

// attend_block for bfloat16 with AVX512_BF16: G query heads of one KV head against a run of
// tiles, with one online-softmax update for the whole run. The probabilities are rounded to
// bf16 and the value rows are accumulated two at a time with vdpbf16ps (the running sum l adds
// the rounded probabilities, so the weights stay normalised). The accumulators keep D in the
// order that interleaving two rows' words gives (unpacklo/hi within 128-bit lanes);
// unpermute_acc puts it back once per split.
template <int D, int G>
inline void attend_run_bf16(const uint16_t* q_heads, float scale, const TileRun& run, int64_t slot_stride,
                            int64_t k_offset, int64_t v_offset, float* parts, uint16_t* probs,
                            RunPrefetcher& prefetch, int lines_per_step) {
  constexpr int NC = D / 32;  // bf16 registers per row
  for (int g = 0; g < G; ++g) {  // scores, then the softmax update
    __m512 tiles[kMaxTiles];
    __m512 run_max = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < run.count; ++t) {
      prefetch.issue(lines_per_step);
      const __m512 sc = scores16<D>(q_heads + g * D, run.base[t] + k_offset, slot_stride, run.rows[t], scale);
      tiles[t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>((1u << run.rows[t]) - 1u), sc);
      run_max = _mm512_max_ps(run_max, tiles[t]);
    }
    float* acc = parts + g * (D + 2);
    const float m_old = acc[D], m_new = std::max(m_old, _mm512_reduce_max_ps(run_max));
    // 0 on the first run (m_old = -inf); 1 while the maximum stands
    const float correction = m_new == m_old ? 1.f : std::exp(m_old - m_new);
    __m512 sums = _mm512_setzero_ps();
    for (int t = 0; t < run.count; ++t) {  // rows past a tile's end: probability 0
      vec16 x;
      std::memcpy(&x, &tiles[t], sizeof(x));
      const __m512 e = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << run.rows[t]) - 1u),
                                           (__m512)exp16_nonpositive(x - m_new));
      const __m256bh rounded = _mm512_cvtneps_pbh(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + g * kMaxTiles * 16 + t * 16), (__m256i)rounded);
      sums = _mm512_add_ps(sums, _mm512_cvtpbh_ps(rounded));
    }
    acc[D] = m_new;
    acc[D + 1] = acc[D + 1] * correction + _mm512_reduce_add_ps(sums);
    if (correction != 1.f)
      for (int d = 0; d < D; ++d) acc[d] *= correction;
  }
  __m512 acc[G][2 * NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * NC; ++c) acc[g][c] = _mm512_loadu_ps(parts + g * (D + 2) + c * 16);
  for (int t = 0; t < run.count; ++t) {
    const uint16_t* values = run.base[t] + v_offset;
    const int64_t rows = run.rows[t];
    for (int64_t i = 0; i < rows; i += 2) {  // rows i and i + 1 (a zero row past the tile's end)
      prefetch.issue(lines_per_step);
      __m512i pair[2 * NC];
      for (int c = 0; c < NC; ++c) {
        const __m512i a = _mm512_loadu_si512(values + i * slot_stride + c * 32);
        const __m512i b = i + 1 < rows ? _mm512_loadu_si512(values + (i + 1) * slot_stride + c * 32)
                                       : _mm512_setzero_si512();
        pair[2 * c] = _mm512_unpacklo_epi16(a, b);
        pair[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < G; ++g) {  // (p_i, p_i+1) in every 32-bit lane; past the end, p is 0
        uint32_t both;
        std::memcpy(&both, probs + g * kMaxTiles * 16 + t * 16 + i, sizeof(both));
        const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
        for (int c = 0; c < 2 * NC; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], weights, (__m512bh)pair[c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(parts + g * (D + 2) + c * 16, acc[g][c]);
}

// The accumulators' D back in order: register pair (lo, hi) of 32 interleaved values holds
// lo lane 4L + m -> d = 8L + m and hi lane 4L + m -> d = 8L + 4 + m (L: 128-bit lane).
template <int D>
inline void unpermute_acc(float* acc) {
  for (int c = 0; c < D / 32; ++c) {
    const __m512 lo = _mm512_loadu_ps(acc + c * 32), hi = _mm512_loadu_ps(acc + c * 32 + 16);
    const __m512 first = _mm512_shuffle_f32x4(lo, hi, 0x44), second = _mm512_shuffle_f32x4(lo, hi, 0xEE);
    _mm512_storeu_ps(acc + c * 32, _mm512_shuffle_f32x4(first, first, 0xD8));
    _mm512_storeu_ps(acc + c * 32 + 16, _mm512_shuffle_f32x4(second, second, 0xD8));
  }
}

// The tiles of positions [start, last), at most kMaxTiles; returns the position after them.
inline int64_t next_run(const uint16_t* cache, const int64_t* table, int64_t block_size, int64_t slot_stride,
                        int64_t start, int64_t last, TileRun& run) {
  run.count = 0;
  while (start < last && run.count < kMaxTiles) {
    const int64_t offset = start % block_size;
    const int64_t rows = std::min({int64_t{16}, block_size - offset, last - start});
    run.base[run.count] = cache + (table[start / block_size] * block_size + offset) * slot_stride;
    run.rows[run.count++] = rows;
    start += rows;
  }
  return start;
}

// attend_split_fixed for bfloat16 with AVX512_BF16; q: every query head of the sequence, bf16
// bits. While a run is attended, the next run's rows are prefetched through its arithmetic;
// during the last run, the first run of the task that follows on this thread (``then``, when
// it has one): its blocks lie anywhere in the pool, and nothing else would fetch them early.
// Measured on a 2-core AMD EPYC (family 25), 32 sequences of 1024 positions, (9, 3) heads of
// 64, 30 layers: 29.4 -> 23.8 ms with each sequence's blocks in order, 49.0 -> 43.1 with them
// scattered over a pool 4x their number (attend_split_fixed, built without AVX512_BF16: within 3%).
template <int D, int G>
void attend_split_bf16(const uint16_t* q, float scale, const uint16_t* cache, const int64_t* table,
                       int64_t block_size, int64_t kv_heads, int64_t first, int64_t last, float* parts,
                       const Span& then) {
  const int64_t slot_stride = 2 * kv_heads * D, stride = D + 2;
  alignas(64) uint16_t probs[G * kMaxTiles * 16 + 2];  // one run's probabilities as bf16, per query head
  std::memset(probs, 0, sizeof(probs));  // rows past a tile's end read as 0
  init_partials(parts, kv_heads * G, D);
  TileRun run, ahead, following;
  RunPrefetcher prefetch;
  int64_t after = next_run(cache, table, block_size, slot_stride, first, last, run);
  while (run.count > 0) {
    after = next_run(cache, table, block_size, slot_stride, after, last, ahead);
    if (ahead.count == 0 && then.table != nullptr)
      next_run(cache, then.table, block_size, slot_stride, then.first, then.last, following);
    const TileRun& fetched = ahead.count > 0 ? ahead : following;  // following is empty without a then
    prefetch.reset(fetched, slot_stride * 2);
    // the fetched run's lines over this run's prefetch points: G per tile for the scores, one
    // per row pair for the values, per KV head
    int64_t rows = 0, lines = 0;
    for (int t = 0; t < run.count; ++t) rows += run.rows[t];
    for (int t = 0; t < fetched.count; ++t) lines += fetched.rows[t] * slot_stride * 2 / 64;
    const int64_t points = kv_heads * (G * run.count + (rows + 1) / 2);
    const int lines_per_step = static_cast<int>((lines + points - 1) / points);
    for (int64_t h = 0; h < kv_heads; ++h)
      attend_run_bf16<D, G>(q + h * G * D, scale, run, slot_stride, h * D, (kv_heads + h) * D,
                            parts + h * G * stride, probs, prefetch, lines_per_step);
    run = ahead;
  }
  for (int64_t head = 0; head < kv_heads * G; ++head) unpermute_acc<D>(parts + head * stride);
}

template <int D>
bool attend_bf16_group(int64_t group, const uint16_t* q, float scale, const uint16_t* cache, const int64_t* table,
                       int64_t block_size, int64_t kv_heads, int64_t first, int64_t last, float* parts,
                       const Span& then) {
  return with_group(group, [&](auto g) {
    attend_split_bf16<D, decltype(g)::value>(q, scale, cache, table, block_size, kv_heads, first, last, parts, then);
  });
}
#endif  // __AVX512BF16__

// One task through attend_split_bf16 where this build and the shapes allow (a bfloat16 cache,
// AVX512_BF16, head_dim 64 or 128, group 1-8): the query's heads are copied to q_bits, one
// contiguous row. false: the caller takes the other paths.
template <typename scalar_t>
bool attend_bf16(const scalar_t* query, int64_t q_head, int64_t heads, int64_t head_dim, int64_t group, double scale,
                 const scalar_t* cache, const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t first,
                 int64_t last, float* parts, std::vector<uint16_t>& q_bits, const Span& then) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (head_dim != 64 && head_dim != 128) return false;
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(q_bits.data() + h * head_dim, query + h * q_head, head_dim * sizeof(uint16_t));
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(cache);
    const float sc = static_cast<float>(scale);
    return head_dim == 64
        ? attend_bf16_group<64>(group, q_bits.data(), sc, bits, table, block_size, kv_heads, first, last, parts, then)
        : attend_bf16_group<128>(group, q_bits.data(), sc, bits, table, block_size, kv_heads, first, last, parts,
                                 then);
  }
#endif
  return false;
}

// One query token per sequence against its paged context:
//   query [n, heads, head_dim]; kv_cache [blocks, block_size, 2 * kv_heads, head_dim] (keys in
//   heads [0, kv_heads), values after); block_tables [n, max_blocks] int64; seq_lens [n] int64.
// Reads only positions [0, seq_len) of each sequence, through its block table. Each task is
// one (sequence, split of kSplitPositions) over every KV head: the K/V rows of a KV head are
// read once for all the query heads of its group, converted to float32, and attended with an
// online softmax (head_dim 64 or 128, group 1-8 and blocks of at most 32 slots through
// attend_split_fixed, other shapes through attend_split; bfloat16 on CPUs with AVX512_BF16
// through attend_split_bf16); the splits of a (sequence, KV head) are then merged in order.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "paged_decode_attention: query [n, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), "paged_decode_attention: contiguous kv_cache");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "paged_decode_attention: dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2,
              "paged_decode_attention: int64 block_tables [n, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "paged_decode_attention: int64 seq_lens");
  const int64_t n = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(1), kv_heads = kv_cache.size(2) / 2;
  TORCH_CHECK(kv_cache.size(3) == head_dim && heads % kv_heads == 0, "paged_decode_attention: head shapes");
  TORCH_CHECK(block_tables.size(0) == n && seq_lens.numel() == n, "paged_decode_attention: one table per query");
  const int64_t max_blocks = block_tables.size(1), group = heads / kv_heads;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // tasks: (sequence, split); splits[seq] = how many, first_task[seq] = where its tasks start
  std::vector<int64_t> splits(n), first_task(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "paged_decode_attention: bad seq_len ", lens[i]);
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[i * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block id ", block, " out of range");
    }
    splits[i] = (lens[i] + kSplitPositions - 1) / kSplitPositions;
    first_task[i + 1] = first_task[i] + splits[i];
  }
  const int64_t head_part = group * (head_dim + 2);  // one (task, KV head)'s partial result
  const int64_t task_part = kv_heads * head_part;     // one task's: every KV head of its sequence
  std::vector<float> parts(first_task[n] * task_part);
  auto out = at::empty({n, heads, head_dim}, query.options());
  DISPATCH(query.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t q_tok = query.stride(0), q_head = query.stride(1);
    const int64_t slot_stride = 2 * kv_heads * head_dim;
    at::parallel_for(0, first_task[n], 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(heads * head_dim), scratch(head_dim + group * block_size);  // attend_split's
      std::vector<uint16_t> q_bits(heads * head_dim);  // attend_bf16's
      int64_t seq = std::upper_bound(first_task.begin(), first_task.end(), begin) - first_task.begin() - 1;
      for (int64_t task = begin; task < end; ++task) {
        while (task >= first_task[seq + 1]) ++seq;
        const int64_t split = task - first_task[seq];
        const int64_t first = split * kSplitPositions, last = std::min(lens[seq], first + kSplitPositions);
        const int64_t* table = tables + seq * max_blocks;
        float* task_parts = parts.data() + task * task_part;
        Span then;  // the next task on this thread, whose first blocks the last run prefetches
        if (task + 1 < end) {
          const int64_t next_seq = task + 1 < first_task[seq + 1] ? seq : seq + 1;
          then.table = tables + next_seq * max_blocks;
          then.first = (task + 1 - first_task[next_seq]) * kSplitPositions;
          then.last = std::min(lens[next_seq], then.first + kSplitPositions);
        }
        if (attend_bf16(q + seq * q_tok, q_head, heads, head_dim, group, scale, cache, table, block_size, kv_heads,
                        first, last, task_parts, q_bits, then))
          continue;
        for (int64_t h = 0; h < heads; ++h) {  // the scale folded into the query
          load_f32(q + seq * q_tok + h * q_head, qf.data() + h * head_dim, head_dim);
          for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] *= static_cast<float>(scale);
        }
        const bool fixed = block_size <= kMaxFixedBlock &&
            ((head_dim == 64 && attend_fixed_group<scalar_t, 64>(group, qf.data(), cache, table, block_size,
                                                                 kv_heads, first, last, task_parts, then)) ||
             (head_dim == 128 && attend_fixed_group<scalar_t, 128>(group, qf.data(), cache, table, block_size,
                                                                   kv_heads, first, last, task_parts, then)));
        if (!fixed) {
          for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
            attend_split<scalar_t>(qf.data() + kvh * group * head_dim, cache, table, block_size, slot_stride,
                                   kvh * head_dim, (kv_heads + kvh) * head_dim, group, head_dim, first, last,
                                   task_parts + kvh * head_part, scratch.data());
        }
      }
    });
    at::parallel_for(0, n * kv_heads, 4, [&](int64_t begin, int64_t end) {  // merge the splits, in order
      std::vector<float> acc(head_dim);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t seq = pair / kv_heads, kvh = pair % kv_heads;
        const float* head_parts = parts.data() + first_task[seq] * task_part + kvh * head_part;
        for (int64_t g = 0; g < group; ++g) {
          float m = -INFINITY;
          for (int64_t sp = 0; sp < splits[seq]; ++sp)
            m = std::max(m, head_parts[sp * task_part + g * (head_dim + 2) + head_dim]);
          std::fill(acc.begin(), acc.end(), 0.f);
          float total = 0.f;
          for (int64_t sp = 0; sp < splits[seq]; ++sp) {
            const float* part = head_parts + sp * task_part + g * (head_dim + 2);
            const float weight = std::exp(part[head_dim] - m);
            total += part[head_dim + 1] * weight;
            axpy_f32(weight, part, acc.data(), head_dim);
          }
          scalar_t* dst = o + (seq * heads + kvh * group + g) * head_dim;
          const float inv = 1.f / total;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
        }
      }
    });
  });
  return out;
}

// y = x W^T (+ b) in float32 for a few rows of x (decode batches): each weight row is read from
// memory once and dotted with every row of x while it sits in L1. BLAS kernels treat a
// handful of rows as that many matrix-vector products and stream the weight once per row.
at::Tensor skinny_linear_f32(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "skinny_linear_f32: contiguous float32 x [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.size(1) == x.size(1),
              "skinny_linear_f32: contiguous float32 weight [out, in] matching x");
  const int64_t rows = x.size(0), in = x.size(1), out_features = weight.size(0);
  TORCH_CHECK(rows >= 1 && rows <= 16, "skinny_linear_f32: 1 to 16 rows, got ", rows);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == out_features,
                "skinny_linear_f32: float32 bias [out]");
    b = bias->data_ptr<float>();
  }
  auto out = at::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* w = wp + n * in;
      const float add = b ? b[n] : 0.f;
      for (int64_t r = 0; r < rows; ++r) op[r * out_features + n] = dot_f32(xp + r * in, w, in) + add;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Each kernel runs without the GIL (its arguments are converted first, its result after),
  // so that the worker's other Python threads (gRPC, KV transport, the prefill lane) go on
  // while it computes. They take their tensors by reference: a tensor taken by value is
  // released when the kernel returns, still without the GIL, and releasing the last C++
  // reference beside a Python one drops a Python reference, which waits for the GIL (up to a
  // switch interval, 5 ms, while another thread runs Python).
  const auto kNoGil = py::call_guard<py::gil_scoped_release>();
  m.def("add_rms_norm_", &add_rms_norm_, "residual += delta; rms_norm(residual) * weight", kNoGil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up", kNoGil);
  m.def("rope_", &rope_, "in-place RoPE on interleaved pairs", kNoGil);
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention through block tables", kNoGil);
  m.def("skinny_linear_f32", &skinny_linear_f32, "x W^T (+ b) for a few rows, the weight read once", kNoGil);
}
