// y = x W^T (+ b) for bf16 CPU linears, row-invariant by construction: every output element
// is one fixed sequence of floating-point ops over k, whatever M is and wherever the row sits,
// so a request's logits never depend on its batch-mates.
//
// Why our own GEMM: at decode sizes (M = 1..32 rows) oneDNN streamed the weights at ~40% of
// this machine's memory bandwidth, and its kernel choice changes with M, so rows were bitwise
// stable only in tiles of <= 32.
//
// One build runs one arithmetic path, chosen at compile time from the -march macros:
//   amx / avx512_bf16  (AVX-512 BF16; AMX when the CPU and the kernel allow it, decided once per
//                       process): vdpbf16ps / tdpbf16ps, pairs of bf16 products into fp32.
//   avx512             (AVX-512F without BF16), avx2 (AVX2 + FMA), generic (portable C++):
//                       bf16 widened to fp32, one multiply-add chain per element (see below).
//
// AVX-512 BF16 weight layout (packed once at load): panels of 64 output columns, each panel
// [K/2][64][2] bf16, so one k-pair of a panel is four contiguous 64-byte vectors and a
// thread reading its panels walks one sequential stream.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "bf16.h"
#include "isa.h"
#include "parallel.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CONVEYOR_HAS_BF16_LINEAR 1
#else
#define CONVEYOR_HAS_BF16_LINEAR 0
#endif

namespace {

constexpr int64_t kPanel = 64;  // output columns per panel (4 zmm of fp32 accumulators)
constexpr int kMaxRows = 6;     // rows per micro-kernel call: 6 x 4 = 24 accumulators

#if CONVEYOR_HAS_BF16_LINEAR

// out[r][c] for MR rows and one panel. x rows are read as 32-bit (bf16, bf16) pairs.
template <int MR>
inline void panel_rows(const uint16_t* x, int64_t ldx, int64_t k_pairs, bool odd_k, const uint16_t* panel,
                       const float* bias, uint16_t* out, int64_t ldo, int64_t cols) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* w = panel;
  for (int64_t kp = 0; kp < k_pairs; ++kp, w += 2 * kPanel) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * kp, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
    }
  }
  if (odd_k) {  // last k alone: pair it with a zero (the packed weight holds a zero there too)
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int r = 0; r < MR; ++r) {
      const int32_t pair = static_cast<int32_t>(x[r * ldx + 2 * k_pairs]);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
    }
  }
  for (int r = 0; r < MR; ++r) {
    uint16_t* o = out + r * ldo;
    for (int j = 0; j < 4; ++j) {
      const int64_t c0 = 16 * j;
      if (c0 >= cols) break;
      __m512 v = acc[r][j];
      const __mmask16 mask = cols - c0 >= 16 ? static_cast<__mmask16>(0xFFFF)
                                              : static_cast<__mmask16>((1u << (cols - c0)) - 1);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c0));
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(o + c0, mask, rounded);
    }
  }
}

using PanelFn = void (*)(const uint16_t*, int64_t, int64_t, bool, const uint16_t*, const float*, uint16_t*, int64_t,
                         int64_t);
constexpr PanelFn kPanelFns[kMaxRows + 1] = {nullptr, panel_rows<1>, panel_rows<2>, panel_rows<3>,
                                             panel_rows<4>, panel_rows<5>, panel_rows<6>};

#endif


#if CONVEYOR_HAS_AMX
constexpr int kTileRows = 16;
constexpr int64_t kKBlock = 32;  // k per tile op
constexpr int64_t kPrefetchBlocks = 2;

// One 16-row block against one 64-column panel: C = sum over k-blocks of A_kb B_kb, in
// k order; the hardware reduces every C element the same way, whatever the other rows hold.
inline void amx_panel_block(const uint16_t* a, int64_t lda_bytes, int64_t k_blocks, const uint16_t* panel,
                            float* cbuf) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr int64_t kb_stride = kTileRows * 2 * kPanel;  // bf16 elements per 16 k-pairs of a panel
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint16_t* b = panel + kb * kb_stride;
    // The four B loads walk 4 KB at a 256-byte stride; ask for the block after next ourselves.
    const char* ahead = reinterpret_cast<const char*>(b + kPrefetchBlocks * kb_stride);
    for (int line = 0; line < 64; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    _tile_loadd(4, a + kb * kKBlock, lda_bytes);
    _tile_loadd(5, b, 4 * kPanel);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 32, 4 * kPanel);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 64, 4 * kPanel);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 96, 4 * kPanel);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, cbuf, 4 * kPanel);
  _tile_stored(1, cbuf + 16, 4 * kPanel);
  _tile_stored(2, cbuf + 32, 4 * kPanel);
  _tile_stored(3, cbuf + 48, 4 * kPanel);
}
#endif

