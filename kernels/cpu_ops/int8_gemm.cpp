// CPU GEMM of int8 weights (per-output-channel scales) by quantized activations, two modes:
//
// - int16 rows (activation_group 0, the default): y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] wq[n, k]
//   (+ bias[n]). Each row is quantized to int16 in [-32639, 32639] with one scale (~256x finer
//   than int8, so what is left is the weights' rounding: the error of weight-only int8).
// - int8 per 32 columns (activation_group 32, llama.cpp q8_0's activation scheme): each row is
//   cut into groups of 32 columns, each quantized to int8 in [-127, 127] with its own scale:
//   y[m, n] = sw[n] * sum_g sx[m, g] * sum_{k in g} xq[m, k] wq[n, k] (+ bias[n]). Half the
//   instructions of the int16 mode; coarser (see weights.py for the accuracy measured).
//
// The instruction set is picked at run time:
// - AVX-512 VNNI: `vpdpbusd` (u8 x s8 -> int32, 64 MACs per instruction; faster than the int16
//   `vpdpwssd` on these cores). It wants one operand unsigned: the weights are stored offset by
//   +128. int16 rows: each value is split into two int8 digits, x = 256 hi + lo with hi, lo in
//   [-128, 127], each digit plane runs through `vpdpbusd` (two per 4 MACs) and 128 * (the block's
//   digit sum) is taken off each plane. int8 groups: one `vpdpbusd` per 4 MACs into int32 sums
//   over one group (8 quads), then converted and added into float sums with the row's group scale
//   broadcast (fma); the offset is linear, so it folds into one float per row (sum over groups of
//   scale_g * 128 * digit sum_g), taken off once at the end (times the column scale).
// - AVX2: `vpmaddwd` (int16 x int16 -> int32 pairs, 16 MACs) on the widened weights.
// - else a scalar loop. All three give the same integer sums, so the same result (int8 groups:
//   the same int32 group sums and the same fma chain, so the same floats bit for bit).
//
// Weight layout (`int8_gemm_pack`, once at load): output columns in groups of kGroup = 64; within
// a group, for each quad of input columns (4q .. 4q+3), the 64 columns' four values side by side,
// offset by 128: packed[g][q][c][t] = w[64 g + c][4 q + t] + 128 (uint8), padded past N and K
// with zero weights. One quad of a group is 256 contiguous bytes: four 64-byte vectors whose 32-bit
// lane c holds column c's four values, against four activation digits broadcast to every lane.
//
// Blocking: threads split the column groups. Each thread walks K in blocks of kKC quads (int8
// groups: one block spanning K, as their sums are float), per block its groups, per group the rows
// in tiles of R: an R x 64 tile of int32 sums in registers (exact; int8 groups: float sums of exact
// group sums), added as float into the output, which holds the running sum until the last block
// applies the scales, the offset and the bias (16 columns at a time on AVX-512). One block instead
// of 512-column ones: 1.06x on SmolLM2's four projections at 256 rows (docs/benchmarks/README.md, int8-gemm).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GS_X86 1
#endif

