// CPU kernels for a decoder layer's per-token "small ops": RMSNorm (plain and with the residual
// add), rotary embedding, SiLU-and-mul, GELU (and GELU-and-mul) and the KV-cache write. Each replaces a chain of torch ops
// (one pass over memory and one dispatch per op) with one pass per row.
//
// Semantics are those of kernels/reference.py, rounding included: every intermediate the
// reference materializes in the input dtype (bf16 / fp16) is rounded to that dtype here too, so
// RoPE, the residual add and the cache write give the reference's bits; RMSNorm differs only in
// the order of its sum of squares, SiLU in its exp (a polynomial, ~1 ulp).
//
// Each row (token) is computed alone, in an order that depends only on the row's length: a row's
// result never depends on the batch. Rows are split over threads with at::parallel_for (torch's
// pool, so torch.set_num_threads applies) once a call has enough of them.
//
// Instruction sets: an AVX-512F path (target attribute, chosen at run time with
// __builtin_cpu_supports) and portable loops, so the build never depends on the machine it was
// compiled on. Registered as torch.ops.gridserve_cpu_layer.* through torch/library.h.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace {

using gs_simd::best_isa;

std::atomic<int64_t> max_isa{1};

inline bool use_avx512() { return std::min(best_isa(), max_isa.load(std::memory_order_relaxed)) >= 1; }

// Rows per parallel chunk: about 16K elements, so a decode-sized call is one chunk.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, (16 * 1024) / std::max<int64_t>(row_elems, 1)); }

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

// x rounded to T and back: what the reference's intermediate tensors of dtype T hold.
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }
template <>
inline float round_to<float>(float x) { return x; }

// A product rounded on its own (no FMA contraction with a following add), as the reference's
// separate torch ops compute it.
inline float product(float a, float b) {
  float p = a * b;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__aarch64__))
#if defined(__x86_64__)
  __asm__("" : "+x"(p));
#else
  __asm__("" : "+w"(p));
#endif
#endif
  return p;
}

// ---------------------------------------------------------------------------------------------
// AVX-512 helpers: 16 lanes in float32; 16-bit types converted on load / store.
#if defined(GS_X86)
using gs_simd::load16;

// float32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (as c10::BFloat16).
GS_AVX512 inline __m256i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

template <typename T>
GS_AVX512 inline void store16(T* p, __m512 v);
template <>
GS_AVX512 inline void store16<float>(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <>
GS_AVX512 inline void store16<c10::BFloat16>(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v));
}
template <>
GS_AVX512 inline void store16<c10::Half>(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Rounded to T and back (a no-op for float).
template <typename T>
GS_AVX512 inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// The first n (< 16) elements, through a zero-padded buffer: tails use the same vector math.
template <typename T>
GS_AVX512 inline __m512 load_part(const T* p, int64_t n) {
  T buf[16];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, n * sizeof(T));
  return load16(buf);
}
template <typename T>
GS_AVX512 inline void store_part(T* p, __m512 v, int64_t n) {
  T buf[16];
  store16(buf, v);
  std::memcpy(static_cast<void*>(p), buf, n * sizeof(T));
}

// exp(x) for any x: n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), exp(r) by Cephes' degree-7
// polynomial, times 2^n with scalef (overflow to inf, underflow to 0). ~1 ulp.
GS_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-110.f)), _mm512_set1_ps(110.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// ---------------------------------------------------------------------------------------------
// RMSNorm: out = w * T(x * rsqrt(mean(x^2) + eps)), optionally after s = T(x + residual) (stored).

struct RowGeometry {
  int64_t rows, hidden;
  int64_t x_stride, r_stride;  // input row strides (elements); outputs are contiguous
};

// Sum of squares of a float row, 16 lanes (same order for every row of this length).
template <typename T>
inline float sum_squares_portable(const T* x, int64_t n) {
  float lanes[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) {
      const float v = f32(x[j + l]);
      lanes[l] += v * v;
    }
  float s = 0.f;
  for (; j < n; ++j) s += f32(x[j]) * f32(x[j]);
  for (int l = 0; l < 16; ++l) s += lanes[l];
  return s;
}

inline float inv_rms(float sum_sq, int64_t n, float eps) {
  const float mean = sum_sq / static_cast<float>(n);
  return 1.f / std::sqrt(mean + eps);
}

template <typename T>
void rms_rows_portable(const RowGeometry& g, const T* x, const T* res, const T* w, float eps, T* out, T* res_out,
                       int64_t r0, int64_t r1) {
  const int64_t n = g.hidden;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * g.x_stride;
    const T* src = xr;
    if (res != nullptr) {
      const T* rr = res + r * g.r_stride;
      T* so = res_out + r * n;
      for (int64_t j = 0; j < n; ++j) so[j] = static_cast<T>(f32(xr[j]) + f32(rr[j]));
      src = so;
    }
    const float inv = inv_rms(sum_squares_portable(src, n), n, eps);
    T* o = out + r * n;
    for (int64_t j = 0; j < n; ++j) o[j] = static_cast<T>(f32(w[j]) * round_to<T>(f32(src[j]) * inv));
  }
}