#if CONVEYOR_HAS_BF16_LINEAR
// fp32 row (+ bias) -> bf16, round to nearest even, only the first `cols` columns.
inline void store_row(const float* acc, const float* bias, uint16_t* out, int64_t cols) {
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const __mmask16 mask = cols - c0 >= 16 ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (cols - c0)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(mask, acc + c0);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c0));
    _mm256_mask_storeu_epi16(out + c0, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}
#endif

}  // namespace

// ---------------------------------------------------------------------------------------------
// Builds without AVX-512 BF16: the bf16 weights are widened to fp32 in registers and every
// output element is ONE chain of fp32 multiply-adds over k, in k order from 0:
//   acc = 0; for k: acc = acc (+) x[k] * w[k]; then acc + bias (fp32); then bf16 (nearest even).
// (+) is one fused multiply-add on AVX2 / AVX-512F and a multiply then an add in the portable
// path (-ffp-contract=off). A bf16 x bf16 product has at most 16 significant bits, exact in
// fp32, so both round alike: the three paths give the same bits (unless a product under- or
// overflows fp32). Row tiles of any height, panel groups of any width, row blocks for cache,
// threads: they only choose which chains run side by side, never the ops of one chain, so a
// row's bits do not depend on M or on where the row sits in the batch.
//
// Weight layout: panels of 16 output columns, each panel [ceil(K/2)][16][2] bf16 (k pairs
// interleaved, zero-padded in K and N), so one k-pair of a panel is one 64-byte line: the even
// k of column c is the low half of 32-bit word c, the odd k its high half (one shift / one mask
// widens a whole line to fp32). x is widened to fp32 once per call (odd K: a zero after the row,
// against the packed zero: the extra step adds 0 * 0 in every row alike).
// ---------------------------------------------------------------------------------------------
#if !CONVEYOR_HAS_BF16_LINEAR
#if defined(__AVX512F__)
#define CONVEYOR_F32_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define CONVEYOR_F32_AVX2 1
#else
#define CONVEYOR_F32_GENERIC 1
#endif
#if defined(CONVEYOR_F32_AVX512) || defined(CONVEYOR_F32_AVX2)
#include <immintrin.h>
#endif
// Unrolled in full before the compiler decides where the accumulator arrays live: a loop over
// them left rolled at that point pins them to the stack (a store per accumulator per k step).
#define CONVEYOR_UNROLL _Pragma("GCC unroll 16")

