// Paged attention over a block-table KV cache, one query row at a time.
//
// Every query row (token t of sequence s at position p) attends keys [0, p] of s,
// read in place through s's block table. Each row is reduced in a fixed order that
// depends only on that row's own history, so results are bitwise independent of which
// other rows share the call (batch invariance) and of how the sequence's prompt was
// split into chunks (prefill partition invariance).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "dense_attention.h"
#include "isa.h"
#include "kv_q8.h"
#include "paged_amx.h"
#include "parallel.h"
#include "vec_math.h"

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

// Element offset of `key`'s row for one KV head, read through the block table (block sizes
// are powers of two: 1 << bs_shift).
inline int64_t cache_row(const int32_t* table, int64_t key, int bs_shift, int64_t kv_block, int64_t kv_tok,
                         int64_t head_offset) {
  return table[key >> bs_shift] * kv_block + (key & ((int64_t{1} << bs_shift) - 1)) * kv_tok + head_offset;
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

// The register-blocked passes share one signature:
// (q or scores, first key, num keys, cache, block table, block size, block stride, token stride, head offset, out)
template <typename scalar_t>
using PassFn = void (*)(const float*, int64_t, int64_t, const scalar_t*, const int32_t*, int64_t, int64_t, int64_t,
                        int64_t, float*);

enum class Pass { kScores, kWeightedSum };

#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
// Pass 1 for bf16 straight from the bf16 query heads (G x D), the scale applied by the pass:
// (q heads, scale, first key, num keys, K cache, V cache, block table, block size, block stride,
// token stride, head offset, scores).
using ScoresBf16Fn = void (*)(const c10::BFloat16*, float, int64_t, int64_t, const c10::BFloat16*,
                              const c10::BFloat16*, const int32_t*, int64_t, int64_t, int64_t, int64_t, float*);

// Cache rows are scattered over the pool by the block tables, so the hardware prefetcher
// cannot follow them: at 32 rows x 135 keys the K/V reads are ~100 MB per step (vec_math.h's prefetch_lines: see
// there why not _mm_prefetch).
// Rows from the bf16 cache (AVX-512 BF16 and without BF16, AVX2): pass 1 prefetches each key group's V rows for pass
// 3 only while a row's keys are few enough that they are still cached when pass 3 comes (past kValuesInPass1MaxKeys,
// 256 KB of V at head dim 64, they were evicted first and read twice); longer rows' pass 3 prefetches its V rows
// kValuesAhead keys ahead itself (short rows do not pay for those prefetches). One row at 16k keys through 16 layers
// (benchmarks/long_context_attention.py): 25.0-25.5 -> 16.0-20.9 ms per step at BF16, 32-33 -> 22-24.5 without.
constexpr int64_t kValuesInPass1MaxKeys = 2048;
constexpr int64_t kValuesAhead = 64;
inline bool pass1_fetches_values(int64_t num_keys) { return num_keys <= kValuesInPass1MaxKeys; }
using conveyor_vec::prefetch_lines;
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
// bf16 rows with D % 16 == 0: explicit AVX-512 (the generic loops above do not vectorize
// well around the bf16 conversion). _mm512_reduce_add_ps is a fixed tree, so still reproducible.
using conveyor_vec::load_bf16;
template <>
inline float dot<c10::BFloat16>(const float* q, const c10::BFloat16* k, int64_t n) {
  if (n % 16) {
    float s = 0.f;
    for (int64_t d = 0; d < n; ++d) s += q[d] * to_float(k[d]);
    return s;
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load_bf16(k + d), acc);
  return _mm512_reduce_add_ps(acc);
}
inline void load_row(const c10::BFloat16* v, float* out, int64_t n) {
  if (n % 16) {
    for (int64_t d = 0; d < n; ++d) out[d] = to_float(v[d]);
    return;
  }
  for (int64_t d = 0; d < n; d += 16) _mm512_storeu_ps(out + d, load_bf16(v + d));
}

// Pass 3 with D = 16 * DV and G query heads per KV head: the G x D accumulator stays in registers across all keys
// (the generic loop reloads and stores it every key). load_values(j, vf) puts key j's D values, as fp32, in vf:
// from the bf16 cache (weighted_sum_bf16) or from the prepass's fp32 rows (weighted_sum_pre), the same FMA chains.
// Forced inline (the loop and its loaders): the accumulator must stay in registers, as when it was written twice.
template <int G, int DV, class LoadValues>
__attribute__((always_inline)) inline void weighted_sum_regs(const float* scores, int64_t num_keys, float* acc_out,
                                                             LoadValues load_values) {
  __m512 acc[G][DV];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < DV; ++d) acc[g][d] = _mm512_setzero_ps();
  for (int64_t j = 0; j < num_keys; ++j) {
    __m512 vf[DV];
    load_values(j, vf);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * num_keys + j]);
      for (int d = 0; d < DV; ++d) acc[g][d] = _mm512_fmadd_ps(p, vf[d], acc[g][d]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc_out + g * DV * 16 + 16 * d, acc[g][d]);
}

template <int G, int DV>
void weighted_sum_bf16(const float* scores, int64_t first, int64_t num_keys, const c10::BFloat16* vc,
                       const int32_t* table, int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset,
                       float* acc_out) {
  const int bs_shift = __builtin_ctzll(BS);
  const auto load_values = [&](int64_t j, __m512* vf) __attribute__((always_inline)) {
    const c10::BFloat16* v = vc + cache_row(table, j + first, bs_shift, kv_block, kv_tok, kv_offset);
    if (!pass1_fetches_values(num_keys) && j + kValuesAhead < num_keys)  // pass 1 leaves a long row's values
      prefetch_lines(vc + cache_row(table, j + kValuesAhead + first, bs_shift, kv_block, kv_tok, kv_offset), 32 * DV);
    for (int d = 0; d < DV; ++d) vf[d] = load_bf16(v + 16 * d);
  };
  weighted_sum_regs<G, DV>(scores, num_keys, acc_out, load_values);
}

#if defined(__AVX512BF16__)
// ---- Pass 3 in bf16 dot products (AVX-512 BF16): the softmax weights rounded to bf16, as the AMX tiles take them ----
// vdpbf16ps adds two keys' products per lane, acc[d] += p_a v_a[d] + p_b v_b[d] for the key pairs (a, b) = (2k, 2k + 1):
// half the instructions of one FMA per key, and V read as bf16 (the prepass kept fp32 rows: twice the bytes). A pair's
// V vectors are its two rows interleaved by 16-bit unpacks, in the unpacks' lane order (lo: d = 8L + i at dword 4L + i
// of 128-bit lane L, hi: d = 8L + 4 + i), the same in every path (the cache here, prepare_rows' pairs, the prepass
// kernels); the accumulators go back to d order once at the end. In a row's edge pairs the key outside its
// [first, end) is zero in V (never read from the cache) and weighs 0, so every path runs the same operands: a row's
// bits stay independent of its batch and of its prompt's chunks, as with the fp32 sum this replaced (~1.2x attention
// at long prompts, results.md).

// Key pairs covering keys [first, first + n): from pair first / 2 to the pair of the last key.
inline int64_t num_pairs(int64_t first, int64_t n) { return (first + n + 1) / 2 - first / 2; }

// Lanes i of a 16-float load at element e0 with off <= e0 + i < off + n.
inline __mmask16 range_mask(int64_t e0, int64_t off, int64_t n) {
  const int64_t lo = std::max<int64_t>(0, off - e0), hi = std::min<int64_t>(16, off + n - e0);
  if (hi <= lo) return 0;
  return static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
}

// The weights of keys [first, first + n) of G heads (rows of n fp32 in `scores`) as bf16 pairs (vcvtne2ps2bf16: round
// to nearest even), pair k holding keys 2 (first / 2 + k) and the next, weights outside the range 0: G x num_pairs dwords.
inline void weight_pairs(const float* scores, int64_t G, int64_t first, int64_t n, uint32_t* out) {
  const int64_t np = num_pairs(first, n), off = first & 1, elements = 2 * np;
  for (int64_t g = 0; g < G; ++g) {
    const float* row = scores + g * n;  // element e is row[e - off]
    uint32_t* dst = out + g * np;
    for (int64_t e = 0; e < elements; e += 32) {
      const __mmask16 m_lo = range_mask(e, off, n), m_hi = range_mask(e + 16, off, n);
      // Masked lanes are not read, so the element before the row (off = 1) is never touched.
      const __m512 lo = _mm512_maskz_loadu_ps(m_lo, m_lo ? row + e - off : row);
      const __m512 hi = _mm512_maskz_loadu_ps(m_hi, m_hi ? row + e + 16 - off : row);
      const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      _mm512_mask_storeu_epi32(dst + e / 2, conveyor_vec::lanes_mask((elements - e) / 2), pairs);
    }
  }
}

// Elements 32c .. 32c + 31 of rows a and b (nullptr: zeros) as a pair's two V vectors, unpack order.
inline void pair_chunk(const c10::BFloat16* a, const c10::BFloat16* b, int c, __m512i& lo, __m512i& hi) {
  const __m512i va = a != nullptr ? _mm512_loadu_si512(a + 32 * c) : _mm512_setzero_si512();
  const __m512i vb = b != nullptr ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
  lo = _mm512_unpacklo_epi16(va, vb);
  hi = _mm512_unpackhi_epi16(va, vb);
}

// One 32-element chunk's accumulators (lo, hi: unpack order) stored in d order.
inline void store_pair_chunk(__m512 lo, __m512 hi, float* out) {
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i last16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, first16, hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo, last16, hi));
}

inline __m512 dp_pair(__m512 acc, __m512i v, __m512i w) { return _mm512_dpbf16_ps(acc, (__m512bh)v, (__m512bh)w); }

// The calling thread's weight pairs (weight_pairs) for one row.
inline uint32_t* pair_scratch(int64_t dwords) {
  thread_local std::vector<uint32_t> pairs;
  if (static_cast<int64_t>(pairs.size()) < dwords) pairs.resize(dwords);
  return pairs.data();
}

// Pass 3's loop over a row's key pairs: CH of the D / 32 chunks per sweep over the pairs, G x 2 x CH accumulators in
// registers. load_pair(k, c0, lo, hi) puts pair k's (of the row's) chunks c0 .. c0 + CH - 1 in lo[], hi[]: from the
// bf16 cache (weighted_sum_bf16_dp) or the prepass's pairs (weighted_sum_pre), the same dp chains. Forced inline, as
// weighted_sum_regs: the accumulators must stay in registers.
template <int G, int DV, class LoadPair>
__attribute__((always_inline)) inline void pair_sums(const float* scores, int64_t first, int64_t num_keys,
                                                     float* acc_out, LoadPair load_pair) {
  constexpr int NC = DV / 2, CH = G * DV <= 16 ? NC : (G <= 2 ? 2 : 1);
  const int64_t np = num_pairs(first, num_keys);
  uint32_t* pairs = pair_scratch(G * np);
  weight_pairs(scores, G, first, num_keys, pairs);
  for (int c0 = 0; c0 < NC; c0 += CH) {
    __m512 acc[G][CH][2];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) acc[g][c][0] = acc[g][c][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < np; ++k) {
      __m512i lo[CH], hi[CH];
      load_pair(k, c0, CH, lo, hi);
      for (int c = 0; c < CH; ++c)
        for (int g = 0; g < G; ++g) {
          const __m512i w = _mm512_set1_epi32(static_cast<int32_t>(pairs[g * np + k]));
          acc[g][c][0] = dp_pair(acc[g][c][0], lo[c], w);
          acc[g][c][1] = dp_pair(acc[g][c][1], hi[c], w);
        }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) store_pair_chunk(acc[g][c][0], acc[g][c][1], acc_out + g * DV * 16 + 32 * (c0 + c));
  }
}

// Pass 3 from the bf16 cache (decode, and rows whose sequence was not prepared).
template <int G, int DV>
void weighted_sum_bf16_dp(const float* scores, int64_t first, int64_t num_keys, const c10::BFloat16* vc,
                          const int32_t* table, int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset,
                          float* acc_out) {
  const int bs_shift = __builtin_ctzll(BS);
  const int64_t k0 = first / 2, end = first + num_keys;
  const auto load_pair = [&](int64_t k, int c0, int n, __m512i* lo, __m512i* hi) __attribute__((always_inline)) {
    const int64_t a = 2 * (k0 + k);
    const c10::BFloat16* va = a >= first ? vc + cache_row(table, a, bs_shift, kv_block, kv_tok, kv_offset) : nullptr;
    const c10::BFloat16* vb = a + 1 < end ? vc + cache_row(table, a + 1, bs_shift, kv_block, kv_tok, kv_offset)
                                          : nullptr;
    if (!pass1_fetches_values(num_keys) && c0 == 0 && a + 1 + kValuesAhead < end) {  // (the first sweep only)
      prefetch_lines(vc + cache_row(table, a + kValuesAhead, bs_shift, kv_block, kv_tok, kv_offset), 32 * DV);
      prefetch_lines(vc + cache_row(table, a + 1 + kValuesAhead, bs_shift, kv_block, kv_tok, kv_offset), 32 * DV);
    }
    for (int c = 0; c < n; ++c) pair_chunk(va, vb, c0 + c, lo[c], hi[c]);
  };
  pair_sums<G, DV>(scores, first, num_keys, acc_out, load_pair);
}
#endif

// Pass 1 for bf16: q (G x D, fp32, scaled) stays in registers; one key row is loaded once for all G heads.
template <int G, int DV>
void scores_bf16(const float* qf, int64_t first, int64_t num_keys, const c10::BFloat16* kc, const int32_t* table,
                 int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset, float* scores) {
  const int bs_shift = __builtin_ctzll(BS);
  __m512 q[G][DV];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < DV; ++d) q[g][d] = _mm512_loadu_ps(qf + g * DV * 16 + 16 * d);
  for (int64_t j = 0; j < num_keys; ++j) {
    const int64_t key = j + first;
    const c10::BFloat16* k = kc + cache_row(table, key, bs_shift, kv_block, kv_tok, kv_offset);
    __m512 kf[DV];
    for (int d = 0; d < DV; ++d) kf[d] = load_bf16(k + 16 * d);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(q[g][0], kf[0]);
      for (int d = 1; d < DV; ++d) acc = _mm512_fmadd_ps(q[g][d], kf[d], acc);
      scores[g * num_keys + j] = _mm512_reduce_add_ps(acc);
    }
  }
}

// Pass 3 for D = 256 (Gemma 3, Qwen3.5's attention layers), where G x 16 accumulators do not fit
// the 32 registers: keys in tiles of 32 whose value rows stay in L1 while CH 16-element chunks
// at a time are swept over them, the accumulators parked in acc_out between sweeps. Each element
// is still one FMA chain in key order, so the bits are those of one sweep over all keys.
template <int G, int DV, int CH>
void weighted_sum_bf16_tiled(const float* scores, int64_t first, int64_t num_keys, const c10::BFloat16* vc,
                             const int32_t* table, int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset,
                             float* acc_out) {
  static_assert(DV % CH == 0, "chunks must tile the head");
  constexpr int64_t kTile = 32, D = 16 * DV;
  const int bs_shift = __builtin_ctzll(BS);
  std::fill(acc_out, acc_out + G * D, 0.f);
  const c10::BFloat16* rows[kTile];
  for (int64_t j0 = 0; j0 < num_keys; j0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, num_keys - j0);
    for (int64_t j = 0; j < n; ++j) rows[j] = vc + cache_row(table, j0 + j + first, bs_shift, kv_block, kv_tok, kv_offset);
    for (int64_t key = j0 + kTile; key < std::min<int64_t>(j0 + 2 * kTile, num_keys); ++key)  // the next tile
      prefetch_lines(vc + cache_row(table, key + first, bs_shift, kv_block, kv_tok, kv_offset), 2 * D);
    for (int c0 = 0; c0 < DV; c0 += CH) {
      __m512 acc[G][CH];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CH; ++c) acc[g][c] = _mm512_loadu_ps(acc_out + g * D + 16 * (c0 + c));
      for (int64_t j = 0; j < n; ++j) {
        __m512 vf[CH];
        for (int c = 0; c < CH; ++c) vf[c] = load_bf16(rows[j] + 16 * (c0 + c));
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * num_keys + j0 + j]);
          for (int c = 0; c < CH; ++c) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc_out + g * D + 16 * (c0 + c), acc[g][c]);
    }
  }
}