#if defined(GS_X86)
template <typename T>
GS_AVX512 void rms_rows_avx512(const RowGeometry& g, const T* x, const T* res, const T* w, float eps, T* out,
                               T* res_out, int64_t r0, int64_t r1) {
  const int64_t n = g.hidden, full = n / 16 * 16, tail = n - full;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * g.x_stride;
    const T* src = xr;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    if (res != nullptr) {
      const T* rr = res + r * g.r_stride;
      T* so = res_out + r * n;
      int64_t j = 0;
      for (; j + 32 <= full; j += 32) {
        const __m512 a = round16<T>(_mm512_add_ps(load16(xr + j), load16(rr + j)));
        const __m512 b = round16<T>(_mm512_add_ps(load16(xr + j + 16), load16(rr + j + 16)));
        store16(so + j, a);
        store16(so + j + 16, b);
        acc0 = _mm512_fmadd_ps(a, a, acc0);
        acc1 = _mm512_fmadd_ps(b, b, acc1);
      }
      for (; j < full; j += 16) {
        const __m512 a = round16<T>(_mm512_add_ps(load16(xr + j), load16(rr + j)));
        store16(so + j, a);
        acc0 = _mm512_fmadd_ps(a, a, acc0);
      }
      if (tail) {
        const __m512 a = round16<T>(_mm512_add_ps(load_part(xr + full, tail), load_part(rr + full, tail)));
        store_part(so + full, a, tail);
        acc1 = _mm512_fmadd_ps(a, a, acc1);  // padding lanes are 0 + 0
      }
      src = so;
    } else {
      int64_t j = 0;
      for (; j + 32 <= full; j += 32) {
        const __m512 a = load16(xr + j), b = load16(xr + j + 16);
        acc0 = _mm512_fmadd_ps(a, a, acc0);
        acc1 = _mm512_fmadd_ps(b, b, acc1);
      }
      for (; j < full; j += 16) {
        const __m512 a = load16(xr + j);
        acc0 = _mm512_fmadd_ps(a, a, acc0);
      }
      if (tail) {
        const __m512 a = load_part(xr + full, tail);
        acc1 = _mm512_fmadd_ps(a, a, acc1);
      }
    }
    const float inv = inv_rms(_mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)), n, eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    T* o = out + r * n;
    for (int64_t j = 0; j < full; j += 16)
      store16(o + j, _mm512_mul_ps(load16(w + j), round16<T>(_mm512_mul_ps(load16(src + j), vinv))));
    if (tail)
      store_part(o + full, _mm512_mul_ps(load_part(w + full, tail), round16<T>(_mm512_mul_ps(load_part(src + full, tail), vinv))),
                 tail);
  }
}
#endif

template <typename T>
void rms_norm_typed(const RowGeometry& g, const at::Tensor& x, const std::optional<at::Tensor>& res,
                    const at::Tensor& w, double eps, const at::Tensor& out, const std::optional<at::Tensor>& res_out) {
  const T* xp = x.data_ptr<T>();
  const T* rp = res.has_value() ? res->data_ptr<T>() : nullptr;
  T* rop = res_out.has_value() ? res_out->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  const bool avx = use_avx512();
  at::parallel_for(0, g.rows, grain(g.hidden), [&](int64_t r0, int64_t r1) {
#if defined(GS_X86)
    if (avx) return rms_rows_avx512<T>(g, xp, rp, wp, e, op, rop, r0, r1);
#endif
    rms_rows_portable<T>(g, xp, rp, wp, e, op, rop, r0, r1);
  });
}

// x, residual: [rows, hidden] with unit stride along hidden; out, residual_out contiguous.
void rms_norm_impl(const at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& residual_out,
                   const std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, hidden] with unit stride along hidden");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(), "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), "dtypes differ");
  TORCH_CHECK(out.is_contiguous() && out.numel() == rows * hidden, "out must be contiguous [rows, hidden]");
  RowGeometry g{rows, hidden, x.stride(0), 0};
  if (residual.has_value()) {
    TORCH_CHECK(residual_out.has_value(), "residual needs residual_out");
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == hidden &&
                    residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
    TORCH_CHECK(residual_out->is_contiguous() && residual_out->numel() == rows * hidden &&
                    residual_out->scalar_type() == x.scalar_type(),
                "residual_out must be contiguous [rows, hidden]");
    g.r_stride = residual->stride(0);
  }
  if (rows == 0 || hidden == 0) return;
  switch (x.scalar_type()) {
    case at::kFloat: return rms_norm_typed<float>(g, x, residual, weight, eps, out, residual_out);
    case at::kBFloat16: return rms_norm_typed<c10::BFloat16>(g, x, residual, weight, eps, out, residual_out);
    case at::kHalf: return rms_norm_typed<c10::Half>(g, x, residual, weight, eps, out, residual_out);
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  rms_norm_impl(out, x, std::nullopt, std::nullopt, weight, eps);
}

