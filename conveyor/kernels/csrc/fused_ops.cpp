// Small fused CPU ops for the decode hot path (residual add + RMSNorm, SiLU-and-multiply,
// rotary + KV write, greedy argmax). Each replaces several torch ops (and their per-op
// dispatch cost, which dominates at decode sizes) with one pass over the row, rounds to the
// activation dtype wherever torch's op chain would, and reduces every row in a fixed order
// of its own. bf16 rows take AVX-512 or AVX2 paths; other dtypes take the scalar templates.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "kv_q8.h"
#include "parallel.h"
#include "vec_math.h"

namespace {

// Rows per thread before an op goes parallel. At decode sizes these ops take microseconds,
// less than waking the second thread, and every parallel region is a point where a step waits
// for a thread the OS may have lent to the HTTP side.
constexpr int64_t kRowGrain = 64;

template <typename scalar_t>
inline scalar_t round_to(float x) { return static_cast<scalar_t>(x); }

// transformers' LlamaRMSNorm: fp32 statistics, cast to the input dtype, then times the weight.
// With `delta`, the row is first x + delta rounded to the dtype (the residual add), and that
// sum is written to `sum_out` as well.
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* delta, const scalar_t* w, scalar_t* out, scalar_t* sum_out,
                   int64_t rows, int64_t n, float eps) {
  conveyor_parallel::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> summed(delta != nullptr ? n : 0);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * n;
      if (delta != nullptr) {
        for (int64_t j = 0; j < n; ++j)
          summed[j] = round_to<scalar_t>(static_cast<float>(xr[j]) + static_cast<float>(delta[r * n + j]));
        std::memcpy(sum_out + r * n, summed.data(), n * sizeof(scalar_t));
        xr = summed.data();
      }
      float part[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) {
          const float v = static_cast<float>(xr[i + l]);
          part[l] += v * v;
        }
      for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) part[l] += part[l + width];
      float sum = part[0];
      for (; i < n; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      scalar_t* o = out + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const scalar_t normed = round_to<scalar_t>(static_cast<float>(xr[j]) * inv);
        o[j] = round_to<scalar_t>(static_cast<float>(w[j]) * static_cast<float>(normed));
      }
    }
  });
}

#if defined(__AVX512F__)
using namespace conveyor_vec;

template <>
void rms_norm_rows<c10::BFloat16>(const c10::BFloat16* x, const c10::BFloat16* delta, const c10::BFloat16* w,
                                  c10::BFloat16* out, c10::BFloat16* sum_out, int64_t rows, int64_t n, float eps) {
  conveyor_parallel::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* xr = x + r * n;
      if (delta != nullptr) {
        for (int64_t j = 0; j < n; j += 16) {
          const __mmask16 mask = lanes_mask(n - j);
          store_bf16(sum_out + r * n + j, _mm512_add_ps(load_bf16(xr + j, mask), load_bf16(delta + r * n + j, mask)), mask);
        }
        xr = sum_out + r * n;
      }
      __m512 squares = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 v = load_bf16(xr + j, lanes_mask(n - j));
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps);
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mask = lanes_mask(n - j);
        const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(xr + j, mask), vinv));
        store_bf16(out + r * n + j, _mm512_mul_ps(load_bf16(w + j, mask), normed), mask);
      }
    }
  });
}
#elif defined(CONVEYOR_AVX2)
using namespace conveyor_vec;

