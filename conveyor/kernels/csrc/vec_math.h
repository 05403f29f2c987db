// Vector helpers shared by the kernels. bf16 rows: 16 lanes (AVX-512) or 8 lanes (AVX2) in
// fp32, rounded back exactly as c10::BFloat16 does (round to nearest even, NaN -> 0x7FC0), so
// vector code keeps the bits of torch's scalar ops. Row max/sum: reductions whose order depends
// only on the row's length.
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// AVX2 + FMA without AVX-512 (x86-64-v3: Haswell and later Intel client CPUs, AMD Zen 1-3):
// the kernels take 8-lane __m256 paths under this macro.
#define CONVEYOR_AVX2 1
#endif

namespace conveyor_vec {

// Prefetch (T0) the `bytes` from p, a line at a time. x86: asm volatile, not _mm_prefetch: GCC 12 silently dropped
// the intrinsic's loops from attention's pass 1 once its body grew a branch (loops of prefetches alone: no side
// effects to keep), and decode rows then waited on every key row (AVX-512 without BF16: 1.7x slower per call).
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
#if defined(__x86_64__)
  for (int64_t i = 0; i < bytes; i += 64) asm volatile("prefetcht0 %0" : : "m"(c[i]));
#else
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
#endif
}

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

// r[i] holds 16 dwords of row i; afterwards r[c] holds column c of all 16 rows, in row order.
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c], 128-bit lane L: rows i..i+3 at column 4L + c
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i v0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(u0, v0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(u1, v1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
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
#elif defined(CONVEYOR_AVX2)
// AVX2 has no mask registers: a row's last n % 8 elements go through a small zero-padded
// buffer (load_bf16_tail / store_bf16_tail), so neither reads nor writes leave the row.

inline __m256 load_bf16(const void* p) {  // 8 bf16 -> 8 fp32
  const __m128i bits = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 load_bf16_tail(const void* p, int64_t n) {  // n < 8 bf16, the other lanes 0
  alignas(16) uint16_t buf[8] = {0};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(uint16_t));
  return load_bf16(buf);
}

inline __m256 load_bf16(const void* p, int64_t remaining) {
  return remaining >= 8 ? load_bf16(p) : load_bf16_tail(p, remaining);
}

// 16 bf16 (one 256-bit load) as two fp32 vectors: even elements 0, 2, .., 14 and odd 1, 3, .., 15.
// No cross-lane shuffle, so it is the cheapest way to widen bf16 where the caller can live with
// the interleaved order (dot products, per-element sums that are put back in order at the end).
inline void load_bf16_even_odd(const void* p, __m256& even, __m256& odd) {
  const __m256i bits = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// fp32 -> bf16 bits in the top half of each dword (low half zero): round to nearest even,
// NaN -> 0x7FC0, exactly c10::BFloat16's rounding.
inline __m256i round_bf16_bits_hi(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, bias), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
}

inline __m128i to_bf16_bits(__m256 v) {  // 8 bf16, in order
  const __m256i r = _mm256_srli_epi32(round_bf16_bits_hi(v), 16);  // every dword <= 0xFFFF: packus keeps it
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline void store_bf16(void* p, __m256 v) { _mm_storeu_si128(static_cast<__m128i*>(p), to_bf16_bits(v)); }

inline void store_bf16_tail(void* p, __m256 v, int64_t n) {  // the first n < 8 lanes only
  alignas(16) uint16_t buf[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), to_bf16_bits(v));
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(uint16_t));
}

// What a bf16 op hands the next one: the fp32 result rounded to bf16, widened again.
inline __m256 round_bf16(__m256 v) { return _mm256_castsi256_ps(round_bf16_bits_hi(v)); }

// exp(x) on [-87, 88] (clamped): the AVX-512 exp_ps's Cody-Waite reduction and degree-6
// polynomial. 2^k is built in the exponent field (k is in [-126, 127], a normal float), and
// p * 2^k rounds once, as scalef does.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Fixed trees across the 8 lanes: ((0+4)+(2+6)) + ((1+5)+(3+7)) for the sum.
inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float reduce_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight rows' sums at once: out lane i = sum of v[i]'s lanes, by the same tree for every i
// ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), so no sum depends on which slot its row sits in.
inline __m256 reduce_add8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float row_max(const float* x, int64_t n) {  // max is order-free, so vector lanes are safe
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(x + j));
  float m = reduce_max(best);
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// 8 lane sums (lane l takes l, l + 8, ...), a fixed tree across lanes, then the tail in order.
inline float row_sum(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + j));
  float s = reduce_add(acc);
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