void fused_add_rms_norm(const at::Tensor& out, const at::Tensor& residual_out, const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  rms_norm_impl(out, x, residual_out, residual, weight, eps);
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding. Per token, cos and sin are expanded to the rotary width once ("signed": the
// sin that multiplies the partner element, negated where the reference subtracts), then each head
// computes out[j] = T(T(x[j] cos[j]) + T(x[partner(j)] sin[j])) for j < rotary_dim and copies the
// rest. partner(j): neox j +- rot/2, GPT-J j ^ 1.

struct RopeGeometry {
  int64_t tokens, heads, head_size, rot, max_pos;
  int64_t s_token, s_head;  // input strides; the output is contiguous [tokens, heads, head_size]
};

template <typename T>
void rope_head_portable(const T* x, T* o, const float* cs, const float* sn, int64_t rot, int64_t d, bool neox) {
  const int64_t half = rot / 2;
  for (int64_t j = 0; j < rot; ++j) {
    const int64_t p = neox ? (j < half ? j + half : j - half) : (j ^ 1);
    o[j] = static_cast<T>(round_to<T>(product(f32(x[j]), cs[j])) + round_to<T>(product(f32(x[p]), sn[j])));
  }
  if (d > rot) std::memcpy(static_cast<void*>(o + rot), x + rot, (d - rot) * sizeof(T));
}

#if defined(GS_X86)
// The empty asm makes `v` opaque to the optimizer: the product is rounded before the add (as the
// reference's separate mul and add ops), never contracted into an FMA.
GS_AVX512 inline __m512 rounded_product(__m512 v) {
  __asm__("" : "+v"(v));
  return v;
}

template <typename T>
GS_AVX512 inline __m512 rope16(__m512 x, __m512 partner, const float* cs, const float* sn) {
  const __m512 a = round16<T>(rounded_product(_mm512_mul_ps(x, _mm512_loadu_ps(cs))));
  const __m512 b = round16<T>(rounded_product(_mm512_mul_ps(partner, _mm512_loadu_ps(sn))));
  return _mm512_add_ps(a, b);
}

template <typename T>
GS_AVX512 void rope_head_avx512(const T* x, T* o, const float* cs, const float* sn, int64_t rot, int64_t d, bool neox) {
  int64_t done = 0;
  if (neox) {
    const int64_t half = rot / 2;
    if (half % 16 == 0) {
      for (int64_t j = 0; j < half; j += 16) {
        const __m512 lo = load16(x + j), hi = load16(x + j + half);
        store16(o + j, rope16<T>(lo, hi, cs + j, sn + j));
        store16(o + j + half, rope16<T>(hi, lo, cs + j + half, sn + j + half));
      }
      done = rot;
    }
  } else {
    for (; done + 16 <= rot; done += 16) {
      const __m512 v = load16(x + done);
      store16(o + done, rope16<T>(v, _mm512_permute_ps(v, 0xB1), cs + done, sn + done));  // swap pairs
    }
  }
  if (done < rot) {  // neox with rot/2 not a multiple of 16, or GPT-J's last pairs
    const int64_t half = rot / 2;
    for (int64_t j = done; j < rot; ++j) {
      const int64_t p = neox ? (j < half ? j + half : j - half) : (j ^ 1);
      o[j] = static_cast<T>(round_to<T>(product(f32(x[j]), cs[j])) + round_to<T>(product(f32(x[p]), sn[j])));
    }
  }
  if (d > rot) std::memcpy(static_cast<void*>(o + rot), x + rot, (d - rot) * sizeof(T));
}
#endif

template <typename T, typename C>
void rope_typed(const int64_t* pos, const T* q, const RopeGeometry& gq, T* q_out, const T* k, const RopeGeometry& gk,
                T* k_out, const C* cache, bool neox) {
  const int64_t rot = gq.rot, half = rot / 2, d = gq.head_size;
  const bool avx = use_avx512();
  at::parallel_for(0, gq.tokens, grain((gq.heads + gk.heads) * d), [&](int64_t t0, int64_t t1) {
    std::vector<float> cs(rot + 16), sn(rot + 16);
    for (int64_t t = t0; t < t1; ++t) {
      const C* row = cache + pos[t] * rot;
      for (int64_t i = 0; i < half; ++i) {
        // the reference casts cos / sin to x's dtype before using them
        const float c = round_to<T>(f32(row[i])), s = round_to<T>(f32(row[half + i]));
        if (neox) {
          cs[i] = cs[half + i] = c;
          sn[i] = -s;
          sn[half + i] = s;
        } else {
          cs[2 * i] = cs[2 * i + 1] = c;
          sn[2 * i] = -s;
          sn[2 * i + 1] = s;
        }
      }
      for (int pass = 0; pass < 2; ++pass) {
        const RopeGeometry& g = pass == 0 ? gq : gk;
        const T* src = pass == 0 ? q : k;
        T* dst = pass == 0 ? q_out : k_out;
        for (int64_t h = 0; h < g.heads; ++h) {
          const T* x = src + t * g.s_token + h * g.s_head;
          T* o = dst + (t * g.heads + h) * d;
#if defined(GS_X86)
          if (avx) {
            rope_head_avx512<T>(x, o, cs.data(), sn.data(), rot, d, neox);
            continue;
          }
#endif
          rope_head_portable<T>(x, o, cs.data(), sn.data(), rot, d, neox);
        }
      }
    }
  });
}

template <typename T>
void rope_cache_dispatch(const int64_t* pos, const at::Tensor& q, const RopeGeometry& gq, const at::Tensor& q_out,
                         const at::Tensor& k, const RopeGeometry& gk, const at::Tensor& k_out, const at::Tensor& cache,
                         bool neox) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  T* ko = k_out.data_ptr<T>();
  switch (cache.scalar_type()) {
    case at::kFloat: return rope_typed<T, float>(pos, qp, gq, qo, kp, gk, ko, cache.data_ptr<float>(), neox);
    case at::kBFloat16:
      return rope_typed<T, c10::BFloat16>(pos, qp, gq, qo, kp, gk, ko, cache.data_ptr<c10::BFloat16>(), neox);
    case at::kHalf: return rope_typed<T, c10::Half>(pos, qp, gq, qo, kp, gk, ko, cache.data_ptr<c10::Half>(), neox);
    default: TORCH_CHECK(false, "unsupported cos_sin_cache dtype ", cache.scalar_type());
  }
}

void rotary_embedding(const at::Tensor& query_out, const at::Tensor& key_out, const at::Tensor& positions, const at::Tensor& query,
                      const at::Tensor& key, const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3, "query and key must be [tokens, heads, head_size]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "query and key need unit stride along head_size");
  TORCH_CHECK(key.size(0) == query.size(0) && key.size(2) == query.size(2), "query and key shapes differ");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "query and key dtypes differ");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == query.size(0),
              "positions must be int64 [tokens]");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(), "cos_sin_cache must be contiguous 2-D");
  const int64_t tokens = query.size(0), d = query.size(2), rot = cos_sin_cache.size(1);
  TORCH_CHECK(rot % 2 == 0 && rot <= d, "rotary_dim must be even and at most head_size");
  TORCH_CHECK(query_out.is_contiguous() && query_out.sizes() == query.sizes() && query_out.scalar_type() == query.scalar_type(),
              "query_out must be contiguous with query's shape");
  TORCH_CHECK(key_out.is_contiguous() && key_out.sizes() == key.sizes() && key_out.scalar_type() == key.scalar_type(),
              "key_out must be contiguous with key's shape");
  const int64_t max_pos = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " out of range [0, ", max_pos, ")");
  if (tokens == 0) return;
  const RopeGeometry gq{tokens, query.size(1), d, rot, max_pos, query.stride(0), query.stride(1)};
  const RopeGeometry gk{tokens, key.size(1), d, rot, max_pos, key.stride(0), key.stride(1)};
  switch (query.scalar_type()) {
    case at::kFloat: return rope_cache_dispatch<float>(pos, query, gq, query_out, key, gk, key_out, cos_sin_cache, is_neox);
    case at::kBFloat16:
      return rope_cache_dispatch<c10::BFloat16>(pos, query, gq, query_out, key, gk, key_out, cos_sin_cache, is_neox);
    case at::kHalf: return rope_cache_dispatch<c10::Half>(pos, query, gq, query_out, key, gk, key_out, cos_sin_cache, is_neox);
    default: TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
}