// 8 lanes at a time; a row's last n % 8 elements are loaded zero-padded and stored lane by lane.
// The squares are the AVX-512 path's 16 lane sums (lanes 0-7 and 8-15 of every 16 elements in
// two accumulators, zeros past the end) and GCC's _mm512_reduce_add_ps tree across them, so the
// statistics, and with them the output bits, match a GCC AVX-512 build's. Pointers and sizes are
// copied into locals: the vector stores may alias anything and would make the compiler reload
// the lambda's captures every iteration.
template <>
void rms_norm_rows<c10::BFloat16>(const c10::BFloat16* x, const c10::BFloat16* delta, const c10::BFloat16* w,
                                  c10::BFloat16* out, c10::BFloat16* sum_out, int64_t rows, int64_t n, float eps) {
  conveyor_parallel::parallel_for(0, rows, kRowGrain, [=](int64_t begin, int64_t end) {
    const int64_t len = n;
    const c10::BFloat16* const xs = x;
    const c10::BFloat16* const ds = delta;
    const c10::BFloat16* const ws = w;
    c10::BFloat16* const os = out;
    c10::BFloat16* const ss = sum_out;
    const float feps = eps;
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* xr = xs + r * len;
      if (ds != nullptr) {
        const c10::BFloat16* dr = ds + r * len;
        c10::BFloat16* sr = ss + r * len;
        int64_t j = 0;
        for (; j + 8 <= len; j += 8) store_bf16(sr + j, _mm256_add_ps(load_bf16(xr + j), load_bf16(dr + j)));
        if (j < len)
          store_bf16_tail(sr + j, _mm256_add_ps(load_bf16_tail(xr + j, len - j), load_bf16_tail(dr + j, len - j)),
                          len - j);
        xr = sr;
      }
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 16 <= len; j += 16) {
        const __m256 a = load_bf16(xr + j), b = load_bf16(xr + j + 8);
        lo = _mm256_fmadd_ps(a, a, lo);
        hi = _mm256_fmadd_ps(b, b, hi);
      }
      if (j < len) {  // the last, partial 16: the lanes past the end would add 0 * 0
        const __m256 a = load_bf16(xr + j, len - j);
        lo = _mm256_fmadd_ps(a, a, lo);
        if (j + 8 < len) {
          const __m256 b = load_bf16_tail(xr + j + 8, len - j - 8);
          hi = _mm256_fmadd_ps(b, b, hi);
        }
      }
      const float inv = 1.f / std::sqrt(reduce_add(_mm256_add_ps(hi, lo)) / static_cast<float>(len) + feps);
      const __m256 vinv = _mm256_set1_ps(inv);
      c10::BFloat16* o = os + r * len;
      j = 0;
      for (; j + 8 <= len; j += 8) {
        const __m256 normed = round_bf16(_mm256_mul_ps(load_bf16(xr + j), vinv));
        store_bf16(o + j, _mm256_mul_ps(load_bf16(ws + j), normed));
      }
      if (j < len) {
        const __m256 normed = round_bf16(_mm256_mul_ps(load_bf16_tail(xr + j, len - j), vinv));
        store_bf16_tail(o + j, _mm256_mul_ps(load_bf16_tail(ws + j, len - j), normed), len - j);
      }
    }
  });
}
#endif

// silu(gate) * up over a fused (T, 2I) gate|up row: silu rounds to the dtype, then the product does.
template <typename scalar_t>
void silu_mul_rows(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t inter) {
  conveyor_parallel::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gate_up + r * 2 * inter;
      const scalar_t* u = g + inter;
      for (int64_t j = 0; j < inter; ++j) {
        const float gf = static_cast<float>(g[j]);
        const scalar_t silu = round_to<scalar_t>(gf / (1.f + std::exp(-gf)));
        out[r * inter + j] = round_to<scalar_t>(static_cast<float>(silu) * static_cast<float>(u[j]));
      }
    }
  });
}

// out[r] = times(gate[r], up[r]) over the bf16 rows of a fused (T, 2I) gate|up, on the vector levels: every lane
// runs the same ops and the tail is masked (AVX-512) or padded (AVX2), so a row's bits stay its own.
#if defined(__AVX512F__)
template <typename Times>
void gated_rows_bf16(const c10::BFloat16* gate_up, c10::BFloat16* out, int64_t rows, int64_t inter, Times times) {
  conveyor_parallel::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* g = gate_up + r * 2 * inter;
      const c10::BFloat16* u = g + inter;
      for (int64_t j = 0; j < inter; j += 16) {
        const __mmask16 mask = lanes_mask(inter - j);
        store_bf16(out + r * inter + j, times(load_bf16(g + j, mask), load_bf16(u + j, mask)), mask);
      }
    }
  });
}

inline __m512 silu_times(__m512 gf, __m512 up) {
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gf));
  const __m512 silu = round_bf16(_mm512_div_ps(gf, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  return _mm512_mul_ps(silu, up);
}
#elif defined(CONVEYOR_AVX2)
template <typename Times>
void gated_rows_bf16(const c10::BFloat16* gate_up, c10::BFloat16* out, int64_t rows, int64_t inter, Times times) {
  conveyor_parallel::parallel_for(0, rows, kRowGrain, [=](int64_t begin, int64_t end) {
    const int64_t len = inter;  // locals: the vector stores may alias the captures
    const c10::BFloat16* const src = gate_up;
    c10::BFloat16* const dst = out;
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* g = src + r * 2 * len;
      const c10::BFloat16* u = g + len;
      c10::BFloat16* o = dst + r * len;
      int64_t j = 0;
      for (; j + 8 <= len; j += 8) store_bf16(o + j, times(load_bf16(g + j), load_bf16(u + j)));
      if (j < len)
        store_bf16_tail(o + j, times(load_bf16_tail(g + j, len - j), load_bf16_tail(u + j, len - j)), len - j);
    }
  });
}

