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
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace {

using gs_simd::best_isa;

// Hot loops get an AVX2 clone picked at load time on x86 (GCC ifunc); the default clone keeps
// the library portable, so the build never depends on the machine it was compiled on.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GS_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GS_SIMD_CLONES
#endif

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

struct Geometry {
  int64_t num_tokens, num_heads, num_kv_heads, head_size, group, block_size, max_blocks;
  int64_t q_stride_token, q_stride_head;   // query strides (last dim contiguous)
  int64_t o_stride_token, o_stride_head;   // output strides (last dim contiguous)
  int64_t kv_stride_block, kv_stride_pos, kv_stride_head;  // within the K or the V half
  float scale;
  float k_scale, v_scale;  // fp8 cache: stored values are K / k_scale and V / v_scale (else 1)
};

// Scratch for one token, reused across a thread's share of the tokens.
struct Scratch {
  std::vector<float> q, scores, acc, row, inv_sum;
  Scratch(const Geometry& g, int64_t max_ctx)
      : q(g.num_heads * g.head_size), scores(g.num_heads * ((std::max<int64_t>(max_ctx, 1) + 15) / 16 * 16)),
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

// KV heads [kv0, kv1) of one query token (and their query heads) over its first `visible`
// positions. Each position's K (then V) row holds the KV heads contiguously, so the walk reads
// whole rows in cache order.
template <typename T, typename C>
GS_SIMD_CLONES void attend_token(
    const Geometry& g, const T* query, const C* keys, const C* values, T* out,
    const int32_t* blocks, int64_t token, int64_t visible, int64_t kv0, int64_t kv1, Scratch& s) {
  const int64_t d = g.head_size, G = g.group, h0 = kv0 * G, h1 = kv1 * G;
  load_query(g, query, token, h0, h1, s);
  float* scores = s.scores.data();  // [H, visible]

  // Pass 1: scores, walking the block table a block at a time.
  for (int64_t start = 0; start < visible; start += g.block_size) {
    const int64_t n = std::min(g.block_size, visible - start);
    const C* block = keys + blocks[start / g.block_size] * g.kv_stride_block;
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const float* k = widen(block + p * g.kv_stride_pos + kvh * g.kv_stride_head, s.row.data(), d);
        for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h)
          scores[h * visible + start + p] = dot(s.q.data() + h * d, k, d);
      }
    }
  }
  // Softmax per query head (unnormalized; divided by the sum at the end).
  float* inv_sum = s.inv_sum.data();
  for (int64_t h = h0; h < h1; ++h) {
    float* row = scores + h * visible;
    float m = row[0];
    for (int64_t p = 1; p < visible; ++p) m = std::max(m, row[p]);
    float sum = 0.f;
    for (int64_t p = 0; p < visible; ++p) {
      row[p] = std::exp(row[p] - m);
      sum += row[p];
    }
    inv_sum[h] = g.v_scale / sum;
  }
  // Pass 2: weighted sum of V.
  std::fill(s.acc.begin() + h0 * d, s.acc.begin() + h1 * d, 0.f);
  for (int64_t start = 0; start < visible; start += g.block_size) {
    const int64_t n = std::min(g.block_size, visible - start);
    const C* block = values + blocks[start / g.block_size] * g.kv_stride_block;
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        const float* v = widen(block + p * g.kv_stride_pos + kvh * g.kv_stride_head, s.row.data(), d);
        for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h)
          axpy(scores[h * visible + start + p], v, s.acc.data() + h * d, d);
      }
    }
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