namespace f32gemm {

constexpr int64_t kCols = 16;  // output columns per panel

using conveyor_bf16::round_bf16;
using conveyor_bf16::widen_bf16;

// A partial panel (the last one when N % 16 != 0): out[c] = bf16(acc[c] + bias[c]), c < n.
inline void store_partial(const float* acc, const float* bias, uint16_t* out, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = round_bf16(bias != nullptr ? acc[c] + bias[c] : acc[c]);
}

#if defined(CONVEYOR_F32_AVX512)
// AVX-512F (Skylake-SP .. Ice Lake, Zen 4 builds at -march=skylake-avx512): a panel's 16
// columns are one zmm; the x broadcasts fold into the FMAs.
constexpr int kMaxRows = 8;  // 8 x 1 accumulators: enough chains to cover FMA latency on 2 ports
constexpr int kMaxGroup = 4;
constexpr int kPanelsFor[kMaxRows + 1] = {0, 4, 4, 2, 2, 1, 1, 1, 1};  // panels per kernel call
constexpr int64_t kPrefetch = 256;  // bf16 elements ahead in a panel stream (8 k-pairs, 512 bytes)

inline void store16(__m512 v, const float* bias, uint16_t* out, int64_t n) {
  if (n < kCols) {
    alignas(64) float tmp[kCols];
    _mm512_store_ps(tmp, v);
    store_partial(tmp, bias, out, n);
    return;
  }
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

template <int MR, int NP>
void tile(const float* x, int64_t ldx, int64_t k_pairs, const uint16_t* w, int64_t pstride, const float* bias,
          uint16_t* out, int64_t ldo, int64_t cols) {
  __m512 acc[MR][NP];
  CONVEYOR_UNROLL for (int r = 0; r < MR; ++r)
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    const uint16_t* line = w + 2 * kCols * kp;
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(line + j * pstride + kPrefetch), _MM_HINT_T0);
    }
    // Even k of the pair for every accumulator, then odd k: one chain per element either way.
    __m512 wv[NP];
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) {
      wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(line + j * pstride), 16));
    }
    CONVEYOR_UNROLL for (int r = 0; r < MR; ++r) {
      const __m512 xe = _mm512_set1_ps(x[r * ldx + 2 * kp]);
      CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(xe, wv[j], acc[r][j]);
    }
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) {
      wv[j] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(line + j * pstride), odd_mask));
    }
    CONVEYOR_UNROLL for (int r = 0; r < MR; ++r) {
      const __m512 xo = _mm512_set1_ps(x[r * ldx + 2 * kp + 1]);
      CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(xo, wv[j], acc[r][j]);
    }
  }
  CONVEYOR_UNROLL for (int r = 0; r < MR; ++r) {
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) {
      if (j * kCols < cols)
        store16(acc[r][j], bias != nullptr ? bias + j * kCols : nullptr, out + r * ldo + j * kCols,
                std::min<int64_t>(kCols, cols - j * kCols));
    }
  }
}

#elif defined(CONVEYOR_F32_AVX2)
// AVX2 + FMA (Haswell .. Alder Lake, Zen 1-3): a panel's 16 columns are two ymm.
constexpr int kMaxRows = 5;  // 5 x 2 accumulators + 2 weights + broadcast + mask: 14 of 16 ymm
constexpr int kMaxGroup = 2;
constexpr int kPanelsFor[kMaxRows + 1] = {0, 2, 2, 1, 1, 1};
constexpr int64_t kPrefetch = 256;

inline __m256i round_bf16x8(__m256 v) {  // 8 x (bf16 in the low half of a 32-bit lane)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

inline void store16(__m256 lo, __m256 hi, const float* bias, uint16_t* out, int64_t n) {
  if (n < kCols) {
    alignas(32) float tmp[kCols];
    _mm256_store_ps(tmp, lo);
    _mm256_store_ps(tmp + 8, hi);
    store_partial(tmp, bias, out, n);
    return;
  }
  if (bias != nullptr) {
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
  }
  // packus interleaves 64-bit quarters (lo0-3, hi0-3, lo4-7, hi4-7): put them back in order.
  const __m256i packed = _mm256_packus_epi32(round_bf16x8(lo), round_bf16x8(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xD8));
}

template <int MR, int NP>
void tile(const float* x, int64_t ldx, int64_t k_pairs, const uint16_t* w, int64_t pstride, const float* bias,
          uint16_t* out, int64_t ldo, int64_t cols) {
  __m256 acc[MR][NP][2];
  CONVEYOR_UNROLL for (int r = 0; r < MR; ++r)
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    const uint16_t* line = w + 2 * kCols * kp;
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(line + j * pstride + kPrefetch), _MM_HINT_T0);
    }
    // Even k of the pair for every accumulator, then odd k: every chain advances one step
    // before any takes its next (they overlap the FMA latency); the ops of one chain are the
    // same either way.
    __m256 wv[NP][2];
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j)
      CONVEYOR_UNROLL for (int h = 0; h < 2; ++h)
        wv[j][h] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + j * pstride + 16 * h)), 16));
    CONVEYOR_UNROLL for (int r = 0; r < MR; ++r) {
      const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * kp);
      CONVEYOR_UNROLL for (int j = 0; j < NP; ++j)
        CONVEYOR_UNROLL for (int h = 0; h < 2; ++h) acc[r][j][h] = _mm256_fmadd_ps(xe, wv[j][h], acc[r][j][h]);
    }
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j)
      CONVEYOR_UNROLL for (int h = 0; h < 2; ++h)
        wv[j][h] = _mm256_castsi256_ps(_mm256_and_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + j * pstride + 16 * h)), odd_mask));
    CONVEYOR_UNROLL for (int r = 0; r < MR; ++r) {
      const __m256 xo = _mm256_broadcast_ss(x + r * ldx + 2 * kp + 1);
      CONVEYOR_UNROLL for (int j = 0; j < NP; ++j)
        CONVEYOR_UNROLL for (int h = 0; h < 2; ++h) acc[r][j][h] = _mm256_fmadd_ps(xo, wv[j][h], acc[r][j][h]);
    }
  }
  CONVEYOR_UNROLL for (int r = 0; r < MR; ++r) {
    CONVEYOR_UNROLL for (int j = 0; j < NP; ++j) {
      if (j * kCols < cols)
        store16(acc[r][j][0], acc[r][j][1], bias != nullptr ? bias + j * kCols : nullptr, out + r * ldo + j * kCols,
                std::min<int64_t>(kCols, cols - j * kCols));
    }
  }
}

