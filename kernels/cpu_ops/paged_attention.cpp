// CPU paged attention that reads K/V in place through the block table (no gathered copy).
//
// One work item is a query token with all its heads: each position's K/V row (every KV head,
// contiguous in the cache) is read once and serves the `group` query heads of each KV head
// (GQA/MQA). Per token, two passes in float32: scores of every visible position (reads K once),
// then softmax and the weighted sum of V (reads V once). Threads get runs of tokens of about equal
// total context, so they stay balanced when context lengths differ; with fewer tokens than
// threads, tokens are split by KV heads as well.
//
// A sequence's new tokens are its last q_len positions: token i of a row with q_len tokens and
// context ctx sees positions [0, ctx - q_len + i]. Rows longer than `max_q_len` are skipped (their
// output is left untouched) so the caller can run them through a tiled prefill path.
//
// Score modifiers (Hugging Face semantics, see gridserve.kernels.reference): a sliding window
// (query at position i sees j iff i - j < window) narrows a token's positions to [lo, hi): blocks
// wholly before lo are never read, a chunk that straddles lo is masked. The soft cap
// (s = cap * tanh(s / cap), on the scaled score) and ALiBi (s += slope[h] * (j - i), after the cap)
// are applied to each score as it is computed; the AVX-512 kernel has a clone without them, so a
// plain model runs exactly the code it ran before.
//
// Attention sinks (gpt-oss): an optional logit per query head that joins every softmax's
// denominator and carries no value, p_j = exp(s_j) / (exp(sink[h]) + sum_j exp(s_j)); the row's
// max takes the sink into account, so exp never overflows. The window narrows the positions, never
// the sink.
//
// The cache may be narrower than the query (kv_cache_dtype): fp32 queries over a 16-bit or fp8
// cache, 16-bit queries over fp8. fp8 rows hold K / k_scale and V / v_scale (per-tensor scales):
// k_scale is folded into the query, v_scale into the final normalization, so rows are widened
// with a 256-entry lookup table and nothing else.

