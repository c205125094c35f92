// CPU paged MLA decode: absorbed queries over the latent cache, read in place through the block
// table (gridserve.kernels.mla has the contract and the torch reference).
//
// A cache entry [kv_lora_rank + rope_dim] is one token's latent c_kv and rope key k_pe, shared by
// every head: the key of every head is the whole entry, its value the latent part. One work item
// is a query token and a range of its heads; each visible position's entry is read (and widened
// to float32) once per pass and serves every head of the range. Two passes in float32: the scores
// of every visible position, then softmax and the weighted sum of latents. Items are split over
// threads in runs of about equal work (positions x heads), so contexts of different lengths and a
// single long sequence both keep every thread busy.
//
// Token i of a row with q_len new tokens and context ctx sees positions [0, ctx - q_len + i].
// The cache may be narrower than the query: fp32 queries over a 16-bit or fp8 cache, 16-bit
// queries over fp8 (fp8 values are unscaled: MLA's cache has no per-tensor scale).
//
// Registered as torch.ops.gridserve_cpu_mla.mla_decode through torch/library.h.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"

namespace {

using gs_simd::axpy;
using gs_simd::dot;
using gs_simd::to_float;
using gs_simd::widen;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GS_MLA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GS_MLA_CLONES
#endif

struct Geometry {
  int64_t num_tokens, num_heads, entry, rank, block_size, max_blocks;
  int64_t q_stride_token, q_stride_head, o_stride_token, o_stride_head;
  int64_t c_stride_block, c_stride_pos;
  float scale;
};

// A token and a range of its heads: the unit of work given to a thread.
struct Unit {
  int64_t token, h0, h1;
};

struct Scratch {
  std::vector<float> q, scores, acc, row;
  Scratch(const Geometry& g, int64_t max_span)
      : q(g.num_heads * g.entry), scores(g.num_heads * std::max<int64_t>(max_span, 1)),
        acc(g.num_heads * g.rank), row(g.entry) {}
};

// Heads [h0, h1) of one token over positions [0, span) of its sequence (`blocks`: its table row).
template <typename T, typename C>
GS_MLA_CLONES void attend(const Geometry& g, const T* query, const C* cache, T* out, const int32_t* blocks,
                          int64_t token, int64_t span, int64_t h0, int64_t h1, Scratch& s) {
  const int64_t E = g.entry, R = g.rank;
  for (int64_t h = h0; h < h1; ++h) {
    const T* q = query + token * g.q_stride_token + h * g.q_stride_head;
    for (int64_t j = 0; j < E; ++j) s.q[h * E + j] = to_float(q[j]) * g.scale;
  }
  float* scores = s.scores.data();  // position p of head h at h * span + p
  for (int64_t pos = 0; pos < span;) {  // pass 1: scores, a run of positions inside one block at a time
    const int64_t offset = pos % g.block_size, n = std::min(g.block_size - offset, span - pos);
    const C* block = cache + blocks[pos / g.block_size] * g.c_stride_block + offset * g.c_stride_pos;
    for (int64_t p = 0; p < n; ++p) {
      const float* row = widen(block + p * g.c_stride_pos, s.row.data(), E);
      for (int64_t h = h0; h < h1; ++h) scores[h * span + pos + p] = dot(s.q.data() + h * E, row, E);
    }
    pos += n;
  }
  for (int64_t h = h0; h < h1; ++h) {  // softmax per head, unnormalized
    float* row = scores + h * span;
    float m = row[0];
    for (int64_t p = 1; p < span; ++p) m = std::max(m, row[p]);
    float sum = 0.f;
    for (int64_t p = 0; p < span; ++p) {
      row[p] = std::exp(row[p] - m);
      sum += row[p];
    }
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < span; ++p) row[p] *= inv;
  }
  std::fill(s.acc.begin() + h0 * R, s.acc.begin() + h1 * R, 0.f);
  for (int64_t pos = 0; pos < span;) {  // pass 2: the weighted sum of latents
    const int64_t offset = pos % g.block_size, n = std::min(g.block_size - offset, span - pos);
    const C* block = cache + blocks[pos / g.block_size] * g.c_stride_block + offset * g.c_stride_pos;
    for (int64_t p = 0; p < n; ++p) {
      const float* row = widen(block + p * g.c_stride_pos, s.row.data(), R);
      for (int64_t h = h0; h < h1; ++h) axpy(scores[h * span + pos + p], row, s.acc.data() + h * R, R);
    }
    pos += n;
  }
  for (int64_t h = h0; h < h1; ++h) {
    T* o = out + token * g.o_stride_token + h * g.o_stride_head;
    for (int64_t j = 0; j < R; ++j) o[j] = static_cast<T>(s.acc[h * R + j]);
  }
}

template <typename T, typename C>
void run(const Geometry& g, const at::Tensor& query, const at::Tensor& cache, const at::Tensor& out,
         const std::vector<int64_t>& seq, const std::vector<int64_t>& span, const int32_t* table) {
  if (g.num_tokens == 0) return;
  const int64_t threads = at::get_num_threads();
  // whole tokens when there are enough to go round the threads, else each token's heads split too
  const int64_t slices = std::min(g.num_heads, (threads + g.num_tokens - 1) / g.num_tokens);
  std::vector<Unit> units;
  int64_t total = 0, max_span = 0;
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    max_span = std::max(max_span, span[t]);
    for (int64_t i = 0; i < slices; ++i) {
      units.push_back({t, g.num_heads * i / slices, g.num_heads * (i + 1) / slices});
      total += span[t] * (units.back().h1 - units.back().h0);
    }
  }
  // contiguous runs of units with about equal work (at::parallel_for's static chunks would not be)
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(units.size()); ++i) {
    done += span[units[i].token] * (units[i].h1 - units[i].h0);
    const int64_t part = static_cast<int64_t>(bounds.size());
    if (part < threads && done * threads >= total * part) bounds.push_back(i + 1);
  }
  if (bounds.back() != static_cast<int64_t>(units.size())) bounds.push_back(units.size());
  const T* q = query.data_ptr<T>();
  const C* c = static_cast<const C*>(cache.data_ptr());
  T* o = out.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(g, max_span);
    for (int64_t i = bounds[begin]; i < bounds[end]; ++i) {
      const Unit& u = units[i];
      attend<T, C>(g, q, c, o, table + seq[u.token] * g.max_blocks, u.token, span[u.token], u.h0, u.h1, scratch);
    }
  });
}