namespace {

constexpr int64_t kGroup = 64;        // output columns per packed group
constexpr int64_t kQuadBytes = 256;   // one k-quad of a group: 64 columns x 4 uint8
constexpr int64_t kKC = 128;          // k-quads per block: 512 columns keep int16 x int8 sums exact
constexpr int32_t kXMax = 32639;      // 127 * 256 + 127: the largest value two int8 digits hold
constexpr int kMaxRows = 4;           // tallest row tile
constexpr int64_t kActGroup = 32;     // int8 activations: input columns per scale
constexpr int64_t kGroupQuads = kActGroup / 4;
static_assert(kKC % kGroupQuads == 0, "K blocks hold whole activation groups");

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

Isa detect_isa() {
#if defined(GS_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni")) {
    return Isa::kAvx512Vnni;
  }
  if (__builtin_cpu_supports("avx2")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

// The best instruction set this CPU runs, capped at `cap` (tests compare the paths).
Isa active_isa(int64_t cap) {
  static const Isa best = detect_isa();
  return static_cast<Isa>(std::min<int64_t>(static_cast<int64_t>(best), cap));
}

// Row tile height per instruction set (what fits the register file beside the accumulators).
int tile_rows(Isa isa) { return isa == Isa::kAvx512Vnni ? 3 : isa == Isa::kAvx2 ? 4 : 1; }

// The activations of one call, quantized: int16 rows [m, kp] (zero-padded), and for VNNI their
// two int8 digit planes and each row's digit sums per K block (the +128 weight offset's share).
//
// Grouped int8 (`group` = 32): rows [m, kp] (kp a multiple of 32, zero-padded), one scale per
// 32 columns [m, kp / 32], and per row the +128 weight offset's share in float: sum over groups
// of scale_g * 128 * (digit sum of group g), taken off once at the end. Output row r is
// (float sum - offset[r]) * scale[r] * weight scale; scale[r] is 1 for grouped rows and offset[r]
// is 0 for int16 rows.
struct Activations {
  int64_t kp = 0;
  int64_t group = 0;                     // 0: int16 per row; kActGroup: int8 per group
  std::vector<int16_t> q;
  std::vector<float> scale, offset;      // [m]
  std::vector<int8_t> hi, lo;            // [m, kp]
  std::vector<int32_t> hi_sum, lo_sum;   // [m, blocks]
  std::vector<int8_t> q8;                // grouped: [m, kp]
  std::vector<float> group_scale;        // grouped: [m, kp / kActGroup]
};

// ---- tiles: acc[r][c] = sum over `quads` k-quads of x[r] . w[c], for R rows and 64 columns ----

// Scalar and AVX2 read the int16 rows (row stride lda); w is the group's first quad of the block.
void tile_scalar(const int16_t* x, const uint8_t* w, int64_t quads, int32_t* acc) {
  std::fill(acc, acc + kGroup, 0);
  for (int64_t q = 0; q < quads; ++q) {
    const uint8_t* wq = w + q * kQuadBytes;
    for (int c = 0; c < kGroup; ++c) {
      int32_t sum = 0;
      for (int t = 0; t < 4; ++t) sum += x[4 * q + t] * (static_cast<int32_t>(wq[4 * c + t]) - 128);
      acc[c] += sum;
    }
  }
}

// Grouped int8 rows: per 32-column group an exact int32 sum of (w + 128) x, then float
// acc = fma(sum, group scale, acc). Every instruction set forms the same integer sums and the same
// fma chain, so the same floats.
void tile_q8_scalar(const int8_t* x, const float* s, const uint8_t* w, int64_t quads, float* acc) {
  std::fill(acc, acc + kGroup, 0.f);
  int32_t sum[kGroup];
  for (int64_t q0 = 0; q0 < quads; q0 += kGroupQuads) {
    const int64_t q1 = std::min(quads, q0 + kGroupQuads);
    std::fill(sum, sum + kGroup, 0);
    for (int64_t q = q0; q < q1; ++q) {
      const uint8_t* wq = w + q * kQuadBytes;
      for (int c = 0; c < kGroup; ++c)
        for (int t = 0; t < 4; ++t) sum[c] += static_cast<int32_t>(wq[4 * c + t]) * x[4 * q + t];
    }
    const float sg = s[q0 / kGroupQuads];
    for (int c = 0; c < kGroup; ++c) acc[c] = std::fma(static_cast<float>(sum[c]), sg, acc[c]);
  }
}

#if defined(GS_X86)
// One k-quad of one digit plane: R rows x 64 columns, one `vpdpbusd` per 4 MACs.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline void quad_q8_vnni(
    __m512i (&h)[R][4], const int8_t* x, int64_t lda, const uint8_t* wq, int64_t q) {
  const __m512i b0 = _mm512_loadu_si512(wq);
  const __m512i b1 = _mm512_loadu_si512(wq + 64);
  const __m512i b2 = _mm512_loadu_si512(wq + 128);
  const __m512i b3 = _mm512_loadu_si512(wq + 192);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    int32_t digits;
    std::memcpy(&digits, x + r * lda + 4 * q, sizeof(digits));
    const __m512i xv = _mm512_set1_epi32(digits);
    h[r][0] = _mm512_dpbusd_epi32(h[r][0], b0, xv);
    h[r][1] = _mm512_dpbusd_epi32(h[r][1], b1, xv);
    h[r][2] = _mm512_dpbusd_epi32(h[r][2], b2, xv);
    h[r][3] = _mm512_dpbusd_epi32(h[r][3], b3, xv);
  }
}

// VNNI: R rows x 64 columns x 2 digit planes = 8R accumulators of 16 lanes.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(
    const int8_t* hi, const int8_t* lo, int64_t lda, const uint8_t* w, int64_t quads,
    int32_t* acc_hi, int32_t* acc_lo) {
  __m512i h[R][4], l[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) h[r][j] = l[r][j] = _mm512_setzero_si512();
  for (int64_t q = 0; q < quads; ++q) {  // both planes against the same 4 weight vectors
    quad_q8_vnni<R>(h, hi, lda, w + q * kQuadBytes, q);
    quad_q8_vnni<R>(l, lo, lda, w + q * kQuadBytes, q);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_si512(acc_hi + r * kGroup + 16 * j, h[r][j]);
      _mm512_storeu_si512(acc_lo + r * kGroup + 16 * j, l[r][j]);
    }
}

