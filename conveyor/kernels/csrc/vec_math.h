// Vector helpers shared by the kernels. bf16 rows: 16 lanes in fp32, rounded back exactly as
// c10::BFloat16 does (round to nearest even, NaN -> 0x7FC0), so vector code keeps the bits of
// torch's scalar ops. Row max/sum: reductions whose order depends only on the row's length.
#pragma once
#include <cstdint>
#include <limits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace conveyor_vec {
#if defined(__AVX512F__)

inline __mmask16 lanes_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

inline __m512 load_bf16(const void* p, __mmask16 mask = 0xFFFF) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m256i to_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

inline void store_bf16(void* p, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, mask, to_bf16_bits(v));
}

// What a bf16 op hands the next one: the fp32 result rounded to bf16, widened again.
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}

// exp(x) on [-87, 88] (clamped): Cody-Waite reduction plus a degree-6 polynomial, ~1 ulp.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

inline float row_max(const float* x, int64_t n) {  // max is order-free, so vector lanes are safe
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(x + j));
  float m = _mm512_reduce_max_ps(best);
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// 16 lane sums (lane l takes l, l + 16, ...), a fixed tree across lanes, then the tail in order.
inline float row_sum(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + j));
  float s = _mm512_reduce_add_ps(acc);
  for (; j < n; ++j) s += x[j];
  return s;
}
#else
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

inline float row_sum(const float* x, int64_t n) {
  float s = 0.f;
  for (int64_t j = 0; j < n; ++j) s += x[j];
  return s;
}
#endif
}  // namespace conveyor_vec