inline __m256 silu_times(__m256 gf, __m256 up) {  // the AVX-512 path's ops, 8 lanes
  const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gf));
  const __m256 silu = round_bf16(_mm256_div_ps(gf, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
  return _mm256_mul_ps(silu, up);
}
#endif

#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
template <>
void silu_mul_rows<c10::BFloat16>(const c10::BFloat16* gate_up, c10::BFloat16* out, int64_t rows, int64_t inter) {
  gated_rows_bf16(gate_up, out, rows, inter, [](auto gate, auto up) { return silu_times(gate, up); });
}
#endif

using conveyor_vec::row_max;

// HF rotary on one head: x*cos + rotate_half(x)*sin, rounding after each op as torch does.
template <typename scalar_t>
inline void rotate_head_scalar(const scalar_t* x, const scalar_t* cos, const scalar_t* ssin, scalar_t* out,
                               int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const scalar_t a = round_to<scalar_t>(static_cast<float>(x[d]) * static_cast<float>(cos[d]));
    const scalar_t b = round_to<scalar_t>(static_cast<float>(x[(d + half) % D]) * static_cast<float>(ssin[d]));
    out[d] = round_to<scalar_t>(static_cast<float>(a) + static_cast<float>(b));
  }
}

template <typename scalar_t>
inline void rotate_head(const scalar_t* x, const scalar_t* cos, const scalar_t* ssin, scalar_t* out, int64_t D) {
  rotate_head_scalar(x, cos, ssin, out, D);
}

#if defined(__AVX512F__)
// Same ops 16 lanes at a time; lanes would straddle the roll unless half the head is a multiple of 16.
template <>
inline void rotate_head<c10::BFloat16>(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* ssin,
                                       c10::BFloat16* out, int64_t D) {
  const int64_t half = D / 2;
  if (half % 16 != 0) {
    rotate_head_scalar(x, cos, ssin, out, D);
    return;
  }
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 a = round_bf16(_mm512_mul_ps(load_bf16(x + d), load_bf16(cos + d)));
    const __m512 b = round_bf16(_mm512_mul_ps(load_bf16(x + (d + half) % D), load_bf16(ssin + d)));
    store_bf16(out + d, _mm512_add_ps(a, b));
  }
}
#elif defined(CONVEYOR_AVX2)
// Same ops 8 lanes at a time; lanes would straddle the roll unless half the head is a multiple of 8.
template <>
inline void rotate_head<c10::BFloat16>(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* ssin,
                                       c10::BFloat16* out, int64_t D) {
  const int64_t half = D / 2;
  if (half % 8 != 0) {
    rotate_head_scalar(x, cos, ssin, out, D);
    return;
  }
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 a = round_bf16(_mm256_mul_ps(load_bf16(x + d), load_bf16(cos + d)));
    const __m256 b = round_bf16(_mm256_mul_ps(load_bf16(x + (d + half) % D), load_bf16(ssin + d)));
    store_bf16(out + d, _mm256_add_ps(a, b));
  }
}
#endif

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: dtype mismatch");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n, "rms_norm: weight size mismatch");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            nullptr, x.numel() / n, n, static_cast<float>(eps));
  });
  return out;
}

// (x + delta, rms_norm(x + delta)): the residual add fused into the next norm.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: dtype mismatch");
  TORCH_CHECK(x.sizes() == delta.sizes(), "add_rms_norm: shape mismatch");
  x = x.contiguous();
  delta = delta.contiguous();
  weight = weight.contiguous();
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n, "add_rms_norm: weight size mismatch");
  auto summed = torch::empty_like(x);
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), summed.data_ptr<scalar_t>(), x.numel() / n, n,
                            static_cast<float>(eps));
  });
  return {summed, out};
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: expects (T, 2I)");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

constexpr float kGeluBeta = 0.7978845608028654f, kGeluKappa = 0.044715f;  // sqrt(2 / pi), as torch rounds it