// AVX2: 16 bytes of a quad widen to 4 columns x 4 values; `vpmaddwd` against the row's four
// values (broadcast as 64 bits) leaves each column's sum in two lanes, added at the end. R rows x
// 8 columns (two vectors each) per pass, 8 passes per group.
template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(
    const int16_t* x, int64_t lda, const uint8_t* w, int64_t quads, int32_t* acc) {
  const __m256i offset = _mm256_set1_epi16(128);
  for (int s = 0; s < 8; ++s) {
    __m256i c[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm256_setzero_si256();
    const uint8_t* ws = w + 32 * s;
    for (int64_t q = 0; q < quads; ++q) {
      const uint8_t* wq = ws + q * kQuadBytes;
      const __m256i b0 = _mm256_sub_epi16(
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq))), offset);
      const __m256i b1 = _mm256_sub_epi16(
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + 16))), offset);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int64_t values;
        std::memcpy(&values, x + r * lda + 4 * q, sizeof(values));
        const __m256i xv = _mm256_set1_epi64x(values);
        c[r][0] = _mm256_add_epi32(c[r][0], _mm256_madd_epi16(xv, b0));
        c[r][1] = _mm256_add_epi32(c[r][1], _mm256_madd_epi16(xv, b1));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // lanes (c0 c0 c1 c1 c2 c2 c3 c3), (c4 .. c7) -> hadd: c0 c1 c4 c5 c2 c3 c6 c7 -> reorder
      const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(c[r][0], c[r][1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kGroup + 8 * s), sums);
    }
  }
}

// VNNI, grouped int8 rows: R x 64 int32 sums over one group (8 quads), then into R x 64 float
// sums with the row's group scale. 4R + 4R + 4 weight vectors: R = 3 fits the 32 registers.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_q8_vnni(
    const int8_t* x, int64_t lda, const float* s, int64_t lds, const uint8_t* w, int64_t quads,
    float* acc) {
  __m512 f[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) f[r][j] = _mm512_setzero_ps();
  for (int64_t q0 = 0; q0 < quads; q0 += kGroupQuads) {
    __m512i h[R][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) h[r][j] = _mm512_setzero_si512();
    if (q0 + kGroupQuads <= quads) {
#pragma GCC unroll 8
      for (int64_t q = q0; q < q0 + kGroupQuads; ++q) quad_q8_vnni<R>(h, x, lda, w + q * kQuadBytes, q);
    } else {
      for (int64_t q = q0; q < quads; ++q) quad_q8_vnni<R>(h, x, lda, w + q * kQuadBytes, q);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 sg = _mm512_set1_ps(s[r * lds + q0 / kGroupQuads]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) f[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h[r][j]), sg, f[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + r * kGroup + 16 * j, f[r][j]);
}

// AVX2, grouped int8 rows: as `tile_avx2` on the uint8 (+128) weights widened to int16 and the
// row's four int8 values widened likewise; 8 columns per pass.
template <int R>
__attribute__((target("avx2,fma"))) void tile_q8_avx2(
    const int8_t* x, int64_t lda, const float* s, int64_t lds, const uint8_t* w, int64_t quads,
    float* acc) {
  for (int p = 0; p < 8; ++p) {
    __m256 f[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
    const uint8_t* wp = w + 32 * p;
    for (int64_t q0 = 0; q0 < quads; q0 += kGroupQuads) {
      const int64_t q1 = std::min(quads, q0 + kGroupQuads);
      __m256i c[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm256_setzero_si256();
      for (int64_t q = q0; q < q1; ++q) {
        const uint8_t* wq = wp + q * kQuadBytes;
        const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq)));
        const __m256i b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + 16)));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t values;
          std::memcpy(&values, x + r * lda + 4 * q, sizeof(values));
          const __m256i xv = _mm256_cvtepi8_epi16(_mm_set1_epi32(values));
          c[r][0] = _mm256_add_epi32(c[r][0], _mm256_madd_epi16(xv, b0));
          c[r][1] = _mm256_add_epi32(c[r][1], _mm256_madd_epi16(xv, b1));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(c[r][0], c[r][1]), 0xD8);
        const __m256 sg = _mm256_set1_ps(s[r * lds + q0 / kGroupQuads]);
        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), sg, f[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * kGroup + 8 * p, f[r]);
  }
}
#endif