#if defined(__AVX512BF16__)
// weighted_sum_bf16_dp for D = 256 (Gemma 3, Qwen3.5's attention layers), whose G x 16 accumulators do not fit the
// registers: pairs in tiles of 16 whose value rows stay in L1 while CH 32-element chunks at a time are swept over
// them, the accumulators parked between sweeps (as weighted_sum_bf16_tiled does for fp32). Each element is still
// one chain over the pairs in order: the bits of one sweep over all pairs.
template <int G, int DV, int CH>
void weighted_sum_bf16_dp_tiled(const float* scores, int64_t first, int64_t num_keys, const c10::BFloat16* vc,
                                const int32_t* table, int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset,
                                float* acc_out) {
  constexpr int NC = DV / 2;
  static_assert(NC % CH == 0, "chunks must tile the head");
  constexpr int64_t kTilePairs = 16;
  const int bs_shift = __builtin_ctzll(BS);
  const int64_t np = num_pairs(first, num_keys), k0 = first / 2, end = first + num_keys;
  uint32_t* pairs = pair_scratch(G * np);
  weight_pairs(scores, G, first, num_keys, pairs);
  alignas(64) float parked[NC][G][2][16] = {};  // unpack order, as the registers hold them
  const c10::BFloat16* rows_a[kTilePairs];
  const c10::BFloat16* rows_b[kTilePairs];
  for (int64_t t0 = 0; t0 < np; t0 += kTilePairs) {
    const int64_t n = std::min<int64_t>(kTilePairs, np - t0);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t a = 2 * (k0 + t0 + k);
      rows_a[k] = a >= first ? vc + cache_row(table, a, bs_shift, kv_block, kv_tok, kv_offset) : nullptr;
      rows_b[k] = a + 1 < end ? vc + cache_row(table, a + 1, bs_shift, kv_block, kv_tok, kv_offset) : nullptr;
      if (!pass1_fetches_values(num_keys) && a + 1 + kValuesAhead < end) {  // pass 1 leaves a long row's values
        prefetch_lines(vc + cache_row(table, a + kValuesAhead, bs_shift, kv_block, kv_tok, kv_offset), 32 * DV);
        prefetch_lines(vc + cache_row(table, a + 1 + kValuesAhead, bs_shift, kv_block, kv_tok, kv_offset), 32 * DV);
      }
    }
    for (int c0 = 0; c0 < NC; c0 += CH) {
      __m512 acc[G][CH][2];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CH; ++c)
          for (int h = 0; h < 2; ++h) acc[g][c][h] = _mm512_load_ps(parked[c0 + c][g][h]);
      for (int64_t k = 0; k < n; ++k)
        for (int c = 0; c < CH; ++c) {
          __m512i lo, hi;
          pair_chunk(rows_a[k], rows_b[k], c0 + c, lo, hi);
          for (int g = 0; g < G; ++g) {
            const __m512i w = _mm512_set1_epi32(static_cast<int32_t>(pairs[g * np + t0 + k]));
            acc[g][c][0] = dp_pair(acc[g][c][0], lo, w);
            acc[g][c][1] = dp_pair(acc[g][c][1], hi, w);
          }
        }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CH; ++c)
          for (int h = 0; h < 2; ++h) _mm512_store_ps(parked[c0 + c][g][h], acc[g][c][h]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int g = 0; g < G; ++g)
      store_pair_chunk(_mm512_load_ps(parked[c][g][0]), _mm512_load_ps(parked[c][g][1]), acc_out + g * DV * 16 + 32 * c);
}
#endif

template <int G>
PassFn<c10::BFloat16> sum256_fn() {
#if defined(__AVX512BF16__)
  return weighted_sum_bf16_dp_tiled<G, 16, (G <= 2 ? 4 : 2)>;  // G x CH x 2 accumulators: 16 (G = 2, 4), 12, 8
#else
  return weighted_sum_bf16_tiled<G, 16, (G <= 2 ? 8 : 4)>;
#endif
}

template <Pass P, int G, int DV>
PassFn<c10::BFloat16> pass_fn() {
#if defined(__AVX512BF16__)
  // D = 128 with 3-4 query heads takes pass 3 in four sweeps of one chunk (G x 2 x CH accumulators): over a long row
  // each sweep read the values from memory again, so those go in L1-sized tiles of pairs (the same chains).
  if constexpr (DV == 8 && G >= 3)
    return P == Pass::kScores ? scores_bf16<G, DV> : weighted_sum_bf16_dp_tiled<G, DV, 2>;
  return P == Pass::kScores ? scores_bf16<G, DV> : weighted_sum_bf16_dp<G, DV>;
#else
  return P == Pass::kScores ? scores_bf16<G, DV> : weighted_sum_bf16<G, DV>;
#endif
}

template <Pass P, int DV>
PassFn<c10::BFloat16> pick_pass(int64_t G) {
  switch (G) {
    case 1: return pass_fn<P, 1, DV>();
    case 2: return pass_fn<P, 2, DV>();
    case 3: return pass_fn<P, 3, DV>();
    case 4: return pass_fn<P, 4, DV>();
    default: return nullptr;
  }
}

// The fast path for bf16 with D = 64 or 128 and up to 4 query heads per KV head; nullptr otherwise.
template <Pass P>
PassFn<c10::BFloat16> fast_pass(const c10::BFloat16*, int64_t G, int64_t D) {
  if (D == 64) return pick_pass<P, 4>(G);
  if (D == 128) return pick_pass<P, 8>(G);
  if (D == 256 && P == Pass::kWeightedSum && G >= 1 && G <= 4)  // pass 1 at D = 256: wide_scores_fn
    return G == 1 ? sum256_fn<1>() : G == 2 ? sum256_fn<2>() : G == 3 ? sum256_fn<3>() : sum256_fn<4>();
  return nullptr;
}
#elif defined(CONVEYOR_AVX2)
// AVX2 + FMA (x86-64-v3): 8 fp32 lanes, 16 ymm registers, no masks and no bf16 dot products.
// One 256-bit load holds 16 bf16; a shift widens its even elements and a mask its odd ones (no
// cross-lane shuffle), and the fp32 side (q, or the accumulators) is laid out to match.

// Pass 1 for bf16 with D = 16 * DH and G query heads per KV head, 8 keys at a time. Each score
// is one FMA chain over its 8 lanes (lane l takes elements 16h + 2l, then 16h + 2l + 1, for
// h = 0, 1, ..), then the lanes' fixed tree (reduce_add8: the same tree for every key of the
// group, with one horizontal pass for 8 keys instead of 8). Slots past the last key repeat the
// group's first row and are never stored, so a row's scores depend only on its own keys.
// q * scale is rounded once, as the generic path does.
template <int G, int DH>
void scores_avx2(const c10::BFloat16* q_heads, float scale, int64_t first, int64_t num_keys,
                 const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table, int64_t BS,
                 int64_t kv_block, int64_t kv_tok, int64_t kv_offset, float* scores) {
  constexpr int D = 16 * DH;
  const int bs_shift = __builtin_ctzll(BS);
  alignas(32) float qf[G][DH][2][8];  // [g][h][0]: elements 16h + 2l; [g][h][1]: 16h + 2l + 1
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < DH; ++h)
      for (int l = 0; l < 8; ++l) {
        qf[g][h][0][l] = to_float(q_heads[g * D + 16 * h + 2 * l]) * scale;
        qf[g][h][1][l] = to_float(q_heads[g * D + 16 * h + 2 * l + 1]) * scale;
      }
  const int64_t last = first + num_keys;
  for (int64_t j0 = 0; j0 < num_keys; j0 += 8) {
    const int64_t n = std::min<int64_t>(8, num_keys - j0);
    const c10::BFloat16* k[8];
    for (int i = 0; i < 8; ++i)  // past the last key: the group's first row again, never stored
      k[i] = kc + cache_row(table, first + j0 + (i < n ? i : 0), bs_shift, kv_block, kv_tok, kv_offset);
    // This group's values for pass 3, and the keys 16 ahead for this pass.
    for (int64_t key = first + j0; key < first + j0 + n; ++key) {
      if (pass1_fetches_values(num_keys))
        prefetch_lines(vc + cache_row(table, key, bs_shift, kv_block, kv_tok, kv_offset), 2 * D);
      if (key + 16 < last) prefetch_lines(kc + cache_row(table, key + 16, bs_shift, kv_block, kv_tok, kv_offset), 2 * D);
    }
    __m256 part[G][8];
    for (int i = 0; i < 8; i += 2) {  // two keys per sweep: each q vector loaded once for both
      __m256 a[G], b[G];
      for (int g = 0; g < G; ++g) a[g] = b[g] = _mm256_setzero_ps();
      if (i < n) {
        for (int h = 0; h < DH; ++h) {
          __m256 ea, oa, eb, ob;
          conveyor_vec::load_bf16_even_odd(k[i] + 16 * h, ea, oa);
          conveyor_vec::load_bf16_even_odd(k[i + 1] + 16 * h, eb, ob);
          for (int g = 0; g < G; ++g) {
            const __m256 qe = _mm256_load_ps(qf[g][h][0]);
            a[g] = _mm256_fmadd_ps(qe, ea, a[g]);
            b[g] = _mm256_fmadd_ps(qe, eb, b[g]);
            const __m256 qo = _mm256_load_ps(qf[g][h][1]);
            a[g] = _mm256_fmadd_ps(qo, oa, a[g]);
            b[g] = _mm256_fmadd_ps(qo, ob, b[g]);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        part[g][i] = a[g];
        part[g][i + 1] = b[g];
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 s = conveyor_vec::reduce_add8(part[g]);
      float* dst = scores + g * num_keys + j0;
      if (n == 8) {
        _mm256_storeu_ps(dst, s);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, s);
        std::memcpy(dst, tmp, n * sizeof(float));
      }
    }
  }
}

// Pass 3 for bf16 with D = 16 * DH: every output element is one FMA chain over the keys in key
// order (the fp32 AVX-512 pass's arithmetic, so the same bits as AVX-512 without BF16; with BF16 pass 3 takes bf16
// dot products, weighted_sum_bf16_dp). G x D accumulators do not fit 16
// registers, so the keys are swept once per CH 16-element chunks of the row (a 64-byte line
// per key for CH = 2), with G x CH x 2 accumulators held in registers.
template <int G, int DH, int CH>
void weighted_sum_avx2(const float* scores, int64_t first, int64_t num_keys, const c10::BFloat16* vc,
                       const int32_t* table, int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset,
                       float* acc_out) {
  static_assert(DH % CH == 0, "chunks must tile the head");
  constexpr int D = 16 * DH;
  // Keys go in tiles of kTile; every sweep runs over one tile while its value rows sit in L1 (a sweep
  // per key range instead of per whole history, which re-read each row from L2 or memory once per
  // sweep). Between tiles a sweep's accumulators wait in `parked`: each element is still one FMA
  // chain in key order, so the bits are those of one sweep over all keys.
  constexpr int64_t kTile = 32;
  const int bs_shift = __builtin_ctzll(BS);
  alignas(32) float parked[DH / CH][G][CH][2][8] = {};
  const c10::BFloat16* rows[kTile];
  for (int64_t j0 = 0; j0 < num_keys; j0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, num_keys - j0);
    for (int64_t j = 0; j < n; ++j) rows[j] = vc + cache_row(table, j0 + j + first, bs_shift, kv_block, kv_tok, kv_offset);
    for (int64_t key = j0 + kTile; key < std::min<int64_t>(j0 + 2 * kTile, num_keys); ++key)  // the next tile
      prefetch_lines(vc + cache_row(table, key + first, bs_shift, kv_block, kv_tok, kv_offset), 2 * D);
    for (int c0 = 0; c0 < DH; c0 += CH) {
      __m256 even[G][CH], odd[G][CH];  // lane l: element 16c + 2l, and 16c + 2l + 1
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CH; ++c) {
          even[g][c] = _mm256_load_ps(parked[c0 / CH][g][c][0]);
          odd[g][c] = _mm256_load_ps(parked[c0 / CH][g][c][1]);
        }
      for (int64_t j = 0; j < n; ++j) {
        const c10::BFloat16* v = rows[j] + 16 * c0;
        for (int c = 0; c < CH; ++c) {
          __m256 e, o;
          conveyor_vec::load_bf16_even_odd(v + 16 * c, e, o);
          for (int g = 0; g < G; ++g) {
            const __m256 p = _mm256_broadcast_ss(scores + g * num_keys + j0 + j);
            even[g][c] = _mm256_fmadd_ps(p, e, even[g][c]);
            odd[g][c] = _mm256_fmadd_ps(p, o, odd[g][c]);
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CH; ++c) {
          _mm256_store_ps(parked[c0 / CH][g][c][0], even[g][c]);
          _mm256_store_ps(parked[c0 / CH][g][c][1], odd[g][c]);
        }
    }
  }
  // Back in element order: pairs (0 1 2 3 | 8 9 10 11) and (4 5 6 7 | 12 13 14 15), then the halves.
  for (int c0 = 0; c0 < DH; c0 += CH)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) {
        const __m256 even = _mm256_load_ps(parked[c0 / CH][g][c][0]), odd = _mm256_load_ps(parked[c0 / CH][g][c][1]);
        const __m256 lo = _mm256_unpacklo_ps(even, odd);
        const __m256 hi = _mm256_unpackhi_ps(even, odd);
        float* dst = acc_out + g * D + 16 * (c0 + c);
        _mm256_storeu_ps(dst, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
      }
}

template <int DH>
PassFn<c10::BFloat16> pick_sum_avx2(int64_t G) {
  switch (G) {  // chunks per sweep: G x CH x 2 accumulators <= 12 of the 16 registers
    case 1: return weighted_sum_avx2<1, DH, 4>;
    case 2: return weighted_sum_avx2<2, DH, 2>;
    case 3: return weighted_sum_avx2<3, DH, 2>;
    case 4: return weighted_sum_avx2<4, DH, 1>;
    default: return nullptr;
  }
}

// Pass 3 for bf16 with D = 64, 128 or 256 and up to 4 query heads per KV head; nullptr otherwise.
// Pass 1 runs scores_avx2 (wide_scores_fn), which reads the bf16 query itself.
template <Pass P>
PassFn<c10::BFloat16> fast_pass(const c10::BFloat16*, int64_t G, int64_t D) {
  if (P != Pass::kWeightedSum) return nullptr;
  if (D == 64) return pick_sum_avx2<4>(G);
  if (D == 128) return pick_sum_avx2<8>(G);
  if (D == 256) return pick_sum_avx2<16>(G);  // Gemma 3, Qwen3.5's attention layers
  return nullptr;
}

template <int DH>
ScoresBf16Fn pick_scores_avx2(int64_t G) {
  switch (G) {
    case 1: return scores_avx2<1, DH>;
    case 2: return scores_avx2<2, DH>;
    case 3: return scores_avx2<3, DH>;
    case 4: return scores_avx2<4, DH>;
    default: return nullptr;
  }
}

inline ScoresBf16Fn wide_scores_fn(int64_t G, int64_t D) {
  if (D == 64) return pick_scores_avx2<4>(G);
  if (D == 128) return pick_scores_avx2<8>(G);
  if (D == 256) return pick_scores_avx2<16>(G);
  return nullptr;
}

inline void load_row(const c10::BFloat16* v, float* out, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] = to_float(v[d]);
}
#else
inline void load_row(const c10::BFloat16* v, float* out, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] = to_float(v[d]);
}
#endif

template <Pass P, typename scalar_t>
PassFn<scalar_t> fast_pass(const scalar_t*, int64_t, int64_t) {
  return nullptr;  // only bf16 on AVX-512 and AVX2 has the register-blocked paths
}

#if defined(__AVX512BF16__)
template <int DV>
PassFn<c10::BFloat16> pick_fp32_sum(int64_t G) {
  switch (G) {
    case 1: return weighted_sum_bf16<1, DV>;
    case 2: return weighted_sum_bf16<2, DV>;
    case 3: return weighted_sum_bf16<3, DV>;
    case 4: return weighted_sum_bf16<4, DV>;
    default: return nullptr;
  }
}
#endif

// The q8_0 row path's weighted sum over a bf16 V: fp32 FMA chains at every level, where fast_pass takes bf16 dot
// products with AVX-512 BF16 (that path's tests hold it to the exact formula, and it has no prepass to match).
template <typename scalar_t>
PassFn<scalar_t> fp32_weighted_sum(const scalar_t* v, int64_t G, int64_t D) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (D == 64) return pick_fp32_sum<4>(G);
    if (D == 128) return pick_fp32_sum<8>(G);
    if (D == 256 && G >= 1 && G <= 4)
      return G == 1 ? weighted_sum_bf16_tiled<1, 16, 8> : G == 2 ? weighted_sum_bf16_tiled<2, 16, 8>
           : G == 3 ? weighted_sum_bf16_tiled<3, 16, 4> : weighted_sum_bf16_tiled<4, 16, 4>;
  }
#endif
  return fast_pass<Pass::kWeightedSum>(v, G, D);
}

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