// Registered as torch.ops.gridserve_cpu.paged_attention through torch/library.h (not
// torch/extension.h + pybind11, which takes several times longer to compile).

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
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace {

using gs_simd::axpy;
using gs_simd::best_isa;
using gs_simd::dot;
using gs_simd::to_float;
using gs_simd::widen;

// Hot loops get an AVX2 clone picked at load time on x86 (GCC ifunc); the default clone keeps
// the library portable, so the build never depends on the machine it was compiled on.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GS_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GS_SIMD_CLONES
#endif

struct Geometry {
  int64_t num_tokens, num_heads, num_kv_heads, head_size, group, block_size, max_blocks;
  int64_t q_stride_token, q_stride_head;   // query strides (last dim contiguous)
  int64_t o_stride_token, o_stride_head;   // output strides (last dim contiguous)
  int64_t kv_stride_block, kv_stride_pos, kv_stride_head;  // within the K or the V half
  float scale;
  float k_scale, v_scale;  // fp8 cache: stored values are K / k_scale and V / v_scale (else 1)
  int64_t window;          // sliding window (0: none)
  float soft_cap;          // logit soft cap (0: none)
  const float* alibi;      // [num_heads] ALiBi slopes, or null
  const float* sinks;      // [num_heads] attention-sink logits, or null
  bool mods() const { return soft_cap > 0.f || alibi != nullptr; }
};

// The soft cap and ALiBi of a query head's score at relative position `rel` = j - i (portable path).
inline float modify_score(const Geometry& g, float score, int64_t h, int64_t rel) {
  if (g.soft_cap > 0.f) score = g.soft_cap * std::tanh(score / g.soft_cap);
  if (g.alibi != nullptr) score += g.alibi[h] * static_cast<float>(rel);
  return score;
}

// Scratch for one token, reused across a thread's share of the tokens.
struct Scratch {
  std::vector<float> q, scores, acc, row, inv_sum;
  Scratch(const Geometry& g, int64_t max_span)  // max_span: the most positions a token reads
      : q(g.num_heads * g.head_size), scores(g.num_heads * ((std::max<int64_t>(max_span, 1) + 15) / 16 * 16)),
        acc(g.num_heads * g.head_size), row(g.head_size), inv_sum(g.num_heads) {}
};

// Query heads [h0, h1) of `token` into the scratch in float32, scaled (and k_scale folded in).
template <typename T>
inline void load_query(const Geometry& g, const T* query, int64_t token, int64_t h0, int64_t h1, Scratch& s) {
  const int64_t d = g.head_size;
  for (int64_t h = h0; h < h1; ++h) {
    const T* q = query + token * g.q_stride_token + h * g.q_stride_head;
    for (int64_t j = 0; j < d; ++j) s.q[h * d + j] = to_float(q[j]) * g.scale * g.k_scale;
  }
}

// The weighted sums of query heads [h0, h1), normalized, into `out`.
template <typename T>
inline void store_output(const Geometry& g, T* out, int64_t token, int64_t h0, int64_t h1, const Scratch& s) {
  const int64_t d = g.head_size;
  for (int64_t h = h0; h < h1; ++h) {
    T* o = out + token * g.o_stride_token + h * g.o_stride_head;
    for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(s.acc[h * d + j] * s.inv_sum[h]);
  }
}

// KV heads [kv0, kv1) of one query token (and their query heads) over its positions [lo, hi).
// Each position's K (then V) row holds the KV heads contiguously, so the walk reads whole rows in
// cache order, a run of positions inside one block at a time.
template <typename T, typename C>
GS_SIMD_CLONES void attend_token(
    const Geometry& g, const T* query, const C* keys, const C* values, T* out,
    const int32_t* blocks, int64_t token, int64_t lo, int64_t hi, int64_t kv0, int64_t kv1, Scratch& s) {
  const int64_t d = g.head_size, G = g.group, h0 = kv0 * G, h1 = kv1 * G, visible = hi - lo;
  load_query(g, query, token, h0, h1, s);
  float* scores = s.scores.data();  // [H, visible]: position lo + p of head h at h * visible + p

  // Pass 1: scores, walking the block table a block at a time.
  for (int64_t pos = lo; pos < hi;) {
    const int64_t offset = pos % g.block_size, n = std::min(g.block_size - offset, hi - pos);
    const C* block = keys + blocks[pos / g.block_size] * g.kv_stride_block + offset * g.kv_stride_pos;
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const float* k = widen(block + p * g.kv_stride_pos + kvh * g.kv_stride_head, s.row.data(), d);
        for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h)
          scores[h * visible + pos - lo + p] = dot(s.q.data() + h * d, k, d);
      }
    }
    pos += n;
  }
  if (g.mods()) {
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t p = 0; p < visible; ++p)
        scores[h * visible + p] = modify_score(g, scores[h * visible + p], h, lo + p - (hi - 1));
  }
  // Softmax per query head (unnormalized; divided by the sum at the end).
  float* inv_sum = s.inv_sum.data();
  for (int64_t h = h0; h < h1; ++h) {
    float* row = scores + h * visible;
    float m = row[0];
    for (int64_t p = 1; p < visible; ++p) m = std::max(m, row[p]);
    if (g.sinks != nullptr) m = std::max(m, g.sinks[h]);
    float sum = g.sinks != nullptr ? std::exp(g.sinks[h] - m) : 0.f;
    for (int64_t p = 0; p < visible; ++p) {
      row[p] = std::exp(row[p] - m);
      sum += row[p];
    }
    inv_sum[h] = g.v_scale / sum;
  }
  // Pass 2: weighted sum of V.
  std::fill(s.acc.begin() + h0 * d, s.acc.begin() + h1 * d, 0.f);
  for (int64_t pos = lo; pos < hi;) {
    const int64_t offset = pos % g.block_size, n = std::min(g.block_size - offset, hi - pos);
    const C* block = values + blocks[pos / g.block_size] * g.kv_stride_block + offset * g.kv_stride_pos;
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const float* v = widen(block + p * g.kv_stride_pos + kvh * g.kv_stride_head, s.row.data(), d);
        for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h)
          axpy(scores[h * visible + pos - lo + p], v, s.acc.data() + h * d, d);
      }
    }
    pos += n;
  }
  store_output(g, out, token, h0, h1, s);
}