// acc [rows, 64]: the int32 sums x . w of one block (the VNNI planes combined), as float; for
// grouped rows the block's float sum over its groups.
void run_tile(Isa isa, int rows, const Activations& a, int64_t row0, int64_t kq0, int64_t block,
              const uint8_t* w, int64_t quads, float* acc) {
  alignas(64) int32_t hi[kMaxRows * kGroup];
  alignas(64) int32_t lo[kMaxRows * kGroup];
  const int64_t lda = a.kp, off = row0 * lda + 4 * kq0;
  if (a.group) {
    const int8_t* x = a.q8.data() + off;
    const int64_t lds = a.kp / kActGroup;
    const float* s = a.group_scale.data() + row0 * lds + kq0 / kGroupQuads;
#if defined(GS_X86)
    if (isa == Isa::kAvx512Vnni) {
      switch (rows) {
        case 3: tile_q8_vnni<3>(x, lda, s, lds, w, quads, acc); break;
        case 2: tile_q8_vnni<2>(x, lda, s, lds, w, quads, acc); break;
        default: tile_q8_vnni<1>(x, lda, s, lds, w, quads, acc); break;
      }
      return;
    }
    if (isa == Isa::kAvx2) {
      switch (rows) {
        case 4: tile_q8_avx2<4>(x, lda, s, lds, w, quads, acc); break;
        case 3: tile_q8_avx2<3>(x, lda, s, lds, w, quads, acc); break;
        case 2: tile_q8_avx2<2>(x, lda, s, lds, w, quads, acc); break;
        default: tile_q8_avx2<1>(x, lda, s, lds, w, quads, acc); break;
      }
      return;
    }
#endif
    for (int r = 0; r < rows; ++r) tile_q8_scalar(x + r * lda, s + r * lds, w, quads, acc + r * kGroup);
    return;
  }
#if defined(GS_X86)
  if (isa == Isa::kAvx512Vnni) {
    const int8_t* h = a.hi.data() + off;
    const int8_t* l = a.lo.data() + off;
    switch (rows) {
      case 3: tile_vnni<3>(h, l, lda, w, quads, hi, lo); break;
      case 2: tile_vnni<2>(h, l, lda, w, quads, hi, lo); break;
      default: tile_vnni<1>(h, l, lda, w, quads, hi, lo); break;
    }
    const int64_t blocks = (a.kp / 4 + kKC - 1) / kKC;
    for (int r = 0; r < rows; ++r) {
      // the weights carry +128: take 128 x (the block's digit sum) off each plane, exactly
      const int32_t hs = 128 * a.hi_sum[(row0 + r) * blocks + block];
      const int32_t ls = 128 * a.lo_sum[(row0 + r) * blocks + block];
      for (int c = 0; c < kGroup; ++c) {
        const int64_t i = r * kGroup + c;
        acc[i] = 256.f * static_cast<float>(hi[i] - hs) + static_cast<float>(lo[i] - ls);
      }
    }
    return;
  }
  if (isa == Isa::kAvx2) {
    const int16_t* x = a.q.data() + off;
    switch (rows) {
      case 4: tile_avx2<4>(x, lda, w, quads, hi); break;
      case 3: tile_avx2<3>(x, lda, w, quads, hi); break;
      case 2: tile_avx2<2>(x, lda, w, quads, hi); break;
      default: tile_avx2<1>(x, lda, w, quads, hi); break;
    }
    for (int64_t i = 0; i < rows * kGroup; ++i) acc[i] = static_cast<float>(hi[i]);
    return;
  }
#endif
  for (int r = 0; r < rows; ++r) {
    tile_scalar(a.q.data() + off + r * lda, w, quads, hi);
    for (int c = 0; c < kGroup; ++c) acc[r * kGroup + c] = static_cast<float>(hi[c]);
  }
}

// Hot scalar loops get an AVX2 / AVX-512 clone picked at load time (GCC ifunc), as in
// paged_attention.cpp; the default clone keeps the library portable.
#if defined(GS_X86) && !defined(__clang__)
#define GS_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GS_SIMD_CLONES
#endif

constexpr int kLanes = 16;  // independent partial maxima: vectorizes without -ffast-math

