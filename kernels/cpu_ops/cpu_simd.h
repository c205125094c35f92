// What the C++ CPU kernels of this folder share: the x86 target macros, the run-time AVX-512
// check, 16-lane float32 loads of float32 / bf16 / fp16 data, and the portable float32 row helpers
// (a cache row widened to float32, dot, axpy) of the attention kernels. Each .cpp builds its own library;
// `build_extension` hashes this header with the source, so editing it rebuilds them.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GS_X86 1
#define GS_AVX512 __attribute__((target("avx512f")))
#endif

namespace gs_simd {

// 1 when this CPU runs AVX-512F (checked once), else 0: the kernels' best instruction set.
inline int64_t best_isa() {
#if defined(GS_X86)
  static const bool avx512 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return avx512 ? 1 : 0;
#else
  return 0;
#endif
}

#if defined(GS_X86)
// 16 consecutive values as float32 (16-bit types widened exactly).
template <typename T>
GS_AVX512 inline __m512 load16(const T* p);
template <>
GS_AVX512 inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
GS_AVX512 inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
template <>
GS_AVX512 inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// ---- portable float32 rows (the compiler vectorizes these loops) -------------------------------

constexpr int kLanes = 16;  // independent partial sums: vectorizes without -ffast-math

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Every value of an 8-bit float, indexed by its bits.
template <typename F8>
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(F8(static_cast<uint8_t>(b), F8::from_bits()));
    return t;
  }();
  return table.data();
}

// K/V rows in float32 are used in place; fp16/bf16 rows are widened into `buf` first, fp8 rows
// through their lookup table.
template <typename C>
inline const float* widen(const C* src, float* buf, int64_t d) {
  for (int64_t j = 0; j < d; ++j) buf[j] = to_float(src[j]);
  return buf;
}
template <>
inline const float* widen<float>(const float* src, float*, int64_t) { return src; }
template <typename F8>
inline const float* widen_fp8(const F8* src, float* buf, int64_t d) {
  const float* table = fp8_table<F8>();
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  for (int64_t j = 0; j < d; ++j) buf[j] = table[bits[j]];
  return buf;
}
template <>
inline const float* widen<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, float* buf, int64_t d) {
  return widen_fp8(src, buf, d);
}
template <>
inline const float* widen<c10::Float8_e5m2>(const c10::Float8_e5m2* src, float* buf, int64_t d) {
  return widen_fp8(src, buf, d);
}

inline float dot(const float* a, const float* b, int64_t d) {
  float lanes[kLanes] = {0.f};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[j + l] * b[j + l];
  float s = 0.f;
  for (; j < d; ++j) s += a[j] * b[j];
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t d) {
  for (int64_t j = 0; j < d; ++j) y[j] += p * x[j];
}

}  // namespace gs_simd