template <typename T, typename C>
GS_AVX512 void attend_token_avx512(
    const Geometry& g, const T* query, const C* keys, const C* values, T* out,
    const int32_t* blocks, int64_t token, int64_t visible, int64_t kv0, int64_t kv1, Scratch& s) {
  const int64_t d = g.head_size, G = g.group, h0 = kv0 * G, h1 = kv1 * G;
  const int64_t chunks = (visible + 15) / 16, stride = chunks * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (visible - (chunks - 1) * 16)) - 1);
  load_query(g, query, token, h0, h1, s);
  float* scores = s.scores.data();  // [H, stride]: chunk c of head h at h * stride + 16 c
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  // Pass 1: scores, 16 positions (one chunk, inside one block) at a time.
  auto chunk_at = [&](const C* half, int64_t start) {
    return half + blocks[start / g.block_size] * g.kv_stride_block + (start % g.block_size) * g.kv_stride_pos;
  };
  __m512 dots[16];
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t start = 16 * c, n = std::min<int64_t>(16, visible - start);
    const C* chunk = chunk_at(keys, start);
    const C* next = c + 1 < chunks ? chunk_at(keys, start + 16) : chunk_at(values, 0);  // then V's first
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      const C* rows = chunk + kvh * g.kv_stride_head;
      const C* ahead = next + kvh * g.kv_stride_head;
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        const float* q = s.q.data() + h * d;
        for (int64_t p = 0; p < 16; ++p) {
          if (h == kvh * G) prefetch_row(ahead + p * g.kv_stride_pos, d);
          if (p >= n) {
            dots[p] = _mm512_setzero_ps();
            continue;
          }
          const C* k = rows + p * g.kv_stride_pos;
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q), load16(k));
          for (int64_t j = 16; j < d; j += 16) x = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load16(k + j), x);
          dots[p] = x;
        }
        const __m512 sums = sum_each(dots);
        _mm512_storeu_ps(scores + h * stride + start, n == 16 ? sums : _mm512_mask_blend_ps(tail, minus_inf, sums));
      }
    }
  }
  // Softmax per query head (unnormalized; divided by the sum at the end).
  float* inv_sum = s.inv_sum.data();
  for (int64_t h = h0; h < h1; ++h) {
    float* row = scores + h * stride;
    __m512 m = minus_inf;
    for (int64_t c = 0; c < chunks; ++c) m = _mm512_max_ps(m, _mm512_loadu_ps(row + 16 * c));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + 16 * c), top));
      if (c == chunks - 1) e = _mm512_maskz_mov_ps(tail, e);
      _mm512_storeu_ps(row + 16 * c, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[h] = g.v_scale / _mm512_reduce_add_ps(sum);
  }
  // Pass 2: weighted sum of V, up to 64 output columns held in registers over a chunk.
  std::fill(s.acc.begin() + h0 * d, s.acc.begin() + h1 * d, 0.f);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t start = 16 * c, n = std::min<int64_t>(16, visible - start);
    const C* chunk = chunk_at(values, start);
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      const C* rows = chunk + kvh * g.kv_stride_head;
      const C* ahead = c + 1 < chunks ? chunk_at(values, start + 16) + kvh * g.kv_stride_head : nullptr;
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        const float* w = scores + h * stride + start;
        float* acc = s.acc.data() + h * d;
        for (int64_t j = 0; j < d; j += 64) {
          const int64_t vecs = std::min<int64_t>(64, d - j) / 16;
          __m512 a[4];
          for (int64_t i = 0; i < vecs; ++i) a[i] = _mm512_loadu_ps(acc + j + 16 * i);
          for (int64_t p = 0; p < n; ++p) {
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
      return &attend_token_avx512<T, C>;
  }
#endif
  return nullptr;
}

// A token and a range of its KV heads: the unit of work given to a thread.
struct Unit {
  int64_t token, kv0, kv1;
};

// Splits `units` into `parts` contiguous runs of about equal cost (K/V rows read).
std::vector<int64_t> balanced_bounds(const std::vector<Unit>& units,
                                     const std::vector<int64_t>& visible, int64_t parts) {
  auto cost = [&](const Unit& u) { return (visible[u.token] + 1) * (u.kv1 - u.kv0); };
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

template <typename T, typename C>
void run(const Geometry& g, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& out, const std::vector<int64_t>& token_seq,
         const std::vector<int64_t>& token_visible, const int32_t* block_table, int64_t max_ctx) {
  const T* q = query.data_ptr<T>();
  const C* keys = static_cast<const C*>(kv_cache.data_ptr());
  const C* values = keys + kv_cache.stride(0);
  T* o = out.data_ptr<T>();
  const int64_t threads = at::get_num_threads();
  int64_t num_active = 0;
  for (int64_t t = 0; t < g.num_tokens; ++t) num_active += token_visible[t] > 0;
  if (num_active == 0) return;
  // Whole tokens when there are enough to go round the threads; otherwise each token's KV heads
  // are split too, so that a single long sequence still uses every core.
  const int64_t slices = std::min(g.num_kv_heads, (threads + num_active - 1) / num_active);
  std::vector<Unit> units;
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    if (token_visible[t] <= 0) continue;
    for (int64_t i = 0; i < slices; ++i)
      units.push_back({t, g.num_kv_heads * i / slices, g.num_kv_heads * (i + 1) / slices});
  }
  // One task per thread, each a run of units with about the same number of rows to read:
  // at::parallel_for's static chunks would leave threads idle when context lengths differ.
  const auto bounds = balanced_bounds(units, token_visible, threads);
  const auto fast = fast_kernel<T, C>(g);
  const auto attend = fast != nullptr ? fast : &attend_token<T, C>;
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(g, max_ctx);
    for (int64_t i = bounds[begin]; i < bounds[end]; ++i) {
      const Unit& u = units[i];
      const int32_t* blocks = block_table + token_seq[u.token] * g.max_blocks;
      attend(g, q, keys, values, o, blocks, u.token, token_visible[u.token], u.kv0, u.kv1, scratch);
    }
  });
}

