// Paged attention over a block-table KV cache, one query row at a time.
//
// Every query row (token t of sequence s at position p) attends keys [0, p] of s,
// read in place through s's block table. Each row is reduced in a fixed order that
// depends only on that row's own history, so results are bitwise independent of which
// other rows share the call (batch invariance) and of how the sequence's prompt was
// split into chunks (prefill partition invariance).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of an fp32
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Dot product with kLanes independent partial sums combined in a fixed order: the compiler
// vectorizes it without reassociating, so the result is reproducible.
template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += q[d + l] * to_float(k[d + l]);
  // Fixed pairwise tree: short dependency chains, same order for every row.
  for (int64_t width = kLanes / 2; width >= 1; width /= 2)
    for (int64_t l = 0; l < width; ++l) part[l] += part[l + width];
  float s = part[0];
  for (; d < n; ++d) s += q[d] * to_float(k[d]);
  return s;
}

#if defined(__AVX512F__)
#include <immintrin.h>
// bf16 rows with D % 16 == 0: explicit AVX-512 (the generic loops above do not vectorize
// well around the bf16 conversion). _mm512_reduce_add_ps is a fixed tree, so still reproducible.
inline __m512 load_bf16x16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <>
inline float dot<c10::BFloat16>(const float* q, const c10::BFloat16* k, int64_t n) {
  if (n % 16) {
    float s = 0.f;
    for (int64_t d = 0; d < n; ++d) s += q[d] * to_float(k[d]);
    return s;
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load_bf16x16(k + d), acc);
  return _mm512_reduce_add_ps(acc);
}
inline void load_row(const c10::BFloat16* v, float* out, int64_t n) {
  if (n % 16) {
    for (int64_t d = 0; d < n; ++d) out[d] = to_float(v[d]);
    return;
  }
  for (int64_t d = 0; d < n; d += 16) _mm512_storeu_ps(out + d, load_bf16x16(v + d));
}
#else
inline void load_row(const c10::BFloat16* v, float* out, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] = to_float(v[d]);
}
#endif
template <typename scalar_t>
inline void load_row(const scalar_t* v, float* out, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] = to_float(v[d]);
}

// exp for x <= 0 (softmax after max subtraction): Cody-Waite range reduction plus a
// degree-6 polynomial (~1 ulp). Plain arithmetic, so loops over it vectorize.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::floor(x * 1.44269504f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

template <typename scalar_t>
void attend_rows(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                 const torch::Tensor& block_tables, const torch::Tensor& token_seq, const torch::Tensor& token_pos,
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
    std::vector<float> scores, qf(G * D), acc(G * D), denom(G), vf(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / KVH, kvh = task % KVH;
      const int64_t num_keys = static_cast<int64_t>(pos[t]) + 1;
      const int32_t* table = bt + static_cast<int64_t>(seq[t]) * max_blocks;
      if (static_cast<int64_t>(scores.size()) < G * num_keys) scores.resize(G * num_keys);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(q[t * q_row + (kvh * G + g) * D + d]) * fscale;
      // Pass 1: scores, in key order.
      for (int64_t j = 0; j < num_keys; ++j) {
        const scalar_t* k = kc + table[j / BS] * kv_block + (j % BS) * kv_tok + kvh * D;
        for (int64_t g = 0; g < G; ++g) scores[g * num_keys + j] = dot(qf.data() + g * D, k, D);
      }
      // Pass 2: softmax weights per head (max is order-free; the sum runs in key order).
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * num_keys;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < num_keys; ++j) m = sg[j] > m ? sg[j] : m;
        for (int64_t j = 0; j < num_keys; ++j) sg[j] = exp_nonpositive(sg[j] - m);
        float l = 0.f;
        for (int64_t j = 0; j < num_keys; ++j) l += sg[j];
        denom[g] = l;
      }
      // Pass 3: weighted sum of values, in key order.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < num_keys; ++j) {
        const scalar_t* v = vc + table[j / BS] * kv_block + (j % BS) * kv_tok + kvh * D;
        load_row(v, vf.data(), D);
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
    attend_rows<scalar_t>(query, key_cache, value_cache, block_tables.contiguous(), token_seq.contiguous(),
                          token_pos.contiguous(), scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Row-invariant paged attention (CPU)");
}