#if defined(GS_X86)
// AVX-512 path (fp32 / fp16 / bf16 caches, head and block sizes multiples of 16), picked at run
// time. Same two passes, vectorized where the portable loop is not: the scores of 16 positions
// at a time (16 dot products reduced together into one vector instead of 16 horizontal sums),
// the softmax (a polynomial exp over 16 scores), and V accumulated in registers across a chunk's
// positions. The portable loop spends more time on that bookkeeping than on reading K/V.
using gs_simd::load16;

// exp(x) for x <= 0: 2^(x log2 e) split into an integer power (scalef) and 2^f, f in [-0.5, 0.5],
// by a degree-6 polynomial (relative error ~2e-7); below -87 it flushes to ~0 like expf.
GS_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, i);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, i);
}

// tanh(x) to ~1e-7 (Cephes' tanhf): an odd polynomial below |x| = 0.625, where (1 - e) / (1 + e)
// with e = exp(-2|x|) would cancel; that quotient, with x's sign, above.
GS_AVX512 inline __m512 tanh16(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  const __m512 e = exp_nonpositive(_mm512_mul_ps(ax, _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 large = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 sign = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
  const __m512 signed_large = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(large), _mm512_castps_si512(sign)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ), signed_large, small);
}

// The soft cap and ALiBi of 16 scores of head h at positions start.. for a query at position qpos.
GS_AVX512 inline __m512 modify16(const Geometry& g, __m512 s, int64_t h, int64_t start, int64_t qpos) {
  if (g.soft_cap > 0.f)
    s = _mm512_mul_ps(tanh16(_mm512_mul_ps(s, _mm512_set1_ps(1.f / g.soft_cap))), _mm512_set1_ps(g.soft_cap));
  if (g.alibi != nullptr) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 rel = _mm512_add_ps(_mm512_set1_ps(static_cast<float>(start - qpos)), iota);
    s = _mm512_add_ps(s, _mm512_mul_ps(_mm512_set1_ps(g.alibi[h]), rel));
  }
  return s;
}