// gelu_tanh(gate) * up over a fused (T, 2I) gate|up (Gemma's GeGLU), torch's tanh formula in fp32, rounded
// where torch's two ops round (bf16 on the vector levels: below). Parallel over whole rows: torch's own gelu splits its
// range at element counts (vector body vs scalar tail), so a row's bits could depend on the batch.
template <typename scalar_t>
void gelu_tanh_mul_rows(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t inter) {
  constexpr float kBeta = kGeluBeta, kKappa = kGeluKappa;
  conveyor_parallel::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gate_up + r * 2 * inter;
      const scalar_t* u = g + inter;
      for (int64_t j = 0; j < inter; ++j) {
        const float x = static_cast<float>(g[j]);
        const float inner = kBeta * (x + kKappa * (x * x * x));
        const scalar_t gelu = round_to<scalar_t>(0.5f * x * (1.f + std::tanh(inner)));
        out[r * inter + j] = round_to<scalar_t>(static_cast<float>(gelu) * static_cast<float>(u[j]));
      }
    }
  });
}

// The bf16 rows on the vector levels: tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) with our exp_ps
// (~1 ulp; no overflow, no cancellation that survives the bf16 rounding after 1 + tanh), the same ops for
// every lane and the tail masked, so a row's bits stay its own. std::tanh per element cost ~20 ns: at 16
// rows of Gemma 3 270M's 2,048-wide GeGLU that was ~0.6 ms a layer, a third of the C=16 decode step.
#if defined(__AVX512F__)
inline __m512 gelu_tanh_ps(__m512 x) {  // in fp32, not rounded
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(kGeluBeta), _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(kGeluKappa), x3)));
  const __m512 e = exp_ps(_mm512_mul_ps(_mm512_set1_ps(-2.f), _mm512_abs_ps(inner)));
  const __m512 th = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));  // tanh |inner|, in [0, 1]
  const __m512 signed_th = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(th), _mm512_and_si512(_mm512_castps_si512(inner), _mm512_set1_epi32(INT32_MIN))));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, signed_th));
}

inline __m512 gelu_tanh_times(__m512 x, __m512 up) { return _mm512_mul_ps(round_bf16(gelu_tanh_ps(x)), up); }

#elif defined(CONVEYOR_AVX2)
inline __m256 gelu_tanh_ps(__m256 x) {  // the AVX-512 path's ops, 8 lanes
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(kGeluBeta), _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(kGeluKappa), x3)));
  const __m256 e = exp_ps(_mm256_mul_ps(_mm256_set1_ps(-2.f), _mm256_andnot_ps(sign, inner)));
  const __m256 th = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 signed_th = _mm256_or_ps(th, _mm256_and_ps(inner, sign));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, signed_th));
}

inline __m256 gelu_tanh_times(__m256 x, __m256 up) { return _mm256_mul_ps(round_bf16(gelu_tanh_ps(x)), up); }
#endif

#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
template <>
void gelu_tanh_mul_rows<c10::BFloat16>(const c10::BFloat16* gate_up, c10::BFloat16* out, int64_t rows, int64_t inter) {
  gated_rows_bf16(gate_up, out, rows, inter, [](auto gate, auto up) { return gelu_tanh_times(gate, up); });
}
#endif

torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gelu_tanh_mul: expects (T, 2I)");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "gelu_tanh_mul", [&] {
    gelu_tanh_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// The exact (erf) GELU, x * Phi(x) with Phi(x) = erfc(-x / sqrt 2) / 2, computed in fp32 and rounded once (BERT's
// act, ModernBERT's GeGLU). torch's own gelu computes erf one way in its vector body and another in its scalar tail,
// and splits its range at element counts, so a row's bits would depend on the batch. Here every element of one build
// runs one formula: the vector levels (fp32 and bf16) run the same lane ops on every element, the tail masked
// (AVX-512) or padded (AVX2); other levels and dtypes take one scalar std::erfc in double per element.
//
// The vector formula is Cephes' ndtrf in z = x / sqrt 2, its erff/erfcf polynomials evaluated with FMAs:
//   |z| < 1: Phi = 1/2 + erf(z) / 2, erf(z) = z T(z^2)
//   |z| >= 1: erfc(|z|) = exp(-x^2 / 2) q P(q^2), q = 1 / |z| (P below |z| = 2, R beyond); Phi = erfc / 2 for
//   x < 0, else 1 - erfc / 2. exp's argument is -x^2 / 2 with x^2 split exactly into hi + lo (an FMA):
//   exp(-hi / 2) (1 - lo / 2) keeps the negative tail's relative error at the polynomials' (Cephes' erfcf,
//   which rounds x^2, is 4e-6 there). Past |x| = 13 (Phi(-13) = 6e-39) Phi is 0 or 1.
constexpr float kSqrtHalf = 0.70710678118654752f, kGeluErfLimit = 13.f;
constexpr float kErfT[] = {7.853861353153693e-5f, -8.010193625184903e-4f, 5.188327685732524e-3f,
                           -2.685381193529856e-2f, 1.128358514861418e-1f, -3.761262582423300e-1f,
                           1.128379165726710e+0f};  // erf(z) = z T(z^2), |z| < 1