// One row to int16 (zero-padded to kp) with one symmetric scale; returns the scale.
GS_SIMD_CLONES float quantize_row(const float* row, int64_t k, int64_t kp, int16_t* out) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= k; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], std::fabs(row[j + l]));
  float amax = 0.f;
  for (int l = 0; l < kLanes; ++l) amax = std::max(amax, lanes[l]);
  for (; j < k; ++j) amax = std::max(amax, std::fabs(row[j]));
  const float inv = amax > 0.f ? static_cast<float>(kXMax) / amax : 0.f;
  // Round to nearest even by the 1.5 * 2^23 trick (|v| <= 32639): vectorizes on any x86, unlike
  // nearbyint without SSE4.1. The clamp guards against inv's rounding pushing past kXMax.
  constexpr float kMagic = 12582912.f;
  for (j = 0; j < k; ++j) {
    const float v = std::min(std::max(row[j] * inv, -float(kXMax)), float(kXMax));
    out[j] = static_cast<int16_t>((v + kMagic) - kMagic);
  }
  for (; j < kp; ++j) out[j] = 0;
  return amax / static_cast<float>(kXMax);
}

// One int16 row to its two int8 digits (v = 256 hi + lo, lo in [-128, 127]) and their sums per
// K block.
GS_SIMD_CLONES void split_row(const int16_t* q, int64_t kp, int64_t blocks, int8_t* hi, int8_t* lo,
                              int32_t* hi_sum, int32_t* lo_sum) {
  for (int64_t j = 0; j < kp; ++j) {
    const int32_t h = (static_cast<int32_t>(q[j]) + 128) >> 8;  // floor
    hi[j] = static_cast<int8_t>(h);
    lo[j] = static_cast<int8_t>(q[j] - 256 * h);
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = b * 4 * kKC, j1 = std::min(kp, j0 + 4 * kKC);
    int32_t hs = 0, ls = 0;
    for (int64_t j = j0; j < j1; ++j) {
      hs += hi[j];
      ls += lo[j];
    }
    hi_sum[b] = hs;
    lo_sum[b] = ls;
  }
}

GS_SIMD_CLONES void combine_row(const float* hi, const float* lo, float s, const float* sw,
                                const float* bias, int64_t n, float* y) {
  for (int64_t c = 0; c < n; ++c) y[c] = (256.f * hi[c] + lo[c]) * s * sw[c] + (bias ? bias[c] : 0.f);
}

// Each row to int16 with one symmetric scale (and, for VNNI, to its digit planes and sums).
Activations quantize_rows(const float* x, int64_t m, int64_t k, Isa isa) {
  Activations a;
  a.kp = (k + 3) / 4 * 4;
  const int64_t blocks = (a.kp / 4 + kKC - 1) / kKC;
  const bool digits = isa == Isa::kAvx512Vnni;
  a.q.resize(static_cast<size_t>(m * a.kp));
  a.scale.resize(static_cast<size_t>(m));
  a.offset.assign(static_cast<size_t>(m), 0.f);
  if (digits) {
    a.hi.resize(a.q.size());
    a.lo.resize(a.q.size());
    a.hi_sum.resize(static_cast<size_t>(m * blocks));
    a.lo_sum.resize(static_cast<size_t>(m * blocks));
  }
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int16_t* q = a.q.data() + i * a.kp;
      a.scale[i] = quantize_row(x + i * k, k, a.kp, q);
      if (digits) {
        split_row(q, a.kp, blocks, a.hi.data() + i * a.kp, a.lo.data() + i * a.kp,
                  a.hi_sum.data() + i * blocks, a.lo_sum.data() + i * blocks);
      }
    }
  });
  return a;
}

// One row to int8 per 32-column group, zero-padded to kp (a multiple of 32): symmetric, scale =
// amax / 127, values round(x * (127 / amax)) to nearest even. Writes the group scales; returns
// the row's offset term (sum of scale_g * 128 * digit sum_g). The AVX-512 version below forms
// the same values bit for bit (same float operations, explicit fma).
GS_SIMD_CLONES float quantize_q8_row(const float* row, int64_t k, int64_t kp, int8_t* out,
                                     float* group_scale) {
  constexpr float kMagic = 12582912.f;
  float offset = 0.f;
  for (int64_t j0 = 0; j0 < kp; j0 += kActGroup) {
    const int64_t n = std::max<int64_t>(0, std::min(kActGroup, k - j0));
    float amax = 0.f;
    for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(row[j0 + j]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kActGroup; ++j) {
      int32_t v = 0;
      if (j < n) {
        const float t = std::min(std::max(row[j0 + j] * inv, -127.f), 127.f);
        v = static_cast<int32_t>((t + kMagic) - kMagic);
      }
      out[j0 + j] = static_cast<int8_t>(v);
      sum += v;
    }
    const float sg = amax / 127.f;
    group_scale[j0 / kActGroup] = sg;
    offset = std::fma(sg, static_cast<float>(128 * sum), offset);
  }
  return offset;
}

