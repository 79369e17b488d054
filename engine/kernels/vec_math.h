// Vector helpers shared by the native CPU kernels (cpu_ops.cpp, prefill_attention.cpp,
// block_linear.cpp): rows as GCC vector extensions (16 floats, or a register's width) and exp.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

// Rows as vectors of 16 floats (GCC vector extensions: one AVX-512 register, or two AVX2 ones),
// for the fixed-size attention kernels.
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

// One register of floats (and of int32) at the machine's width: 16 lanes with AVX-512, else 8.
// GCC lowers a vector wider than the registers through the stack wherever a scalar meets it (16
// stores to broadcast it), so loops that multiply by scalars work in these (block_linear.cpp,
// silu_mul): on the AVX2-only EPYC of family 23 that made the blocks' matmul 3-7x faster.
#if defined(__AVX512F__)
typedef float vreg __attribute__((vector_size(64)));
typedef int32_t vreg_i32 __attribute__((vector_size(64)));
#else
typedef float vreg __attribute__((vector_size(32)));
typedef int32_t vreg_i32 __attribute__((vector_size(32)));
#endif
constexpr int kRegLanes = sizeof(vreg) / sizeof(float);

inline vreg load_vreg(const float* p) {
  vreg v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// exp(x) for x <= 0 on every lane of V (float lanes; I: int32 lanes of the same count), with
// the polynomial and steps of cpu_ops.cpp's exp_nonpositive: t <= 0, so floor(t) is the
// truncation less one where they differ.
template <typename V, typename I>
inline V exp_nonpositive_lanes(V x) {
  const V t = (x < -87.f ? -87.f : x) * 1.4426950408889634f;
  const I truncated = __builtin_convertvector(t, I);
  const I whole = truncated + (__builtin_convertvector(truncated, V) > t);  // a true lane is -1
  const V f = t - __builtin_convertvector(whole, V);
  V p = f * 2.168343198718503e-4f + 1.2437946861609817e-3f;
  p = p * f + 9.679985232651234e-3f;
  p = p * f + 5.548214912414551e-2f;
  p = p * f + 2.4023030698299408e-1f;
  p = p * f + 6.931468844413757e-1f;
  p = p * f + 1.f;
  const I bits = (whole + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// the same on 16 lanes (the attention kernels' rows)
inline vec16 exp16_nonpositive(vec16 x) {
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  return exp_nonpositive_lanes<vec16, i32x16>(x);
}

// Calls f with the group size (query heads per KV head) as a compile-time constant
// (std::integral_constant<int, G>) for the compiled-in groups 1-8; false (f not called) for
// any other. Both kernel files instantiate their attention per group through it.
template <typename F>
bool with_group(int64_t group, F&& f) {
  switch (group) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 5: f(std::integral_constant<int, 5>{}); return true;
    case 6: f(std::integral_constant<int, 6>{}); return true;
    case 7: f(std::integral_constant<int, 7>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}