constexpr float kErfcP[] = {2.326819970068386e-2f, -1.387039388740657e-1f, 3.687424674597105e-1f,
                            -5.824733027278666e-1f, 6.210004621745983e-1f, -4.944515323274145e-1f,
                            3.404879937665872e-1f, -2.741127028184656e-1f, 5.638259427386472e-1f};  // 1 <= |z| < 2
constexpr float kErfcR[] = {-1.047766399936249e+1f, 1.297719955372516e+1f, -7.495518717768503e+0f,
                            2.921019019210786e+0f, -1.015265279202700e+0f, 4.218463358204948e-1f,
                            -2.820767439740514e-1f, 5.641895067754075e-1f};  // |z| >= 2

// The scalar levels (and fp16, fp64 everywhere): erfc in double, one rounding to the dtype.
template <typename scalar_t>
inline scalar_t gelu_erf_scalar(scalar_t x) {
  const double xd = static_cast<double>(x);
  return static_cast<scalar_t>(xd * (0.5 * std::erfc(xd * -0.70710678118654752440)));
}

#if defined(__AVX512F__)
using FloatVec = __m512;
constexpr int64_t kFloatLanes = 16;

template <size_t N>
inline __m512 horner(__m512 y, const float (&c)[N]) {
  __m512 p = _mm512_set1_ps(c[0]);
  for (size_t i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(c[i]));
  return p;
}

inline __m512 gelu_erf_ps(__m512 x) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f), limit = _mm512_set1_ps(kGeluErfLimit);
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), limit)), limit);
  const __m512 z = _mm512_mul_ps(xc, _mm512_set1_ps(kSqrtHalf));
  const __m512 a = _mm512_abs_ps(z);
  // 1/2 + (z / 2) T(z^2) in one rounding: Phi falls to 0.08 at z = -1, so every rounding before it counts six-fold
  const __m512 phi_in = _mm512_fmadd_ps(_mm512_mul_ps(half, z), horner(_mm512_mul_ps(z, z), kErfT), half);
  const __m512 hi = _mm512_mul_ps(xc, xc);
  const __m512 lo = _mm512_fmsub_ps(xc, xc, hi);  // x^2 - hi, exactly
  __m512 e = exp_ps(_mm512_mul_ps(_mm512_set1_ps(-0.5f), hi));
  e = _mm512_fnmadd_ps(_mm512_mul_ps(half, lo), e, e);  // exp(-x^2 / 2), to second order in lo
  const __m512 q = _mm512_div_ps(one, a);  // inf at z = 0: that lane takes phi_in
  const __m512 y = _mm512_mul_ps(q, q);
  const __m512 p = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(2.f), _CMP_LT_OQ), horner(y, kErfcR),
                                        horner(y, kErfcP));
  const __m512 tail = _mm512_mul_ps(half, _mm512_mul_ps(_mm512_mul_ps(e, q), p));  // Phi(-|x|)
  const __m512 phi_out = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ),
                                          _mm512_sub_ps(one, tail), tail);
  __m512 phi = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, one, _CMP_LT_OQ), phi_out, phi_in);
  phi = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_sub_ps(_mm512_setzero_ps(), limit), _CMP_NLT_UQ), phi);
  return _mm512_mul_ps(x, phi);
}

inline __m512 vec_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 load_lanes(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes_mask(n), p); }
inline __m512 load_lanes(const c10::BFloat16* p, int64_t n) { return load_bf16(p, lanes_mask(n)); }
inline void store_lanes(float* p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, lanes_mask(n), v); }
inline void store_lanes(c10::BFloat16* p, __m512 v, int64_t n) { store_bf16(p, v, lanes_mask(n)); }
inline __m512 round_lanes(const float*, __m512 v) { return v; }
inline __m512 round_lanes(const c10::BFloat16*, __m512 v) { return round_bf16(v); }
#elif defined(CONVEYOR_AVX2)
using FloatVec = __m256;
constexpr int64_t kFloatLanes = 8;

template <size_t N>
inline __m256 horner(__m256 y, const float (&c)[N]) {
  __m256 p = _mm256_set1_ps(c[0]);
  for (size_t i = 1; i < N; ++i) p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(c[i]));
  return p;
}