// ---------------------------------------------------------------------------------------------
// SiLU-and-mul: out[j] = T(T(g / (1 + exp(-g))) * u), g = x[j], u = x[d + j].

template <typename T>
void silu_rows_portable(const T* x, int64_t x_stride, T* out, int64_t d, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = x + r * x_stride;
    const T* u = g + d;
    T* o = out + r * d;
    for (int64_t j = 0; j < d; ++j) {
      const float v = f32(g[j]);
      o[j] = static_cast<T>(round_to<T>(v / (1.f + std::exp(-v))) * f32(u[j]));
    }
  }
}

#if defined(GS_X86)
template <typename T>
GS_AVX512 inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 s = round16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  return _mm512_mul_ps(s, u);
}

template <typename T>
GS_AVX512 void silu_rows_avx512(const T* x, int64_t x_stride, T* out, int64_t d, int64_t r0, int64_t r1) {
  const int64_t full = d / 16 * 16, tail = d - full;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = x + r * x_stride;
    const T* u = g + d;
    T* o = out + r * d;
    for (int64_t j = 0; j < full; j += 16) store16(o + j, silu_mul16<T>(load16(g + j), load16(u + j)));
    if (tail) store_part(o + full, silu_mul16<T>(load_part(g + full, tail), load_part(u + full, tail)), tail);
  }
}
#endif