// x[j] = exp(x[j] - m) for x <= m (16 or 8 lanes at a time: exp_ps, the same range reduction and polynomial as
// exp_nonpositive(), which takes the scalar tail), returning their sum as conveyor_vec::row_sum adds them (lane sums,
// the fixed tree, then the tail in order), in one pass. Both orders depend only on n, so a row's result never
// depends on its batch-mates.
#if defined(__AVX512F__)
inline float exp_shifted_sum(float* x, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = conveyor_vec::exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), vm));
    _mm512_storeu_ps(x + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  float s = _mm512_reduce_add_ps(acc);
  for (; j < n; ++j) s += (x[j] = exp_nonpositive(x[j] - m));
  return s;
}
#elif defined(CONVEYOR_AVX2)
inline float exp_shifted_sum(float* x, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = conveyor_vec::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
    _mm256_storeu_ps(x + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float s = conveyor_vec::reduce_add(acc);
  for (; j < n; ++j) s += (x[j] = exp_nonpositive(x[j] - m));
  return s;
}
#else
inline float exp_shifted_sum(float* x, int64_t n, float m) {
  for (int64_t j = 0; j < n; ++j) x[j] = exp_nonpositive(x[j] - m);
  return conveyor_vec::row_sum(x, n);
}
#endif

// Pass 2 of every attention path: soft-capping (Gemma 2: score = c * tanh(score / c), each score on its
// own, row-invariant), then the softmax weights of each of the G heads' num_keys scores and their sums
// (max is order-free; the sum's order depends only on num_keys). `sinks` (GPT-OSS; nullptr otherwise):
// one learnt logit per head that joins the max and the denominator but has no value, added to the sum
// last, so rows without sinks keep their bits and rows with them stay row-invariant.
inline void softmax_scores(float* scores, int64_t G, int64_t num_keys, double softcap, float* denom,
                           const float* sinks) {
  if (softcap > 0.0) {
    const float cap = static_cast<float>(softcap);
    for (int64_t i = 0; i < G * num_keys; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * num_keys;
    float m = conveyor_vec::row_max(sg, num_keys);
    if (sinks != nullptr) m = sinks[g] > m ? sinks[g] : m;
    denom[g] = exp_shifted_sum(sg, num_keys, m);
    if (sinks != nullptr) denom[g] += exp_nonpositive(sinks[g] - m);
  }
}

#if defined(__AVX512F__)
// Pass 1 for bf16 with D = 32 * DH and G query heads per KV head, 16 keys at a time and no
// horizontal sums: the 16 key rows are transposed in registers so that one vector holds one
// (d, d+1) pair for all 16 keys, and vdpbf16ps adds q's matching pair into 16 key lanes at
// once. Every score is the same chain of pair products in d order (even and odd pairs in two
// accumulators, added at the end), wherever the key sits in its group of 16, so a row's
// scores depend only on its own keys. Replaced a per-key reduce_add that dominated decode.

using conveyor_vec::transpose16x16_epi32;

#if defined(__AVX512BF16__)
// One h-slice (16 transposed pair vectors: pairs 16h .. 16h + 15 of 16 keys) into R rows' G heads' chains: even pairs
// c into even[], odd ones into odd[], one vdpbf16ps each against q's pair. The same ops wherever the vectors come from
// (transposed here from the cache, or prepared once: transpose_key_group).
template <int G, int DH, int R>
__attribute__((always_inline)) inline void dpbf16_slice(const __m512i* rows, int h, const int32_t (&qpair)[R][G][16 * DH],
                                                        __m512 (&even)[R][G], __m512 (&odd)[R][G]) {
  for (int c = 0; c < 16; c += 2)
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) {
        even[r][g] = _mm512_dpbf16_ps(even[r][g], (__m512bh)rows[c], (__m512bh)_mm512_set1_epi32(qpair[r][g][16 * h + c]));
        odd[r][g] = _mm512_dpbf16_ps(odd[r][g], (__m512bh)rows[c + 1],
                                     (__m512bh)_mm512_set1_epi32(qpair[r][g][16 * h + c + 1]));
      }
}

// kt, shared (scores_dpbf16_shared; first = 0): the row's first `shared` keys (a multiple of 16) as prepared groups,
// transpose_key_group's vectors, read instead of loaded and transposed: the same vectors into the same chains. skip: a
// multiple of 16 keys from `first` whose scores the caller computed (scores_dpbf16_shared_rows).
template <int G, int DH>
__attribute__((always_inline)) inline void scores_dpbf16_from(
    const c10::BFloat16* q_heads, float scale, int64_t first, int64_t num_keys, const c10::BFloat16* kc,
    const c10::BFloat16* vc, const int32_t* table, int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset,
    const __m512i* kt, int64_t shared, int64_t skip, float* scores) {
  constexpr int D = 32 * DH;
  const int bs_shift = __builtin_ctzll(BS);
  int32_t qpair[1][G][16 * DH];
  std::memcpy(qpair, q_heads, sizeof(qpair));  // G heads x D bf16 = G x (D / 2) pairs
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = skip; j0 < num_keys; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, num_keys - j0);
    __m512 even[1][G], odd[1][G];
    for (int g = 0; g < G; ++g) even[0][g] = odd[0][g] = _mm512_setzero_ps();
    if (j0 < shared) {
      for (int h = 0; h < DH; ++h) dpbf16_slice<G, DH, 1>(kt + (j0 / 16) * 16 * DH + 16 * h, h, qpair, even, odd);
      for (int g = 0; g < G; ++g)
        _mm512_storeu_ps(scores + g * num_keys + j0, _mm512_mul_ps(_mm512_add_ps(even[0][g], odd[0][g]), vscale));
      continue;
    }
    // The next group's keys for this pass, and this group's values for pass 3.
    for (int64_t key = first + j0; key < first + j0 + n; ++key) {
      const int64_t row = cache_row(table, key, bs_shift, kv_block, kv_tok, kv_offset);
      if (pass1_fetches_values(num_keys)) prefetch_lines(vc + row, 2 * D);
      if (key + 16 < first + num_keys) {
        const int64_t ahead = key + 16;
        prefetch_lines(kc + cache_row(table, ahead, bs_shift, kv_block, kv_tok, kv_offset), 2 * D);
      }
    }
    for (int h = 0; h < DH; ++h) {
      __m512i rows[16];
      for (int i = 0; i < 16; ++i) {
        if (i >= n) {  // past the last key: zeros, never stored
          rows[i] = _mm512_setzero_si512();
          continue;
        }
        const int64_t key = first + j0 + i;
        const c10::BFloat16* k = kc + cache_row(table, key, bs_shift, kv_block, kv_tok, kv_offset);
        rows[i] = _mm512_loadu_si512(k + 32 * h);
      }
      transpose16x16_epi32(rows);
      dpbf16_slice<G, DH, 1>(rows, h, qpair, even, odd);
    }
    const __mmask16 mask = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g)
      _mm512_mask_storeu_ps(scores + g * num_keys + j0, mask,
                            _mm512_mul_ps(_mm512_add_ps(even[0][g], odd[0][g]), vscale));
  }
}

template <int G, int DH>
void scores_dpbf16(const c10::BFloat16* q_heads, float scale, int64_t first, int64_t num_keys,
                   const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table, int64_t BS,
                   int64_t kv_block, int64_t kv_tok, int64_t kv_offset, float* scores) {
  scores_dpbf16_from<G, DH>(q_heads, scale, first, num_keys, kc, vc, table, BS, kv_block, kv_tok, kv_offset,
                            nullptr, 0, 0, scores);
}

template <int DH>
ScoresBf16Fn pick_dpbf16(int64_t G) {
  switch (G) {
    case 1: return scores_dpbf16<1, DH>;
    case 2: return scores_dpbf16<2, DH>;
    case 3: return scores_dpbf16<3, DH>;
    case 4: return scores_dpbf16<4, DH>;
    default: return nullptr;
  }
}

inline ScoresBf16Fn wide_scores_fn(int64_t G, int64_t D) {
  if (D == 64) return pick_dpbf16<2>(G);
  if (D == 128) return pick_dpbf16<4>(G);
  if (D == 256) return pick_dpbf16<8>(G);  // Gemma 3, Qwen3.5's attention layers (was a dot product per key)
  return nullptr;
}

#else
// AVX-512 without BF16 (Skylake-SP to Ice Lake servers, and VMs that hide AVX512_BF16): the same
// transposed 16-key layout, each (d, d+1) pair widened to fp32 (a shift for d, a mask for d + 1)
// and multiplied by q's fp32 pair in two FMAs. Every score is one fixed chain of those products
// in d order (even and odd pairs in two accumulators, added at the end, then scaled), wherever
// the key sits in its group of 16. Replaced one horizontal reduce per key and head (scores_bf16)
// and adds the K/V prefetch that pass lacked: 1.3-1.8x per layer on decode at 2k keys (results.md).
// One h-slice (16 transposed pair vectors: elements 32h .. 32h + 31 of 16 keys) into R rows' G heads' chains: even
// pairs c into even[], odd ones into odd[], each as fma(q[d], element d) then fma(q[d + 1], element d + 1). The same
// ops wherever the vectors come from (transposed here from the cache, or prepared once: transpose_key_group).
template <int G, int DH, int R>
__attribute__((always_inline)) inline void fma16_slice(const __m512i* rows, int h, const float (&qf)[R][G][32 * DH],
                                                       __m512 (&even)[R][G], __m512 (&odd)[R][G]) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int c = 0; c < 16; ++c) {
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(rows[c], 16));  // element 32h + 2c
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(rows[c], high));  // element 32h + 2c + 1
    const int d = 32 * h + 2 * c;
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) {
        __m512& acc = (c & 1) ? odd[r][g] : even[r][g];
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qf[r][g][d]), lo, acc);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qf[r][g][d + 1]), hi, acc);
      }
  }
}

// kt, shared, skip: as scores_dpbf16_from (prepared groups for the first `shared` keys of a row whose first key is 0;
// `skip` keys whose scores the caller computed).
template <int G, int DH>
__attribute__((always_inline)) inline void scores_fma16_from(
    const c10::BFloat16* q_heads, float scale, int64_t first, int64_t num_keys, const c10::BFloat16* kc,
    const c10::BFloat16* vc, const int32_t* table, int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset,
    const __m512i* kt, int64_t shared, int64_t skip, float* scores) {
  constexpr int D = 32 * DH;
  const int bs_shift = __builtin_ctzll(BS);
  float qf[1][G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qf[0][g][d] = to_float(q_heads[g * D + d]);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = skip; j0 < num_keys; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, num_keys - j0);
    __m512 even[1][G], odd[1][G];
    for (int g = 0; g < G; ++g) even[0][g] = odd[0][g] = _mm512_setzero_ps();
    if (j0 < shared) {
      for (int h = 0; h < DH; ++h) fma16_slice<G, DH, 1>(kt + (j0 / 16) * 16 * DH + 16 * h, h, qf, even, odd);
    } else {
      for (int64_t key = first + j0; key < first + j0 + n; ++key) {  // as scores_dpbf16
        if (pass1_fetches_values(num_keys))
        prefetch_lines(vc + cache_row(table, key, bs_shift, kv_block, kv_tok, kv_offset), 2 * D);
        if (key + 16 < first + num_keys)
          prefetch_lines(kc + cache_row(table, key + 16, bs_shift, kv_block, kv_tok, kv_offset), 2 * D);
      }
      for (int h = 0; h < DH; ++h) {
        __m512i rows[16];
        for (int i = 0; i < 16; ++i) {
          if (i >= n) {
            rows[i] = _mm512_setzero_si512();
            continue;
          }
          const c10::BFloat16* k = kc + cache_row(table, first + j0 + i, bs_shift, kv_block, kv_tok, kv_offset);
          rows[i] = _mm512_loadu_si512(k + 32 * h);
        }
        transpose16x16_epi32(rows);
        fma16_slice<G, DH, 1>(rows, h, qf, even, odd);
      }
    }
    const __mmask16 mask = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g)
      _mm512_mask_storeu_ps(scores + g * num_keys + j0, mask,
                            _mm512_mul_ps(_mm512_add_ps(even[0][g], odd[0][g]), vscale));
  }
}

template <int G, int DH>
void scores_fma16(const c10::BFloat16* q_heads, float scale, int64_t first, int64_t num_keys,
                  const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table, int64_t BS,
                  int64_t kv_block, int64_t kv_tok, int64_t kv_offset, float* scores) {
  scores_fma16_from<G, DH>(q_heads, scale, first, num_keys, kc, vc, table, BS, kv_block, kv_tok, kv_offset, nullptr,
                           0, 0, scores);
}

template <int DH>
ScoresBf16Fn pick_fma16(int64_t G) {
  switch (G) {
    case 1: return scores_fma16<1, DH>;
    case 2: return scores_fma16<2, DH>;
    case 3: return scores_fma16<3, DH>;
    case 4: return scores_fma16<4, DH>;
    default: return nullptr;
  }
}

inline ScoresBf16Fn wide_scores_fn(int64_t G, int64_t D) {
  if (D == 64) return pick_fma16<2>(G);
  if (D == 128) return pick_fma16<4>(G);
  if (D == 256) return pick_fma16<8>(G);  // Gemma 3, Qwen3.5's attention layers
  return nullptr;
}
#endif

// ---- A prefill's rows: each sequence's keys transposed, and its values paired, once per call ----
// Every row of a prefill chunk re-loads and re-transposes each 16-key group in scores_dpbf16 and re-interleaves each
// value pair in weighted_sum_bf16_dp. Where a sequence has kPrepassRows rows or more in the call, its KV heads' key
// groups (16 keys from key 0, scores_dpbf16's registers after the transpose, zeros past the last key) and value
// pairs (pair_chunk's vectors) are made once, and its rows read them: the same values into the same op chains, so the same bits
// whichever way a row goes (each lane's score is its own chain, wherever the key sits in its group).
constexpr int64_t kPrepassRows = 16;
// The fewest keys a shared prefix is prepared for (Prepass::group_of).
constexpr int64_t kSharedMinKeys = 64;
// The most bytes one call prepares (keys and values together; the scratch, kept across calls, never holds more):
// unbounded, a 128k-token prompt's chunked prefill left ~384 MB (1B model) on the engine thread for the process's
// life, outside the KV budget. Sequences past it take the per-row passes (the same bits).
constexpr int64_t kPrepassCapBytes = int64_t{64} << 20;

// kPrepassCapBytes, or CONVEYOR_ROW_PREPASS_BYTES (read once per process; the tests' small caps).
inline int64_t prepass_cap_bytes() {
  static const int64_t cap = [] {
    const char* v = std::getenv("CONVEYOR_ROW_PREPASS_BYTES");
    return v != nullptr && *v != '\0' ? std::max<int64_t>(0, std::strtoll(v, nullptr, 10)) : kPrepassCapBytes;
  }();
  return cap;
}

using PreScoresFn = void (*)(const c10::BFloat16*, float, int64_t, int64_t, const __m512i*, float*);
using PreSumFn = void (*)(const float*, int64_t, int64_t, const uint32_t*, float*);
// (each row's q heads, scale, the rows' shared first key, each row's key count, transposed keys, each row's scores)
using PreScoresRowsFn = void (*)(const c10::BFloat16* const*, float, int64_t, const int64_t*, const __m512i*,
                                 float* const*);
// (each row's scores, each row's key count, the rows' shared first key, value pairs, each row's accumulator out)
using PreSumRowsFn = void (*)(const float* const*, const int64_t*, int64_t, const uint32_t*, float* const*);
// A row whose first keys are a prepared shared prefix (first key 0): (q heads, scale, key count, the caches and table
// as ScoresBf16Fn takes them, the prefix's transposed keys, its key count, scores out)
using SharedScoresFn = void (*)(const c10::BFloat16*, float, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                                const int32_t*, int64_t, int64_t, int64_t, int64_t, const __m512i*, int64_t, float*);
// The same for block_rows rows of one group (each row's q heads, key count, table, scores out), and their weighted
// sums (each row's scores and key count, the value cache, each row's table, the cache's strides and KV head offset,
// the prefix's key count, each row's acc out)
using SharedScoresRowsFn = void (*)(const c10::BFloat16* const*, float, const int64_t*, const c10::BFloat16*,
                                    const c10::BFloat16*, const int32_t* const*, int64_t, int64_t, int64_t, int64_t,
                                    const __m512i*, int64_t, float* const*);
using SharedSumRowsFn = void (*)(const float* const*, const int64_t*, const c10::BFloat16*, const int32_t* const*,
                                 int64_t, int64_t, int64_t, int64_t, int64_t, float* const*);