#if defined(GS_X86)
__attribute__((target("avx512f,avx512bw"))) float quantize_q8_row_avx512(
    const float* row, int64_t k, int64_t kp, int8_t* out, float* group_scale) {
  const __m512 hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  float offset = 0.f;
  for (int64_t j0 = 0; j0 < kp; j0 += kActGroup) {
    const int64_t n = std::max<int64_t>(0, std::min(kActGroup, k - j0));
    const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? 0xFFFF : n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0;
    const __m512 v0 = _mm512_maskz_loadu_ps(m0, row + j0);
    const __m512 v1 = _mm512_maskz_loadu_ps(m1, row + j0 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    // vcvtps2dq rounds to nearest even (the default MXCSR mode), as the scalar magic-number trick
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, inv), lo), hi));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, inv), lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j0), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j0 + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    const float sg = amax / 127.f;
    group_scale[j0 / kActGroup] = sg;
    offset = std::fma(sg, static_cast<float>(128 * sum), offset);
  }
  return offset;
}
#endif

// Each row to int8 per 32-column group (AVX-512 where the capped instruction set has it).
Activations quantize_groups(const float* x, int64_t m, int64_t k, Isa isa) {
  Activations a;
  a.group = kActGroup;
  a.kp = (k + kActGroup - 1) / kActGroup * kActGroup;
  const int64_t groups = a.kp / kActGroup;
  a.q8.resize(static_cast<size_t>(m * a.kp));
  a.group_scale.resize(static_cast<size_t>(m * groups));
  a.scale.assign(static_cast<size_t>(m), 1.f);
  a.offset.resize(static_cast<size_t>(m));
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int8_t* q = a.q8.data() + i * a.kp;
      float* gs = a.group_scale.data() + i * groups;
#if defined(GS_X86)
      if (isa == Isa::kAvx512Vnni) {
        a.offset[i] = quantize_q8_row_avx512(x + i * k, k, a.kp, q, gs);
        continue;
      }
#endif
      a.offset[i] = quantize_q8_row(x + i * k, k, a.kp, q, gs);
    }
  });
  return a;
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "int8_gemm: ", what); }

// The optional bias's n float32 values, or null without one.
const float* bias_values(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
        "bias must be n contiguous float32 values");
  return bias->data_ptr<float>();
}

int64_t packed_numel(int64_t n, int64_t k) {
  return (n + kGroup - 1) / kGroup * ((k + 3) / 4) * kQuadBytes;
}

void int8_gemm_pack(const at::Tensor& packed, const at::Tensor& weight) {
  check(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
        "weight must be a contiguous 2-D int8 tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  check(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
            packed.numel() == packed_numel(n, k),
        "packed must be a contiguous uint8 tensor of packed_numel(n, k) elements");
  const int64_t quads = (k + 3) / 4, groups = (n + kGroup - 1) / kGroup;
  const int8_t* w = weight.data_ptr<int8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* dst = out + g * quads * kQuadBytes;
      for (int64_t q = 0; q < quads; ++q) {
        for (int64_t c = 0; c < kGroup; ++c) {
          const int64_t col = g * kGroup + c;
          for (int64_t t = 0; t < 4; ++t) {
            const int64_t kk = 4 * q + t;
            const int32_t v = (col < n && kk < k) ? w[col * k + kk] : 0;
            dst[q * kQuadBytes + 4 * c + t] = static_cast<uint8_t>(v + 128);
          }
        }
      }
    }
  });
}

#if defined(GS_X86)
// The last block's epilogue for one row of a full 64-column group, 16 columns at a time:
// ((src [+ running]) - off) * s * sw (+ bias), each operation rounded on its own, in the scalar
// loop's order (the empty asm keeps GCC from contracting a product and a sum into an fma), so
// both give the same floats.
__attribute__((target("avx512f"))) void finish_row_avx512(const float* src, const float* running, float off,
                                                       float s, const float* sw, const float* bias, float* dst) {
  const __m512 vo = _mm512_set1_ps(off), vs = _mm512_set1_ps(s);
  for (int64_t c = 0; c < kGroup; c += 16) {
    __m512 t = _mm512_loadu_ps(src + c);
    if (running != nullptr) t = _mm512_add_ps(_mm512_loadu_ps(running + c), t);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(t, vo), vs), _mm512_loadu_ps(sw + c));
    __asm__("" : "+v"(v));
    v = _mm512_add_ps(v, bias != nullptr ? _mm512_loadu_ps(bias + c) : _mm512_setzero_ps());
    _mm512_storeu_ps(dst + c, v);
  }
}
#endif