inline __m256 gelu_erf_ps(__m256 x) {  // the AVX-512 path's ops, 8 lanes
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f), limit = _mm256_set1_ps(kGeluErfLimit);
  const __m256 neg_limit = _mm256_set1_ps(-kGeluErfLimit);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, neg_limit), limit);
  const __m256 z = _mm256_mul_ps(xc, _mm256_set1_ps(kSqrtHalf));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.f), z);
  const __m256 phi_in = _mm256_fmadd_ps(_mm256_mul_ps(half, z), horner(_mm256_mul_ps(z, z), kErfT), half);
  const __m256 hi = _mm256_mul_ps(xc, xc);
  const __m256 lo = _mm256_fmsub_ps(xc, xc, hi);
  __m256 e = exp_ps(_mm256_mul_ps(_mm256_set1_ps(-0.5f), hi));
  e = _mm256_fnmadd_ps(_mm256_mul_ps(half, lo), e, e);
  const __m256 q = _mm256_div_ps(one, a);
  const __m256 y = _mm256_mul_ps(q, q);
  const __m256 p = _mm256_blendv_ps(horner(y, kErfcR), horner(y, kErfcP),
                                    _mm256_cmp_ps(a, _mm256_set1_ps(2.f), _CMP_LT_OQ));
  const __m256 tail = _mm256_mul_ps(half, _mm256_mul_ps(_mm256_mul_ps(e, q), p));
  const __m256 phi_out = _mm256_blendv_ps(_mm256_sub_ps(one, tail), tail,
                                      _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  __m256 phi = _mm256_blendv_ps(phi_out, phi_in, _mm256_cmp_ps(a, one, _CMP_LT_OQ));
  phi = _mm256_and_ps(phi, _mm256_cmp_ps(x, neg_limit, _CMP_NLT_UQ));
  return _mm256_mul_ps(x, phi);
}

inline __m256 vec_mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }

inline __m256 load_lanes(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float buf[8] = {0.f};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(float));
  return _mm256_load_ps(buf);
}
inline __m256 load_lanes(const c10::BFloat16* p, int64_t n) { return load_bf16(p, n); }

inline void store_lanes(float* p, __m256 v, int64_t n) {
  if (n >= 8) {
    _mm256_storeu_ps(p, v);
    return;
  }
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(float));
}
inline void store_lanes(c10::BFloat16* p, __m256 v, int64_t n) {
  if (n >= 8) store_bf16(p, v);
  else store_bf16_tail(p, v, n);
}
inline __m256 round_lanes(const float*, __m256 v) { return v; }
inline __m256 round_lanes(const c10::BFloat16*, __m256 v) { return round_bf16(v); }
#endif

#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
template <typename scalar_t>
constexpr bool kVectorGelu = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;

// n elements from their own pointers (locals: the vector stores may alias anything the caller captured).
template <typename scalar_t>
void gelu_erf_span(const scalar_t* x, scalar_t* out, int64_t n) {
  for (int64_t j = 0; j < n; j += kFloatLanes) store_lanes(out + j, gelu_erf_ps(load_lanes(x + j, n - j)), n - j);
}

template <typename scalar_t>
void gelu_tanh_span(const scalar_t* x, scalar_t* out, int64_t n) {
  for (int64_t j = 0; j < n; j += kFloatLanes) store_lanes(out + j, gelu_tanh_ps(load_lanes(x + j, n - j)), n - j);
}

// gelu(gate) rounds to the dtype, then the product does, as torch's two ops.
template <typename scalar_t>
void gelu_erf_mul_span(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t n) {
  for (int64_t j = 0; j < n; j += kFloatLanes) {
    const FloatVec gelu = round_lanes(gate, gelu_erf_ps(load_lanes(gate + j, n - j)));
    store_lanes(out + j, vec_mul(gelu, load_lanes(up + j, n - j)), n - j);
  }
}
#else
template <typename scalar_t>
constexpr bool kVectorGelu = false;

template <typename scalar_t>
void gelu_erf_span(const scalar_t*, scalar_t*, int64_t) {}

template <typename scalar_t>
void gelu_tanh_span(const scalar_t*, scalar_t*, int64_t) {}

template <typename scalar_t>
void gelu_erf_mul_span(const scalar_t*, const scalar_t*, scalar_t*, int64_t) {}
#endif

// Elementwise: any split of the range gives every element the same bits.
template <typename scalar_t>
void gelu_erf_elements(const scalar_t* x, scalar_t* out, int64_t n) {
  conveyor_parallel::parallel_for(0, n, 4096, [=](int64_t begin, int64_t end) {
    if constexpr (kVectorGelu<scalar_t>) {
      gelu_erf_span(x + begin, out + begin, end - begin);
    } else {
      for (int64_t i = begin; i < end; ++i) out[i] = gelu_erf_scalar(x[i]);
    }
  });
}