template <typename T>
void silu_typed(const at::Tensor& x, const at::Tensor& out, int64_t rows, int64_t d) {
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t stride = x.stride(0);
  const bool avx = use_avx512();
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t r0, int64_t r1) {
#if defined(GS_X86)
    if (avx) return silu_rows_avx512<T>(xp, stride, op, d, r0, r1);
#endif
    silu_rows_portable<T>(xp, stride, op, d, r0, r1);
  });
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [rows, 2d], unit stride along 2d");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.numel() == rows * d && out.scalar_type() == x.scalar_type(),
              "out must be contiguous [rows, d] of x's dtype");
  if (rows == 0 || d == 0) return;
  switch (x.scalar_type()) {
    case at::kFloat: return silu_typed<float>(x, out, rows, d);
    case at::kBFloat16: return silu_typed<c10::BFloat16>(x, out, rows, d);
    case at::kHalf: return silu_typed<c10::Half>(x, out, rows, d);
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

// ---------------------------------------------------------------------------------------------
// GELU and GELU-and-mul (GeGLU): out[j] = T(gelu(x[j])), or T(T(gelu(g)) * u) with g = x[j],
// u = x[d + j], as F.gelu followed by a separate multiply. Exact GELU is 0.5 x erfc(-x / sqrt 2)
// (no cancellation for negative x, where 1 + erf loses digits); the tanh approximation
// 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), is computed as x / (1 + exp(-2u)).

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kTanhBeta = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhKappa = 0.044715f;

template <bool kTanh>
inline float gelu_scalar(float x) {
  if constexpr (kTanh) {
    const float u = kTanhBeta * (x + kTanhKappa * (x * x * x));
    return x / (1.f + std::exp(-2.f * u));
  } else {
    return 0.5f * x * std::erfc(-x * kSqrtHalf);
  }
}

// Row r of x holds `in_width` elements (2d with the multiply, d without).
template <typename T, bool kTanh, bool kMul>
void gelu_rows_portable(const T* x, int64_t x_stride, T* out, int64_t d, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = x + r * x_stride;
    T* o = out + r * d;
    for (int64_t j = 0; j < d; ++j) {
      const float a = gelu_scalar<kTanh>(f32(g[j]));
      if constexpr (kMul) {
        o[j] = static_cast<T>(round_to<T>(a) * f32(g[d + j]));
      } else {
        o[j] = static_cast<T>(a);
      }
    }
  }
}

#if defined(GS_X86)
// c[0] z^(n-1) + ... + c[n-1] by Horner's rule.
template <int N>
GS_AVX512 inline __m512 horner16(__m512 z, const float (&c)[N]) {
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(c[i]));
  return p;
}

// erfc(a) for any a to ~4e-7 relative (Cephes' erff / erfcf): 1 - a T(a^2) for |a| < 1, else
// exp(-a^2) / |a| P(1 / a^2) (R past 2), with exp(-a^2) from a split of |a| whose head squares
// exactly; 2 - erfc(|a|) for a <= -1.
GS_AVX512 inline __m512 erfc16(__m512 a) {
  static constexpr float kT[] = {7.853861353153693e-5f, -8.010193625184903e-4f, 5.188327685732524e-3f,
                                 -2.685381193529856e-2f, 1.128358514861418e-1f, -3.761262582423300e-1f,
                                 1.128379165726710e+0f};
  static constexpr float kP[] = {2.326819970068386e-2f, -1.387039388740657e-1f, 3.687424674597105e-1f,
                                 -5.824733027278666e-1f, 6.210004621745983e-1f, -4.944515323274145e-1f,
                                 3.404879937665872e-1f, -2.741127028184656e-1f, 5.638259427386472e-1f};
  static constexpr float kR[] = {-1.047766399936249e+1f, 1.297719955372516e+1f, -7.495518717768503e+0f,
                                 2.921019019210786e+0f, -1.015265279202700e+0f, 4.218463358204948e-1f,
                                 -2.820767439740514e-1f, 5.641895067754075e-1f};
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 ax = _mm512_abs_ps(a);
  const __m512 small = _mm512_fnmadd_ps(a, horner16(_mm512_mul_ps(a, a), kT), one);
  const __m512 y = _mm512_div_ps(one, ax);
  const __m512 w = _mm512_mul_ps(y, y);
  const __m512 poly = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(2.f), _CMP_LT_OQ), horner16(w, kR),
                                           horner16(w, kP));
  const __m512 head = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(ax), _mm512_set1_epi32(static_cast<int>(0xFFFFF000u))));
  const __m512 tail = _mm512_mul_ps(_mm512_sub_ps(ax, head), _mm512_add_ps(ax, head));
  const __m512 e = _mm512_mul_ps(exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(head, head))),
                                 exp16(_mm512_sub_ps(_mm512_setzero_ps(), tail)));
  __m512 large = _mm512_mul_ps(_mm512_mul_ps(e, y), poly);
  large = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ), large,
                               _mm512_sub_ps(_mm512_set1_ps(2.f), large));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, one, _CMP_LT_OQ), large, small);
}