// Key group `grp` (keys 16 grp .. + 15, those past `keys` zero) of one KV head, transposed: DH x 16 vectors.
template <int DH>
void transpose_key_group(const c10::BFloat16* kc, const int32_t* table, int bs_shift, int64_t kv_block,
                         int64_t kv_tok, int64_t kv_offset, int64_t keys, int64_t grp, __m512i* out) {
  const int64_t n = std::min<int64_t>(16, keys - 16 * grp);
  for (int h = 0; h < DH; ++h) {
    __m512i rows[16];
    for (int i = 0; i < 16; ++i)
      rows[i] = i < n ? _mm512_loadu_si512(kc + cache_row(table, 16 * grp + i, bs_shift, kv_block, kv_tok, kv_offset) +
                                           32 * h)
                      : _mm512_setzero_si512();
    transpose16x16_epi32(rows);
    for (int c = 0; c < 16; ++c) out[16 * h + c] = rows[c];
  }
}

// Rows per block of the prepared passes: G x R = 12 (the broadcasts of the rows' weights stay at one per two FMAs).
constexpr int pre_block_rows(int G) { return 12 / G; }

// Pass 1 on prepared (transposed) key groups for R rows that start at key `first`, the groups up to key `end`: per
// group, slice(grp, even, odd) adds the group's products (dpbf16_slice or fma16_slice, each level's ops), then each
// row stores only its own keys' scores (row r's are num_keys[r] long; groups past its last key computed, not
// stored). Forced inline, as the slices: the 2 x G x R accumulators must stay in registers.
template <int G, int R, class Slice>
__attribute__((always_inline)) inline void pre_rows_groups(float scale, int64_t first, int64_t end,
                                                           const int64_t* num_keys, float* const* scores, Slice slice) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t grp = first / 16; 16 * grp < end; ++grp) {
    __m512 even[R][G], odd[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) even[r][g] = odd[r][g] = _mm512_setzero_ps();
    slice(grp, even, odd);
    const int64_t base = 16 * grp, lo = std::max(first, base);
    for (int r = 0; r < R; ++r) {
      const int64_t hi = std::min(first + num_keys[r], base + 16);
      if (hi <= lo) continue;  // past this row's last key
      const __mmask16 mask = static_cast<__mmask16>(((1u << (hi - base)) - 1) & ~((1u << (lo - base)) - 1));
      for (int g = 0; g < G; ++g) {
        const __m512 v = _mm512_mul_ps(_mm512_add_ps(even[r][g], odd[r][g]), vscale);
        float* dst = scores[r] + g * num_keys[r] + (lo - first);
        if (mask == 0xFFFF) {
          _mm512_storeu_ps(dst, v);
        } else {
          _mm512_mask_compressstoreu_ps(dst, mask, v);
        }
      }
    }
  }
}

#if defined(__AVX512BF16__)

// weighted_sum_bf16_dp on the prepared pairs `vp` (pair 0 = keys 0 and 1; per pair D / 32 chunks of lo, hi vectors).
// keep: the pair's elements a row takes (even: key a, odd: key b), all but at the row's edges.
inline __m512i pair_vector(const uint32_t* vp, int64_t pair, int c, int half, int NC, __mmask32 keep) {
  const __m512i v = _mm512_loadu_si512(vp + (pair * NC + c) * 32 + 16 * half);
  return keep == 0xFFFFFFFFu ? v : _mm512_maskz_mov_epi16(keep, v);
}

inline __mmask32 pair_keep(int64_t pair, int64_t first, int64_t end) {
  return (2 * pair >= first ? 0x55555555u : 0u) | (2 * pair + 1 < end ? 0xAAAAAAAAu : 0u);
}

template <int G, int DV>
void weighted_sum_pre(const float* scores, int64_t first, int64_t num_keys, const uint32_t* vp, float* acc_out) {
  constexpr int NC = DV / 2;
  const int64_t k0 = first / 2, end = first + num_keys;
  const auto load_pair = [&](int64_t k, int c0, int n, __m512i* lo, __m512i* hi) __attribute__((always_inline)) {
    const __mmask32 keep = pair_keep(k0 + k, first, end);
    for (int c = 0; c < n; ++c) {
      lo[c] = pair_vector(vp, k0 + k, c0 + c, 0, NC, keep);
      hi[c] = pair_vector(vp, k0 + k, c0 + c, 1, NC, keep);
    }
  };
  pair_sums<G, DV>(scores, first, num_keys, acc_out, load_pair);
}

// scores_dpbf16_pre for R rows of one sequence that start at the same key: each transposed key group loaded once for
// the R rows, and 2 x G x R accumulators (24 at G x R = 12) where one row's 2 x G chains left vdpbf16ps waiting on
// its latency (8 chains: ~2/3 of its throughput). Groups past a row's last key are computed and not stored. Every
// score is still its row's chain of pair products in d order: the bits of scores_dpbf16_pre.
template <int G, int DH, int R>
void scores_dpbf16_pre_rows(const c10::BFloat16* const* q_rows, float scale, int64_t first, const int64_t* num_keys,
                            const __m512i* kt, float* const* scores) {
  int32_t qpair[R][G][16 * DH];
  for (int r = 0; r < R; ++r) std::memcpy(qpair[r], q_rows[r], sizeof(qpair[r]));
  int64_t end = first;
  for (int r = 0; r < R; ++r) end = std::max(end, first + num_keys[r]);
  pre_rows_groups<G, R>(scale, first, end, num_keys, scores, [&](int64_t grp, __m512 (&even)[R][G],
                                                                 __m512 (&odd)[R][G]) __attribute__((always_inline)) {
    for (int h = 0; h < DH; ++h) dpbf16_slice<G, DH, R>(kt + grp * 16 * DH + 16 * h, h, qpair, even, odd);
  });
}

// scores_dpbf16 on the transposed groups `kt` (group 0 = keys 0..15): the groups that hold keys [first, first +
// num_keys), each lane's chain as there, only the row's own keys stored (one row of scores_dpbf16_pre_rows).
template <int G, int DH>
void scores_dpbf16_pre(const c10::BFloat16* q_heads, float scale, int64_t first, int64_t num_keys, const __m512i* kt,
                       float* scores) {
  const c10::BFloat16* q_rows[1] = {q_heads};
  float* score_rows[1] = {scores};
  scores_dpbf16_pre_rows<G, DH, 1>(q_rows, scale, first, &num_keys, kt, score_rows);
}

// weighted_sum_pre for R rows of one sequence that start at the same key: each pair's V vectors loaded once for the R
// rows (for the pairs all of them see whole, then each row's own further pairs alone), one 32-element chunk of D per
// sweep so the G x 2 x R accumulators stay in registers (24 at G x R = 12). One row at a time re-read V per row and head
// group, from L3 at long prompts. Every output element is still its row's one chain over the pairs in order, the same
// operands: the bits of weighted_sum_pre.
template <int G, int DV, int R>
void weighted_sum_pre_rows(const float* const* scores, const int64_t* num_keys, int64_t first, const uint32_t* vp,
                           float* const* acc_out) {
  constexpr int NC = DV / 2;
  const int64_t k0 = first / 2;
  uint32_t* pairs[R];
  int64_t np[R], end[R];
  int64_t total = 0;
  for (int r = 0; r < R; ++r) total += G * num_pairs(first, num_keys[r]);
  uint32_t* scratch = pair_scratch(total);
  int64_t common = std::numeric_limits<int64_t>::max();  // pairs [k0, common): whole in every row (but the first edge)
  for (int r = 0; r < R; ++r) {
    np[r] = num_pairs(first, num_keys[r]);
    end[r] = first + num_keys[r];
    pairs[r] = scratch;
    scratch += G * np[r];
    weight_pairs(scores[r], G, first, num_keys[r], pairs[r]);
    common = std::min(common, end[r] / 2);
  }
  common = std::max(common, k0);
  for (int c = 0; c < NC; ++c) {
    __m512 acc[R][G][2];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g][0] = acc[r][g][1] = _mm512_setzero_ps();
    const auto step = [&](int r, int64_t k, __m512i lo, __m512i hi) __attribute__((always_inline)) {
      for (int g = 0; g < G; ++g) {
        const __m512i w = _mm512_set1_epi32(static_cast<int32_t>(pairs[r][g * np[r] + k]));
        acc[r][g][0] = dp_pair(acc[r][g][0], lo, w);
        acc[r][g][1] = dp_pair(acc[r][g][1], hi, w);
      }
    };
    for (int64_t pair = k0; pair < common; ++pair) {
      const __mmask32 keep = pair_keep(pair, first, end[0]);  // the same for every row here
      const __m512i lo = pair_vector(vp, pair, c, 0, NC, keep), hi = pair_vector(vp, pair, c, 1, NC, keep);
      for (int r = 0; r < R; ++r) step(r, pair - k0, lo, hi);
    }
    for (int r = 0; r < R; ++r)
      for (int64_t pair = common; pair < k0 + np[r]; ++pair) {
        const __mmask32 keep = pair_keep(pair, first, end[r]);
        step(r, pair - k0, pair_vector(vp, pair, c, 0, NC, keep), pair_vector(vp, pair, c, 1, NC, keep));
      }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) store_pair_chunk(acc[r][g][0], acc[r][g][1], acc_out[r] + g * DV * 16 + 32 * c);
  }
}


// Pass 1 of a decode (or verify, or short chunk) row of a sequence in a shared-prefix group: its first `shared` keys
// from the group's prepared groups, the rest from the cache (scores_dpbf16_from): the bits of the row from the cache
// alone. (Its pass 3 reads the cache: interleaving a value pair costs two unpacks, not a transpose.)
template <int G, int DH>
void scores_dpbf16_shared(const c10::BFloat16* q_heads, float scale, int64_t num_keys, const c10::BFloat16* kc,
                          const c10::BFloat16* vc, const int32_t* table, int64_t BS, int64_t kv_block, int64_t kv_tok,
                          int64_t kv_offset, const __m512i* kt, int64_t shared, float* scores) {
  scores_dpbf16_from<G, DH>(q_heads, scale, 0, num_keys, kc, vc, table, BS, kv_block, kv_tok, kv_offset, kt, shared,
                            0, scores);
}

// scores_dpbf16_shared for R rows of one group (different sequences, each row's first key 0): the prefix's groups
// loaded once for the R rows (2 x G x R accumulators, as scores_dpbf16_pre_rows), then each row's own keys from the
// cache. Every score is its row's chain as in scores_dpbf16_shared: the same bits.
template <int G, int DH, int R>
void scores_dpbf16_shared_rows(const c10::BFloat16* const* q_rows, float scale, const int64_t* num_keys,
                               const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* const* tables,
                               int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset, const __m512i* kt,
                               int64_t shared, float* const* scores) {
  int32_t qpair[R][G][16 * DH];
  for (int r = 0; r < R; ++r) std::memcpy(qpair[r], q_rows[r], sizeof(qpair[r]));
  pre_rows_groups<G, R>(scale, 0, shared, num_keys, scores, [&](int64_t grp, __m512 (&even)[R][G],
                                                                __m512 (&odd)[R][G]) __attribute__((always_inline)) {
    for (int h = 0; h < DH; ++h) dpbf16_slice<G, DH, R>(kt + grp * 16 * DH + 16 * h, h, qpair, even, odd);
  });
  for (int r = 0; r < R; ++r)
    scores_dpbf16_from<G, DH>(q_rows[r], scale, 0, num_keys[r], kc, vc, tables[r], BS, kv_block, kv_tok, kv_offset,
                              nullptr, 0, shared, scores[r]);
}

// weighted_sum_bf16_dp for R rows of one group: each pair of the shared prefix's keys read from the cache once for
// the R rows (the same blocks in every row's table), then each row's own pairs, one 32-element chunk of D per sweep
// (G x 2 x R accumulators, as weighted_sum_pre_rows). Every output element is its row's one chain over its pairs in order, the
// same operands: the bits of weighted_sum_bf16_dp.
template <int G, int DV, int R>
void weighted_sum_bf16_dp_shared_rows(const float* const* scores, const int64_t* num_keys, const c10::BFloat16* vc,
                                      const int32_t* const* tables, int64_t BS, int64_t kv_block, int64_t kv_tok,
                                      int64_t kv_offset, int64_t shared, float* const* acc_out) {
  constexpr int NC = DV / 2;
  const int bs_shift = __builtin_ctzll(BS);
  uint32_t* pairs[R];
  int64_t np[R];
  int64_t total = 0;
  for (int r = 0; r < R; ++r) total += G * num_pairs(0, num_keys[r]);
  uint32_t* scratch = pair_scratch(total);
  for (int r = 0; r < R; ++r) {
    np[r] = num_pairs(0, num_keys[r]);
    pairs[r] = scratch;
    scratch += G * np[r];
    weight_pairs(scores[r], G, 0, num_keys[r], pairs[r]);
  }
  const int64_t common = shared / 2;
  for (int c = 0; c < NC; ++c) {
    __m512 acc[R][G][2];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g][0] = acc[r][g][1] = _mm512_setzero_ps();
    const auto step = [&](int r, int64_t k, __m512i lo, __m512i hi) __attribute__((always_inline)) {
      for (int g = 0; g < G; ++g) {
        const __m512i w = _mm512_set1_epi32(static_cast<int32_t>(pairs[r][g * np[r] + k]));
        acc[r][g][0] = dp_pair(acc[r][g][0], lo, w);
        acc[r][g][1] = dp_pair(acc[r][g][1], hi, w);
      }
    };
    for (int64_t pair = 0; pair < common; ++pair) {
      __m512i lo, hi;
      pair_chunk(vc + cache_row(tables[0], 2 * pair, bs_shift, kv_block, kv_tok, kv_offset),
                 vc + cache_row(tables[0], 2 * pair + 1, bs_shift, kv_block, kv_tok, kv_offset), c, lo, hi);
      for (int r = 0; r < R; ++r) step(r, pair, lo, hi);
    }
    for (int r = 0; r < R; ++r)
      for (int64_t pair = common; pair < np[r]; ++pair) {
        const int64_t a = 2 * pair;
        const c10::BFloat16* va = vc + cache_row(tables[r], a, bs_shift, kv_block, kv_tok, kv_offset);
        const c10::BFloat16* vb =
            a + 1 < num_keys[r] ? vc + cache_row(tables[r], a + 1, bs_shift, kv_block, kv_tok, kv_offset) : nullptr;
        __m512i lo, hi;
        pair_chunk(va, vb, c, lo, hi);
        step(r, pair, lo, hi);
      }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) store_pair_chunk(acc[r][g][0], acc[r][g][1], acc_out[r] + g * DV * 16 + 32 * c);
  }
}

template <int DH>
void pick_shared(int64_t G, SharedScoresFn& qk, SharedScoresRowsFn& qk_rows, SharedSumRowsFn& sum_rows) {
  switch (G) {
    case 1: qk = scores_dpbf16_shared<1, DH>,
            qk_rows = scores_dpbf16_shared_rows<1, DH, pre_block_rows(1)>,
            sum_rows = weighted_sum_bf16_dp_shared_rows<1, 2 * DH, pre_block_rows(1)>; break;
    case 2: qk = scores_dpbf16_shared<2, DH>,
            qk_rows = scores_dpbf16_shared_rows<2, DH, pre_block_rows(2)>,
            sum_rows = weighted_sum_bf16_dp_shared_rows<2, 2 * DH, pre_block_rows(2)>; break;
    case 3: qk = scores_dpbf16_shared<3, DH>,
            qk_rows = scores_dpbf16_shared_rows<3, DH, pre_block_rows(3)>,
            sum_rows = weighted_sum_bf16_dp_shared_rows<3, 2 * DH, pre_block_rows(3)>; break;
    case 4: qk = scores_dpbf16_shared<4, DH>,
            qk_rows = scores_dpbf16_shared_rows<4, DH, pre_block_rows(4)>,
            sum_rows = weighted_sum_bf16_dp_shared_rows<4, 2 * DH, pre_block_rows(4)>; break;
    default: qk = nullptr, qk_rows = nullptr, sum_rows = nullptr;
  }
}

