// Paged attention over a block-table KV cache, one query row at a time.
//
// Every query row (token t of sequence s at position p) attends keys [0, p] of s,
// read in place through s's block table. Each row is reduced in a fixed sequential
// order that depends only on that row's own history, so results are bitwise
// independent of which other rows share the call (batch invariance) and of how the
// sequence's prompt was split into chunks (prefill partition invariance).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// Dot product with kLanes independent partial sums combined in a fixed order: the
// compiler can vectorize it without reassociating, so the result stays reproducible.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += a[d + l] * b[d + l];
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += part[l];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

template <typename scalar_t>
void attend_rows(const torch::Tensor& query,        // (T, H, D)
                 const torch::Tensor& key_cache,    // (NB, BS, KVH, D)
                 const torch::Tensor& value_cache,  // (NB, BS, KVH, D)
                 const torch::Tensor& block_tables, // (S, MAXB) int32
                 const torch::Tensor& token_seq,    // (T,) int32: row -> sequence index
                 const torch::Tensor& token_pos,    // (T,) int32: row -> absolute position
                 double scale, torch::Tensor& out) {
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2);
  const int64_t G = H / KVH;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = key_cache.data_ptr<scalar_t>();
  const scalar_t* vc = value_cache.data_ptr<scalar_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* seq = token_seq.data_ptr<int32_t>();
  const int32_t* pos = token_pos.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t q_row = H * D, kv_tok = KVH * D, kv_block = BS * KVH * D;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, T * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qf(G * D), acc(G * D), kf(D), vf(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / KVH, kvh = task % KVH;
      const int64_t num_keys = static_cast<int64_t>(pos[t]) + 1;
      const int32_t* table = bt + static_cast<int64_t>(seq[t]) * max_blocks;
      scores.assign(G * num_keys, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[t * q_row + (kvh * G + g) * D + d]) * fscale;
      // Pass 1: scores, in key order.
      for (int64_t j = 0; j < num_keys; ++j) {
        const scalar_t* k = kc + table[j / BS] * kv_block + (j % BS) * kv_tok + kvh * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          scores[g * num_keys + j] = dot(qf.data() + g * D, kf.data(), D);
        }
      }
      // Pass 2: softmax weights per head.
      std::vector<float> denom(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * num_keys;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < num_keys; ++j) m = sg[j] > m ? sg[j] : m;
        float l = 0.f;
        for (int64_t j = 0; j < num_keys; ++j) {
          sg[j] = std::exp(sg[j] - m);
          l += sg[j];
        }
        denom[g] = l;
      }
      // Pass 3: weighted sum of values, in key order.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < num_keys; ++j) {
        const scalar_t* v = vc + table[j / BS] * kv_block + (j % BS) * kv_tok + kvh * D;
        for (int64_t d = 0; d < D; ++d) vf[d] = static_cast<float>(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * num_keys + j];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / denom[g];
        scalar_t* og = o + t * q_row + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) og[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor token_seq, torch::Tensor token_pos,
                              double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "paged_attention: bad ranks");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "paged_attention: dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && token_seq.scalar_type() == torch::kInt32 &&
                  token_pos.scalar_type() == torch::kInt32, "paged_attention: index tensors must be int32");
  // NOTE: the caches are whole-pool tensors; a hidden .contiguous() copy would cost the pool per call.
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  query = query.contiguous();
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    attend_rows<scalar_t>(query, key_cache, value_cache, block_tables.contiguous(),
                          token_seq.contiguous(), token_pos.contiguous(), scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Row-invariant paged attention (CPU)");
}