// out [m, n] float32 = (x quantized to int16 per row, or with activation_group 32 to int8 per 32
// columns) @ (packed int8 weight).T * scales (+ bias).
void int8_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
               const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t isa_cap,
               int64_t activation_group) {
  check(activation_group == 0 || activation_group == kActGroup,
        "activation_group must be 0 (int16 per row) or 32 (int8 per 32 columns)");
  check(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
        "x must be a contiguous 2-D float32 tensor");
  check(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
            out.size(0) == x.size(0),
        "out must be a contiguous float32 [m, n] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  check(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
        "scales must be n contiguous float32 values");
  check(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
            packed.numel() == packed_numel(n, k),
        "packed does not hold an [n, k] weight");
  const float* bias_ptr = bias_values(bias, n);
  if (m == 0 || n == 0) return;
  float* y = out.data_ptr<float>();
  const int64_t quads = (k + 3) / 4, groups = (n + kGroup - 1) / kGroup;
  if (quads == 0) {  // k == 0: the product is empty
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < n; ++c) y[i * n + c] = bias_ptr ? bias_ptr[c] : 0.f;
    return;
  }
  const Isa isa = active_isa(isa_cap);
  const Activations a = activation_group ? quantize_groups(x.data_ptr<float>(), m, k, isa)
                                         : quantize_rows(x.data_ptr<float>(), m, k, isa);
  const int mr = tile_rows(isa);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sw = scales.data_ptr<float>();
  // int16 rows: K blocks of kKC quads keep the int32 sums exact. int8 groups sum in float per
  // group, so one block spans K: each output is written once, never read back and added to.
  const int64_t block_quads = activation_group ? quads : kKC;
  const bool wide_epilogue = isa == Isa::kAvx512Vnni;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float acc[kMaxRows * kGroup];
    for (int64_t kb = 0; kb < quads; kb += block_quads) {
      const int64_t kc = std::min(block_quads, quads - kb);
      const bool first = kb == 0, last = kb + kc == quads;
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* wb = w + (g * quads + kb) * kQuadBytes;
        const int64_t col0 = g * kGroup, cols = std::min(kGroup, n - col0);
        for (int64_t r0 = 0; r0 < m; r0 += mr) {
          const int rows = static_cast<int>(std::min<int64_t>(mr, m - r0));
          run_tile(isa, rows, a, r0, kb, kb / kKC, wb, kc, acc);
          for (int r = 0; r < rows; ++r) {
            float* dst = y + (r0 + r) * n + col0;
            const float* src = acc + r * kGroup;
            if (!last) {
              for (int64_t c = 0; c < cols; ++c) dst[c] = first ? src[c] : dst[c] + src[c];
              continue;
            }
            const float s = a.scale[r0 + r], off = a.offset[r0 + r];
            const float* swc = sw + col0;
#if defined(GS_X86)
            if (wide_epilogue && cols == kGroup) {
              finish_row_avx512(src, first ? nullptr : dst, off, s, swc, bias_ptr ? bias_ptr + col0 : nullptr, dst);
              continue;
            }
#endif
            for (int64_t c = 0; c < cols; ++c) {
              const float total = first ? src[c] : dst[c] + src[c];
              dst[c] = (total - off) * s * swc[c] + (bias_ptr ? bias_ptr[col0 + c] : 0.f);
            }
          }
        }
      }
    }
  });
}

// The grouped activations of x (for tests): q [m, kp] int8, group scales [m, kp / 32], offsets [m].
void int8_gemm_quantize_groups(const at::Tensor& q, const at::Tensor& group_scale,
                               const at::Tensor& offset, const at::Tensor& x, int64_t isa_cap) {
  check(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
        "x must be a contiguous 2-D float32 tensor");
  const int64_t m = x.size(0), k = x.size(1), kp = (k + kActGroup - 1) / kActGroup * kActGroup;
  check(q.scalar_type() == at::kChar && q.is_contiguous() && q.numel() == m * kp &&
            group_scale.scalar_type() == at::kFloat && group_scale.is_contiguous() &&
            group_scale.numel() == m * kp / kActGroup && offset.scalar_type() == at::kFloat &&
            offset.is_contiguous() && offset.numel() == m,
        "quantize_groups wants q int8 [m, kp], group_scale float32 [m, kp / 32], offset float32 [m]");
  const Activations a = quantize_groups(x.data_ptr<float>(), m, k, active_isa(isa_cap));
  std::memcpy(q.data_ptr<int8_t>(), a.q8.data(), a.q8.size());
  std::memcpy(group_scale.data_ptr<float>(), a.group_scale.data(), a.group_scale.size() * sizeof(float));
  std::memcpy(offset.data_ptr<float>(), a.offset.data(), a.offset.size() * sizeof(float));
}