template <bool kTanh>
GS_AVX512 inline __m512 gelu16(__m512 x) {
  if constexpr (kTanh) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(kTanhBeta), _mm512_fmadd_ps(_mm512_set1_ps(kTanhKappa), cube, x));
    const __m512 e = exp16(_mm512_mul_ps(u, _mm512_set1_ps(-2.f)));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  } else {
    const __m512 half_x = _mm512_mul_ps(_mm512_set1_ps(0.5f), x);
    return _mm512_mul_ps(half_x, erfc16(_mm512_mul_ps(x, _mm512_set1_ps(-kSqrtHalf))));
  }
}

template <typename T, bool kTanh, bool kMul>
GS_AVX512 inline __m512 gelu_out16(const T* g, int64_t d, int64_t j, int64_t n) {
  const __m512 a = gelu16<kTanh>(n == 16 ? load16(g + j) : load_part(g + j, n));
  if constexpr (kMul) {
    return _mm512_mul_ps(round16<T>(a), n == 16 ? load16(g + d + j) : load_part(g + d + j, n));
  } else {
    return a;
  }
}

template <typename T, bool kTanh, bool kMul>
GS_AVX512 void gelu_rows_avx512(const T* x, int64_t x_stride, T* out, int64_t d, int64_t r0, int64_t r1) {
  const int64_t full = d / 16 * 16, tail = d - full;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = x + r * x_stride;
    T* o = out + r * d;
    for (int64_t j = 0; j < full; j += 16) store16(o + j, gelu_out16<T, kTanh, kMul>(g, d, j, 16));
    if (tail) store_part(o + full, gelu_out16<T, kTanh, kMul>(g, d, full, tail), tail);
  }
}
#endif

template <typename T, bool kTanh, bool kMul>
void gelu_typed(const at::Tensor& x, const at::Tensor& out, int64_t rows, int64_t d) {
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t stride = x.stride(0);
  const bool avx = use_avx512();
  at::parallel_for(0, rows, grain(kMul ? 2 * d : d), [&](int64_t r0, int64_t r1) {
#if defined(GS_X86)
    if (avx) return gelu_rows_avx512<T, kTanh, kMul>(xp, stride, op, d, r0, r1);
#endif
    gelu_rows_portable<T, kTanh, kMul>(xp, stride, op, d, r0, r1);
  });
}