#else
// Portable C++ (x86-64 baseline, aarch64, ...): acc[c] = acc[c] + x * w[c], a multiply then an
// add per step (-ffp-contract=off). The c loops run across output columns, so the compiler can
// vectorize them (SSE2, NEON) without touching the order within one column.
#if defined(__aarch64__)
constexpr int kMaxRows = 4;  // 32 vector registers: 4 x 4 accumulators + weights
#else
constexpr int kMaxRows = 2;  // 16 SSE registers: 2 x 4 accumulators + weights
#endif
constexpr int kMaxGroup = 1;
constexpr int kPanelsFor[5] = {0, 1, 1, 1, 1};

template <int MR, int NP>
void tile(const float* x, int64_t ldx, int64_t k_pairs, const uint16_t* w, int64_t pstride, const float* bias,
          uint16_t* out, int64_t ldo, int64_t cols) {
  static_assert(NP == 1, "the portable kernel takes one panel at a time");
  (void)pstride;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  constexpr int kEvenShift = 0;  // the bf16 at the lower address is the high half of the word
#else
  constexpr int kEvenShift = 16;
#endif
  float acc[MR][kCols];
  CONVEYOR_UNROLL for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.f;
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    // One 64-byte line: word c holds column c's (even k, odd k) pair. Widen with whole-array
    // shifts and masks (bit copies into float arrays), which vectorize on SSE2 and NEON alike.
    uint32_t words[kCols], even_bits[kCols], odd_bits[kCols];
    std::memcpy(words, w + 2 * kCols * kp, sizeof(words));
    for (int c = 0; c < kCols; ++c) {
      even_bits[c] = kEvenShift != 0 ? words[c] << 16 : words[c] & 0xFFFF0000u;
      odd_bits[c] = kEvenShift != 0 ? words[c] & 0xFFFF0000u : words[c] << 16;
    }
    float we[kCols], wo[kCols];
    std::memcpy(we, even_bits, sizeof(we));
    std::memcpy(wo, odd_bits, sizeof(wo));
    CONVEYOR_UNROLL for (int r = 0; r < MR; ++r) {
      const float xe = x[r * ldx + 2 * kp];
      for (int c = 0; c < kCols; ++c) acc[r][c] = acc[r][c] + xe * we[c];
    }
    CONVEYOR_UNROLL for (int r = 0; r < MR; ++r) {
      const float xo = x[r * ldx + 2 * kp + 1];
      for (int c = 0; c < kCols; ++c) acc[r][c] = acc[r][c] + xo * wo[c];
    }
  }
  const int64_t n = std::min<int64_t>(kCols, cols);
  CONVEYOR_UNROLL for (int r = 0; r < MR; ++r) store_partial(acc[r], bias, out + r * ldo, n);
}
#endif

using TileFn = void (*)(const float*, int64_t, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t,
                        int64_t);

template <int MR, int NP>
constexpr TileFn tile_entry() {
  if constexpr (MR <= kMaxRows && NP <= kPanelsFor[MR]) {
    return &tile<MR, NP>;
  } else {
    return nullptr;
  }
}