template <int DH>
void pick_pre(int64_t G, PreScoresFn& qk, PreSumFn& sum, PreScoresRowsFn& qk_rows, PreSumRowsFn& sum_rows,
              int64_t& block_rows) {
  switch (G) {
    case 1: qk = scores_dpbf16_pre<1, DH>, sum = weighted_sum_pre<1, 2 * DH>,
            qk_rows = scores_dpbf16_pre_rows<1, DH, pre_block_rows(1)>,
            sum_rows = weighted_sum_pre_rows<1, 2 * DH, pre_block_rows(1)>, block_rows = pre_block_rows(1); break;
    case 2: qk = scores_dpbf16_pre<2, DH>, sum = weighted_sum_pre<2, 2 * DH>,
            qk_rows = scores_dpbf16_pre_rows<2, DH, pre_block_rows(2)>,
            sum_rows = weighted_sum_pre_rows<2, 2 * DH, pre_block_rows(2)>, block_rows = pre_block_rows(2); break;
    case 3: qk = scores_dpbf16_pre<3, DH>, sum = weighted_sum_pre<3, 2 * DH>,
            qk_rows = scores_dpbf16_pre_rows<3, DH, pre_block_rows(3)>,
            sum_rows = weighted_sum_pre_rows<3, 2 * DH, pre_block_rows(3)>, block_rows = pre_block_rows(3); break;
    case 4: qk = scores_dpbf16_pre<4, DH>, sum = weighted_sum_pre<4, 2 * DH>,
            qk_rows = scores_dpbf16_pre_rows<4, DH, pre_block_rows(4)>,
            sum_rows = weighted_sum_pre_rows<4, 2 * DH, pre_block_rows(4)>, block_rows = pre_block_rows(4); break;
    default: qk = nullptr, sum = nullptr, qk_rows = nullptr, sum_rows = nullptr, block_rows = 1;
  }
}

#else
// AVX-512 without BF16: the prepass transposes keys only (pass 3 takes one FMA per key from the cache: no transpose
// to save there), and the prepared groups go through fma16_slice, the ops of the pass from the cache: the same bits.

// scores_fma16 on the transposed groups `kt` (group 0 = keys 0..15) for R rows that start at the same key: each
// prepared group widened once for the R rows (2 x G x R accumulators); groups past a row's last key computed, not
// stored.
template <int G, int DH, int R>
void scores_fma16_pre_rows(const c10::BFloat16* const* q_rows, float scale, int64_t first, const int64_t* num_keys,
                           const __m512i* kt, float* const* scores) {
  constexpr int D = 32 * DH;
  float qf[R][G][D];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) qf[r][g][d] = to_float(q_rows[r][g * D + d]);
  int64_t end = first;
  for (int r = 0; r < R; ++r) end = std::max(end, first + num_keys[r]);
  pre_rows_groups<G, R>(scale, first, end, num_keys, scores, [&](int64_t grp, __m512 (&even)[R][G],
                                                                 __m512 (&odd)[R][G]) __attribute__((always_inline)) {
    for (int h = 0; h < DH; ++h) fma16_slice<G, DH, R>(kt + grp * 16 * DH + 16 * h, h, qf, even, odd);
  });
}

template <int G, int DH>
void scores_fma16_pre(const c10::BFloat16* q_heads, float scale, int64_t first, int64_t num_keys, const __m512i* kt,
                      float* scores) {
  const c10::BFloat16* q_rows[1] = {q_heads};
  float* score_rows[1] = {scores};
  scores_fma16_pre_rows<G, DH, 1>(q_rows, scale, first, &num_keys, kt, score_rows);
}

template <int G, int DH>
void scores_fma16_shared(const c10::BFloat16* q_heads, float scale, int64_t num_keys, const c10::BFloat16* kc,
                         const c10::BFloat16* vc, const int32_t* table, int64_t BS, int64_t kv_block, int64_t kv_tok,
                         int64_t kv_offset, const __m512i* kt, int64_t shared, float* scores) {
  scores_fma16_from<G, DH>(q_heads, scale, 0, num_keys, kc, vc, table, BS, kv_block, kv_tok, kv_offset, kt, shared, 0,
                           scores);
}

// R rows of one shared-prefix group (first key 0): the prefix's groups for the R rows at once, then each row's own
// keys from the cache.
template <int G, int DH, int R>
void scores_fma16_shared_rows(const c10::BFloat16* const* q_rows, float scale, const int64_t* num_keys,
                              const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* const* tables,
                              int64_t BS, int64_t kv_block, int64_t kv_tok, int64_t kv_offset, const __m512i* kt,
                              int64_t shared, float* const* scores) {
  constexpr int D = 32 * DH;
  float qf[R][G][D];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) qf[r][g][d] = to_float(q_rows[r][g * D + d]);
  pre_rows_groups<G, R>(scale, 0, shared, num_keys, scores, [&](int64_t grp, __m512 (&even)[R][G],
                                                                __m512 (&odd)[R][G]) __attribute__((always_inline)) {
    for (int h = 0; h < DH; ++h) fma16_slice<G, DH, R>(kt + grp * 16 * DH + 16 * h, h, qf, even, odd);
  });
  for (int r = 0; r < R; ++r)
    scores_fma16_from<G, DH>(q_rows[r], scale, 0, num_keys[r], kc, vc, tables[r], BS, kv_block, kv_tok, kv_offset,
                             nullptr, 0, shared, scores[r]);
}

template <int DH>
void pick_shared(int64_t G, SharedScoresFn& qk, SharedScoresRowsFn& qk_rows, SharedSumRowsFn& sum_rows) {
  sum_rows = nullptr;  // pass 3 from the cache, row by row
  switch (G) {
    case 1: qk = scores_fma16_shared<1, DH>, qk_rows = scores_fma16_shared_rows<1, DH, pre_block_rows(1)>; break;
    case 2: qk = scores_fma16_shared<2, DH>, qk_rows = scores_fma16_shared_rows<2, DH, pre_block_rows(2)>; break;
    case 3: qk = scores_fma16_shared<3, DH>, qk_rows = scores_fma16_shared_rows<3, DH, pre_block_rows(3)>; break;
    case 4: qk = scores_fma16_shared<4, DH>, qk_rows = scores_fma16_shared_rows<4, DH, pre_block_rows(4)>; break;
    default: qk = nullptr, qk_rows = nullptr;
  }
}

template <int DH>
void pick_pre(int64_t G, PreScoresFn& qk, PreSumFn& sum, PreScoresRowsFn& qk_rows, PreSumRowsFn& sum_rows,
              int64_t& block_rows) {
  sum = nullptr;  // pass 3 from the cache, row by row
  sum_rows = nullptr;
  block_rows = pre_block_rows(static_cast<int>(G));
  switch (G) {
    case 1: qk = scores_fma16_pre<1, DH>, qk_rows = scores_fma16_pre_rows<1, DH, pre_block_rows(1)>; break;
    case 2: qk = scores_fma16_pre<2, DH>, qk_rows = scores_fma16_pre_rows<2, DH, pre_block_rows(2)>; break;
    case 3: qk = scores_fma16_pre<3, DH>, qk_rows = scores_fma16_pre_rows<3, DH, pre_block_rows(3)>; break;
    case 4: qk = scores_fma16_pre<4, DH>, qk_rows = scores_fma16_pre_rows<4, DH, pre_block_rows(4)>; break;
    default: qk = nullptr, qk_rows = nullptr, block_rows = 1;
  }
}
#endif

// One call's prepared sequences: where sequence s's KV head h starts in `kt` and `vp` (-1: not prepared).
struct Prepass {
  PreScoresFn qk = nullptr;
  PreSumFn sum = nullptr;
  PreScoresRowsFn qk_rows = nullptr;  // block_rows rows of one sequence at once (the same bits as `qk` per row)
  PreSumRowsFn sum_rows = nullptr;    // and as `sum` per row
  int64_t block_rows = 1;
  std::vector<int64_t> keys, kt_at, vp_at;  // per sequence
  std::vector<__m512i> kt;                  // per sequence, KV head: its groups x DH x 16
  std::vector<uint32_t> vp;                 // per sequence, KV head: its key pairs x D (weighted_sum_pre's layout)
  // Shared prefixes: sequences whose block tables begin with the same blocks (requests on one prompt through the
  // prefix cache: fan-out agents, n > 1) and that are not prepared themselves. A group's first `keys` keys (whole
  // 16-key groups every member's rows see) are transposed once, laid out as a sequence's, and its members' rows read
  // them (scores_dpbf16_shared) instead of each loading and transposing the same keys; blocks of its rows read each
  // shared value pair once (weighted_sum_bf16_dp_shared_rows).
  SharedScoresFn qk_shared = nullptr;
  SharedScoresRowsFn qk_shared_rows = nullptr;  // block_rows rows of one group at once (the same bits per row)
  SharedSumRowsFn sum_shared_rows = nullptr;
  std::vector<int64_t> group_of;                          // per sequence: its group, -1: none
  std::vector<int64_t> group_keys, group_kt_at;  // per group

  bool has(int64_t s) const { return qk != nullptr && kt_at[s] >= 0; }
  int64_t shared_keys(int64_t s) const {
    return qk_shared != nullptr && group_of[s] >= 0 ? group_keys[group_of[s]] : 0;
  }
  const __m512i* shared_keys_of(int64_t s, int64_t kvh, int64_t DH) const {
    const int64_t g = group_of[s];
    return kt.data() + group_kt_at[g] + kvh * (group_keys[g] / 16) * 16 * DH;
  }

  const __m512i* keys_of(int64_t s, int64_t kvh, int64_t DH) const {
    return kt.data() + kt_at[s] + kvh * ((keys[s] + 15) / 16) * 16 * DH;
  }
  const uint32_t* values_of(int64_t s, int64_t kvh, int64_t D) const {
    return vp.data() + vp_at[s] + kvh * ((keys[s] + 1) / 2) * D;
  }
  int64_t bytes() const {
    return static_cast<int64_t>(kt.capacity() * sizeof(__m512i) + vp.capacity() * sizeof(uint32_t));
  }
};

// The calling thread's scratch, kept across calls (the engine thread's: one call at a time).
inline Prepass& caller_prepass() {
  thread_local Prepass scratch;
  return scratch;
}

// Fills `pre` for the sequences with kPrepassRows rows or more among the call's T (bf16 caches, D = 64, 128 or 256,
// G <= 4: scores_dpbf16's shapes), in order, each that still fits within prepass_cap_bytes(); then, where `from_zero`
// (every row's first key is 0: no sliding window), the shared prefixes of the other sequences
// (Prepass::group_of), each cut to what still fits. Leaves pre.qk null when nothing is prepared.
void prepare_rows(Prepass& pre, const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* bt, int64_t max_blocks,
                  int64_t num_seqs, const int32_t* seq, const int64_t* visible, int64_t T, int64_t KVH, int64_t G,
                  int64_t D, int bs_shift, int64_t kv_block, int64_t kv_tok, bool from_zero) {
  pre.qk = nullptr;
  pre.qk_shared = nullptr;
  if (G > 4 || (D != 64 && D != 128 && D != 256)) return;
  // A decode call of one sequence (C = 1) or with a sliding window prepares nothing: no per-call bookkeeping either.
  if (T < kPrepassRows && (!from_zero || num_seqs < 2)) return;
  std::vector<int64_t> rows(num_seqs, 0), least(num_seqs, std::numeric_limits<int64_t>::max());
  pre.keys.assign(num_seqs, 0);
  for (int64_t t = 0; t < T; ++t) {
    ++rows[seq[t]];
    pre.keys[seq[t]] = std::max(pre.keys[seq[t]], visible[t]);
    least[seq[t]] = std::min(least[seq[t]], visible[t]);
  }
  const int64_t DH = D / 32;
  pre.kt_at.assign(num_seqs, -1);
  pre.vp_at.assign(num_seqs, -1);
  pre.group_of.assign(num_seqs, -1);
  pre.group_keys.clear();
  pre.group_kt_at.clear();
  int64_t kt_size = 0, vp_size = 0;
  const int64_t cap = prepass_cap_bytes();
  const auto bytes = [](int64_t kt_n, int64_t vp_n) {
    return kt_n * static_cast<int64_t>(sizeof(__m512i)) + vp_n * static_cast<int64_t>(sizeof(uint32_t));
  };
  struct Item {  // one KV head of a prepared sequence or shared prefix: its keys, and where they go in kt and vp
    const int32_t* table;
    int64_t keys, kvh, kt_at, vp_at;  // vp_at -1: keys only (a shared prefix)
  };
  std::vector<Item> items;
#if defined(__AVX512BF16__)
  constexpr bool values = true;  // pass 3's pairs too (weighted_sum_pre); without BF16 it reads the cache
#else
  constexpr bool values = false;
#endif
  for (int64_t s = 0; s < num_seqs && T >= kPrepassRows; ++s) {
    if (rows[s] < kPrepassRows) continue;
    const int64_t kt_add = KVH * ((pre.keys[s] + 15) / 16) * 16 * DH;
    const int64_t vp_add = values ? KVH * ((pre.keys[s] + 1) / 2) * D : 0;
    if (bytes(kt_size + kt_add, vp_size + vp_add) > cap) continue;  // past the cap: its rows take the per-row passes
    pre.kt_at[s] = kt_size;
    pre.vp_at[s] = values ? vp_size : -1;
    for (int64_t kvh = 0; kvh < KVH; ++kvh)
      items.push_back({bt + s * max_blocks, pre.keys[s], kvh, kt_size + kvh * ((pre.keys[s] + 15) / 16) * 16 * DH,
                       values ? vp_size + kvh * ((pre.keys[s] + 1) / 2) * D : -1});
    kt_size += kt_add;
    vp_size += vp_add;
  }
  if (from_zero) {
    // Candidates in the order of their tables (whole blocks every row of each sees), so that sequences sharing a long
    // prefix sit together even where other prompts begin with the same blocks (one chat template's first tokens);
    // then greedy groups: a candidate joins while its table holds at least kSharedMinKeys keys' blocks alike with the
    // group's first, and the group's prefix is the blocks every member holds alike, in whole 16-key groups.
    std::vector<int64_t> cand;
    for (int64_t s = 0; s < num_seqs; ++s)
      if (rows[s] > 0 && pre.kt_at[s] < 0 && least[s] >= kSharedMinKeys) cand.push_back(s);
    const auto seen = [&](int64_t s) { return std::min<int64_t>(least[s] >> bs_shift, max_blocks); };
    const auto common_blocks = [&](int64_t x, int64_t y, int64_t limit) {
      const int32_t* tx = bt + x * max_blocks;
      const int32_t* ty = bt + y * max_blocks;
      int64_t same = 0;
      while (same < limit && tx[same] == ty[same]) ++same;
      return same;
    };
    std::stable_sort(cand.begin(), cand.end(), [&](int64_t x, int64_t y) {
      const int64_t n = std::min(seen(x), seen(y)), same = common_blocks(x, y, n);
      if (same < n) return bt[x * max_blocks + same] < bt[y * max_blocks + same];
      return seen(x) < seen(y);
    });
    const int64_t BS = int64_t{1} << bs_shift;
    const auto whole_keys = [&](int64_t blocks) { return (blocks * BS) / 16 * 16; };
    for (size_t i = 0; i < cand.size();) {
      int64_t blocks = seen(cand[i]);
      size_t j = i + 1;
      for (; j < cand.size(); ++j) {
        const int64_t same = common_blocks(cand[i], cand[j], std::min(blocks, seen(cand[j])));
        if (whole_keys(same) < kSharedMinKeys) break;
        blocks = same;
      }
      if (j - i >= 2) {
        const int32_t* lead = bt + cand[i] * max_blocks;
        int64_t keys = whole_keys(blocks);
        const int64_t per_key = bytes(KVH * DH, 0);  // a key's share of kt (16-key groups)
        keys = std::min(keys, std::max<int64_t>(0, cap - bytes(kt_size, vp_size)) / per_key / 16 * 16);
        if (keys >= kSharedMinKeys) {
          const int64_t g = static_cast<int64_t>(pre.group_keys.size());
          pre.group_keys.push_back(keys);
          pre.group_kt_at.push_back(kt_size);
          for (size_t m = i; m < j; ++m) pre.group_of[cand[m]] = g;
          for (int64_t kvh = 0; kvh < KVH; ++kvh)
            items.push_back({lead, keys, kvh, kt_size + kvh * (keys / 16) * 16 * DH, -1});
          kt_size += KVH * (keys / 16) * 16 * DH;
        }
      }
      i = j;
    }
  }
  if (items.empty()) return;
  if (static_cast<int64_t>(pre.kt.size()) < kt_size || static_cast<int64_t>(pre.vp.size()) < vp_size) {
    // Grown to exact sizes (not resize's doubling), both within the cap together: the largest seen while they fit,
    // else this call's.
    int64_t kt_n = std::max<int64_t>(kt_size, pre.kt.size()), vp_n = std::max<int64_t>(vp_size, pre.vp.size());
    if (bytes(kt_n, vp_n) > cap) kt_n = kt_size, vp_n = vp_size;
    std::vector<__m512i>().swap(pre.kt);  // the old buffers go before the new ones are made
    std::vector<uint32_t>().swap(pre.vp);
    std::vector<__m512i>(kt_n).swap(pre.kt);
    std::vector<uint32_t>(vp_n).swap(pre.vp);
  }
  if (DH == 2) {
    pick_pre<2>(G, pre.qk, pre.sum, pre.qk_rows, pre.sum_rows, pre.block_rows);
    pick_shared<2>(G, pre.qk_shared, pre.qk_shared_rows, pre.sum_shared_rows);
  } else if (DH == 4) {
    pick_pre<4>(G, pre.qk, pre.sum, pre.qk_rows, pre.sum_rows, pre.block_rows);
    pick_shared<4>(G, pre.qk_shared, pre.qk_shared_rows, pre.sum_shared_rows);
  } else {
    pick_pre<8>(G, pre.qk, pre.sum, pre.qk_rows, pre.sum_rows, pre.block_rows);
    pick_shared<8>(G, pre.qk_shared, pre.qk_shared_rows, pre.sum_shared_rows);
  }
  conveyor_parallel::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int64_t keys = it.keys, kvh = it.kvh;
      __m512i* kt = pre.kt.data() + it.kt_at;
      for (int64_t grp = 0; 16 * grp < keys; ++grp) {
        if (DH == 2) {
          transpose_key_group<2>(kc, it.table, bs_shift, kv_block, kv_tok, kvh * D, keys, grp, kt + grp * 16 * DH);
        } else if (DH == 4) {
          transpose_key_group<4>(kc, it.table, bs_shift, kv_block, kv_tok, kvh * D, keys, grp, kt + grp * 16 * DH);
        } else {
          transpose_key_group<8>(kc, it.table, bs_shift, kv_block, kv_tok, kvh * D, keys, grp, kt + grp * 16 * DH);
        }
      }
#if defined(__AVX512BF16__)
      if (it.vp_at < 0) continue;
      uint32_t* vp = pre.vp.data() + it.vp_at;
      const int NC = static_cast<int>(D / 32);
      for (int64_t pair = 0; 2 * pair < keys; ++pair) {
        const c10::BFloat16* a = vc + cache_row(it.table, 2 * pair, bs_shift, kv_block, kv_tok, kvh * D);
        const c10::BFloat16* b = 2 * pair + 1 < keys
                                     ? vc + cache_row(it.table, 2 * pair + 1, bs_shift, kv_block, kv_tok, kvh * D)
                                     : nullptr;
        for (int c = 0; c < NC; ++c) {
          __m512i lo, hi;
          pair_chunk(a, b, c, lo, hi);
          _mm512_storeu_si512(vp + (pair * NC + c) * 32, lo);
          _mm512_storeu_si512(vp + (pair * NC + c) * 32 + 16, hi);
        }
      }
#endif
    }
  });
}
#define CONVEYOR_ROW_PREPASS 1
#endif