constexpr int64_t kSerialElements = 1 << 19;  // up to this many elements per thread (planes ops)

// For a library GEMM of int8 x int8 -> int32 (oneDNN's AMX matmul): x [m, k] float32 as the
// int16 rows of the int16 mode (same values, same scales), each split into its two int8 digits,
// the high digits in rows [0, m) of `planes` and the low ones in rows [m, 2m).
void int8_gemm_quantize_planes(const at::Tensor& planes, const at::Tensor& scale, const at::Tensor& x) {
  check(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
        "x must be a contiguous 2-D float32 tensor");
  const int64_t m = x.size(0), k = x.size(1);
  check(planes.scalar_type() == at::kChar && planes.is_contiguous() && planes.dim() == 2 &&
            planes.size(0) == 2 * m && planes.size(1) == k && scale.scalar_type() == at::kFloat &&
            scale.is_contiguous() && scale.numel() == m,
        "quantize_planes wants planes int8 [2m, k] and scale float32 [m]");
  const float* xp = x.data_ptr<float>();
  int8_t* hi = planes.data_ptr<int8_t>();
  int8_t* lo = hi + m * k;
  float* sp = scale.data_ptr<float>();
  // Decode-sized inputs on the calling thread: another parallel region per GEMM is another wait
  // for a descheduled thread on cores shared with other processes.
  at::parallel_for(0, m, std::max<int64_t>(1, kSerialElements / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    std::vector<int16_t> q(static_cast<size_t>(k));
    for (int64_t i = begin; i < end; ++i) {
      sp[i] = quantize_row(xp + i * k, k, k, q.data());
      split_row(q.data(), k, 0, hi + i * k, lo + i * k, nullptr, nullptr);
    }
  });
}

// out [m, n] = (256 acc[r] + acc[m + r]) * scale[r] * wscale (+ bias): the digit planes' products
// (float32, exact integers) combined as the int16 mode's epilogue does.
void int8_gemm_combine_planes(const at::Tensor& out, const at::Tensor& acc, const at::Tensor& scale,
                              const at::Tensor& wscale, const c10::optional<at::Tensor>& bias) {
  check(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
        "out must be a contiguous float32 [m, n] tensor");
  const int64_t m = out.size(0), n = out.size(1);
  check(acc.scalar_type() == at::kFloat && acc.is_contiguous() && acc.dim() == 2 &&
            acc.size(0) == 2 * m && acc.size(1) == n,
        "acc must be a contiguous float32 [2m, n] tensor");
  check(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == m &&
            wscale.scalar_type() == at::kFloat && wscale.is_contiguous() && wscale.numel() == n,
        "scale must be m and wscale n contiguous float32 values");
  const float* bias_ptr = bias_values(bias, n);
  const float* a = acc.data_ptr<float>();
  const float* sx = scale.data_ptr<float>();
  const float* sw = wscale.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, kSerialElements / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) combine_row(a + r * n, a + (m + r) * n, sx[r], sw, bias_ptr, n, y + r * n);
  });
}

int64_t int8_gemm_packed_numel(int64_t n, int64_t k) { return packed_numel(n, k); }

// 2: AVX-512 VNNI, 1: AVX2, 0: scalar (the best this CPU runs).
int64_t int8_gemm_isa() { return static_cast<int64_t>(active_isa(2)); }

}  // namespace

TORCH_LIBRARY(gridserve_int8_gemm, m) {
  m.def("pack(Tensor(a!) packed, Tensor weight) -> ()");
  m.def("gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales, Tensor? bias, int isa_cap, "
        "int activation_group) -> ()");
  m.def("quantize_groups(Tensor(a!) q, Tensor(a!) group_scale, Tensor(a!) offset, Tensor x, "
        "int isa_cap) -> ()");
  m.def("quantize_planes(Tensor(a!) planes, Tensor(a!) scale, Tensor x) -> ()");
  m.def("combine_planes(Tensor(a!) out, Tensor acc, Tensor scale, Tensor wscale, Tensor? bias) -> ()");
  m.def("packed_numel(int n, int k) -> int", &int8_gemm_packed_numel);
  m.def("isa() -> int", &int8_gemm_isa);
}

TORCH_LIBRARY_IMPL(gridserve_int8_gemm, CPU, m) {
  m.impl("pack", int8_gemm_pack);
  m.impl("gemm", int8_gemm);
  m.impl("quantize_groups", int8_gemm_quantize_groups);
  m.impl("quantize_planes", int8_gemm_quantize_planes);
  m.impl("combine_planes", int8_gemm_combine_planes);
}