template <bool kMul>
void gelu_dispatch(const at::Tensor& out, const at::Tensor& x, bool tanh) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (!kMul || x.size(1) % 2 == 0),
              kMul ? "x must be [rows, 2d], unit stride along 2d" : "x must be [rows, d], unit stride along d");
  const int64_t rows = x.size(0), d = kMul ? x.size(1) / 2 : x.size(1);
  TORCH_CHECK(out.is_contiguous() && out.numel() == rows * d && out.scalar_type() == x.scalar_type(),
              "out must be contiguous [rows, d] of x's dtype");
  if (rows == 0 || d == 0) return;
  switch (x.scalar_type()) {
    case at::kFloat:
      return tanh ? gelu_typed<float, true, kMul>(x, out, rows, d) : gelu_typed<float, false, kMul>(x, out, rows, d);
    case at::kBFloat16:
      return tanh ? gelu_typed<c10::BFloat16, true, kMul>(x, out, rows, d)
                  : gelu_typed<c10::BFloat16, false, kMul>(x, out, rows, d);
    case at::kHalf:
      return tanh ? gelu_typed<c10::Half, true, kMul>(x, out, rows, d)
                  : gelu_typed<c10::Half, false, kMul>(x, out, rows, d);
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

void gelu_and_mul(const at::Tensor& out, const at::Tensor& x, bool tanh) { gelu_dispatch<true>(out, x, tanh); }
void gelu(const at::Tensor& out, const at::Tensor& x, bool tanh) { gelu_dispatch<false>(out, x, tanh); }

// ---------------------------------------------------------------------------------------------
// reshape_and_cache: token t's K and V rows ([kv_heads, head_size]) into slot slot_mapping[t] of
// kv_cache [2, blocks, block_size, kv_heads, head_size]; negative slots (padding) are skipped.
// Conversion as reference.to_cache_dtype: a cast, or for fp8 x / scale clamped to the format's
// finite range (NaN kept) and then cast.

template <typename K, typename C>
inline void convert_row(const K* src, C* dst, int64_t n, float scale) {
  if constexpr (std::is_same_v<K, C>) {
    std::memcpy(static_cast<void*>(dst), src, n * sizeof(K));
  } else if constexpr (std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>) {
    const float limit = static_cast<float>(std::numeric_limits<C>::max());
    for (int64_t j = 0; j < n; ++j) {
      float v = f32(src[j]) / scale;
      v = v < -limit ? -limit : (v > limit ? limit : v);  // NaN passes through, as torch.clamp
      dst[j] = static_cast<C>(v);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<C>(f32(src[j]));
  }
}

#if defined(GS_X86)
// 16-bit / fp32 to 16-bit / fp32 (types differ), 16 at a time.
template <typename K, typename C>
GS_AVX512 void convert_row_avx512(const K* src, C* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) store16(dst + j, load16(src + j));
  if (j < n) store_part(dst + j, load_part(src + j, n - j), n - j);
}
#endif

// float32 -> fp8 bits, 16 at a time: c10's fp8e4m3fn / fp8e5m2_from_fp32_value, lane for lane
// (inputs are already divided by the scale and clamped to the finite range; NaN, inf and the
// overflow branch are kept anyway). The scalar loop uses c10 itself and the tests compare both.
struct E4M3Bits {
  static constexpr uint32_t max_bits = 1087u << 20, denorm = 141u << 23, min_normal = 121u << 23;
  static constexpr int shift = 20;
  static constexpr uint32_t bias = ((uint32_t)(7 - 127) << 23) + 0x7FFFF;
  static constexpr int nan = 0x7F, overflow = 0x7E;
  static constexpr bool saturate_carry = true;  // rounding into 0x7f (NaN) gives 0x7e
};
struct E5M2Bits {
  static constexpr uint32_t max_bits = 143u << 23, denorm = 134u << 23, min_normal = 113u << 23;
  static constexpr int shift = 21;
  static constexpr uint32_t bias = ((uint32_t)(15 - 127) << 23) + 0xFFFFF;
  static constexpr int nan = 0x7F, overflow = 0x7C;
  static constexpr bool saturate_carry = false;
};

#if defined(GS_X86)
template <typename B>
GS_AVX512 inline __m128i fp8_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i mag = _mm512_xor_si512(bits, sign);
  // normal: round the mantissa to nearest even, rebias the exponent
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, B::shift), _mm512_set1_epi32(1));
  __m512i normal = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(static_cast<int>(B::bias))), odd), B::shift);
  normal = _mm512_and_si512(normal, _mm512_set1_epi32(0xFF));
  if constexpr (B::saturate_carry)
    normal = _mm512_mask_mov_epi32(normal, _mm512_cmpeq_epi32_mask(normal, _mm512_set1_epi32(0x7F)),
                                   _mm512_set1_epi32(0x7E));
  // subnormal: let the float adder round (magic number), then take the low bits
  const __m512 magic = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(B::denorm)));
  const __m512i sub = _mm512_and_si512(
      _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(mag), magic)),
                       _mm512_set1_epi32(static_cast<int>(B::denorm))),
      _mm512_set1_epi32(0xFF));
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(static_cast<int>(B::min_normal)));
  const __mmask16 is_big = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(static_cast<int>(B::max_bits)));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7F800000));
  __m512i r = _mm512_mask_mov_epi32(normal, is_sub, sub);
  r = _mm512_mask_mov_epi32(r, is_big, _mm512_set1_epi32(B::overflow));
  r = _mm512_mask_mov_epi32(r, is_nan, _mm512_set1_epi32(B::nan));
  r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
  return _mm512_cvtepi32_epi8(r);
}

// One row to fp8: x / scale, clamped to +-limit (NaN kept: max/min return their second operand
// when either is NaN, so the value goes second), then the bits.
template <typename B>
GS_AVX512 inline __m128i fp8_scaled(__m512 v, __m512 scale, __m512 lo, __m512 hi) {
  return fp8_bits<B>(_mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_div_ps(v, scale))));
}

template <typename K, typename B>
GS_AVX512 void fp8_row_avx512(const K* src, uint8_t* dst, int64_t n, float scale, float limit) {
  const __m512 vs = _mm512_set1_ps(scale), hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), fp8_scaled<B>(load16(src + j), vs, lo, hi));
  if (j < n) {
    alignas(16) uint8_t buf[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), fp8_scaled<B>(load_part(src + j, n - j), vs, lo, hi));
    std::memcpy(dst + j, buf, n - j);
  }
}
#endif

struct CacheGeometry {
  int64_t tokens, heads, head_size, block_size, slots;
  int64_t k_s_token, k_s_head, v_s_token, v_s_head;
  int64_t c_s_kv, c_s_block, c_s_pos, c_s_head;
};