// A task's G heads out: each head's weighted value sum over its softmax denominator, in the output dtype.
template <typename scalar_t>
inline void store_heads(const float* acc, const float* denom, int64_t G, int64_t D, scalar_t* out) {
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / denom[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[g * D + d] * inv);
  }
}

// The query heads one task of attend_rows handles together: all of a KV head's G when G <= 4 (the
// register-blocked passes go up to 4), else the largest of 4, 3, 2 that divides G (1 otherwise).
inline int64_t head_subgroup(int64_t G) {
  if (G <= 4) return G;
  for (int64_t sg : {4, 3, 2})
    if (G % sg == 0) return sg;
  return 1;
}

// The first key a query at `visible - 1` attends: 0 (every key), the start of its sliding window (window > 0),
// or the start of its chunk (window < 0: chunks of -window positions, Llama 4's chunked local attention).
inline int64_t first_key(int64_t visible, int64_t window) {
  if (window > 0) return visible > window ? visible - window : 0;
  if (window < 0) return ((visible - 1) / -window) * -window;
  return 0;
}

// Denormals flushed to zero (FTZ) and read as zero (DAZ) while a row path runs, on every thread and call (so still
// one arithmetic): a peaked softmax's tiny weights took microcode assists in the weighted sums, as on the tile
// path (paged_amx.h).
struct DenormalsOff {
#if defined(__x86_64__) || defined(__i386__)
  const unsigned csr = _mm_getcsr();
  DenormalsOff() { _mm_setcsr(csr | 0x8040); }
  ~DenormalsOff() { _mm_setcsr(csr); }
#endif
};

template <typename scalar_t>
void attend_rows(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                 const torch::Tensor& block_tables, const torch::Tensor& token_seq, const torch::Tensor& token_pos,
                 double scale, int64_t window, double softcap, const float* sinks, const int32_t* key_end,
                 torch::Tensor& out) {
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2);
  // More than 4 query heads per KV head (GPT-OSS 8, MLA every head): the heads go in sub-groups of G,
  // each its own task on the register-blocked passes (a head's arithmetic is the same in any sub-group).
  const int64_t NSUB = H / KVH / head_subgroup(H / KVH), G = H / KVH / NSUB;
  const int bs_shift = __builtin_ctzll(BS);  // block sizes are powers of two (checked by the caller)
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
#if CONVEYOR_PAGED_AMX
  // The amx build: bf16 rows in AMX tiles with an online softmax (paged_amx.h), decode and prefill alike.
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (conveyor_paged_amx::enabled() && conveyor_paged_amx::fits(D)) {
      std::vector<int64_t> firsts(T), ends(T);
      for (int64_t t = 0; t < T; ++t) {
        firsts[t] = first_key(static_cast<int64_t>(pos[t]) + 1, window);
        ends[t] = key_end != nullptr ? static_cast<int64_t>(key_end[t]) : static_cast<int64_t>(pos[t]) + 1;
      }
      conveyor_paged_amx::Call call;
      call.q = reinterpret_cast<const uint16_t*>(q);
      call.out = reinterpret_cast<uint16_t*>(o);
      call.H = H;
      call.D = D;
      call.kc = reinterpret_cast<const uint16_t*>(kc);
      call.vc = reinterpret_cast<const uint16_t*>(vc);
      call.kv_block = kv_block;
      call.kv_tok = kv_tok;
      call.bs_shift = bs_shift;
      call.c = fscale * conveyor_paged_amx::kLog2e;
      call.scale = fscale;
      call.softcap = static_cast<float>(softcap);
      call.sinks = sinks;
      conveyor_paged_amx::attend(call, bt, block_tables.size(0), max_blocks, seq, firsts.data(), ends.data(), T, KVH,
                                 H / KVH);
      return;
    }
  }
#endif
  const auto fast_sum = fast_pass<Pass::kWeightedSum>(vc, G, D);
  const auto fast_qk = fast_pass<Pass::kScores>(kc, G, D);
#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
  // Pass 1 straight from the bf16 query: vdpbf16ps (AVX-512 BF16) or scores_avx2.
  const ScoresBf16Fn dp_qk = std::is_same_v<scalar_t, c10::BFloat16> ? wide_scores_fn(G, D) : nullptr;
#else
  const void* dp_qk = nullptr;
#endif

#if defined(CONVEYOR_ROW_PREPASS)
  // NOTE: through a reference: the pool's threads, reading `pre` in the lambda below, must see the caller's
  // scratch (a thread_local named there would be each thread's own, empty one).
  Prepass& pre = caller_prepass();
  pre.qk = nullptr;  // (nothing prepared unless prepare_rows runs below)
  pre.qk_shared = nullptr;
  pre.qk_shared_rows = nullptr;
  pre.sum_shared_rows = nullptr;
  pre.group_keys.clear();
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (dp_qk != nullptr && fast_sum != nullptr && NSUB == 1) {
      std::vector<int64_t> visible(T);
      for (int64_t t = 0; t < T; ++t) visible[t] = key_end != nullptr ? key_end[t] : static_cast<int64_t>(pos[t]) + 1;
      prepare_rows(pre, kc, vc, bt, max_blocks, block_tables.size(0), seq, visible.data(), T, KVH, G, D, bs_shift,
                   kv_block, kv_tok, window == 0);
    }
  }
#endif
  // Row blocks: runs of pre.block_rows consecutive rows of one prepared sequence with the same first key take
  // their weighted sums together (weighted_sum_pre_rows: the same bits), as do pre.block_rows rows of one shared-prefix
  // group (different sequences, first key 0: the *_shared_rows kernels); every other row is a block of one.
  std::vector<int64_t> block_rows;   // the blocks' rows, block after block
  std::vector<int64_t> block_first;  // block b's rows: block_rows[block_first[b] .. block_first[b + 1])
  std::vector<char> block_shared;    // block b is a shared-prefix group's
  block_rows.reserve(T);
  block_first.reserve(T + 1);
  const auto add_block = [&](int64_t t0, int64_t n, bool shared_block) {
    block_first.push_back(static_cast<int64_t>(block_rows.size()));
    for (int64_t r = 0; r < n; ++r) block_rows.push_back(t0 + r);
    block_shared.push_back(shared_block);
  };
#if defined(CONVEYOR_ROW_PREPASS)
  std::vector<std::vector<int64_t>> group_rows(pre.qk_shared_rows != nullptr ? pre.group_keys.size() : 0);
#endif
  for (int64_t t = 0; t < T;) {
    int64_t n = 1;
#if defined(CONVEYOR_ROW_PREPASS)
    if (pre.has(seq[t]) && pre.qk_rows != nullptr) {
      const int64_t first = first_key(static_cast<int64_t>(pos[t]) + 1, window);
      while (n < pre.block_rows && t + n < T && seq[t + n] == seq[t] &&
             first_key(static_cast<int64_t>(pos[t + n]) + 1, window) == first)
        ++n;
      if (n < pre.block_rows) n = 1;  // a short run goes row by row
    } else if (!group_rows.empty() && !pre.has(seq[t]) && pre.shared_keys(seq[t]) > 0 &&
               first_key(static_cast<int64_t>(pos[t]) + 1, window) == 0) {
      group_rows[pre.group_of[seq[t]]].push_back(t);  // blocked below
      ++t;
      continue;
    }
#endif
    add_block(t, n, false);
    t += n;
  }
#if defined(CONVEYOR_ROW_PREPASS)
  for (const std::vector<int64_t>& rows : group_rows) {
    size_t i = 0;
    for (; i + pre.block_rows <= rows.size(); i += pre.block_rows) {
      block_first.push_back(static_cast<int64_t>(block_rows.size()));
      block_rows.insert(block_rows.end(), rows.begin() + i, rows.begin() + i + pre.block_rows);
      block_shared.push_back(true);
    }
    for (; i < rows.size(); ++i) add_block(rows[i], 1, false);  // the rest row by row (still reading the prefix)
  }
#endif
  block_first.push_back(static_cast<int64_t>(block_rows.size()));
  const int64_t NB = static_cast<int64_t>(block_first.size()) - 1;
  conveyor_parallel::parallel_for(0, NB * KVH * NSUB, 1, [&](int64_t begin, int64_t end) {
    const DenormalsOff flush;
    std::vector<float> scores, qf(G * D), acc(G * D), denom(G), vf(D);
#if defined(CONVEYOR_ROW_PREPASS)
    std::vector<std::vector<float>> block_scores(pre.block_rows), block_acc(pre.block_rows, std::vector<float>(G * D)),
        block_denom(pre.block_rows, std::vector<float>(G));
#endif
    for (int64_t task = begin; task < end; ++task) {
      // vkv: this task's sub-group of query heads (its first head is vkv * G), reading KV head kvh. Tasks go head
      // major, rows last to first: a thread's run of tasks reads one KV head's keys (in L2, not the whole
      // cache), and a prefill's longest rows are claimed first, so the two threads end together.
      const int64_t b = NB - 1 - task % NB, vkv = task / NB, kvh = vkv / NSUB;
#if defined(CONVEYOR_ROW_PREPASS)
      if (block_first[b + 1] - block_first[b] > 1) {
        const int64_t* brows = block_rows.data() + block_first[b];
        const int64_t t0 = brows[0], R = block_first[b + 1] - block_first[b];
        const int64_t first = first_key(static_cast<int64_t>(pos[t0]) + 1, window);
        const c10::BFloat16* q_rows[pre_block_rows(1)];
        const int32_t* tables[pre_block_rows(1)];
        float* score_rows[pre_block_rows(1)];
        float* acc_rows[pre_block_rows(1)];
        int64_t key_counts[pre_block_rows(1)];
        for (int64_t r = 0; r < R; ++r) {
          const int64_t t = brows[r];
          const int64_t visible = key_end != nullptr ? static_cast<int64_t>(key_end[t]) : static_cast<int64_t>(pos[t]) + 1;
          key_counts[r] = visible - first;
          std::vector<float>& sc = block_scores[r];
          if (static_cast<int64_t>(sc.size()) < G * key_counts[r]) sc.resize(G * key_counts[r]);
          q_rows[r] = reinterpret_cast<const c10::BFloat16*>(q + t * q_row + vkv * G * D);
          tables[r] = bt + static_cast<int64_t>(seq[t]) * max_blocks;
          score_rows[r] = sc.data();
          acc_rows[r] = block_acc[r].data();
        }
        if (block_shared[b]) {
          const int64_t shared = pre.shared_keys(seq[t0]);
          const auto* kcb = reinterpret_cast<const c10::BFloat16*>(kc);
          const auto* vcb = reinterpret_cast<const c10::BFloat16*>(vc);
          pre.qk_shared_rows(q_rows, fscale, key_counts, kcb, vcb, tables, BS, kv_block, kv_tok, kvh * D,
                             pre.shared_keys_of(seq[t0], kvh, D / 32), shared, score_rows);
        } else {
          pre.qk_rows(q_rows, fscale, first, key_counts, pre.keys_of(seq[t0], kvh, D / 32), score_rows);
        }
        for (int64_t r = 0; r < R; ++r)
          softmax_scores(score_rows[r], G, key_counts[r], softcap, block_denom[r].data(), sinks ? sinks + vkv * G : nullptr);
        if (block_shared[b] && pre.sum_shared_rows != nullptr) {
          pre.sum_shared_rows(const_cast<const float* const*>(score_rows), key_counts,
                              reinterpret_cast<const c10::BFloat16*>(vc), tables, BS, kv_block, kv_tok, kvh * D,
                              pre.shared_keys(seq[t0]), acc_rows);
        } else if (!block_shared[b] && pre.sum_rows != nullptr) {
          pre.sum_rows(const_cast<const float* const*>(score_rows), key_counts, first, pre.values_of(seq[t0], kvh, D),
                       acc_rows);
        } else {  // pass 3 from the cache, row by row (AVX-512 without BF16)
          for (int64_t r = 0; r < R; ++r)
            fast_sum(score_rows[r], first, key_counts[r], vc, tables[r], BS, kv_block, kv_tok, kvh * D, acc_rows[r]);
        }
        for (int64_t r = 0; r < R; ++r)
          store_heads(block_acc[r].data(), block_denom[r].data(), G, D, o + brows[r] * q_row + vkv * G * D);
        continue;
      }
#endif
      const int64_t t = block_rows[block_first[b]];
      // Keys [first, pos]: the whole history, the last `window` positions (sliding window), or with a
      // negative window the query's own chunk of -window positions (Llama 4's chunked attention).
      // key_end (Gemma 3's image rows): keys up to the end of the row's bidirectional run; the window still
      // starts from the row's own position.
      const int64_t first = first_key(static_cast<int64_t>(pos[t]) + 1, window);
      const int64_t visible = key_end != nullptr ? static_cast<int64_t>(key_end[t]) : static_cast<int64_t>(pos[t]) + 1;
      const int64_t num_keys = visible - first;
      const int32_t* table = bt + static_cast<int64_t>(seq[t]) * max_blocks;
      if (static_cast<int64_t>(scores.size()) < G * num_keys) scores.resize(G * num_keys);
#if defined(CONVEYOR_ROW_PREPASS)
      const bool prepared = pre.has(seq[t]);  // this row's sequence's keys and values prepared (prepare_rows)
      // Its sequence's first keys prepared as a shared prefix (prepare_rows' groups; their rows start at key 0).
      const int64_t shared = !prepared && first == 0 ? pre.shared_keys(seq[t]) : 0;
      const bool prepared_values = prepared && pre.sum != nullptr;  // (AVX-512 without BF16 prepares keys only)
#else
      constexpr bool prepared = false;
      constexpr int64_t shared = 0;
      constexpr bool prepared_values = false;
#endif
      // Pass 1: scores, in key order.
#if defined(CONVEYOR_ROW_PREPASS)
      if (shared > 0)
        pre.qk_shared(reinterpret_cast<const c10::BFloat16*>(q + t * q_row + vkv * G * D), fscale, num_keys,
                      reinterpret_cast<const c10::BFloat16*>(kc), reinterpret_cast<const c10::BFloat16*>(vc), table,
                      BS, kv_block, kv_tok, kvh * D, pre.shared_keys_of(seq[t], kvh, D / 32), shared, scores.data());
      else if (prepared)
        pre.qk(reinterpret_cast<const c10::BFloat16*>(q + t * q_row + vkv * G * D), fscale, first, num_keys,
               pre.keys_of(seq[t], kvh, D / 32), scores.data());
      else
#endif
#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
      if (dp_qk != nullptr)
        dp_qk(reinterpret_cast<const c10::BFloat16*>(q + t * q_row + vkv * G * D), fscale, first, num_keys,
              reinterpret_cast<const c10::BFloat16*>(kc), reinterpret_cast<const c10::BFloat16*>(vc), table, BS,
              kv_block, kv_tok, kvh * D, scores.data());
#endif
      for (int64_t g = 0; dp_qk == nullptr && g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(q[t * q_row + (vkv * G + g) * D + d]) * fscale;
      if (dp_qk == nullptr && fast_qk != nullptr)
        fast_qk(qf.data(), first, num_keys, kc, table, BS, kv_block, kv_tok, kvh * D, scores.data());
      for (int64_t j = 0; dp_qk == nullptr && fast_qk == nullptr && j < num_keys; ++j) {
        const int64_t key = j + first;
        const scalar_t* k = kc + cache_row(table, key, bs_shift, kv_block, kv_tok, kvh * D);
        for (int64_t g = 0; g < G; ++g) scores[g * num_keys + j] = dot(qf.data() + g * D, k, D);
      }
      softmax_scores(scores.data(), G, num_keys, softcap, denom.data(), sinks ? sinks + vkv * G : nullptr);  // pass 2
      // Pass 3: weighted sum of values, in key order.
      if (prepared_values) {
#if defined(CONVEYOR_ROW_PREPASS)
        pre.sum(scores.data(), first, num_keys, pre.values_of(seq[t], kvh, D), acc.data());
#endif
      } else if (fast_sum != nullptr) {
        fast_sum(scores.data(), first, num_keys, vc, table, BS, kv_block, kv_tok, kvh * D, acc.data());
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
      }
      for (int64_t j = 0; fast_sum == nullptr && j < num_keys; ++j) {
        const int64_t key = j + first;
        const scalar_t* v = vc + cache_row(table, key, bs_shift, kv_block, kv_tok, kvh * D);
        load_row(v, vf.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * num_keys + j];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      store_heads(acc.data(), denom.data(), G, D, o + t * q_row + vkv * G * D);
    }
  });
}

// ---- Q8_0 caches (kv_q8.h: per (token, KV head) row, 34-byte blocks of fp16 d + 32 int8) ------------
// Pass 1 on int8 keys quantizes each query head per 32-block as llama.cpp does for K.Q, so a block's dot
// product is an exact int32 S_b (any instruction order gives the same integer), then one float step per
// block, in block order: score = scale * sum_b (dq_b * dk_b) * S_b. Pass 3 dequantizes values on the fly:
// acc[d] += (p_j * dv_jb) * v_jd, one chain per element in key order. Both orders depend only on the
// row's own keys, so rows stay batch- and chunk-invariant exactly as on the bf16 path.
using conveyor_q8::block_scale;
using conveyor_q8::scale_bits;
using conveyor_q8::block_values;
using conveyor_q8::kBlock;
using conveyor_q8::kBlockBytes;

template <typename scalar_t>
void quantize_query(const scalar_t* q, int64_t G, int64_t D, int8_t* qq, float* qd) {
  float v[kBlock];
  const int64_t nb = D / kBlock;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t i = 0; i < kBlock; ++i) v[i] = to_float(q[g * D + b * kBlock + i]);
      qd[g * nb + b] = conveyor_q8::quantize_block(v, qq + g * D + b * kBlock);
    }
}