// Lane p of the result = the sum of v[p]'s 16 lanes: a transpose-and-add tree (15 adds).
GS_AVX512 inline __m512 sum_each(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// Asks for one KV head's row of a position of the next 16-position chunk, into L2, one row per
// position computed: chunks sit in blocks scattered over the cache, where the hardware prefetcher
// cannot follow. Spread over the chunk's positions rather than issued as a burst of 16 rows at its
// start (a burst fills the core's miss buffers and stalls the loads behind it): 1.12x with a
// 16-bit cache, 1.03x with fp32 at batch 256. Into L1 instead: 0.96x for fp32 rows (a 48 KB chunk
// evicts the one being read), the same as L2 for 16-bit ones.
template <typename C>
GS_AVX512 inline void prefetch_row(const C* row, int64_t d) {
  const char* base = reinterpret_cast<const char*>(row);
  const int64_t bytes = d * static_cast<int64_t>(sizeof(C));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(base + off, _MM_HINT_T1);
}

// Positions [lo, hi) in chunks of 16 from lo rounded down to 16 (a chunk never crosses a block, as
// block sizes are multiples of 16); lanes outside [lo, hi) of the first and last chunks are masked.
template <typename T, typename C, bool kMods>
GS_AVX512 void attend_token_avx512(
    const Geometry& g, const T* query, const C* keys, const C* values, T* out,
    const int32_t* blocks, int64_t token, int64_t lo, int64_t hi, int64_t kv0, int64_t kv1, Scratch& s) {
  const int64_t d = g.head_size, G = g.group, h0 = kv0 * G, h1 = kv1 * G;
  const int64_t base = lo / 16 * 16, skip = lo - base, span = hi - base;
  const int64_t chunks = (span + 15) / 16, stride = chunks * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (span - (chunks - 1) * 16)) - 1);
  const __mmask16 head = static_cast<__mmask16>(0xFFFFu << skip);
  auto lanes = [&](int64_t c) {  // the chunk's positions inside [lo, hi)
    return static_cast<__mmask16>((c == 0 ? head : 0xFFFF) & (c == chunks - 1 ? tail : 0xFFFF));
  };
  load_query(g, query, token, h0, h1, s);
  float* scores = s.scores.data();  // [H, stride]: chunk c of head h at h * stride + 16 c
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  // Pass 1: scores, 16 positions (one chunk, inside one block) at a time.
  auto chunk_at = [&](const C* half, int64_t start) {
    return half + blocks[start / g.block_size] * g.kv_stride_block + (start % g.block_size) * g.kv_stride_pos;
  };
  __m512 dots[16];
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t start = base + 16 * c, first = c == 0 ? skip : 0, n = std::min<int64_t>(16, hi - start);
    const __mmask16 valid = lanes(c);
    const C* chunk = chunk_at(keys, start);
    const C* next = c + 1 < chunks ? chunk_at(keys, start + 16) : chunk_at(values, base);  // then V's first
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      const C* rows = chunk + kvh * g.kv_stride_head;
      const C* ahead = next + kvh * g.kv_stride_head;
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        const float* q = s.q.data() + h * d;
        for (int64_t p = 0; p < 16; ++p) {
          if (h == kvh * G) prefetch_row(ahead + p * g.kv_stride_pos, d);
          if (p >= n || p < first) {
            dots[p] = _mm512_setzero_ps();
            continue;
          }
          const C* k = rows + p * g.kv_stride_pos;
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q), load16(k));
          for (int64_t j = 16; j < d; j += 16) x = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load16(k + j), x);
          dots[p] = x;
        }
        __m512 sums = sum_each(dots);
        if constexpr (kMods) sums = modify16(g, sums, h, start, hi - 1);
        _mm512_storeu_ps(scores + h * stride + 16 * c,
                         valid == 0xFFFF ? sums : _mm512_mask_blend_ps(valid, minus_inf, sums));
      }
    }
  }
  // Softmax per query head (unnormalized; divided by the sum at the end).
  float* inv_sum = s.inv_sum.data();
  for (int64_t h = h0; h < h1; ++h) {
    float* row = scores + h * stride;
    __m512 m = minus_inf;
    for (int64_t c = 0; c < chunks; ++c) m = _mm512_max_ps(m, _mm512_loadu_ps(row + 16 * c));
    float top_value = _mm512_reduce_max_ps(m);
    if (g.sinks != nullptr) top_value = std::max(top_value, g.sinks[h]);
    const __m512 top = _mm512_set1_ps(top_value);
    const float sink = g.sinks != nullptr ? std::exp(g.sinks[h] - top_value) : 0.f;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + 16 * c), top));
      const __mmask16 valid = lanes(c);
      if (valid != 0xFFFF) e = _mm512_maskz_mov_ps(valid, e);
      _mm512_storeu_ps(row + 16 * c, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[h] = g.v_scale / (_mm512_reduce_add_ps(sum) + sink);
  }
  // Pass 2: weighted sum of V, up to 64 output columns held in registers over a chunk.
  std::fill(s.acc.begin() + h0 * d, s.acc.begin() + h1 * d, 0.f);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t start = base + 16 * c, first = c == 0 ? skip : 0, n = std::min<int64_t>(16, hi - start);
    const C* chunk = chunk_at(values, start);
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      const C* rows = chunk + kvh * g.kv_stride_head;
      const C* ahead = c + 1 < chunks ? chunk_at(values, start + 16) + kvh * g.kv_stride_head : nullptr;
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        const float* w = scores + h * stride + 16 * c;
        float* acc = s.acc.data() + h * d;
        for (int64_t j = 0; j < d; j += 64) {
          const int64_t vecs = std::min<int64_t>(64, d - j) / 16;
          __m512 a[4];
          for (int64_t i = 0; i < vecs; ++i) a[i] = _mm512_loadu_ps(acc + j + 16 * i);
          for (int64_t p = first; p < n; ++p) {
            if (ahead != nullptr && h == kvh * G && j == 0) prefetch_row(ahead + p * g.kv_stride_pos, d);
            const __m512 wp = _mm512_set1_ps(w[p]);
            const C* v = rows + p * g.kv_stride_pos + j;
            for (int64_t i = 0; i < vecs; ++i) a[i] = _mm512_fmadd_ps(wp, load16(v + 16 * i), a[i]);
          }
          for (int64_t i = 0; i < vecs; ++i) _mm512_storeu_ps(acc + j + 16 * i, a[i]);
        }
      }
    }
  }
  store_output(g, out, token, h0, h1, s);
}
#endif

