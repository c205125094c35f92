// What the C++ CPU kernels of this folder share: the x86 target macros, the run-time AVX-512
// check and 16-lane float32 loads of float32 / bf16 / fp16 data. Each .cpp builds its own library;
// `build_extension` hashes this header with the source, so editing it rebuilds them.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

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

}  // namespace gs_simd
