// Vector helpers shared by the native CPU kernels (cpu_ops.cpp, prefill_attention.cpp): rows
// as GCC vector extensions (one AVX-512 register, or two AVX2 ones) and exp on 16 lanes.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

// Rows as vectors of 16 floats (GCC vector extensions: one AVX-512 register, or two AVX2 ones),
// for the fixed-size attention kernels and the elementwise ops.
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

// exp(x) for x <= 0 on 16 lanes at once (the polynomial and steps of cpu_ops.cpp's
// exp_nonpositive): t <= 0, so floor(t) is the truncation less one where they differ.
inline vec16 exp16_nonpositive(vec16 x) {
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  const vec16 t = (x < -87.f ? -87.f : x) * 1.4426950408889634f;
  const i32x16 truncated = __builtin_convertvector(t, i32x16);
  const i32x16 whole = truncated + (__builtin_convertvector(truncated, vec16) > t);  // a true lane is -1
  const vec16 f = t - __builtin_convertvector(whole, vec16);
  vec16 p = f * 2.168343198718503e-4f + 1.2437946861609817e-3f;
  p = p * f + 9.679985232651234e-3f;
  p = p * f + 5.548214912414551e-2f;
  p = p * f + 2.4023030698299408e-1f;
  p = p * f + 6.931468844413757e-1f;
  p = p * f + 1.f;
  const i32x16 bits = (whole + 127) << 23;
  vec16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
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