// Instruction sets: 0 the portable loops, 1 AVX-512 (when the CPU has it). Tests lower the cap to
// compare the two.
std::atomic<int64_t> max_isa{1};

// The AVX-512 kernel for this cache type and geometry, or null for the portable one.
template <typename T, typename C>
auto fast_kernel(const Geometry& g) -> decltype(&attend_token<T, C>) {
#if defined(GS_X86)
  constexpr bool wide = std::is_same<C, float>::value || std::is_same<C, c10::BFloat16>::value ||
                        std::is_same<C, c10::Half>::value;
  if constexpr (wide) {
    if (std::min(best_isa(), max_isa.load()) >= 1 && g.head_size % 16 == 0 && g.block_size % 16 == 0)
      return g.mods() ? &attend_token_avx512<T, C, true> : &attend_token_avx512<T, C, false>;
  }
#endif
  return nullptr;
}

// A token and a range of its KV heads: the unit of work given to a thread.
struct Unit {
  int64_t token, kv0, kv1;
};

// Splits `units` into `parts` contiguous runs of about equal cost (K/V rows read).
std::vector<int64_t> balanced_bounds(const std::vector<Unit>& units, const std::vector<int64_t>& lo,
                                     const std::vector<int64_t>& hi, int64_t parts) {
  auto cost = [&](const Unit& u) { return (hi[u.token] - lo[u.token] + 1) * (u.kv1 - u.kv0); };
  int64_t total = 0;
  for (const Unit& u : units) total += cost(u);
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(units.size()); ++i) {
    done += cost(units[i]);
    const int64_t part = static_cast<int64_t>(bounds.size());
    if (part < parts && done * parts >= total * part) bounds.push_back(i + 1);
  }
  if (bounds.back() != static_cast<int64_t>(units.size())) bounds.push_back(units.size());
  return bounds;
}

// Per query token: its sequence and the positions [lo, hi) it reads (hi = 0: not handled here).
struct TokenSpans {
  std::vector<int64_t> seq, lo, hi;
  int64_t max_span = 0;  // the most positions one token reads, from its first 16-position chunk
};