// The tanh GELU alone (SigLIP's MLP), the formula of gelu_tanh_mul's gate, in fp32 and rounded once.
template <typename scalar_t>
void gelu_tanh_elements(const scalar_t* x, scalar_t* out, int64_t n) {
  conveyor_parallel::parallel_for(0, n, 4096, [=](int64_t begin, int64_t end) {
    if constexpr (kVectorGelu<scalar_t>) {
      gelu_tanh_span(x + begin, out + begin, end - begin);
    } else {
      for (int64_t i = begin; i < end; ++i) {
        const float v = static_cast<float>(x[i]);
        out[i] = round_to<scalar_t>(0.5f * v * (1.f + std::tanh(kGeluBeta * (v + kGeluKappa * (v * v * v)))));
      }
    }
  });
}

// gelu_erf(gate) * up over a fused (T, 2I) gate|up (ModernBERT's GeGLU: Wi's input|gate halves).
template <typename scalar_t>
void gelu_erf_mul_rows(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t inter) {
  conveyor_parallel::parallel_for(0, rows, kRowGrain, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gate_up + r * 2 * inter;
      if constexpr (kVectorGelu<scalar_t>) {
        gelu_erf_mul_span(g, g + inter, out + r * inter, inter);
      } else {
        for (int64_t j = 0; j < inter; ++j)
          out[r * inter + j] = round_to<scalar_t>(static_cast<float>(gelu_erf_scalar(g[j])) *
                                                  static_cast<float>(g[inter + j]));
      }
    }
  });
}

torch::Tensor gelu_erf(torch::Tensor x) {
  x = x.contiguous();
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_erf", [&] {
    gelu_erf_elements<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.numel());
  });
  return out;
}

// In place (a vision tower's (4096, 4304) activations: a fresh 35 MB output costs ~9 ms of page faults here).
torch::Tensor gelu_tanh_(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "gelu_tanh_: x must be contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_tanh_", [&] {
    gelu_tanh_elements<scalar_t>(x.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.numel());
  });
  return x;
}

torch::Tensor gelu_erf_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gelu_erf_mul: expects (T, 2I)");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "gelu_erf_mul", [&] {
    gelu_erf_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// Apertus' xIELU, with its four per-layer scalars already as transformers computes them (alpha_p and alpha_n
// after their softplus): x > 0: alpha_p * x * x + beta * x; else (expm1(min(x, eps)) - x) * alpha_n + beta * x,
// rounding to the dtype after each op as torch's chain of ops does. Scalar per element (torch's expm1 splits
// its range into a vector body and a scalar tail, so a row's bits could depend on the batch).
template <typename scalar_t>
void xielu_elements(const scalar_t* x, scalar_t* out, int64_t n, float alpha_p, float alpha_n, float beta, float eps) {
  auto r = [](float v) { return static_cast<float>(round_to<scalar_t>(v)); };
  conveyor_parallel::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = static_cast<float>(x[i]);
      const float linear = r(beta * v);
      const float y = v > 0.f ? r(r(alpha_p * v) * v) + linear
                              : r(r(r(std::expm1(std::min(v, eps))) - v) * alpha_n) + linear;
      out[i] = round_to<scalar_t>(y);
    }
  });
}

torch::Tensor xielu(torch::Tensor x, double alpha_p, double alpha_n, double beta, double eps) {
  x = x.contiguous();
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "xielu", [&] {
    xielu_elements<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.numel(), static_cast<float>(alpha_p),
                             static_cast<float>(alpha_n), static_cast<float>(beta), static_cast<float>(eps));
  });
  return out;
}

// argmax per row of fp32 logits; the first maximum wins, as torch.argmax does.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32, "argmax_rows: (R, V) float32 only");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  conveyor_parallel::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * n;
      const float best = row_max(xr, n);  // max is order-free, so vector lanes are safe
      int64_t index = 0;
      while (index < n && !(xr[index] == best)) ++index;
      o[r] = index < n ? index : 0;  // all-NaN row: 0
    }
  });
  return out;
}