// The cache element type C for queries of type T.
template <typename T>
void run_cache(at::ScalarType cache_type, const Geometry& g, const at::Tensor& query,
               const at::Tensor& kv_cache, const at::Tensor& out,
               const std::vector<int64_t>& token_seq, const std::vector<int64_t>& token_visible,
               const int32_t* table, int64_t max_ctx) {
  switch (cache_type) {
    case at::kFloat:
      return run<T, float>(g, query, kv_cache, out, token_seq, token_visible, table, max_ctx);
    case at::kBFloat16:
      return run<T, c10::BFloat16>(g, query, kv_cache, out, token_seq, token_visible, table, max_ctx);
    case at::kHalf:
      return run<T, c10::Half>(g, query, kv_cache, out, token_seq, token_visible, table, max_ctx);
    case at::kFloat8_e4m3fn:
      return run<T, c10::Float8_e4m3fn>(g, query, kv_cache, out, token_seq, token_visible, table, max_ctx);
    case at::kFloat8_e5m2:
      return run<T, c10::Float8_e5m2>(g, query, kv_cache, out, token_seq, token_visible, table, max_ctx);
    default:
      TORCH_CHECK(false, "unsupported kv_cache dtype ", cache_type);
  }
}

}  // namespace

// out[t, h, :] = softmax(scale * q . K) V over each token's visible paged context.
void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_table, double scale, int64_t max_q_len,
                     double k_scale, double v_scale) {
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

  // Per token: its sequence and how many positions it sees (0 = not handled here).
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_table.size(0) >= num_seqs,
              "query_start_loc needs num_seqs + 1 entries and block_table num_seqs rows");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> token_seq(g.num_tokens, 0), token_visible(g.num_tokens, 0);
  int64_t max_ctx = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t begin = qsl[i], q_len = qsl[i + 1] - qsl[i], ctx = lens[i];
    TORCH_CHECK(begin >= 0 && q_len >= 0 && begin + q_len <= g.num_tokens, "bad query_start_loc");
    TORCH_CHECK(q_len <= ctx && ctx <= g.max_blocks * g.block_size, "seq_lens out of range for row ", i);
    if (q_len > max_q_len) continue;
    const int32_t* blocks = block_table.data_ptr<int32_t>() + i * g.max_blocks;
    for (int64_t b = 0; b < (ctx + g.block_size - 1) / g.block_size; ++b)
      TORCH_CHECK(blocks[b] >= 0 && blocks[b] < kv_cache.size(1), "block_table[", i, "] out of range");
    for (int64_t t = 0; t < q_len; ++t) {
      token_seq[begin + t] = i;
      token_visible[begin + t] = ctx - q_len + t + 1;
    }
    max_ctx = std::max(max_ctx, ctx);
  }
  const int32_t* table = block_table.data_ptr<int32_t>();

  const auto cache_type = kv_cache.scalar_type();
  switch (query.scalar_type()) {
    case at::kFloat:
      run_cache<float>(cache_type, g, query, kv_cache, out, token_seq, token_visible, table, max_ctx);
      break;
    case at::kBFloat16:
      run_cache<c10::BFloat16>(cache_type, g, query, kv_cache, out, token_seq, token_visible, table,
                               max_ctx);
      break;
    case at::kHalf:
      run_cache<c10::Half>(cache_type, g, query, kv_cache, out, token_seq, token_visible, table, max_ctx);
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
      "float v_scale=1.) -> ()");
  m.def("paged_attention_isa(int cap=-1) -> int", &paged_attention_isa);
}

TORCH_LIBRARY_IMPL(gridserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