template <typename T, typename C>
void run(const Geometry& g, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& out, const TokenSpans& spans, const int32_t* block_table) {
  const T* q = query.data_ptr<T>();
  const C* keys = static_cast<const C*>(kv_cache.data_ptr());
  const C* values = keys + kv_cache.stride(0);
  T* o = out.data_ptr<T>();
  const int64_t threads = at::get_num_threads();
  int64_t num_active = 0;
  for (int64_t t = 0; t < g.num_tokens; ++t) num_active += spans.hi[t] > 0;
  if (num_active == 0) return;
  // Whole tokens when there are enough to go round the threads; otherwise each token's KV heads
  // are split too, so that a single long sequence still uses every core.
  const int64_t slices = std::min(g.num_kv_heads, (threads + num_active - 1) / num_active);
  std::vector<Unit> units;
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    if (spans.hi[t] <= 0) continue;
    for (int64_t i = 0; i < slices; ++i)
      units.push_back({t, g.num_kv_heads * i / slices, g.num_kv_heads * (i + 1) / slices});
  }
  // One task per thread, each a run of units with about the same number of rows to read:
  // at::parallel_for's static chunks would leave threads idle when context lengths differ.
  const auto bounds = balanced_bounds(units, spans.lo, spans.hi, threads);
  const auto fast = fast_kernel<T, C>(g);
  const auto attend = fast != nullptr ? fast : &attend_token<T, C>;
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(g, spans.max_span);
    for (int64_t i = bounds[begin]; i < bounds[end]; ++i) {
      const Unit& u = units[i];
      const int32_t* blocks = block_table + spans.seq[u.token] * g.max_blocks;
      attend(g, q, keys, values, o, blocks, u.token, spans.lo[u.token], spans.hi[u.token], u.kv0, u.kv1, scratch);
    }
  });
}

// The cache element type C for queries of type T.
template <typename T>
void run_cache(at::ScalarType cache_type, const Geometry& g, const at::Tensor& query,
               const at::Tensor& kv_cache, const at::Tensor& out, const TokenSpans& spans, const int32_t* table) {
  switch (cache_type) {
    case at::kFloat:
      return run<T, float>(g, query, kv_cache, out, spans, table);
    case at::kBFloat16:
      return run<T, c10::BFloat16>(g, query, kv_cache, out, spans, table);
    case at::kHalf:
      return run<T, c10::Half>(g, query, kv_cache, out, spans, table);
    case at::kFloat8_e4m3fn:
      return run<T, c10::Float8_e4m3fn>(g, query, kv_cache, out, spans, table);
    case at::kFloat8_e5m2:
      return run<T, c10::Float8_e5m2>(g, query, kv_cache, out, spans, table);
    default:
      TORCH_CHECK(false, "unsupported kv_cache dtype ", cache_type);
  }
}

}  // namespace