template <int MR>
constexpr std::array<TileFn, 5> tile_row() {
  return {nullptr, tile_entry<MR, 1>(), tile_entry<MR, 2>(), tile_entry<MR, 3>(), tile_entry<MR, 4>()};
}

// kTiles[rows][panels]: the kernel for a block of `rows` rows (1..kMaxRows) and `panels` panels.
constexpr std::array<std::array<TileFn, 5>, 9> kTiles = {
    std::array<TileFn, 5>{}, tile_row<1>(), tile_row<2>(), tile_row<3>(), tile_row<4>(),
    tile_row<5>(),           tile_row<6>(), tile_row<7>(), tile_row<8>()};
static_assert(kMaxRows <= 8 && kMaxGroup <= 4, "kTiles covers up to 8 rows and 4 panels");

// Rows [0, n) cut into `parts` near-equal consecutive blocks: where block i starts.
inline int64_t block_start(int64_t n, int64_t parts, int64_t i) {
  const int64_t base = n / parts, extra = n % parts;
  return i * base + std::min(i, extra);
}

// Large M: rows go in cache blocks of about this many bytes of fp32 x (L2-resident while the
// thread walks the panels), near-equal so the threads' shares stay even.
constexpr int64_t kRowBlockBytes = 192 * 1024;

struct Problem {
  const float* x;  // fp32 rows, stride ldx, zero-padded to 2 * k_pairs
  int64_t ldx, m, k_pairs;
  const uint16_t* w;  // packed panels
  int64_t pstride, panels;
  const float* bias;  // fp32, out_features entries, or null
  uint16_t* out;
  int64_t n;  // out_features (the row stride of out)
};

// Rows [r0, r1) against panels [p0, p1): panel groups outer (their weights stay in L1/L2), row
// tiles of at most kMaxRows inner, cut near-equal (AVX2, 16 rows: 4 + 4 + 4 + 4, not 5 + 5 + 5 + 1).
inline void run_block(const Problem& pr, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
  const int64_t rows = r1 - r0, parts = (rows + kMaxRows - 1) / kMaxRows;
  for (int64_t g = p0; g < p1; g += kMaxGroup) {
    const int64_t g_end = std::min(p1, g + kMaxGroup);
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t rs = r0 + block_start(rows, parts, part), mr = r0 + block_start(rows, parts, part + 1) - rs;
      const int64_t step = kPanelsFor[mr];
      for (int64_t p = g; p < g_end; p += step) {
        const int64_t np = std::min(step, g_end - p), c0 = p * kCols;
        kTiles[mr][np](pr.x + rs * pr.ldx, pr.ldx, pr.k_pairs, pr.w + p * pr.pstride, pr.pstride,
                       pr.bias != nullptr ? pr.bias + c0 : nullptr, pr.out + rs * pr.n + c0, pr.n,
                       std::min(np * kCols, pr.n - c0));
      }
    }
  }
}

// Tiles (row block, panel) numbered row block by row block: each thread takes one contiguous
// run, so it keeps its row block's x in cache while it walks the panels.
inline void run(const Problem& pr) {
  const int64_t row_bytes = pr.ldx * static_cast<int64_t>(sizeof(float));
  const int64_t block_rows = std::max<int64_t>(kMaxRows, kRowBlockBytes / row_bytes);
  const int64_t row_blocks = (pr.m + block_rows - 1) / block_rows;
  conveyor_parallel::parallel_for(0, row_blocks * pr.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end;) {
      const int64_t rb = t / pr.panels, p0 = t % pr.panels, p1 = std::min(pr.panels, p0 + (end - t));
      run_block(pr, block_start(pr.m, row_blocks, rb), block_start(pr.m, row_blocks, rb + 1), p0, p1);
      t += p1 - p0;
    }
  });
}

// x (M, K) bf16 (row stride ldx) -> fp32 rows of `width` floats, zeros after K.
inline void widen_rows(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, float* dst, int64_t width) {
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* src = x + r * ldx;
      float* d = dst + r * width;
      for (int64_t i = 0; i < k; ++i) d[i] = widen_bf16(src[i]);
      for (int64_t i = k; i < width; ++i) d[i] = 0.f;
    }
  };
  if (m * k < (1 << 16)) {
    rows(0, m);
  } else {
    conveyor_parallel::parallel_for(0, m, 16, rows);
  }
}

}  // namespace f32gemm
#endif  // !CONVEYOR_HAS_BF16_LINEAR