// Portable pass 1 for one key row: exact int32 block sums, the float step in block order.
inline float dot_q8(const int8_t* qq, const float* qd, const uint8_t* k, int64_t nb) {
  float s = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = k + b * kBlockBytes;
    const int8_t* kv = block_values(blk);
    int32_t isum = 0;
    for (int64_t i = 0; i < kBlock; ++i) isum += static_cast<int32_t>(qq[b * kBlock + i]) * kv[i];
    s += (qd[b] * block_scale(blk)) * static_cast<float>(isum);
  }
  return s;
}

// Portable pass 3 for one value row: acc (G x D) += (p_g * dv_b) * v.
inline void add_row_q8(const float* scores, int64_t num_keys, int64_t j, const uint8_t* v, int64_t G, int64_t D,
                       float* acc) {
  for (int64_t b = 0; b < D / kBlock; ++b) {
    const uint8_t* blk = v + b * kBlockBytes;
    const float dv = block_scale(blk);
    const int8_t* vals = block_values(blk);
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * num_keys + j] * dv;
      float* ag = acc + g * D + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) ag[i] += w * static_cast<float>(vals[i]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// x86-64-v3 and every AVX-512 level. Pass 1 scores a tile of keys at once, one key per lane (16 per zmm with
// AVX-512 VNNI, 8 per ymm otherwise), each block sum S_b an exact int32; the float step is dot_q8's
// (s += (qd_b * dk_b) * S_b in block order, mul then add), so every level's scores are the portable path's
// bits, and a key's score never depends on its lane or its tile.

inline int32_t q8_word(const int8_t* p) {  // 4 query bytes as one int32, to broadcast
  int32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// Where V rows are prefetched: with VNNI pass 1 is short, and V prefetches issued there left L1's fill buffers
// full while its K loads waited, so pass 3 fetches its own rows ahead; the longer pass 1 without VNNI hides them.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kValuesAheadInPass3 = true;
#else
constexpr bool kValuesAheadInPass3 = false;
#endif

// The key rows of one tile (lanes past the last key repeat key 0: read, never stored), the K rows four tiles
// ahead prefetched (two left a long context's pass 1 waiting on memory: 1.05x at 16k keys with four), and this tile's
// V rows unless pass 3 fetches them (vc null: no V prefetch).
template <int L>
inline int q8_tile_rows(int64_t j0, int64_t first, int64_t num_keys, const uint8_t* kc, const uint8_t* vc,
                        const int32_t* table, int bs_shift, int64_t k_block, int64_t k_tok, int64_t k_offset,
                        int64_t v_block, int64_t v_tok, int64_t v_offset, int64_t row, const uint8_t* rows[L]) {
  const int n = static_cast<int>(std::min<int64_t>(L, num_keys - j0));
  for (int i = 0; i < L; ++i) {
    const int64_t key = first + j0 + (i < n ? i : 0);
    rows[i] = kc + cache_row(table, key, bs_shift, k_block, k_tok, k_offset);
    if (i >= n) continue;
    if (!kValuesAheadInPass3 && vc != nullptr) prefetch_lines(vc + cache_row(table, key, bs_shift, v_block, v_tok, v_offset), row);
    if (j0 + i + 4 * L < num_keys) prefetch_lines(kc + cache_row(table, key + 4 * L, bs_shift, k_block, k_tok, k_offset), row);
  }
  return n;
}

constexpr int64_t kMaxQ8Blocks = 16;  // head_dim <= 512 on the vector passes
// How far ahead pass 3 prefetches V rows (kValuesAheadInPass3): a row per key is 68 B at head dim 64, so 16 rows
// ahead kept ~1 KB in flight, too little to stream a long context from memory (one row at 16k keys through 16
// layers: 16.6 -> 13.0 ms per step with 96, 1.25x at 2k keys as well; benchmarks/long_context_attention.py).
constexpr int64_t kQ8Ahead = 96;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 rows' int32 (two ymm per zmm: rows i and i + 8) -> c[t] = int32 t of rows 0..15 (lane i = row i).
inline void transpose16x8_epi32(const __m256i r[16], __m512i c[8]) {
  __m512i z[8];
  for (int i = 0; i < 8; ++i) z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(r[i]), r[i + 8], 1);
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  const __m512i t4 = _mm512_unpacklo_epi32(z[4], z[5]), t5 = _mm512_unpackhi_epi32(z[4], z[5]);
  const __m512i t6 = _mm512_unpacklo_epi32(z[6], z[7]), t7 = _mm512_unpackhi_epi32(z[6], z[7]);
  const __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
  const __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
  const __m512i u4 = _mm512_unpacklo_epi64(t4, t6), u5 = _mm512_unpackhi_epi64(t4, t6);
  const __m512i u6 = _mm512_unpacklo_epi64(t5, t7), u7 = _mm512_unpackhi_epi64(t5, t7);
  // u0 = [rows 0-3 int 0 | rows 0-3 int 4 | rows 8-11 int 0 | rows 8-11 int 4], u4 the same for rows 4-7, 12-15.
  const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  c[0] = _mm512_permutex2var_epi64(u0, lo, u4), c[4] = _mm512_permutex2var_epi64(u0, hi, u4);
  c[1] = _mm512_permutex2var_epi64(u1, lo, u5), c[5] = _mm512_permutex2var_epi64(u1, hi, u5);
  c[2] = _mm512_permutex2var_epi64(u2, lo, u6), c[6] = _mm512_permutex2var_epi64(u2, hi, u6);
  c[3] = _mm512_permutex2var_epi64(u3, lo, u7), c[7] = _mm512_permutex2var_epi64(u3, hi, u7);
}

// Pass 1, 16 keys per zmm: vpdpbusd takes the keys as unsigned (k + 128, a flip of the top bit) and the query
// words as signed; the accumulator starts at -128 * (the block's query sum), so S_b = sum q * k exactly.
template <int G>
void scores_q8(const int8_t* qq, const float* qd, int64_t D, int64_t first, int64_t num_keys, const uint8_t* kc,
               const uint8_t* vc, const int32_t* table, int64_t BS, int64_t k_block, int64_t k_tok, int64_t k_offset,
               int64_t v_block, int64_t v_tok, int64_t v_offset, float* scores) {
  constexpr int L = 16;
  const int bs_shift = __builtin_ctzll(BS);
  const int64_t nb = D / kBlock, row = nb * kBlockBytes;
  int32_t q_offset[G * kMaxQ8Blocks];
  for (int g = 0; g < G; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      int32_t sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) sum += qq[g * D + b * kBlock + i];
      q_offset[g * nb + b] = -128 * sum;
    }
  alignas(64) __m512i cols[kMaxQ8Blocks][8];
  __m512 dk[kMaxQ8Blocks];
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t j0 = 0; j0 < num_keys; j0 += L) {
    const uint8_t* rows[L];
    const int n = q8_tile_rows<L>(j0, first, num_keys, kc, vc, table, bs_shift, k_block, k_tok, k_offset, v_block,
                                  v_tok, v_offset, row, rows);
    for (int64_t b = 0; b < nb; ++b) {
      __m256i r[L];
      alignas(32) uint16_t bits[L];
      for (int i = 0; i < L; ++i) {
        const uint8_t* blk = rows[i] + b * kBlockBytes;
        r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_values(blk)));
        bits[i] = scale_bits(blk);
      }
      transpose16x8_epi32(r, cols[b]);
      for (int t = 0; t < 8; ++t) cols[b][t] = _mm512_xor_si512(cols[b][t], top);
      dk[b] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(bits)));
    }
    for (int g = 0; g < G; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* qb = qq + g * D + b * kBlock;
        __m512i acc = _mm512_set1_epi32(q_offset[g * nb + b]);
        for (int t = 0; t < 8; ++t) acc = _mm512_dpbusd_epi32(acc, cols[b][t], _mm512_set1_epi32(q8_word(qb + 4 * t)));
        const __m512 step = _mm512_mul_ps(dk[b], _mm512_set1_ps(qd[g * nb + b]));
        s = _mm512_add_ps(s, _mm512_mul_ps(step, _mm512_cvtepi32_ps(acc)));
      }
      _mm512_mask_storeu_ps(scores + g * num_keys + j0, static_cast<__mmask16>((1u << n) - 1), s);
    }
  }
}
#else
// Lane i = the sum of v[i]'s 8 int32 lanes (exact: any order gives the same integer).
inline __m256i reduce_add8_epi32(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Pass 1, 8 keys per ymm, without VNNI: per key row and block, |k| x sign(q, k) in maddubs pairs (below
// 2 x 127 x 127 = 32,258, never saturated) widened by madd with ones, then the 8 keys' int32 lanes summed into
// one lane each. Without vpdpbusd a transpose does not pay: the sign trick costs the same per byte either way.
template <int G>
void scores_q8(const int8_t* qq, const float* qd, int64_t D, int64_t first, int64_t num_keys, const uint8_t* kc,
               const uint8_t* vc, const int32_t* table, int64_t BS, int64_t k_block, int64_t k_tok, int64_t k_offset,
               int64_t v_block, int64_t v_tok, int64_t v_offset, float* scores) {
  constexpr int L = 8;
  const int bs_shift = __builtin_ctzll(BS);
  const int64_t nb = D / kBlock, row = nb * kBlockBytes;
  __m256 dk[kMaxQ8Blocks];
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t j0 = 0; j0 < num_keys; j0 += L) {
    const uint8_t* rows[L];
    const int n = q8_tile_rows<L>(j0, first, num_keys, kc, vc, table, bs_shift, k_block, k_tok, k_offset, v_block,
                                  v_tok, v_offset, row, rows);
    for (int64_t b = 0; b < nb; ++b) {
      alignas(16) uint16_t bits[L];
      for (int i = 0; i < L; ++i) bits[i] = scale_bits(rows[i] + b * kBlockBytes);
      dk[b] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(bits)));
    }
    for (int g = 0; g < G; ++g) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qq + g * D + b * kBlock));
        __m256i part[L];
        for (int i = 0; i < L; ++i) {
          const __m256i kb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_values(rows[i] + b * kBlockBytes)));
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(kb, kb), _mm256_sign_epi8(qb, kb));
          part[i] = _mm256_madd_epi16(pairs, ones);
        }
        const __m256 step = _mm256_mul_ps(dk[b], _mm256_set1_ps(qd[g * nb + b]));
        s = _mm256_add_ps(s, _mm256_mul_ps(step, _mm256_cvtepi32_ps(reduce_add8_epi32(part))));
      }
      if (n == L) {
        _mm256_storeu_ps(scores + g * num_keys + j0, s);
      } else {
        alignas(32) float tmp[L];
        _mm256_store_ps(tmp, s);
        std::memcpy(scores + g * num_keys + j0, tmp, n * sizeof(float));
      }
    }
  }
}
#endif

#if defined(__AVX512F__)
// Pass 3 with G query heads, 16 * CH elements (CH / 2 blocks) per sweep over the keys: each element one FMA
// chain in key order, acc += (p_g * dv_b) * v, the same bits as the 256-bit pass below.
template <int G, int CH>
void weighted_sum_q8(const float* scores, int64_t first, int64_t num_keys, const uint8_t* vc, const int32_t* table,
                     int64_t BS, int64_t v_block, int64_t v_tok, int64_t v_offset, int64_t D, float* acc_out) {
  static_assert(CH % 2 == 0, "whole 32-blocks per sweep");
  constexpr int NB = CH / 2;
  const int bs_shift = __builtin_ctzll(BS);
  for (int64_t c0 = 0; c0 < D; c0 += 16 * CH) {
    const int64_t b0 = c0 / kBlock;
    __m512 acc[G][CH];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < num_keys; ++j) {
      const uint8_t* v = vc + cache_row(table, j + first, bs_shift, v_block, v_tok, v_offset) + b0 * kBlockBytes;
      if (kValuesAheadInPass3 && j + kQ8Ahead < num_keys)
        prefetch_lines(vc + cache_row(table, j + kQ8Ahead + first, bs_shift, v_block, v_tok, v_offset) + b0 * kBlockBytes,
                    NB * kBlockBytes);
      __m512 vf[CH];
      float dv[NB];
      for (int k = 0; k < NB; ++k) {
        const uint8_t* blk = v + k * kBlockBytes;
        dv[k] = _cvtsh_ss(scale_bits(blk));
        for (int h = 0; h < 2; ++h)
          vf[2 * k + h] = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block_values(blk) + 16 * h))));
      }
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * num_keys + j];
        for (int k = 0; k < NB; ++k) {
          const __m512 w = _mm512_set1_ps(p * dv[k]);
          for (int h = 0; h < 2; ++h) acc[g][2 * k + h] = _mm512_fmadd_ps(w, vf[2 * k + h], acc[g][2 * k + h]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc_out + g * D + c0 + 16 * c, acc[g][c]);
  }
}
#else
// The 256-bit pass 3 runs in key tiles: a tile's V rows (32 x 68 B at head dim 64, 32 x 272 B at 256) stay in
// L1 while every sweep of the head's elements runs over them, where one sweep over the whole history re-read
// each row from L2 or memory once per sweep (head dim 64 with 4 query heads: four sweeps). 1.04-1.19x on
// x86-64-v3 decode, measured; the 512-bit pass keeps one sweep over all keys (one sweep at head dim 64, and
// tiles measured ~0.95x there: benchmarks/results.md, issue #26, session 7).
constexpr int64_t kQ8SumTile = 32;