template <typename T>
void run_cache(const Geometry& g, const at::Tensor& query, const at::Tensor& cache, const at::Tensor& out,
               const std::vector<int64_t>& seq, const std::vector<int64_t>& span, const int32_t* table) {
  switch (cache.scalar_type()) {
    case at::kFloat:
      return run<T, float>(g, query, cache, out, seq, span, table);
    case at::kBFloat16:
      return run<T, c10::BFloat16>(g, query, cache, out, seq, span, table);
    case at::kHalf:
      return run<T, c10::Half>(g, query, cache, out, seq, span, table);
    case at::kFloat8_e4m3fn:
      return run<T, c10::Float8_e4m3fn>(g, query, cache, out, seq, span, table);
    case at::kFloat8_e5m2:
      return run<T, c10::Float8_e5m2>(g, query, cache, out, seq, span, table);
    default:
      TORCH_CHECK(false, "mla_decode: unsupported cache dtype ", cache.scalar_type());
  }
}

}  // namespace

// out[t, h, :] = softmax(scale * query[t, h] . entries) @ entries[:, :kv_lora_rank] over t's
// visible positions.
void mla_decode(const at::Tensor& out, const at::Tensor& query, const at::Tensor& cache,
                const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                double scale, int64_t kv_lora_rank) {
  TORCH_CHECK(query.device().is_cpu() && cache.device().is_cpu() && out.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(query.dim() == 3 && cache.dim() == 3 && out.dim() == 3,
              "query [T, H, E], cache [N, B, E], out [T, H, R] expected");
  TORCH_CHECK(query.stride(2) == 1 && cache.stride(2) == 1 && out.stride(2) == 1,
              "query, cache and out: the last dim must be contiguous");
  TORCH_CHECK(query.size(2) == cache.size(2), "query and cache entry sizes differ");
  TORCH_CHECK(kv_lora_rank > 0 && kv_lora_rank <= query.size(2), "kv_lora_rank out of range");
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == query.size(1) && out.size(2) == kv_lora_rank,
              "out must be [T, H, kv_lora_rank]");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype");
  TORCH_CHECK(cache.element_size() <= query.element_size(), "the cache may be narrower than query, never wider");
  for (const auto* t : {&query_start_loc, &seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "int32 contiguous CPU metadata expected");

  Geometry g{};
  g.num_tokens = query.size(0);
  g.num_heads = query.size(1);
  g.entry = query.size(2);
  g.rank = kv_lora_rank;
  g.block_size = cache.size(1);
  g.max_blocks = block_table.size(1);
  g.q_stride_token = query.stride(0);
  g.q_stride_head = query.stride(1);
  g.o_stride_token = out.stride(0);
  g.o_stride_head = out.stride(1);
  g.c_stride_block = cache.stride(0);
  g.c_stride_pos = cache.stride(1);
  g.scale = static_cast<float>(scale);

  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_table.size(0) >= num_seqs,
              "query_start_loc needs num_seqs + 1 entries and block_table num_seqs rows");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  std::vector<int64_t> seq(g.num_tokens, 0), span(g.num_tokens, 0);
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == g.num_tokens, "query_start_loc must cover every token");
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t begin = qsl[i], q_len = qsl[i + 1] - qsl[i], ctx = lens[i];
    TORCH_CHECK(q_len >= 0 && begin + q_len <= g.num_tokens, "bad query_start_loc");
    TORCH_CHECK(q_len <= ctx && ctx <= g.max_blocks * g.block_size, "seq_lens out of range for row ", i);
    const int32_t* blocks = table + i * g.max_blocks;
    for (int64_t b = 0; b < (ctx + g.block_size - 1) / g.block_size; ++b)
      TORCH_CHECK(blocks[b] >= 0 && blocks[b] < cache.size(0), "block_table[", i, "] out of range");
    for (int64_t t = 0; t < q_len; ++t) {
      seq[begin + t] = i;
      span[begin + t] = ctx - q_len + t + 1;
    }
  }
  switch (query.scalar_type()) {
    case at::kFloat:
      return run_cache<float>(g, query, cache, out, seq, span, table);
    case at::kBFloat16:
      return run_cache<c10::BFloat16>(g, query, cache, out, seq, span, table);
    case at::kHalf:
      return run_cache<c10::Half>(g, query, cache, out, seq, span, table);
    default:
      TORCH_CHECK(false, "mla_decode: unsupported query dtype ", query.scalar_type());
  }
}

TORCH_LIBRARY(gridserve_cpu_mla, m) {
  m.def(
      "mla_decode(Tensor(a!) out, Tensor query, Tensor cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_table, float scale, int kv_lora_rank) -> ()");
}

TORCH_LIBRARY_IMPL(gridserve_cpu_mla, CPU, m) { m.impl("mla_decode", &mla_decode); }