namespace {

// Chosen once per process, so every call (every M) of every layer goes through the same kernel.
enum class Backend { kAvx512Bf16, kAmx, kF32 };

Backend backend() {
  static const Backend chosen = [] {
#if CONVEYOR_HAS_AMX
    if (conveyor_amx::enabled()) return Backend::kAmx;
#endif
    return CONVEYOR_HAS_BF16_LINEAR ? Backend::kAvx512Bf16 : Backend::kF32;
  }();
  return chosen;
}

}  // namespace

#if CONVEYOR_HAS_AMX
bool conveyor_amx::enabled() {
  static const bool ok = std::getenv("CONVEYOR_DISABLE_AMX") == nullptr && request_permission();
  return ok;
}
#endif

std::string bf16_linear_backend() {
  switch (backend()) {
    case Backend::kAmx: return "amx";
    case Backend::kAvx512Bf16: return "avx512_bf16";
    default: break;
  }
#if defined(CONVEYOR_F32_AVX512)
  return "avx512";
#elif defined(CONVEYOR_F32_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

// Packed shapes, zero-padded, k in pairs:
//   amx / avx512_bf16: (ceil(N/64), ceil(K/32)*16, 64, 2), panels of 64 output columns, k padded
//                      to whole AMX k-blocks of 32;
//   avx512 / avx2 / generic: (ceil(N/16), ceil(K/2), 16, 2), panels of 16 output columns.
torch::Tensor bf16_linear_pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be a 2-D bf16 tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
#if CONVEYOR_HAS_BF16_LINEAR
  const int64_t cols = kPanel, n_pad = (n + cols - 1) / cols * cols, k_pad = (k + 31) / 32 * 32;
#else
  const int64_t cols = f32gemm::kCols, n_pad = (n + cols - 1) / cols * cols, k_pad = (k + 1) / 2 * 2;
#endif
  auto padded = torch::zeros({n_pad, k_pad}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({n_pad / cols, cols, k_pad / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if !CONVEYOR_HAS_BF16_LINEAR
// The avx512 / avx2 / generic paths (see f32gemm above).
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                         const c10::optional<torch::Tensor>& bias) {
  using f32gemm::kCols;
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "weight not packed by this module's pack() (", bf16_linear_backend(), " layout: (N/16, K/2, 16, 2))");
  const int64_t m = x.size(0), k = x.size(1), k_pairs = (k + 1) / 2;
  TORCH_CHECK(packed.size(1) == k_pairs, "in_features mismatch");
  TORCH_CHECK(packed.size(0) == (out_features + kCols - 1) / kCols, "out_features mismatch");
  auto out = torch::empty({m, out_features}, x.options());
  if (m == 0) return out;
  torch::Tensor bias_f32;  // callers pass it in fp32 already (see RowInvariantLinear.prepack): no copy then
  if (bias.has_value() && bias->defined()) {
    bias_f32 = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f32.numel() == out_features, "bias must have out_features entries");
  }
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  // x in fp32, once per call: rows 2 * k_pairs wide (zero after K), the stride nudged off
  // multiples of 4 KB so the rows of a block don't alias in L1. Decode-sized calls reuse a
  // per-thread buffer; prefill-sized ones take a tensor for the call (the GEMM dwarfs it).
  const int64_t width = 2 * k_pairs, ldx = width % 1024 == 0 ? width + 16 : width;
  constexpr int64_t kReusedFloats = 1 << 18;  // 1 MB
  thread_local std::vector<float> xbuf;
  torch::Tensor xbig;
  float* xf;
  if (m * ldx <= kReusedFloats) {
    if (static_cast<int64_t>(xbuf.size()) < m * ldx) xbuf.resize(m * ldx);
    xf = xbuf.data();
  } else {
    xbig = torch::empty({m * ldx}, x.options().dtype(at::kFloat));
    xf = xbig.data_ptr<float>();
  }
  f32gemm::widen_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), xc.stride(0), m, k, xf, ldx);
  f32gemm::Problem pr;
  pr.x = xf;
  pr.ldx = ldx;
  pr.m = m;
  pr.k_pairs = k_pairs;
  pr.w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  pr.pstride = k_pairs * 2 * kCols;
  pr.panels = packed.size(0);
  pr.bias = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  pr.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  pr.n = out_features;
  f32gemm::run(pr);
  return out;
}
#endif

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a 2-D bf16 tensor");
#if !CONVEYOR_HAS_BF16_LINEAR
  return f32_linear(x, packed, out_features, bias);