inline int64_t q8_sum_rows(int64_t j0, int64_t first, int64_t num_keys, const uint8_t* vc, const int32_t* table,
                           int bs_shift, int64_t v_block, int64_t v_tok, int64_t v_offset,
                           const uint8_t* rows[kQ8SumTile]) {
  const int64_t n = std::min<int64_t>(kQ8SumTile, num_keys - j0);
  for (int64_t j = 0; j < n; ++j) rows[j] = vc + cache_row(table, j0 + j + first, bs_shift, v_block, v_tok, v_offset);
  return n;
}

// Pass 3 with G query heads, CH vectors (8 * CH elements of one block) per sweep, in key tiles (kQ8SumTile):
// the G x CH accumulators stay in registers through a tile and wait in acc_out between tiles; each element
// is still one FMA chain in key order, the bits of one sweep over all keys.
template <int G, int CH>
void weighted_sum_q8(const float* scores, int64_t first, int64_t num_keys, const uint8_t* vc, const int32_t* table,
                     int64_t BS, int64_t v_block, int64_t v_tok, int64_t v_offset, int64_t D, float* acc_out) {
  const int bs_shift = __builtin_ctzll(BS);
  std::fill(acc_out, acc_out + G * D, 0.0f);
  const uint8_t* rows[kQ8SumTile];
  for (int64_t j0 = 0; j0 < num_keys; j0 += kQ8SumTile) {
    const int64_t n = q8_sum_rows(j0, first, num_keys, vc, table, bs_shift, v_block, v_tok, v_offset, rows);
    for (int64_t c0 = 0; c0 < D; c0 += 8 * CH) {
      const int64_t b = c0 / kBlock, within = c0 % kBlock;
      __m256 acc[G][CH];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CH; ++c) acc[g][c] = _mm256_loadu_ps(acc_out + g * D + c0 + 8 * c);
      for (int64_t j = 0; j < n; ++j) {
        const uint8_t* blk = rows[j] + b * kBlockBytes;
        const float dv = _cvtsh_ss(scale_bits(blk));
        const int8_t* vals = block_values(blk) + within;
        __m256 vf[CH];
        for (int c = 0; c < CH; ++c)
          vf[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vals + 8 * c))));
        for (int g = 0; g < G; ++g) {
          const __m256 w = _mm256_set1_ps(scores[g * num_keys + j0 + j] * dv);
          for (int c = 0; c < CH; ++c) acc[g][c] = _mm256_fmadd_ps(w, vf[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CH; ++c) _mm256_storeu_ps(acc_out + g * D + c0 + 8 * c, acc[g][c]);
    }
  }
}
#endif

using ScoresQ8Fn = void (*)(const int8_t*, const float*, int64_t, int64_t, int64_t, const uint8_t*, const uint8_t*,
                            const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float*);

inline ScoresQ8Fn scores_q8_fn(int64_t G, int64_t D) {
  if (D / kBlock > kMaxQ8Blocks) return nullptr;
  switch (G) {
    case 1: return scores_q8<1>;
    case 2: return scores_q8<2>;
    case 3: return scores_q8<3>;
    case 4: return scores_q8<4>;
    default: return nullptr;  // head_subgroup never leaves more than 4 query heads per task
  }
}

using SumQ8Fn = void (*)(const float*, int64_t, int64_t, const uint8_t*, const int32_t*, int64_t, int64_t, int64_t,
                         int64_t, int64_t, float*);

inline SumQ8Fn weighted_sum_q8_fn(int64_t G, int64_t D) {
#if defined(__AVX512F__)
  // G x CH accumulators + CH values <= 24 of the 32 registers; 64 elements per sweep where D allows.
  const bool wide = D % 64 == 0;
  switch (G) {
    case 1: return wide ? weighted_sum_q8<1, 4> : weighted_sum_q8<1, 2>;
    case 2: return wide ? weighted_sum_q8<2, 4> : weighted_sum_q8<2, 2>;
    case 3: return wide ? weighted_sum_q8<3, 4> : weighted_sum_q8<3, 2>;
    case 4: return wide ? weighted_sum_q8<4, 4> : weighted_sum_q8<4, 2>;
    default: return nullptr;
  }
#else
  (void)D;
  switch (G) {  // G x CH accumulators <= 12 of the 16 registers
    case 1: return weighted_sum_q8<1, 4>;
    case 2: return weighted_sum_q8<2, 4>;
    case 3: return weighted_sum_q8<3, 4>;
    case 4: return weighted_sum_q8<4, 2>;
    default: return nullptr;
  }
#endif
}
#endif

// Attention with a Q8_0 key and/or value cache (the other one, if any, in the query's dtype).
template <typename scalar_t>
void attend_rows_q8(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                    const torch::Tensor& block_tables, const torch::Tensor& token_seq, const torch::Tensor& token_pos,
                    double scale, int64_t window, double softcap, const float* sinks, const int32_t* key_end,
                    torch::Tensor& out) {
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2);
  // More than 4 query heads per KV head: sub-groups of G heads, as in attend_rows.
  const int64_t NSUB = H / KVH / head_subgroup(H / KVH), G = H / KVH / NSUB, nb = D / kBlock;
  const int bs_shift = __builtin_ctzll(BS);
  const int64_t max_blocks = block_tables.size(1);
  const bool k_q8 = key_cache.scalar_type() == torch::kByte, v_q8 = value_cache.scalar_type() == torch::kByte;
  // Strides in elements of each cache's own type (bytes for a Q8_0 cache).
  const int64_t k_row = k_q8 ? conveyor_q8::row_bytes(D) : D, v_row = v_q8 ? conveyor_q8::row_bytes(D) : D;
  const int64_t k_tok = KVH * k_row, k_block = BS * k_tok, v_tok = KVH * v_row, v_block = BS * v_tok;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const uint8_t* kq = k_q8 ? key_cache.data_ptr<uint8_t>() : nullptr;
  const uint8_t* vq = v_q8 ? value_cache.data_ptr<uint8_t>() : nullptr;
  const scalar_t* ks = k_q8 ? nullptr : key_cache.data_ptr<scalar_t>();
  const scalar_t* vs = v_q8 ? nullptr : value_cache.data_ptr<scalar_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* seq = token_seq.data_ptr<int32_t>();
  const int32_t* pos = token_pos.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t q_row = H * D;
  const float fscale = static_cast<float>(scale);
#if defined(__AVX2__) && defined(__FMA__)
  const ScoresQ8Fn fast_qk = k_q8 ? scores_q8_fn(G, D) : nullptr;  // up to 4 query heads per task (head_subgroup)
  const SumQ8Fn fast_sum = v_q8 ? weighted_sum_q8_fn(G, D) : nullptr;
#else
  const void* fast_qk = nullptr;
  const void* fast_sum = nullptr;
#endif
  // The unquantized side of a mixed pair takes the bf16 path's own fast passes where it has them.
  const auto plain_sum = v_q8 ? nullptr : fp32_weighted_sum(vs, G, D);
  const auto plain_qk = k_q8 ? nullptr : fast_pass<Pass::kScores>(ks, G, D);
#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
  const ScoresBf16Fn plain_dp_qk = !k_q8 && std::is_same_v<scalar_t, c10::BFloat16> ? wide_scores_fn(G, D) : nullptr;
#else
  const void* plain_dp_qk = nullptr;
#endif

  conveyor_parallel::parallel_for(0, T * KVH * NSUB, 1, [&](int64_t begin, int64_t end) {
    const DenormalsOff flush;  // as attend_rows: the tiny weights' assists in pass 3
    std::vector<float> scores, qf(G * D), qd(G * nb), acc(G * D), denom(G), vf(D);
    std::vector<int8_t> qq(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / (KVH * NSUB), vkv = task % (KVH * NSUB), kvh = vkv / NSUB;
      // key_end (Gemma 3's image rows): keys up to the end of the row's bidirectional run; the window still
      // starts from the row's own position.
      const int64_t first = first_key(static_cast<int64_t>(pos[t]) + 1, window);
      const int64_t visible = key_end != nullptr ? static_cast<int64_t>(key_end[t]) : static_cast<int64_t>(pos[t]) + 1;
      const int64_t num_keys = visible - first;
      const int32_t* table = bt + static_cast<int64_t>(seq[t]) * max_blocks;
      if (static_cast<int64_t>(scores.size()) < G * num_keys) scores.resize(G * num_keys);
      const scalar_t* q_heads = q + t * q_row + vkv * G * D;
      // Pass 1: scores, in key order.
      if (k_q8) {
        quantize_query(q_heads, G, D, qq.data(), qd.data());
#if defined(__AVX2__) && defined(__FMA__)
        if (fast_qk != nullptr)
          fast_qk(qq.data(), qd.data(), D, first, num_keys, kq, vq, table, BS, k_block, k_tok, kvh * k_row, v_block,
                  v_tok, kvh * v_row, scores.data());
#endif
        for (int64_t j = 0; fast_qk == nullptr && j < num_keys; ++j) {
          const uint8_t* k = kq + cache_row(table, j + first, bs_shift, k_block, k_tok, kvh * k_row);
          for (int64_t g = 0; g < G; ++g) scores[g * num_keys + j] = dot_q8(qq.data() + g * D, qd.data() + g * nb, k, nb);
        }
        for (int64_t i = 0; i < G * num_keys; ++i) scores[i] *= fscale;
      } else if (plain_dp_qk != nullptr) {
#if defined(__AVX512F__) || defined(CONVEYOR_AVX2)
        const auto* kb = reinterpret_cast<const c10::BFloat16*>(ks);  // the K rows stand in for V's prefetch
        plain_dp_qk(reinterpret_cast<const c10::BFloat16*>(q_heads), fscale, first, num_keys, kb, kb, table, BS,
                    k_block, k_tok, kvh * k_row, scores.data());
#endif
      } else {
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(q_heads[g * D + d]) * fscale;
        if (plain_qk != nullptr)
          plain_qk(qf.data(), first, num_keys, ks, table, BS, k_block, k_tok, kvh * k_row, scores.data());
        for (int64_t j = 0; plain_qk == nullptr && j < num_keys; ++j) {
          const scalar_t* k = ks + cache_row(table, j + first, bs_shift, k_block, k_tok, kvh * k_row);
          for (int64_t g = 0; g < G; ++g) scores[g * num_keys + j] = dot(qf.data() + g * D, k, D);
        }
      }
      softmax_scores(scores.data(), G, num_keys, softcap, denom.data(), sinks ? sinks + vkv * G : nullptr);  // pass 2
      // Pass 3: weighted sum of values, in key order.
#if defined(__AVX2__) && defined(__FMA__)
      if (fast_sum != nullptr)
        fast_sum(scores.data(), first, num_keys, vq, table, BS, v_block, v_tok, kvh * v_row, D, acc.data());
#endif
      if (plain_sum != nullptr)
        plain_sum(scores.data(), first, num_keys, vs, table, BS, v_block, v_tok, kvh * v_row, acc.data());
      const bool summed = fast_sum != nullptr || plain_sum != nullptr;
      if (!summed) std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; !summed && j < num_keys; ++j) {
        const int64_t key = j + first;
        if (v_q8) {
          add_row_q8(scores.data(), num_keys, j, vq + cache_row(table, key, bs_shift, v_block, v_tok, kvh * v_row), G,
                     D, acc.data());
          continue;
        }
        load_row(vs + cache_row(table, key, bs_shift, v_block, v_tok, kvh * v_row), vf.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * num_keys + j];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      store_heads(acc.data(), denom.data(), G, D, o + t * q_row + vkv * G * D);
    }
  });
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor token_seq, torch::Tensor token_pos,
                              double scale, int64_t window, double softcap, c10::optional<torch::Tensor> sinks,
                              c10::optional<torch::Tensor> key_end) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "paged_attention: bad ranks");
  // A Q8_0 cache is uint8 (kv_q8.h); any other cache is in the query's dtype.
  const bool q8 = key_cache.scalar_type() == torch::kByte || value_cache.scalar_type() == torch::kByte;
  for (const auto& cache : {key_cache, value_cache})
    TORCH_CHECK(cache.scalar_type() == query.scalar_type() || cache.scalar_type() == torch::kByte,
                "paged_attention: dtype mismatch");
  TORCH_CHECK(!q8 || query.size(2) % conveyor_q8::kBlock == 0, "paged_attention: Q8_0 caches need head_dim % 32 == 0");
  for (const auto& cache : {key_cache, value_cache})
    TORCH_CHECK(cache.scalar_type() != torch::kByte || cache.size(3) == conveyor_q8::row_bytes(query.size(2)),
                "paged_attention: a Q8_0 cache row must be head_dim / 32 blocks of 34 bytes");
  const int64_t block_size = key_cache.size(1);
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0, "paged_attention: block size must be a power of two");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && token_seq.scalar_type() == torch::kInt32 &&
                  token_pos.scalar_type() == torch::kInt32, "paged_attention: index tensors must be int32");
  // NOTE: the caches are whole-pool tensors; a hidden .contiguous() copy would cost the pool per call.
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  query = query.contiguous();
  // Attention sinks (GPT-OSS): one fp32 logit per query head, or None.
  torch::Tensor sink_values;
  if (sinks.has_value() && sinks->defined()) {
    sink_values = sinks->to(torch::kFloat32).contiguous();
    TORCH_CHECK(sink_values.dim() == 1 && sink_values.size(0) == query.size(1),
                "paged_attention: sinks must hold one value per query head");
  }
  const float* sink_ptr = sink_values.defined() ? sink_values.data_ptr<float>() : nullptr;
  // Per-row exclusive end of the visible keys (None: each row's own position + 1, plain causal attention).
  torch::Tensor key_ends;
  if (key_end.has_value() && key_end->defined()) {
    key_ends = key_end->contiguous();
    TORCH_CHECK(key_ends.scalar_type() == torch::kInt32 && key_ends.dim() == 1 && key_ends.size(0) == query.size(0),
                "paged_attention: key_end must be int32, one per row");
  }
  const int32_t* end_ptr = key_ends.defined() ? key_ends.data_ptr<int32_t>() : nullptr;
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    if (q8)
      attend_rows_q8<scalar_t>(query, key_cache, value_cache, block_tables.contiguous(), token_seq.contiguous(),
                               token_pos.contiguous(), scale, window, softcap, sink_ptr, end_ptr, out);
    else
      attend_rows<scalar_t>(query, key_cache, value_cache, block_tables.contiguous(), token_seq.contiguous(),
                            token_pos.contiguous(), scale, window, softcap, sink_ptr, end_ptr, out);
  });
  return out;
}

// The path paged_attention takes for bf16 queries and caches of this head dim in this process.
const char* paged_path(int64_t head_dim) {
#if CONVEYOR_PAGED_AMX
  if (conveyor_paged_amx::enabled() && conveyor_paged_amx::fits(head_dim)) return "amx";
#endif
  (void)head_dim;
  return "rows";
}

// The calling thread's row-path scratch (prepare_rows) in bytes, and the cap it stays within; 0, 0 where this level
// has no prepass (tests).
std::pair<int64_t, int64_t> row_prepass_bytes() {
#if defined(CONVEYOR_ROW_PREPASS)
  return {caller_prepass().bytes(), prepass_cap_bytes()};
#else
  return {0, 0};
#endif
}

// NOTE: every entry point releases the GIL, as torch's own ops do; holding it here stalled the
// server's event loop for whole kernels and then made the engine wait out the GIL switch interval.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("isa", &conveyor_isa::compiled_level, "the -march level this module was compiled for");
  conveyor_parallel::def_pool_sharing(m);
  namespace py = pybind11;
  m.def("paged_attention", &paged_attention, "Row-invariant paged attention (CPU)", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("token_seq"),
        py::arg("token_pos"), py::arg("scale"), py::arg("window"), py::arg("softcap"), py::arg("sinks"),
        py::arg("key_end") = py::none(), release());
  m.def("dense_attention", &dense_attention, "Full attention over one sequence, (P, H * D) bf16 (vision towers)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("num_heads"), py::arg("scale"), release());
  m.def("paged_attention_path", &paged_path, "paged_attention's path for bf16 K/V of this head dim here: amx or rows",
        py::arg("head_dim"));
  m.def("row_prepass_bytes", &row_prepass_bytes, "this thread's row-path prepass scratch and its cap, in bytes");
  m.def("dense_attention_path", &conveyor_dense::path, "dense_attention's path for a head dim here: amx or fp32",
        py::arg("head_dim"));
}