// out[t, h, :] = softmax(modified(scale * q . K)) V over each token's visible paged context.
void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_table, double scale, int64_t max_q_len,
                     double k_scale, double v_scale, int64_t sliding_window, double soft_cap,
                     const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query [T, H, D], kv_cache [2, N, B, KVH, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_cache.stride(4) == 1,
              "query, out and kv_cache: the head dim must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have query's shape");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype");
  TORCH_CHECK(kv_cache.element_size() <= query.element_size(),
              "kv_cache may be narrower than query, never wider");
  for (const auto* t : {&query_start_loc, &seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "int32 contiguous metadata expected");
  const int64_t num_heads = query.size(1), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "query and kv_cache head sizes differ");

  Geometry g{};
  g.num_tokens = query.size(0);
  g.num_heads = num_heads;
  g.num_kv_heads = num_kv_heads;
  g.head_size = query.size(2);
  g.group = num_heads / num_kv_heads;
  g.block_size = kv_cache.size(2);
  g.max_blocks = block_table.size(1);
  g.q_stride_token = query.stride(0);
  g.q_stride_head = query.stride(1);
  g.o_stride_token = out.stride(0);
  g.o_stride_head = out.stride(1);
  g.kv_stride_block = kv_cache.stride(1);
  g.kv_stride_pos = kv_cache.stride(2);
  g.kv_stride_head = kv_cache.stride(3);
  g.scale = static_cast<float>(scale);
  g.k_scale = static_cast<float>(k_scale);
  g.v_scale = static_cast<float>(v_scale);
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0, "sliding_window and soft_cap must be >= 0 (0: off)");
  g.window = sliding_window;
  g.soft_cap = static_cast<float>(soft_cap);
  g.alibi = nullptr;
  if (alibi_slopes.has_value()) {
    const at::Tensor& slopes = *alibi_slopes;
    TORCH_CHECK(slopes.device().is_cpu() && slopes.scalar_type() == at::kFloat && slopes.is_contiguous() &&
                    slopes.dim() == 1 && slopes.size(0) == num_heads,
                "alibi_slopes: a contiguous float32 CPU tensor of num_heads slopes expected");
    g.alibi = slopes.data_ptr<float>();
  }
  g.sinks = nullptr;
  if (sinks.has_value()) {
    const at::Tensor& logits = *sinks;
    TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                    logits.dim() == 1 && logits.size(0) == num_heads,
                "sinks: a contiguous float32 CPU tensor of num_heads logits expected");
    g.sinks = logits.data_ptr<float>();
  }

  // Per token: its sequence and how many positions it sees (0 = not handled here).
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_table.size(0) >= num_seqs,
              "query_start_loc needs num_seqs + 1 entries and block_table num_seqs rows");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TokenSpans spans;
  spans.seq.assign(g.num_tokens, 0);
  spans.lo.assign(g.num_tokens, 0);
  spans.hi.assign(g.num_tokens, 0);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t begin = qsl[i], q_len = qsl[i + 1] - qsl[i], ctx = lens[i];
    TORCH_CHECK(begin >= 0 && q_len >= 0 && begin + q_len <= g.num_tokens, "bad query_start_loc");
    TORCH_CHECK(q_len <= ctx && ctx <= g.max_blocks * g.block_size, "seq_lens out of range for row ", i);
    if (q_len > max_q_len) continue;
    // the first block any of the row's tokens reads (a window may start past the first ones)
    const int64_t first_pos = g.window > 0 ? std::max<int64_t>(0, ctx - q_len + 1 - g.window) : 0;
    const int32_t* blocks = block_table.data_ptr<int32_t>() + i * g.max_blocks;
    for (int64_t b = first_pos / g.block_size; b < (ctx + g.block_size - 1) / g.block_size; ++b)
      TORCH_CHECK(blocks[b] >= 0 && blocks[b] < kv_cache.size(1), "block_table[", i, "] out of range");
    for (int64_t t = 0; t < q_len; ++t) {
      const int64_t hi = ctx - q_len + t + 1, lo = g.window > 0 ? std::max<int64_t>(0, hi - g.window) : 0;
      spans.seq[begin + t] = i;
      spans.lo[begin + t] = lo;
      spans.hi[begin + t] = hi;
      spans.max_span = std::max(spans.max_span, hi - lo / 16 * 16);
    }
  }
  const int32_t* table = block_table.data_ptr<int32_t>();

  const auto cache_type = kv_cache.scalar_type();
  switch (query.scalar_type()) {
    case at::kFloat:
      run_cache<float>(cache_type, g, query, kv_cache, out, spans, table);
      break;
    case at::kBFloat16:
      run_cache<c10::BFloat16>(cache_type, g, query, kv_cache, out, spans, table);
      break;
    case at::kHalf:
      run_cache<c10::Half>(cache_type, g, query, kv_cache, out, spans, table);
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
}

// The instruction set the kernel uses (0 portable, 1 AVX-512); `cap` >= 0 first caps it.
int64_t paged_attention_isa(int64_t cap) {
  if (cap >= 0) max_isa.store(cap);
  return std::min(best_isa(), max_isa.load());
}

TORCH_LIBRARY(gridserve_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_table, float scale, int max_q_len, float k_scale=1., "
      "float v_scale=1., int sliding_window=0, float soft_cap=0., Tensor? alibi_slopes=None, "
      "Tensor? sinks=None) -> ()");
  m.def("paged_attention_isa(int cap=-1) -> int", &paged_attention_isa);
}

TORCH_LIBRARY_IMPL(gridserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