// One pass over a fused q|k|v projection: rotary on q and k, k and v scattered into their
// cache slots, rotated q returned as (T, H, D). Replaces ~10 small torch ops per layer.
// One token's K or V heads (KVH x D, scalar_t) into its cache slot: copied, or quantized to Q8_0 rows
// when the cache is uint8 (kv_q8.h), from the same dtype-rounded values the plain cache would hold.
template <typename scalar_t>
inline void store_kv_row(const scalar_t* heads, const torch::Tensor& cache, int64_t slot, int64_t KVH, int64_t D) {
  if (cache.scalar_type() == torch::kByte) {
    const int64_t row = conveyor_q8::row_bytes(D);
    uint8_t* dst = cache.data_ptr<uint8_t>() + slot * KVH * row;
    for (int64_t h = 0; h < KVH; ++h) conveyor_q8::quantize_row(heads + h * D, dst + h * row, D);
    return;
  }
  std::memcpy(cache.data_ptr<scalar_t>() + slot * KVH * D, heads, KVH * D * sizeof(scalar_t));
}

void check_kv_cache(const torch::Tensor& cache, const torch::Tensor& x, int64_t D, const char* op) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), op, ": caches must be contiguous 4-d tensors");
  if (cache.scalar_type() == torch::kByte) {
    TORCH_CHECK(D % conveyor_q8::kBlock == 0 && cache.size(3) == conveyor_q8::row_bytes(D), op,
                ": a Q8_0 cache row must be head_dim / 32 blocks of 34 bytes");
  } else {
    TORCH_CHECK(cache.scalar_type() == x.scalar_type() && cache.size(3) == D, op, ": cache dtype/shape mismatch");
  }
}

torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor signed_sin, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 2 && key_cache.dim() == 4, "rope_write_kv: bad ranks");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "rope_write_kv: slot_mapping must be int64");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  signed_sin = signed_sin.contiguous();
  const int64_t T = qkv.size(0), KVH = key_cache.size(2), D = cos.size(1);
  check_kv_cache(key_cache, qkv, D, "rope_write_kv");
  check_kv_cache(value_cache, qkv, D, "rope_write_kv");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * KVH) * D, "rope_write_kv: qkv width mismatch");
  auto q_out = torch::empty({T, num_heads, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write_kv", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* ss = signed_sin.data_ptr<scalar_t>();
    scalar_t* q = q_out.data_ptr<scalar_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t width = qkv.size(1);
    conveyor_parallel::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> k_rot(KVH * D);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = src + t * width;
        const scalar_t* ct = c + t * D;
        const scalar_t* st = ss + t * D;
        for (int64_t h = 0; h < num_heads; ++h) rotate_head(row + h * D, ct, st, q + (t * num_heads + h) * D, D);
        for (int64_t h = 0; h < KVH; ++h) rotate_head(row + (num_heads + h) * D, ct, st, k_rot.data() + h * D, D);
        store_kv_row(k_rot.data(), key_cache, slots[t], KVH, D);
        store_kv_row(row + (num_heads + KVH) * D, value_cache, slots[t], KVH, D);
      }
    });
  });
  return q_out;
}

// K/V rows (T, KVH, D) into their slots: index_copy_ for plain caches, quantized rows for Q8_0 ones.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "write_kv: K/V must be (T, KVH, D)");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "write_kv: slot_mapping must be int64");
  key = key.contiguous();
  value = value.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2);
  check_kv_cache(key_cache, key, D, "write_kv");
  check_kv_cache(value_cache, value, D, "write_kv");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv", [&] {
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    conveyor_parallel::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        store_kv_row(k + t * KVH * D, key_cache, slots[t], KVH, D);
        store_kv_row(v + t * KVH * D, value_cache, slots[t], KVH, D);
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("isa", &conveyor_isa::compiled_level, "the -march level this module was compiled for");
  conveyor_parallel::def_pool_sharing(m);
  m.def("rms_norm", &rms_norm, "RMSNorm with transformers' rounding (CPU)", release());
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta)) with torch's rounding (CPU)", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up over a fused (T, 2I) gate|up (CPU)", release());
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up over a fused (T, 2I) gate|up (CPU)", release());
  m.def("gelu_tanh_", &gelu_tanh_, "the tanh GELU in place, one formula for every element (CPU)", release());
  m.def("gelu_erf", &gelu_erf, "the exact (erf) GELU, one formula for every element (CPU)", release());
  m.def("gelu_erf_mul", &gelu_erf_mul, "gelu_erf(gate) * up over a fused (T, 2I) gate|up (CPU)", release());
  m.def("xielu", &xielu, "Apertus' xIELU activation with torch's rounding, per element (CPU)", release());
  m.def("argmax_rows", &argmax_rows, "first-max argmax per row (CPU)", release());
  m.def("rope_write_kv", &rope_write_kv, "rotary on q|k and K/V scatter into cache slots (CPU)", release());
  m.def("write_kv", &write_kv, "K/V scatter into cache slots, quantizing into Q8_0 caches (CPU)", release());
}