template <typename K, typename C>
void cache_typed(const CacheGeometry& g, const K* key, const K* value, C* cache, const int64_t* slots, float k_scale,
                 float v_scale) {
  constexpr bool fp8 = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;
  const bool avx = use_avx512();
  const int64_t d = g.head_size;
  at::parallel_for(0, g.tokens, grain(2 * g.heads * d), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t base = (slot / g.block_size) * g.c_s_block + (slot % g.block_size) * g.c_s_pos;
      for (int half = 0; half < 2; ++half) {
        const K* src = half == 0 ? key + t * g.k_s_token : value + t * g.v_s_token;
        const int64_t s_head = half == 0 ? g.k_s_head : g.v_s_head;
        C* dst = cache + half * g.c_s_kv + base;
        const float scale = half == 0 ? k_scale : v_scale;
        for (int64_t h = 0; h < g.heads; ++h) {
#if defined(GS_X86)
          if constexpr (fp8) {
            if (avx) {
              using Bits = std::conditional_t<std::is_same_v<C, c10::Float8_e4m3fn>, E4M3Bits, E5M2Bits>;
              fp8_row_avx512<K, Bits>(src + h * s_head, reinterpret_cast<uint8_t*>(dst + h * g.c_s_head), d, scale,
                                      static_cast<float>(std::numeric_limits<C>::max()));
              continue;
            }
          } else if constexpr (!std::is_same_v<K, C>) {
            if (avx) {
              convert_row_avx512<K, C>(src + h * s_head, dst + h * g.c_s_head, d);
              continue;
            }
          }
#endif
          convert_row<K, C>(src + h * s_head, dst + h * g.c_s_head, d, scale);
        }
      }
    }
  });
}

template <typename K>
void cache_dispatch(const CacheGeometry& g, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                    const int64_t* slots, float k_scale, float v_scale) {
  const K* kp = key.data_ptr<K>();
  const K* vp = value.data_ptr<K>();
  switch (kv_cache.scalar_type()) {
    case at::kFloat: return cache_typed<K, float>(g, kp, vp, kv_cache.data_ptr<float>(), slots, k_scale, v_scale);
    case at::kBFloat16:
      return cache_typed<K, c10::BFloat16>(g, kp, vp, kv_cache.data_ptr<c10::BFloat16>(), slots, k_scale, v_scale);
    case at::kHalf: return cache_typed<K, c10::Half>(g, kp, vp, kv_cache.data_ptr<c10::Half>(), slots, k_scale, v_scale);
    case at::kFloat8_e4m3fn:
      return cache_typed<K, c10::Float8_e4m3fn>(g, kp, vp, kv_cache.data_ptr<c10::Float8_e4m3fn>(), slots, k_scale,
                                                v_scale);
    case at::kFloat8_e5m2:
      return cache_typed<K, c10::Float8_e5m2>(g, kp, vp, kv_cache.data_ptr<c10::Float8_e5m2>(), slots, k_scale, v_scale);
    default: TORCH_CHECK(false, "unsupported cache dtype ", kv_cache.scalar_type());
  }
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                       double k_scale, double v_scale) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [tokens, kv_heads, head_size]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value need unit stride along head_size");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "key and value dtypes differ");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == key.size(1) &&
                  kv_cache.size(4) == key.size(2) && kv_cache.stride(4) == 1,
              "kv_cache must be [2, blocks, block_size, kv_heads, head_size] with unit stride along head_size");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be int64 [tokens]");
  CacheGeometry g{key.size(0), key.size(1), key.size(2), kv_cache.size(2), kv_cache.size(1) * kv_cache.size(2),
                  key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                  kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)};
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < g.tokens; ++t)
    TORCH_CHECK(slots[t] < g.slots, "slot ", slots[t], " out of range (", g.slots, " slots)");
  if (g.tokens == 0) return;
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  switch (key.scalar_type()) {
    case at::kFloat: return cache_dispatch<float>(g, key, value, kv_cache, slots, ks, vs);
    case at::kBFloat16: return cache_dispatch<c10::BFloat16>(g, key, value, kv_cache, slots, ks, vs);
    case at::kHalf: return cache_dispatch<c10::Half>(g, key, value, kv_cache, slots, ks, vs);
    default: TORCH_CHECK(false, "unsupported dtype ", key.scalar_type());
  }
}

// The instruction set the kernels use (0 portable, 1 AVX-512); `cap` >= 0 first caps it.
int64_t layer_ops_isa(int64_t cap) {
  if (cap >= 0) max_isa.store(cap);
  return std::min(best_isa(), max_isa.load());
}

}  // namespace

TORCH_LIBRARY(gridserve_cpu_layer, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, Tensor residual, Tensor weight, "
      "float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor(a!) query_out, Tensor(b!) key_out, Tensor positions, Tensor query, Tensor key, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_and_mul(Tensor(a!) out, Tensor x, bool tanh) -> ()");
  m.def("gelu(Tensor(a!) out, Tensor x, bool tanh) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, float k_scale, "
      "float v_scale) -> ()");
  m.def("layer_ops_isa(int cap=-1) -> int", &layer_ops_isa);
}

TORCH_LIBRARY_IMPL(gridserve_cpu_layer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_and_mul", &gelu_and_mul);
  m.impl("gelu", &gelu);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