#else
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2, "weight not packed by bf16_linear_pack");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == (k + 31) / 32 * 16, "in_features mismatch");
  TORCH_CHECK(packed.size(0) * kPanel >= out_features, "out_features mismatch");
  auto out = torch::empty({m, out_features}, x.options());
  if (m == 0) return out;
  torch::Tensor bias_f32;  // callers pass it in fp32 already (see RowInvariantLinear.prepack): no copy then
  if (bias.has_value() && bias->defined()) bias_f32 = bias->to(at::kFloat).contiguous();
  const float* bias_ptr = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t panel_stride = packed.size(1) * 2 * kPanel;
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
#if CONVEYOR_HAS_AMX
  if (backend() == Backend::kAmx) {
    // A tiles read 16 rows x 32 k: pad k to the packed width, and give the last partial row
    // block its own zero-filled copy so no tile load runs past the input.
    const int64_t k_pad = packed.size(1) * 2, k_blocks = k_pad / kKBlock;
    torch::Tensor xa = k_pad == k ? x.contiguous() : torch::constant_pad_nd(x, {0, k_pad - k});
    const int64_t full = m / kTileRows * kTileRows;
    const auto* xp = reinterpret_cast<const uint16_t*>(xa.data_ptr<at::BFloat16>());
    // Decode always has a partial block (M < 16): a reused per-thread buffer, not a tensor per call.
    thread_local std::vector<uint16_t> tail;
    if (full < m) {
      tail.assign(kTileRows * k_pad, 0);
      std::memcpy(tail.data(), xp + full * k_pad, (m - full) * k_pad * sizeof(uint16_t));
    }
    const uint16_t* tp = full < m ? tail.data() : nullptr;
    conveyor_parallel::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      conveyor_amx::configure_tiles();
      alignas(64) float cbuf[kTileRows * kPanel];
      for (int64_t p = begin; p < end; ++p) {
        const int64_t c0 = p * kPanel, cols = std::min(kPanel, out_features - c0);
        const float* b = bias_ptr != nullptr ? bias_ptr + c0 : nullptr;
        for (int64_t r = 0; r < m; r += kTileRows) {
          const bool partial = r >= full;
          amx_panel_block(partial ? tp : xp + r * k_pad, k_pad * 2, k_blocks, wp + p * panel_stride, cbuf);
          const int64_t rows = std::min<int64_t>(kTileRows, m - r);
          for (int64_t i = 0; i < rows; ++i) store_row(cbuf + i * kPanel, b, op + (r + i) * out_features + c0, cols);
        }
      }
      _tile_release();
    });
    return out;
  }
#endif
#if CONVEYOR_HAS_BF16_LINEAR
  auto xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const int64_t k_pairs = k / 2;
  const bool odd_k = (k % 2) != 0;
  conveyor_parallel::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t c0 = p * kPanel, cols = std::min(kPanel, out_features - c0);
      const uint16_t* panel = wp + p * panel_stride;
      const float* b = bias_ptr != nullptr ? bias_ptr + c0 : nullptr;
      for (int64_t r = 0; r < m; r += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r));
        kPanelFns[rows](xp + r * k, k, k_pairs, odd_k, panel, b, op + r * out_features + c0, out_features, cols);
      }
    }
  });
#endif
  return out;
#endif  // !CONVEYOR_HAS_BF16_LINEAR
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("isa", &conveyor_isa::compiled_level, "the -march level this module was compiled for");
  conveyor_parallel::def_pool_sharing(m);
  m.def("backend", &bf16_linear_backend,
        "bf16_linear's kernel in this process: amx, avx512_bf16, avx512, avx2 or generic");
  m.def("pack", &bf16_linear_pack, "pack a (N, K) bf16 weight for bf16_linear", release());
  m.def("linear", &bf16_linear, "row-invariant bf16 x W^T (+ b) (CPU)", release());
}
