// y = x W^T (+ b) for GGML block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K, MXFP4), kept in their own bits: never expanded to bf16.
//
// How (llama.cpp's scheme, made batch-invariant):
//   1. each activation row is quantized on its own to int8 in blocks of 32 (scale amax/127, round
//      to nearest even), with the block's sum; a row's quantization never depends on other rows;
//   2. every 32-weight chunk of a weight column is dotted with the row's matching int8 block as an
//      exact integer sum (u8 weight x s8 activation, int32: no rounding, no saturation), so any
//      instruction (VNNI dpbusd, AVX2 maddubs, scalar) and any summation order give the same int;
//   3. the chunk's integer sum is scaled and added into the output's fp32 accumulator in chunk
//      order: one fixed sequence of float ops per output element, whatever M is and wherever the
//      row sits. So a row's bits never depend on its batch-mates, at every M.
//
// Weight layout (repacked once at load from the GGUF blocks, same bits, ~ the same bytes): columns
// in groups of 16; per group, per superblock (32 weights for the legacy types, 256 for K-quants) a
// header of the 16 columns' scales (fp16 as in the file; K-quants' 6-bit sub-block scales unpacked
// to bytes), then per 32-k chunk:
//   4/5/6-bit: 256 bytes of nibbles = 4 vectors of 64 bytes; byte (4 i + t) of vector v holds
//              column i's k = 4 v + t in its low nibble and k = 16 + 4 v + t in its high nibble,
//              so one vector gives two "k-groups" of 16 columns x 4 consecutive k (dpbusd's shape);
//              then the high bits, bit-sliced across the 8 k-groups: 5-bit, one vector whose byte
//              (4 i + t) holds bit 4 of k-group g's value in its bit g; 6-bit, two vectors whose byte
//              holds bits 4-5 of k-groups 4 v2 + g' in its bits 2 g' .. 2 g' + 1 (a shift and a mask per
//              k-group, on every ISA);
//   8-bit:     8 vectors of 64 bytes, vector g byte (4 i + t) = column i's k = 4 g + t, plus 128.
// Weights are stored unsigned (q, plus the type's offset); the offset comes back exactly as
// offset x (the activation block's sum), an integer. MXFP4 keeps its 4-bit E2M1 codes as nibbles
// and its E8M0 scale bytes as the header; unpacking looks the codes up (a byte shuffle) as the
// doubled E2M1 values plus 12, 0..24, so they then run as a Q4_0-style type of offset 12.
//
// One build runs one path, from the -march macros: AVX-512 VNNI (16 columns per zmm), AVX2
// (8-column halves; AVX-VNNI's dpbusd where the CPU has it, else maddubs + madd), or portable C++.
// Q4_K on plain AVX2, avx512_vnni and amx_int8 (at every M), and Q6_K on avx512_vnni, quantize activations per 256
// instead (one float step per superblock on exact int32 superblock sums; see tile_sb_q4k, amx_sb_item, tile_sb_q6k).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bf16.h"
#include "isa.h"
#include "parallel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QG_AVX512 1
#include <immintrin.h>

#include <cstdlib>

#include "amx.h"  // tile configuration and the permission request (AMX builds)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_AVX2 1
#include <immintrin.h>
#if defined(__AVXVNNI__)
#define QG_AVXVNNI 1
#endif
#else
#define QG_GENERIC 1
#endif

namespace {

// GGML type ids (ggml.h), the ones we run.
enum : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kMXFP4 = 39 };

// How a chunk's integer sum becomes a float term:
//   kOffset (Q4_0 Q5_0 Q8_0 MXFP4): w = d (q - o)           acc += (dx d) * (S - o bx)
//   kMin    (Q4_1 Q5_1):      w = d q + m                   acc += (dx d) * S;  acc += m * sx
//   kKMin   (Q4_K Q5_K):      w = (d sc) q - (dmin mn)      acc += (dx (d sc)) * S;  acc -= (dmin mn) * sx
//   kK6     (Q6_K):           w = (d sc) (q - 32), sc per 16 k: the chunk's two halves, each as kOffset
//                             (header: d, sc, then kQ6Fold's per-column offset constant)
// where S = sum of q x over the chunk (int), bx = sum of the activation block (int), dx its scale,
// sx = dx * bx. d sc and dmin mn are exact in fp32 (11-bit x 6/8-bit products). MXFP4's d is the
// E8M0 byte's power of two halved (ggml's e8m0_to_fp32_half), as its E2M1 values are doubled.
enum class Kind { kOffset, kMin, kKMin, kK6 };

struct TypeInfo {
  int sb;         // weights per superblock
  int raw_bytes;  // GGUF bytes per superblock
  int hdr;        // our header bytes per superblock per 16-column group
  int planes;     // high-bit vectors above the nibbles (5-bit: 1, 6-bit: 2)
  bool bytes8;    // 8-bit values (Q8_0)
  Kind kind;
  int offset;
  bool e2m1 = false;  // MXFP4: nibbles are E2M1 codes (looked up), the header E8M0 bytes (not fp16)
};

constexpr TypeInfo type_info(int qt) {
  switch (qt) {
    case kQ4_0: return {32, 18, 32, 0, false, Kind::kOffset, 8};
    case kQ4_1: return {32, 20, 64, 0, false, Kind::kMin, 0};
    case kQ5_0: return {32, 22, 32, 1, false, Kind::kOffset, 16};
    case kQ5_1: return {32, 24, 64, 1, false, Kind::kMin, 0};
    case kQ8_0: return {32, 34, 32, 0, true, Kind::kOffset, 128};
    case kQ4_K: return {256, 144, 320, 0, false, Kind::kKMin, 0};
    case kQ5_K: return {256, 176, 320, 1, false, Kind::kKMin, 0};
    case kQ6_K: return {256, 210, 352, 2, false, Kind::kK6, 32};
    case kMXFP4: return {32, 17, 16, 0, false, Kind::kOffset, 12, true};
    default: return {0, 0, 0, 0, false, Kind::kOffset, 0};
  }
}

constexpr int chunk_bytes(const TypeInfo& t) { return t.bytes8 ? 512 : 256 + 64 * t.planes; }
constexpr int64_t sb_bytes(const TypeInfo& t) { return t.hdr + static_cast<int64_t>(t.sb / 32) * chunk_bytes(t); }
// What a walk prefetches at chunk c of a superblock (prefetch_ahead's fixed distance on): its chunk's bytes, and for
// Q6_K at the last chunk the header's too, so the prefetches cover every byte of the weight. Measured on a Zen 5,
// one core: Q6_K 1.08-1.10x at M = 1-16 with the header prefetched, Q5_K even, Q4_K 0.92x at M = 1 (why is not
// known; Q4_K's header is whole cache lines, Q6_K's ends mid-line).
constexpr int prefetch_bytes(const TypeInfo& t, int c) {
  return chunk_bytes(t) + (t.kind == Kind::kK6 && c == t.sb / 32 - 1 ? t.hdr : 0);
}

constexpr int kGroup = 16;  // columns per group
constexpr int kQ6Fold = 288;  // Q6_K header: the 16 columns' int32 offset constants (store_column) after d and sc

bool supported(int qt) { return type_info(qt).sb != 0; }

// The weights stream from memory once per step: ask for what comes ~3 KB after this chunk (the
// hardware prefetcher alone left the batched decode ~15% slower on a 1B model, measured). Hint 3
// (prefetcht0) where a tile reuses the bytes for more rows. The decode walks (1-2 rows, each byte used
// once) take a hint by CPU vendor, measured at the plain AVX2 level: prefetchnta on AMD (1.07-1.3x over
// t0 at M = 1-2 on a Zen 2 core; benchmarks/results.md, "Issue #26: qgemm round 2"), prefetcht1 elsewhere
// (on an Intel Xeon, family 6 model 207, nta ran the 1B model's decode step 1.3x slower than t1 and the
// hardware prefetcher alone as slow as nta; t0 ~1.04x slower; "Issue #26, session 8"). t0 stayed better
// from 16 rows on both.
template <int Hint = 3>
inline void prefetch_ahead(const uint8_t* chunk, int bytes) {
#if defined(__GNUC__)
  for (int line = 0; line < bytes; line += 64) __builtin_prefetch(chunk + 3072 + line, 0, Hint);
#else
  (void)chunk;
  (void)bytes;
#endif
}

// Whether this CPU's decode walks prefetch non-temporally (above); QG_STREAM_NTA=0/1 fixes it at build
// time (benchmarks/qgemm_ab.py's A/B variants).
inline bool stream_nta() {
#if defined(QG_STREAM_NTA)
  return QG_STREAM_NTA != 0;
#elif defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

#if defined(__AVXVNNI__)
inline void prefetch_stream(const uint8_t* chunk, int bytes, bool) { prefetch_ahead(chunk, bytes); }  // not measured there
#else
inline void prefetch_stream(const uint8_t* chunk, int bytes, bool nta) {
  if (nta) {
    prefetch_ahead<0>(chunk, bytes);
  } else {
    prefetch_ahead<2>(chunk, bytes);
  }
}
#endif

inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// IEEE half -> float, exact (subnormals included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// MXFP4's 16 E2M1 codes as ggml's kvalues_mxfp4 (the values doubled: 0, 1, 2, 3, 4, 6, 8, 12, and
// negated) plus 12, so they are unsigned for u8 x s8 dot products; the offset comes back as 12 bx.
alignas(16) constexpr uint8_t kE2M1Plus12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// E8M0 byte -> its power of two halved, 2^(e - 128), exactly as ggml_e8m0_to_fp32_half (e < 2: subnormal).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

using conveyor_bf16::round_bf16;
using conveyor_bf16::widen_bf16;

// ------------------------------------------------------------------------------------------
// Repacking: one GGUF superblock of one column -> unsigned values + scales.
// ------------------------------------------------------------------------------------------
struct Decoded {
  uint8_t q[256];
  uint16_t d = 0, m = 0;  // fp16 bits: scale, and min (Q4_1/Q5_1) or dmin (K-quants)
  uint8_t sc[16] = {};    // K-quant sub-block scales (Q6_K: int8 bits)
  uint8_t mn[8] = {};     // K-quant sub-block mins
};

inline void k4_scale_min(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_block(int qt, const uint8_t* b, Decoded& o) {
  switch (qt) {
    case kQ4_0:
    case kQ4_1: {
      o.d = rd16(b);
      const uint8_t* qs = b + 2;
      if (qt == kQ4_1) { o.m = rd16(b + 2); qs = b + 4; }
      for (int j = 0; j < 16; ++j) { o.q[j] = qs[j] & 15; o.q[j + 16] = qs[j] >> 4; }
      break;
    }
    case kQ5_0:
    case kQ5_1: {
      o.d = rd16(b);
      const uint8_t* p = b + 2;
      if (qt == kQ5_1) { o.m = rd16(b + 2); p = b + 4; }
      const uint32_t qh = rd32(p);
      const uint8_t* qs = p + 4;
      for (int j = 0; j < 16; ++j) {
        o.q[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
        o.q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      break;
    }
    case kMXFP4: {  // one E8M0 byte, then 16 bytes of codes: low nibbles k 0..15, high k 16..31
      o.d = b[0];
      for (int j = 0; j < 16; ++j) { o.q[j] = b[1 + j] & 15; o.q[j + 16] = b[1 + j] >> 4; }
      break;
    }
    case kQ8_0: {
      o.d = rd16(b);
      for (int j = 0; j < 32; ++j) o.q[j] = static_cast<uint8_t>(static_cast<int>(static_cast<int8_t>(b[2 + j])) + 128);
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      o.d = rd16(b);
      o.m = rd16(b + 2);
      const uint8_t* scales = b + 4;
      for (int j = 0; j < 8; ++j) k4_scale_min(j, scales, &o.sc[j], &o.mn[j]);
      const uint8_t* qh = qt == kQ5_K ? b + 16 : nullptr;
      const uint8_t* qs = qt == kQ5_K ? b + 48 : b + 16;
      for (int c = 0; c < 4; ++c) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t v = qs[32 * c + l];
          o.q[64 * c + l] = v & 15;
          o.q[64 * c + 32 + l] = v >> 4;
          if (qh != nullptr) {
            o.q[64 * c + l] |= ((qh[l] >> (2 * c)) & 1) << 4;
            o.q[64 * c + 32 + l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
        }
      }
      break;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      std::memcpy(o.sc, b + 192, 16);
      o.d = rd16(b + 208);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* l0 = ql + 64 * n;
        const uint8_t* h0 = qh + 32 * n;
        uint8_t* q = o.q + 128 * n;
        for (int l = 0; l < 32; ++l) {
          q[l] = (l0[l] & 15) | (((h0[l] >> 0) & 3) << 4);
          q[l + 32] = (l0[l + 32] & 15) | (((h0[l] >> 2) & 3) << 4);
          q[l + 64] = (l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4);
          q[l + 96] = (l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4);
        }
      }
      break;
    }
    default: break;
  }
}

// Writes column `i` (0..15) of one superblock of a group: header entries and chunk bits.
void store_column(int qt, const Decoded& o, int i, uint8_t* sbp) {
  const TypeInfo t = type_info(qt);
  if (t.e2m1) {
    sbp[i] = static_cast<uint8_t>(o.d);
  } else {
    std::memcpy(sbp + 2 * i, &o.d, 2);
  }
  if (t.kind == Kind::kMin || t.kind == Kind::kKMin) std::memcpy(sbp + 32 + 2 * i, &o.m, 2);
  if (t.kind == Kind::kKMin) {
    for (int j = 0; j < 8; ++j) {
      sbp[64 + 16 * j + i] = o.sc[j];
      sbp[192 + 16 * j + i] = o.mn[j];
    }
  } else if (t.kind == Kind::kK6) {
    // The column's 128 sum_j sc_j sum_{k in j} (q - 32): exact int32 (|.| <= 128 x 16 x 128 x 512 < 2^31), what
    // tile_sb_q6k's biased activations (x + 128) add to a superblock's sum beyond sum_j sc_j sum (q - 32) x.
    int32_t fold = 0;
    for (int j = 0; j < 16; ++j) {
      sbp[32 + 16 * j + i] = o.sc[j];
      int32_t sub = 0;
      for (int k = 0; k < 16; ++k) sub += static_cast<int32_t>(o.q[16 * j + k]) - 32;
      fold += static_cast<int32_t>(static_cast<int8_t>(o.sc[j])) * sub;
    }
    fold *= 128;
    std::memcpy(sbp + kQ6Fold + 4 * i, &fold, 4);
  }
  const int cb = chunk_bytes(t);
  for (int c = 0; c < t.sb / 32; ++c) {
    uint8_t* ch = sbp + t.hdr + static_cast<int64_t>(c) * cb;
    const uint8_t* q = o.q + 32 * c;
    for (int k = 0; k < 32; ++k) {
      const int g = k / 4, tt = k % 4;
      if (t.bytes8) {
        ch[64 * g + 4 * i + tt] = q[k];
        continue;
      }
      const int v = g & 3;
      uint8_t& byte = ch[64 * v + 4 * i + tt];
      byte = g < 4 ? static_cast<uint8_t>((byte & 0xF0) | (q[k] & 15)) : static_cast<uint8_t>((byte & 0x0F) | ((q[k] & 15) << 4));
      if (t.planes == 1) {
        ch[256 + 4 * i + tt] |= static_cast<uint8_t>(((q[k] >> 4) & 1) << g);
      } else if (t.planes == 2) {
        ch[256 + 64 * (g / 4) + 4 * i + tt] |= static_cast<uint8_t>(((q[k] >> 4) & 3) << (2 * (g % 4)));
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Activations: each row quantized on its own, 32-blocks.
// ------------------------------------------------------------------------------------------
struct QuantRows {
  int8_t* q;     // (M, K)
  float* d;      // (M, K/32) scale
  float* s;      // (M, K/32) scale * block sum
  int32_t* b;    // (M, K/32) block sum
  int32_t* b16;  // (M, K/16) half-block sums (Q6_K)
  // (M, K/32, 3) the type's offset times minus the activation sums under each int16 lane of a maddubs
  // (k % 4 in {0, 1}: low half of the word, {2, 3}: high half), for k 0..15, 16..31 and the whole chunk:
  // the plain-AVX2 k_sums start their int16 sums there, so they end at S - offset b (see k_sums). Filled
  // only for the types and level that read it (seeded_sums).
  int32_t* seed;
  float* sd;     // (M, K/256) scale per 256-block, where the activations are quantized per superblock
  // (M, K/64) with sd: the 32-block sums of blocks 2j, 2j + 1 as one int16 pair word (low: 2j), the AVX-512
  // superblock Q4_K's broadcast operand for its mins (|b| <= 32 x 127 fits int16)
  int32_t* b2;
  int64_t k, chunks;
};

inline int32_t int16_pair_word(int32_t lo, int32_t hi) {
  return static_cast<int32_t>((static_cast<uint32_t>(hi) << 16) | (static_cast<uint32_t>(lo) & 0xFFFF));
}

#if defined(QG_AVX512)
// One 32-block of quantize_row, 16 values per vector: per value the same float ops (|v| into the max, v inv
// rounded to nearest even, clamped to +-127), so the same bytes, scale and sums as its scalar loop. NaN
// lanes are dropped from the max as std::max drops them, and clamp to -127 as its std::max(-127, r) does.
inline void quantize_block16x2(const uint16_t* x, int8_t* q, float* d, float* s, int32_t* b, int32_t* b16) {
  __m512 v[2], r[2];
  __m512 amax = _mm512_setzero_ps();
  for (int h = 0; h < 2; ++h) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * h));
    v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    const __m512 a = _mm512_abs_ps(v[h]);
    amax = _mm512_max_ps(amax, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), a));
  }
  const float m = _mm512_reduce_max_ps(amax);
  const float scale = m / 127.f;
  const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
  int32_t half[2];
  for (int h = 0; h < 2; ++h) {
    r[h] = _mm512_roundscale_ps(_mm512_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r[h] = _mm512_min_ps(_mm512_max_ps(r[h], _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));  // NaN -> -127
    const __m512i qi = _mm512_cvtps_epi32(r[h]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(qi));
    half[h] = _mm512_reduce_add_epi32(qi);
  }
  *d = scale;
  *b = half[0] + half[1];
  *s = scale * static_cast<float>(half[0] + half[1]);
  b16[0] = half[0];
  b16[1] = half[1];
}
#endif

// `seed` (QuantRows::seed, the type's `offset`): only where the tiles read it (seeded_sums), else null.
void quantize_row(const uint16_t* x, int64_t k, int8_t* q, float* d, float* s, int32_t* b, int32_t* b16,
                  int32_t* seed, int offset) {
  for (int64_t c = 0; c < k / 32; ++c) {
#if defined(QG_AVX512)
    if (seed == nullptr) {  // (the seeds are AVX2's)
      quantize_block16x2(x + 32 * c, q + 32 * c, d + c, s + c, b + c, b16 + 2 * c);
      continue;
    }
#endif
    float v[32];
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) {
      v[j] = widen_bf16(x[32 * c + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float scale = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < 32; ++j) {
      float r = std::nearbyint(v[j] * inv);
      r = std::min(127.f, std::max(-127.f, r));
      const int8_t qi = static_cast<int8_t>(r);
      q[32 * c + j] = qi;
      (j < 16 ? lo : hi) += qi;
    }
    d[c] = scale;
    b[c] = lo + hi;
    s[c] = scale * static_cast<float>(lo + hi);
    b16[2 * c] = lo;
    b16[2 * c + 1] = hi;
    if (seed == nullptr) continue;
    int32_t lane[2][2] = {};  // [k / 16][k % 4 / 2]
    for (int j = 0; j < 32; ++j) lane[j / 16][j % 4 / 2] += q[32 * c + j];
    for (int h = 0; h < 2; ++h) seed[3 * c + h] = int16_pair_word(-offset * lane[h][0], -offset * lane[h][1]);
    seed[3 * c + 2] = int16_pair_word(-offset * (lane[0][0] + lane[1][0]), -offset * (lane[0][1] + lane[1][1]));
  }
}

// The same row quantized with one scale per 256 values (llama.cpp's Q8_K): for the superblock Q4_K (and
// AVX-512's Q6_K) paths, which then sum a superblock's chunks exactly in int32. The 32-block sums are still kept
// (Q4_K's mins; b16's 16-block sums are no longer read: Q6_K's offset is folded, tile_sb_q6k); d and s are unused.
void quantize_row_sb(const uint16_t* x, int64_t k, int8_t* q, float* sd, int32_t* b, int32_t* b16) {
  for (int64_t blk = 0; blk < k / 256; ++blk) {
#if defined(QG_AVX512)
    {  // The scalar loop below, 16 values per vector, with quantize_block16x2's ops (the same bytes and scales)
      __m512 v[16];
      __m512 amax = _mm512_setzero_ps();
      for (int h = 0; h < 16; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 256 * blk + 16 * h));
        v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        const __m512 a = _mm512_abs_ps(v[h]);
        amax = _mm512_max_ps(amax, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), a));
      }
      const float m = _mm512_reduce_max_ps(amax);
      sd[blk] = m / 127.f;
      const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
      for (int c = 0; c < 8; ++c) {
        int32_t sum = 0;
        for (int h = 2 * c; h < 2 * c + 2; ++h) {
          __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));  // NaN -> -127
          const __m512i qi = _mm512_cvtps_epi32(r);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 256 * blk + 16 * h), _mm512_cvtepi32_epi8(qi));
          b16[16 * blk + h] = _mm512_reduce_add_epi32(qi);
          sum += b16[16 * blk + h];
        }
        b[8 * blk + c] = sum;
      }
      continue;
    }
#endif
    float v[256];
    float amax = 0.f;
    for (int j = 0; j < 256; ++j) {
      v[j] = widen_bf16(x[256 * blk + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    sd[blk] = amax / 127.f;
    for (int c = 0; c < 8; ++c) {
      int32_t half[2] = {0, 0};
      for (int j = 0; j < 32; ++j) {
        float r = std::nearbyint(v[32 * c + j] * inv);
        r = std::min(127.f, std::max(-127.f, r));
        const int8_t qi = static_cast<int8_t>(r);
        q[256 * blk + 32 * c + j] = qi;
        half[j / 16] += qi;
      }
      b16[16 * blk + 2 * c] = half[0];
      b16[16 * blk + 2 * c + 1] = half[1];
      b[8 * blk + c] = half[0] + half[1];
    }
  }
}

// ------------------------------------------------------------------------------------------
// Micro-kernels: MR rows x one group of columns, all superblocks. Each writes acc + bias as bf16.
// ------------------------------------------------------------------------------------------
#if defined(QG_AVX512)
constexpr int kMaxRows = 8;
// Q4_K runs with activations per superblock at every M, decode included, on amx_int8 (amx_sb_item from 16 rows,
// tile_sb_q4k below) and avx512_vnni (tile_sb_q4k): the same exact int32 superblock sums and float step, so the
// two levels (and plain AVX2's, sb_q4k_step) give a row the same bits. One float step per superblock instead of
// eight also made the avx512_vnni prefill faster (benchmarks/results.md, issue #43).
// Q6_K likewise on avx512_vnni only (tile_sb_q6k): amx_int8 keeps its per-16 float steps for Q6_K (its AMX tiles
// sum per chunk half), so there the VNNI tiles below 16 rows do too.
#if CONVEYOR_HAS_AMX && defined(__AMX_INT8__)
bool amx_enabled();
inline bool superblock_acts(int qt) { return qt == kQ4_K || (qt == kQ6_K && !amx_enabled()); }
#else
inline bool superblock_acts(int qt) { return qt == kQ4_K || qt == kQ6_K; }
#endif
inline bool seeded_sums(int) { return false; }

inline __m512i dot4(__m512i acc, __m512i w, const int8_t* x) {  // acc[i] += sum_t w[4i+t] x[t]
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x)))));
}

// One 32-block's dot products for 16 columns as two chains over the 8 k-groups (integer sums: the split changes
// no bit; two chains hide dpbusd's latency).
inline void dot32(const __m512i* w, const int8_t* x, __m512i& s0, __m512i& s1) {
  s0 = dot4(_mm512_setzero_si512(), w[0], x);
  s1 = dot4(_mm512_setzero_si512(), w[4], x + 16);
  s0 = dot4(s0, w[1], x + 4);
  s1 = dot4(s1, w[5], x + 20);
  s0 = dot4(s0, w[2], x + 8);
  s1 = dot4(s1, w[6], x + 24);
  s0 = dot4(s0, w[3], x + 12);
  s1 = dot4(s1, w[7], x + 28);
}

template <int QT>
inline void unpack(const uint8_t* ch, __m512i* w) {
  constexpr TypeInfo t = type_info(QT);
  if constexpr (t.bytes8) {
    for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(ch + 64 * g);
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v) {
      const __m512i raw = _mm512_loadu_si512(ch + 64 * v);
      w[v] = _mm512_and_si512(raw, m4);
      w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    }
    if constexpr (t.e2m1) {  // codes -> values + 12: one in-lane byte shuffle per k-group
      const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Plus12)));
      for (int g = 0; g < 8; ++g) w[g] = _mm512_shuffle_epi8(lut, w[g]);
    }
    // High bits into bits 4-5 of each byte: a 16-bit shift (no bit crosses into the masked
    // field from the other byte) and one ternary-logic op, w | (shifted & mask).
    if constexpr (t.planes == 1) {
      const __m512i hv = _mm512_loadu_si512(ch + 256), bit = _mm512_set1_epi8(0x10);
      for (int g = 0; g < 8; ++g) {
        const __m512i sh = g <= 4 ? _mm512_slli_epi16(hv, 4 - g) : _mm512_srli_epi16(hv, g - 4);
        w[g] = _mm512_ternarylogic_epi32(w[g], sh, bit, 0xF8);
      }
    } else if constexpr (t.planes == 2) {
      const __m512i bits = _mm512_set1_epi8(0x30);
      for (int v = 0; v < 2; ++v) {
        const __m512i hv = _mm512_loadu_si512(ch + 256 + 64 * v);
        w[4 * v + 0] = _mm512_ternarylogic_epi32(w[4 * v + 0], _mm512_slli_epi16(hv, 4), bits, 0xF8);
        w[4 * v + 1] = _mm512_ternarylogic_epi32(w[4 * v + 1], _mm512_slli_epi16(hv, 2), bits, 0xF8);
        w[4 * v + 2] = _mm512_ternarylogic_epi32(w[4 * v + 2], hv, bits, 0xF8);
        w[4 * v + 3] = _mm512_ternarylogic_epi32(w[4 * v + 3], _mm512_srli_epi16(hv, 2), bits, 0xF8);
      }
    }
  }
}

inline __m512 load_half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The 16 columns' d of a superblock: fp16, or MXFP4's E8M0 bytes as e8m0_half does (integer ops only).
template <int QT>
inline __m512 load_scales16(const uint8_t* sbp) {
  if constexpr (type_info(QT).e2m1) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sbp)));
    const __mmask16 normal = _mm512_cmpge_epi32_mask(e, _mm512_set1_epi32(2));
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __m512i norm = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(normal, sub, norm));
  } else {
    return load_half16(sbp);
  }
}

inline __m512 load_u8_16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load_i8_16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}


// The chunk's float step for one row: s0 / s1 are the integer sums over k 0..15 / 16..31 (their
// total for every type but Q6_K). The VNNI and AMX paths both call this: the same ops, the same bits.
template <int QT>
inline __m512 combine(__m512 acc, __m512i s0, __m512i s1, const QuantRows& xr, int64_t row, int64_t kc, __m512 ds,
                      __m512 dm, __m512 ds2) {
  constexpr TypeInfo t = type_info(QT);
  const __m512 dx = _mm512_set1_ps(xr.d[row * xr.chunks + kc]);
  if constexpr (t.kind == Kind::kK6) {
    const int32_t* b16 = xr.b16 + row * xr.chunks * 2 + 2 * kc;
    s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * b16[0]));
    s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * b16[1]));
    acc = _mm512_fmadd_ps(_mm512_mul_ps(dx, ds), _mm512_cvtepi32_ps(s0), acc);
    return _mm512_fmadd_ps(_mm512_mul_ps(dx, ds2), _mm512_cvtepi32_ps(s1), acc);
  } else {
    __m512i sum = _mm512_add_epi32(s0, s1);
    if constexpr (t.kind == Kind::kOffset) {
      sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(t.offset * xr.b[row * xr.chunks + kc]));
    }
    acc = _mm512_fmadd_ps(_mm512_mul_ps(dx, ds), _mm512_cvtepi32_ps(sum), acc);
    if constexpr (t.kind == Kind::kMin) {
      acc = _mm512_fmadd_ps(dm, _mm512_set1_ps(xr.s[row * xr.chunks + kc]), acc);
    } else if constexpr (t.kind == Kind::kKMin) {
      acc = _mm512_fnmadd_ps(dm, _mm512_set1_ps(xr.s[row * xr.chunks + kc]), acc);
    }
    return acc;
  }
}

// Per-column scales of chunk c of a superblock: ds (d, or d sc), dm (m, or dmin mn), ds2 (Q6_K's
// second half).
template <int QT>
inline void chunk_scales(const uint8_t* sbp, int c, __m512 d, __m512 m, __m512& ds, __m512& dm, __m512& ds2) {
  constexpr TypeInfo t = type_info(QT);
  ds = d;
  dm = m;
  ds2 = d;
  if constexpr (t.kind == Kind::kKMin) {
    ds = _mm512_mul_ps(d, load_u8_16(sbp + 64 + 16 * c));
    dm = _mm512_mul_ps(m, load_u8_16(sbp + 192 + 16 * c));
  } else if constexpr (t.kind == Kind::kK6) {
    ds = _mm512_mul_ps(d, load_i8_16(sbp + 32 + 16 * (2 * c)));
    ds2 = _mm512_mul_ps(d, load_i8_16(sbp + 32 + 16 * (2 * c + 1)));
  }
}

inline void store_rows(const __m512* acc, int rows, int64_t r0, const float* bias, uint16_t* out, int64_t ldo,
                       int64_t cols) {
  for (int r = 0; r < rows; ++r) {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, acc[r]);
    uint16_t* o = out + (r0 + r) * ldo;
    for (int64_t i = 0; i < cols; ++i) o[i] = round_bf16(bias != nullptr ? tmp[i] + bias[i] : tmp[i]);
  }
}

// ---- Q4_K per superblock (avx512_vnni and amx_int8 at every M; plain AVX2's contract on 16-column vectors) ----
// Activations int8 per 256 (quantize_row_sb). A superblock's sum_c sc_c S_c and its mins sum_c mn_c bx_c are
// exact int32 (|sum| <= 8 x 63 x 32 x 15 x 127 < 2^31), however they are formed: VNNI per chunk (sc_c x S_c,
// here), or AMX on the weights folded to sc q = 32 hi + lo (amx_sb_item). Then one float step per superblock and
// row, sb_q4k_float, in superblock order: a row's bits are the same whichever path and M computed its sums.

// The superblock's 16 columns' mins as int16 pairs per dword: sub-blocks (2j, 2j + 1), j = 0..3.
inline void sb_q4k_min_pairs(const uint8_t* sbp, __m512i* mnp) {
  for (int j = 0; j < 4; ++j) {
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sbp + 192 + 32 * j)));
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sbp + 208 + 32 * j)));
    mnp[j] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
}

// sum_c mn_c bx_c per column, exact; b2: the row's 4 pair words of this superblock (QuantRows::b2).
inline __m512i sb_q4k_mins(const __m512i* mnp, const int32_t* b2) {
  __m512i m = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mnp[0], _mm512_set1_epi32(b2[0]));
  m = _mm512_dpwssd_epi32(m, mnp[1], _mm512_set1_epi32(b2[1]));
  m = _mm512_dpwssd_epi32(m, mnp[2], _mm512_set1_epi32(b2[2]));
  return _mm512_dpwssd_epi32(m, mnp[3], _mm512_set1_epi32(b2[3]));
}

// The superblock's float step: acc += (dx d) S - (dx dmin) M, plain AVX2's sb_q4k_step on 16 columns.
inline __m512 sb_q4k_float(__m512 acc, __m512i isum, __m512i msum, float dx, __m512 d, __m512 dmin) {
  const __m512 dxv = _mm512_set1_ps(dx);
  acc = _mm512_fmadd_ps(_mm512_mul_ps(dxv, d), _mm512_cvtepi32_ps(isum), acc);
  return _mm512_fnmadd_ps(_mm512_mul_ps(dxv, dmin), _mm512_cvtepi32_ps(msum), acc);
}

// The per-superblock tiles' common loop (activations per 256): per superblock, each 32-k chunk's unpacked weights go
// to chunk(sbp, s, c, w, isum), which adds the MR rows' exact int32 sums; then finish(sbp, s, isum, acc) takes the
// superblock's one float step per row.
// NOTE: forced inline, the loop and the tiles' lambdas alike: left to GCC, Q4_K ran 10 % slower at M = 64-256.
#define QG_INLINE __attribute__((always_inline))
template <int QT, int MR, class Chunk, class Finish>
QG_INLINE inline void sb_tile_loop(const uint8_t* wg, int64_t n_sb, const float* bias, uint16_t* out, int64_t ldo,
                                   int64_t cols, int64_t r0, Chunk chunk, Finish finish) {
  constexpr TypeInfo t = type_info(QT);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n_sb; ++s) {
    const uint8_t* sbp = wg + s * sb_bytes(t);
    __m512i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const uint8_t* ch = sbp + t.hdr + c * chunk_bytes(t);
      prefetch_ahead(ch, prefetch_bytes(t, c));
      __m512i w[8];
      unpack<QT>(ch, w);
      chunk(sbp, s, c, w, isum);
    }
    finish(sbp, s, isum, acc);
  }
  store_rows(acc, MR, r0, bias, out, ldo, cols);
}

// Rows [r0, r0 + MR) x one group on the VNNI tiles (avx512_vnni at every M; amx_int8 below its 16 rows): chunk
// sums by dpbusd, times the chunk's sub-block scale in int32.
template <int MR>
void tile_sb_q4k(const uint8_t* wg, int64_t n_sb, const QuantRows& xr, int64_t r0, const float* bias, uint16_t* out,
                 int64_t ldo, int64_t cols) {
  const int64_t sb_per_row = xr.k / 256;
  const auto chunk = [&](const uint8_t* sbp, int64_t s, int c, const __m512i* w, __m512i* isum) QG_INLINE {
    // Each column's scale in both int16 halves of its dword; the two 16-k half sums of a row (each fits int16:
    // |16 k of q x| <= 16 x 15 x 127) packed as the low and high int16 of a dword: one vpdpwssd adds exactly
    // sc s0 + sc s1. Below 4 rows each half sum goes alone against sc (high word 0, meeting the half sum's sign
    // word). The same integers as add + vpmulld + add; a blend and a shift replace a second vpdpwssd on the
    // multiply pipes (1.03x at M = 256 on a Zen 5, which issues two of dpbusd / dpwssd / vpmulld a cycle in all).
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sbp + 64 + 16 * c)));
    const __m512i sc2 = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));
    for (int r = 0; r < MR; ++r) {
      const int8_t* x = xr.q + (r0 + r) * xr.k + 256 * s + 32 * c;
      __m512i s0, s1;
      dot32(w, x, s0, s1);
      if constexpr (MR >= 4) {
        const __m512i both = _mm512_mask_blend_epi16(0xAAAAAAAA, s0, _mm512_slli_epi32(s1, 16));
        isum[r] = _mm512_dpwssd_epi32(isum[r], both, sc2);
      } else {  // decode: the shift and blend lengthen the one row's chain (0.86x at M = 1)
        isum[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum[r], s0, sc), s1, sc);
      }
    }
  };
  const auto finish = [&](const uint8_t* sbp, int64_t s, const __m512i* isum, __m512* acc) QG_INLINE {
    const __m512 d = load_half16(sbp), dmin = load_half16(sbp + 32);
    __m512i mnp[4];
    sb_q4k_min_pairs(sbp, mnp);
    for (int r = 0; r < MR; ++r) {
      const int64_t row = r0 + r;
      const __m512i msum = sb_q4k_mins(mnp, xr.b2 + row * (xr.k / 64) + 4 * s);
      acc[r] = sb_q4k_float(acc[r], isum[r], msum, xr.sd[row * sb_per_row + s], d, dmin);
    }
  };
  sb_tile_loop<kQ4_K, MR>(wg, n_sb, bias, out, ldo, cols, r0, chunk, finish);
}

// ---- Q6_K per superblock (avx512_vnni; activations per 256, quantize_row_sb) ----
// w = d sc_j (q - 32), sc_j a signed byte per 16 k. The weights go in signed (q - 32, in -32..31) and the
// activations biased, u = x + 128 (1..255, quantize_rows stores them so for this path), so vpdpbusd's unsigned
// operand is the activation: a sub-block's sum_k u (q - 32) = S_j + 128 sum_k (q - 32) with S_j the wanted
// sum_k x (q - 32). The second term is the column's alone: 128 sum_j sc_j sum_k (q - 32) over a superblock is
// packed beside the scales (kQ6Fold) and subtracted once per superblock and row. So sum_j sc_j S_j comes out
// exactly in int32 (|S_j| <= 16 x 32 x 127, x |sc| <= 128, x 16 < 2^31; the biased sums <= 16 x 32 x 255 too), the
// same integer as unsigned q against x less 32 sum_j sc_j bx_j, which cost a vpdpwssd per sub-block pair and row
// (8 per superblock) where this costs one subtraction. Then one float step per superblock and row: acc += (dx d)
// sum_j sc_j S_j, where the per-32 path takes sixteen (one per sub-block). At every M the same ops, so rows stay
// batch-invariant.
inline void dot32_biased(const __m512i* w, const uint8_t* u, __m512i& s0, __m512i& s1) {
  const auto bu = [&](int k) { return _mm512_set1_epi32(static_cast<int>(rd32(u + k))); };
  s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bu(0), w[0]);
  s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bu(16), w[4]);
  s0 = _mm512_dpbusd_epi32(s0, bu(4), w[1]);
  s1 = _mm512_dpbusd_epi32(s1, bu(20), w[5]);
  s0 = _mm512_dpbusd_epi32(s0, bu(8), w[2]);
  s1 = _mm512_dpbusd_epi32(s1, bu(24), w[6]);
  s0 = _mm512_dpbusd_epi32(s0, bu(12), w[3]);
  s1 = _mm512_dpbusd_epi32(s1, bu(28), w[7]);
}

template <int MR>
void tile_sb_q6k(const uint8_t* wg, int64_t n_sb, const QuantRows& xr, int64_t r0, const float* bias, uint16_t* out,
                 int64_t ldo, int64_t cols) {
  const int64_t sb_per_row = xr.k / 256;
  const auto chunk = [&](const uint8_t* sbp, int64_t s, int c, const __m512i* w, __m512i* isum) QG_INLINE {
    // Both halves' sums per row as two interleaved chains (one chain per half and row left the dpbusd latency
    // exposed: 1.11x at M = 16-256 on a Zen 5), each times its sub-block's scale in int32.
    const uint8_t* u = reinterpret_cast<const uint8_t*>(xr.q) + r0 * xr.k + 256 * s + 32 * c;
    const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sbp + 32 + 32 * c)));
    const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sbp + 48 + 32 * c)));
    __m512i ws[8];
    for (int g = 0; g < 8; ++g) ws[g] = _mm512_sub_epi8(w[g], _mm512_set1_epi8(32));
    for (int r = 0; r < MR; ++r) {
      __m512i s0, s1;
      dot32_biased(ws, u + r * xr.k, s0, s1);
      isum[r] = _mm512_add_epi32(_mm512_add_epi32(isum[r], _mm512_mullo_epi32(s0, sc0)), _mm512_mullo_epi32(s1, sc1));
    }
  };
  const auto finish = [&](const uint8_t* sbp, int64_t s, const __m512i* isum, __m512* acc) QG_INLINE {
    const __m512i fold = _mm512_loadu_si512(sbp + kQ6Fold);
    const __m512 d = load_half16(sbp);
    for (int r = 0; r < MR; ++r) {
      const int64_t row = r0 + r;
      const __m512i total = _mm512_sub_epi32(isum[r], fold);
      const __m512 dxv = _mm512_set1_ps(xr.sd[row * sb_per_row + s]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dxv, d), _mm512_cvtepi32_ps(total), acc[r]);
    }
  };
  sb_tile_loop<kQ6_K, MR>(wg, n_sb, bias, out, ldo, cols, r0, chunk, finish);
}

template <int QT, int MR>
void tile(const uint8_t* wg, int64_t n_sb, const QuantRows& xr, int64_t r0, const float* bias, uint16_t* out,
          int64_t ldo, int64_t cols) {
  if constexpr (QT == kQ4_K) {
    if (superblock_acts(QT)) return tile_sb_q4k<MR>(wg, n_sb, xr, r0, bias, out, ldo, cols);
  }
  if constexpr (QT == kQ6_K) {
    if (superblock_acts(QT)) return tile_sb_q6k<MR>(wg, n_sb, xr, r0, bias, out, ldo, cols);
  }
  constexpr TypeInfo t = type_info(QT);
  constexpr int cpb = t.sb / 32;
  constexpr int64_t sbb = sb_bytes(t);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n_sb; ++s) {
    const uint8_t* sbp = wg + s * sbb;
    const __m512 d = load_scales16<QT>(sbp);
    __m512 m = _mm512_setzero_ps();
    if constexpr (t.kind == Kind::kMin || t.kind == Kind::kKMin) m = load_half16(sbp + 32);
    for (int c = 0; c < cpb; ++c) {
      const uint8_t* ch = sbp + t.hdr + c * chunk_bytes(t);
      prefetch_ahead(ch, prefetch_bytes(t, c));
      __m512i w[8];
      unpack<QT>(ch, w);
      const int64_t kc = s * cpb + c;  // the row's 32-block
      __m512 ds, dm, ds2;
      chunk_scales<QT>(sbp, c, d, m, ds, dm, ds2);
      for (int r = 0; r < MR; ++r) {
        const int64_t row = r0 + r;
        const int8_t* x = xr.q + row * xr.k + 32 * kc;
        __m512i s0, s1;
        dot32(w, x, s0, s1);
        acc[r] = combine<QT>(acc[r], s0, s1, xr, row, kc, ds, dm, ds2);
      }
    }
  }
  store_rows(acc, MR, r0, bias, out, ldo, cols);
}

#if CONVEYOR_HAS_AMX && defined(__AMX_INT8__)  // amx.h: AMX tiles (+ BF16), here with INT8
#define QG_AMX 1
// AMX int8 for 16-row blocks (batched decode, prefill). Per 32-k chunk one tdpbssd of the rows' int8
// (16 x 32 bytes) and the chunk's B tile (8 k-groups x 64 bytes: unpack's vectors, dpbusd's and the tile's
// shape alike) gives every (row, column) chunk sum as an exact integer. B holds the weights signed,
// q - offset (every type fits s8), so the tile's sum is S - offset bx, the integer `combine` forms; the
// float step then applies combine's float ops in its order: a row's bits are the VNNI path's at M = 1.
//
// Where the time goes, per chunk and 16-row block (8192 multiply-adds), measured on a 2-vCPU Sapphire Rapids
// VM with a standalone loop of this shape (benchmarks/results.md, issue #43): the tile work (A and B loads,
// the product, the store of the sums) ~10.5 ns, the float step (per row: convert, scale product, FMA; + the
// min for Q4_1/Q5_1/K-quants; Q6_K twice) ~10 ns, and the two do not overlap there: ~0.35-0.4 TMAC/s per
// core at best, ~12% of the tile unit's int8 peak (a 32-k product does half a full 64-k tile's work in the
// same time, so even alone it caps at 50%). Everything else is paid per column group, not per chunk and row
// block: an item unpacks its group's weights once into a panel (tile layout, signed) with each chunk's 16
// column scales, and every 16-row block of the item runs on it; the int8 rows are re-laid so that a
// block's A tiles are one sequential stream (amx_tile_rows).
constexpr int kAmxRows = 16;
// Rows of one work item: its int8 rows (rows x K bytes) stay near this size, in L2, while it walks them.
constexpr int64_t kAmxItemActBytes = 512 * 1024;

// Two sets of tiles, by chunk parity P, so a chunk's product runs while the other's sums are stored and
// scaled. Q6_K sums a chunk in halves (a scale per 16 k): C tmm(2P), tmm(2P + 1) (k 0..15 / 16..31), A tmm4/5
// (16 x 16 bytes), B tmm6/7 (4 k-groups x 64). Every other type: C tmm(P) (16 x 16 int32), A tmm(2 + P)
// (16 x 32 bytes), B tmm(4 + P) (8 k-groups x 64).
inline void amx_configure(bool halves) {
  conveyor_amx::TileConfig cfg;
  auto tile = [&](int i, int rows, int colsb) {
    cfg.rows[i] = static_cast<uint8_t>(rows);
    cfg.colsb[i] = static_cast<uint16_t>(colsb);
  };
  if (halves) {
    for (int i = 0; i < 4; ++i) tile(i, 16, 64);
    tile(4, 16, 16), tile(5, 16, 16), tile(6, 4, 64), tile(7, 4, 64);
  } else {
    tile(0, 16, 64), tile(1, 16, 64), tile(2, 16, 32), tile(3, 16, 32), tile(4, 8, 64), tile(5, 8, 64);
  }
  _tile_loadconfig(&cfg);
}

bool amx_enabled() {
  static const bool ok = [] {
    return std::getenv("CONVEYOR_DISABLE_AMX") == nullptr && conveyor_amx::request_permission();
  }();
  return ok;
}

// One column group's weights as the tiles read them: per chunk its 8 B-tile rows (signed) and its
// column scales (ds; dm, or Q6_K's second-half ds2), made by chunk_scales: the VNNI path's very floats.
struct AmxPanel {
  std::vector<__m512i> w;     // (chunks, 8)
  std::vector<__m512> ds, dm;  // (chunks)
};

template <int QT>
void amx_unpack_panel(const uint8_t* wg, int64_t n_sb, AmxPanel& p) {
  constexpr TypeInfo t = type_info(QT);
  constexpr int cpb = t.sb / 32;
  const int64_t chunks = n_sb * cpb;
  if (static_cast<int64_t>(p.ds.size()) < chunks) {
    p.w.resize(8 * chunks);
    p.ds.resize(chunks);
    p.dm.resize(chunks);
  }
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(t.offset));
  for (int64_t s = 0; s < n_sb; ++s) {
    const uint8_t* sbp = wg + s * sb_bytes(t);
    const __m512 d = load_scales16<QT>(sbp);
    __m512 m = _mm512_setzero_ps();
    if constexpr (t.kind == Kind::kMin || t.kind == Kind::kKMin) m = load_half16(sbp + 32);
    for (int c = 0; c < cpb; ++c) {
      const int64_t kc = s * cpb + c;
      const uint8_t* ch = sbp + t.hdr + c * chunk_bytes(t);
      prefetch_ahead(ch, prefetch_bytes(t, c));  // the weights stream from memory once per call
      __m512i w[8];
      unpack<QT>(ch, w);
      for (int g = 0; g < 8; ++g) p.w[8 * kc + g] = t.offset != 0 ? _mm512_sub_epi8(w[g], offset) : w[g];
      __m512 ds, dm, ds2;
      chunk_scales<QT>(sbp, c, d, m, ds, dm, ds2);
      p.ds[kc] = ds;
      p.dm[kc] = t.kind == Kind::kK6 ? ds2 : dm;
    }
  }
}

// Chunk kc's tile product for the 16-row block at `a` (amx_tile_rows: chunk kc's 16 x 32 bytes at a + 512 kc)
// into parity P's C tiles; and parity P's sums (Q6_K: k 0..15, then 16..31) to `c`. (GCC's tile intrinsics
// take literal tile numbers: one body per P.)
#define QG_AMX_ISSUE_HALVES(C0, C1)      \
  _tile_loadd(4, a + 512 * kc, 32);      \
  _tile_loadd(5, a + 512 * kc + 16, 32); \
  _tile_loadd(6, b, 64);                \
  _tile_loadd(7, b + 256, 64);          \
  _tile_zero(C0);                       \
  _tile_zero(C1);                       \
  _tile_dpbssd(C0, 4, 6);               \
  _tile_dpbssd(C1, 5, 7)
#define QG_AMX_ISSUE(C, A, B)       \
  _tile_loadd(A, a + 512 * kc, 32); \
  _tile_loadd(B, b, 64);           \
  _tile_zero(C);                   \
  _tile_dpbssd(C, A, B)

template <int QT, int P>
inline void amx_issue(const __m512i* w, int64_t kc, const int8_t* a) {
  const auto* b = reinterpret_cast<const uint8_t*>(w + 8 * kc);
  if constexpr (type_info(QT).kind == Kind::kK6) {
    if constexpr (P == 0) {
      QG_AMX_ISSUE_HALVES(0, 1);
    } else {
      QG_AMX_ISSUE_HALVES(2, 3);
    }
  } else if constexpr (P == 0) {
    QG_AMX_ISSUE(0, 2, 4);
  } else {
    QG_AMX_ISSUE(1, 3, 5);
  }
}
#undef QG_AMX_ISSUE_HALVES
#undef QG_AMX_ISSUE

template <int QT, int P>
inline void amx_store(int32_t* c) {
  if constexpr (type_info(QT).kind == Kind::kK6) {
    if constexpr (P == 0) {
      _tile_stored(0, c, 64);
      _tile_stored(1, c + 256, 64);
    } else {
      _tile_stored(2, c, 64);
      _tile_stored(3, c + 256, 64);
    }
  } else if constexpr (P == 0) {
    _tile_stored(0, c, 64);
  } else {
    _tile_stored(1, c, 64);
  }
}

// Row r's float step for chunk kc on its sums `cs`: `combine`'s float ops in its order.
template <int QT>
inline __m512 amx_scale_row(__m512 acc, int r, __m512 ds, __m512 dm, const int32_t* cs, const float* dx,
                            const float* sx, int64_t ld, int64_t kc) {
  constexpr TypeInfo t = type_info(QT);
  const __m512 dxr = _mm512_set1_ps(dx[r * ld + kc]);
  acc = _mm512_fmadd_ps(_mm512_mul_ps(dxr, ds), _mm512_cvtepi32_ps(_mm512_load_si512(cs + 16 * r)), acc);
  if constexpr (t.kind == Kind::kK6) {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(dxr, dm), _mm512_cvtepi32_ps(_mm512_load_si512(cs + 256 + 16 * r)), acc);
  } else if constexpr (t.kind == Kind::kMin) {
    acc = _mm512_fmadd_ps(dm, _mm512_set1_ps(sx[r * ld + kc]), acc);
  } else if constexpr (t.kind == Kind::kKMin) {
    acc = _mm512_fnmadd_ps(dm, _mm512_set1_ps(sx[r * ld + kc]), acc);
  }
  return acc;
}

// Rows [r0, r0 + 16) (quantized rows are padded to whole blocks) against one panel; the first `rows`
// stored. A three-stage pipeline over chunks, the tile sets alternating: before chunk kc is scaled, kc + 2's
// product is issued and kc + 1's sums (whose product was issued a step earlier) stored, so no store waits on
// the product just issued (that wait was ~40% of the time with one set of tiles).
template <int QT>
void amx_block(const __m512i* w, const __m512* ds, const __m512* dm, int64_t chunks, const QuantRows& xr,
               const int8_t* tiled, int64_t r0, int rows, const float* bias, uint16_t* out, int64_t ldo, int64_t cols) {
  alignas(64) int32_t cbufs[2][2 * kAmxRows * 16];
  // NOTE: 16 named accumulators: an array of them stayed on the stack (GCC does not split it into registers
  // across the tile intrinsics' asm statements), costing a load and a store per row and chunk.
  __m512 a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15;
  a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = _mm512_setzero_ps();
  const int8_t* a = tiled + r0 * xr.k;
  const float* dx = xr.d + r0 * xr.chunks;  // row r, chunk kc: dx[r * chunks + kc]
  const float* sx = xr.s + r0 * xr.chunks;
  const int64_t ld = xr.chunks;
  amx_issue<QT, 0>(w, 0, a);
  if (chunks > 1) amx_issue<QT, 1>(w, 1, a);
  amx_store<QT, 0>(cbufs[0]);
  // One body for both parities (branches around the tile ops only), so one copy of the float step.
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const bool odd = (kc & 1) != 0;
    if (kc + 2 < chunks) {  // chunk kc + 2 into kc's tiles, whose sums the previous step stored
      if (odd) amx_issue<QT, 1>(w, kc + 2, a); else amx_issue<QT, 0>(w, kc + 2, a);
    }
    if (kc + 1 < chunks) {
      if (odd) amx_store<QT, 0>(cbufs[0]); else amx_store<QT, 1>(cbufs[1]);
    }
    const int32_t* cs = cbufs[kc & 1];
    const __m512 c_ds = ds[kc], c_dm = dm[kc];
#define QG_AMX_ROW(r) a##r = amx_scale_row<QT>(a##r, r, c_ds, c_dm, cs, dx, sx, ld, kc)
    QG_AMX_ROW(0), QG_AMX_ROW(1), QG_AMX_ROW(2), QG_AMX_ROW(3), QG_AMX_ROW(4), QG_AMX_ROW(5), QG_AMX_ROW(6);
    QG_AMX_ROW(7), QG_AMX_ROW(8), QG_AMX_ROW(9), QG_AMX_ROW(10), QG_AMX_ROW(11), QG_AMX_ROW(12), QG_AMX_ROW(13);
    QG_AMX_ROW(14), QG_AMX_ROW(15);
#undef QG_AMX_ROW
  }
  alignas(64) float sums[kAmxRows][16];
  const __m512 acc[kAmxRows] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
  for (int r = 0; r < kAmxRows; ++r) _mm512_store_ps(sums[r], acc[r]);
  for (int r = 0; r < rows; ++r) {
    uint16_t* o = out + (r0 + r) * ldo;
    for (int64_t i = 0; i < cols; ++i) o[i] = round_bf16(bias != nullptr ? sums[r][i] + bias[i] : sums[r][i]);
  }
}

// One work item: column group `wg` x rows [r0, r0 + rows) (a multiple of 16 in the padded rows; rows past
// the real ones are not stored). The group's panel is unpacked once here, for all of the item's blocks.
template <int QT>
void amx_item(const uint8_t* wg, int64_t n_sb, const QuantRows& xr, const int8_t* tiled, int64_t r0, int64_t rows,
              int64_t m, const float* bias, uint16_t* out, int64_t ldo, int64_t cols) {
  thread_local AmxPanel panel;
  amx_unpack_panel<QT>(wg, n_sb, panel);
  const AmxPanel& p = panel;  // read through a plain reference: no thread-local lookups in the chunk loop
  const int64_t chunks = n_sb * (type_info(QT).sb / 32);
  for (int64_t rb = r0; rb < r0 + rows && rb < m; rb += kAmxRows) {
    amx_block<QT>(p.w.data(), p.ds.data(), p.dm.data(), chunks, xr, tiled, rb,
                  static_cast<int>(std::min<int64_t>(kAmxRows, m - rb)), bias, out, ldo, cols);
  }
}

// ---- Q4_K on AMX per superblock (activations per 256, see tile_sb_q4k) ----
// The panel folds each sub-block scale into its weights, sc q (0..945) = 32 hi + lo with hi, lo in 0..31 (two
// signed-int8 planes, B tiles of 64 k: 16 k-groups x 64 bytes), so a superblock is 4 full 64-k steps of two
// products (hi, lo) accumulating in the C tiles, then one store and one float step: S = 32 C_hi + C_lo exactly.
// Two 16-row blocks share each B load (tiles: C hi/lo of block 0 tmm0/1, of block 1 tmm2/3; A tmm4/5; B hi/lo
// tmm6/7, all 16 x 64). The panel is per-thread scratch, 2 bytes per weight of one column group.
struct AmxSbPanel {
  std::vector<__m512i> hi, lo;  // (n_sb, 64): superblock s, 64-k step j = rows 16 j .. 16 j + 15 of its tile
  std::vector<__m512i> mnp;     // (n_sb, 4): sb_q4k_min_pairs
  std::vector<__m512> d, dmin;  // (n_sb)
};

void amx_sb_configure() {
  conveyor_amx::TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

void amx_sb_unpack_panel(const uint8_t* wg, int64_t n_sb, AmxSbPanel& p) {
  constexpr TypeInfo t = type_info(kQ4_K);
  if (static_cast<int64_t>(p.d.size()) < n_sb) {
    p.hi.resize(64 * n_sb);
    p.lo.resize(64 * n_sb);
    p.mnp.resize(4 * n_sb);
    p.d.resize(n_sb);
    p.dmin.resize(n_sb);
  }
  const __m512i low_byte = _mm512_set1_epi16(0x00FF), five_bits = _mm512_set1_epi16(31);
  for (int64_t s = 0; s < n_sb; ++s) {
    const uint8_t* sbp = wg + s * sb_bytes(t);
    p.d[s] = load_half16(sbp);
    p.dmin[s] = load_half16(sbp + 32);
    sb_q4k_min_pairs(sbp, p.mnp.data() + 4 * s);
    for (int c = 0; c < 8; ++c) {
      const uint8_t* ch = sbp + t.hdr + c * chunk_bytes(t);
      prefetch_ahead(ch, prefetch_bytes(t, c));  // the weights stream from memory once per call
      __m512i w[8];
      unpack<kQ4_K>(ch, w);
      // Column i's scale in both int16 words of dword i (its bytes 4 i .. 4 i + 3 are its 4 k)
      const __m512i sc32 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sbp + 64 + 16 * c)));
      const __m512i sc16 = _mm512_or_si512(sc32, _mm512_slli_epi32(sc32, 16));
      for (int g = 0; g < 8; ++g) {
        const __m512i pe = _mm512_mullo_epi16(_mm512_and_si512(w[g], low_byte), sc16);  // even bytes' sc q
        const __m512i po = _mm512_mullo_epi16(_mm512_srli_epi16(w[g], 8), sc16);        // odd bytes'
        const int64_t at = 64 * s + 8 * c + g;
        p.hi[at] = _mm512_or_si512(_mm512_srli_epi16(pe, 5), _mm512_slli_epi16(_mm512_srli_epi16(po, 5), 8));
        p.lo[at] = _mm512_or_si512(_mm512_and_si512(pe, five_bits), _mm512_slli_epi16(_mm512_and_si512(po, five_bits), 8));
      }
    }
  }
}

// NB (1 or 2) 16-row blocks from padded row r0 (`tiled`: 64-byte A units, amx_tile_rows) against the panel;
// the first `rows` stored. Superblock s + 1's products run while s's float step does (one set of C tiles:
// s's sums are stored before s + 1 zeroes them).
template <int NB>
void amx_sb_block(const AmxSbPanel& p, int64_t n_sb, const QuantRows& xr, const int8_t* tiled, int64_t r0, int rows,
                  const float* bias, uint16_t* out, int64_t ldo, int64_t cols) {
  constexpr int kRows = NB * kAmxRows;
  alignas(64) float acc[kRows][16] = {};
  alignas(64) int32_t cs[2 * NB][kAmxRows * 16];
  const int8_t* a0 = tiled + r0 * xr.k;
  const int8_t* a1 = a0 + kAmxRows * xr.k;
  const auto* hi = reinterpret_cast<const uint8_t*>(p.hi.data());
  const auto* lo = reinterpret_cast<const uint8_t*>(p.lo.data());
  const int64_t sb_per_row = xr.k / 256;
  auto issue = [&](int64_t s) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NB == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t step = 4 * s + j;  // 64-k step: 1 KB of panel per plane, 1 KB of A per block
      _tile_loadd(6, hi + 1024 * step, 64);
      _tile_loadd(7, lo + 1024 * step, 64);
      _tile_loadd(4, a0 + 1024 * step, 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      if constexpr (NB == 2) {
        _tile_loadd(5, a1 + 1024 * step, 64);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
    }
  };
  issue(0);
  for (int64_t s = 0; s < n_sb; ++s) {
    _tile_stored(0, cs[0], 64);
    _tile_stored(1, cs[1], 64);
    if constexpr (NB == 2) {
      _tile_stored(2, cs[2], 64);
      _tile_stored(3, cs[3], 64);
    }
    if (s + 1 < n_sb) issue(s + 1);
    const __m512 d = p.d[s], dmin = p.dmin[s];
    const __m512i* mnp = p.mnp.data() + 4 * s;
    for (int r = 0; r < kRows; ++r) {
      const int b = r / kAmxRows, rr = r % kAmxRows;
      const int64_t row = r0 + r;
      const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cs[2 * b] + 16 * rr), 5),
                                            _mm512_load_si512(cs[2 * b + 1] + 16 * rr));
      const __m512i msum = sb_q4k_mins(mnp, xr.b2 + row * (xr.k / 64) + 4 * s);
      _mm512_store_ps(acc[r], sb_q4k_float(_mm512_load_ps(acc[r]), isum, msum, xr.sd[row * sb_per_row + s], d, dmin));
    }
  }
  for (int r = 0; r < rows; ++r) {
    uint16_t* o = out + (r0 + r) * ldo;
    for (int64_t i = 0; i < cols; ++i) o[i] = round_bf16(bias != nullptr ? acc[r][i] + bias[i] : acc[r][i]);
  }
}

// One work item (as amx_item): the group's panel once, then its 16-row blocks two at a time.
void amx_sb_item(const uint8_t* wg, int64_t n_sb, const QuantRows& xr, const int8_t* tiled, int64_t r0, int64_t rows,
                 int64_t m, const float* bias, uint16_t* out, int64_t ldo, int64_t cols) {
  thread_local AmxSbPanel panel;
  amx_sb_unpack_panel(wg, n_sb, panel);
  const AmxSbPanel& p = panel;
  const int64_t end = std::min(r0 + rows, m);
  for (int64_t rb = r0; rb < end; rb += 2 * kAmxRows) {
    const int real = static_cast<int>(std::min<int64_t>(2 * kAmxRows, end - rb));
    if (real > kAmxRows) {
      amx_sb_block<2>(p, n_sb, xr, tiled, rb, real, bias, out, ldo, cols);
    } else {
      amx_sb_block<1>(p, n_sb, xr, tiled, rb, real, bias, out, ldo, cols);
    }
  }
}

using AmxFn = void (*)(const uint8_t*, int64_t, const QuantRows&, const int8_t*, int64_t, int64_t, int64_t,
                       const float*, uint16_t*, int64_t, int64_t);

// The quantized rows as the A tiles read them: per 16-row block, `unit` bytes of K at a time (32: a chunk,
// 64: amx_sb_item's step), 16 rows x unit bytes (one tile, contiguous), so a block's walk over K is one
// sequential stream. (m_pad, K) bytes.
void amx_tile_rows(const QuantRows& xr, int64_t m_pad, int unit, int8_t* tiled) {
  const int64_t units = xr.k / unit;
  conveyor_parallel::parallel_for(0, m_pad / kAmxRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rb = begin; rb < end; ++rb) {
      for (int64_t u = 0; u < units; ++u) {
        int8_t* dst = tiled + (rb * units + u) * kAmxRows * unit;
        for (int r = 0; r < kAmxRows; ++r) std::memcpy(dst + unit * r, xr.q + (rb * kAmxRows + r) * xr.k + unit * u, unit);
      }
    }
  });
}
AmxFn amx_fn(int qt) {
  switch (qt) {
    case kQ4_0: return &amx_item<kQ4_0>;
    case kQ4_1: return &amx_item<kQ4_1>;
    case kQ5_0: return &amx_item<kQ5_0>;
    case kQ5_1: return &amx_item<kQ5_1>;
    case kQ8_0: return &amx_item<kQ8_0>;
    case kQ4_K: return &amx_sb_item;  // per superblock (superblock_acts)
    case kQ5_K: return &amx_item<kQ5_K>;
    case kQ6_K: return &amx_item<kQ6_K>;
    case kMXFP4: return &amx_item<kMXFP4>;
    default: return nullptr;
  }
}
#endif

#elif defined(QG_AVX2)
// Each 16-column group runs as two independent 8-column halves (h = 0, 1): one ymm per k-group.
constexpr int kMaxRows = 4;
// Up to this many rows a tile walks both halves at once (measured: benchmarks/results.md, issue #26).
#ifndef QG_BOTH_HALVES_ROWS
#define QG_BOTH_HALVES_ROWS 2
#endif
constexpr int kBothHalvesRows = QG_BOTH_HALVES_ROWS;

inline __m256i dot4(__m256i acc, __m256i w, const int8_t* x, bool wide) {
  const __m256i xb = _mm256_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x))));
#if defined(QG_AVXVNNI)
  (void)wide;
  return _mm256_dpbusd_avx_epi32(acc, w, xb);
#else
  // maddubs pairs saturate at int16: 4-6-bit weights x int8 never do. 8-bit weights (stored q + 128)
  // go back to signed q and through the sign trick, |q| x sign(x, q) (pairs <= 2 x 128 x 127): the sum
  // is then of q x itself, so the caller skips Q8_0's offset (kSignedDot8).
  const __m256i ones = _mm256_set1_epi16(1);
  if (!wide) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, xb), ones));
  const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xb, q)), ones));
#endif
}

// How plain AVX2 (maddubs, no dpbusd) sums a chunk of a type: kInt16Chunk, all eight k-groups in one int16
// lane per (column, k % 4 / 2) and one madd; kInt16Halves, one such sum per 16-k half (Q6_K, whose halves
// have their own scales). Both start the lane at QuantRows::seed, minus the offset times the activations
// under it, so a lane ends at its share of S - offset b: the true value fits int16 ((q - o) x over 16 k,
// |q - o| <= 16 and |x| <= 127: <= 32512; Q6_K 8 k of |q - 32| <= 32), so paddw's wrap-around on the way
// there cancels, and each maddubs itself stays exact (<= 2 x 63 x 127). Q4_1 needs no offset (16 x 15 x 127
// fits). The same integers as the per-four-groups sums, one or two madds per chunk instead of two to four.
// kNone: Q5_1, Q5_K (5-bit values without an offset overflow a 16-k lane) and Q8_0 (the sign trick).
enum class Int16Sums { kNone, kInt16Chunk, kInt16Halves };
#if !defined(QG_AVXVNNI)
constexpr Int16Sums int16_sums(const TypeInfo& t) {
  if (t.bytes8) return Int16Sums::kNone;
  if (t.kind == Kind::kK6) return Int16Sums::kInt16Halves;
  if (t.kind == Kind::kOffset || (t.kind == Kind::kMin && t.planes == 0)) return Int16Sums::kInt16Chunk;
  return Int16Sums::kNone;
}
#else
constexpr Int16Sums int16_sums(const TypeInfo&) { return Int16Sums::kNone; }  // dpbusd sums in int32
#endif
// Whether k_sums already took the offset out of S (combine8 then must not).
constexpr bool offset_in_sums(const TypeInfo& t) { return int16_sums(t) != Int16Sums::kNone && t.offset != 0; }
// Whether quantize_rows fills QuantRows::seed for a type (the tiles read it only where the offset is in the sums).
inline bool seeded_sums(int qt) { return offset_in_sums(type_info(qt)); }

// A chunk's two half sums (k 0..15 and 16..31) of one row for 8 columns, exact int32 (kInt16Chunk: their
// total in s0, zero in s1; with the offset taken out where offset_in_sums). `seed`: the row's
// QuantRows::seed words of this chunk.
template <int QT>
inline void k_sums(const __m256i* w, const int8_t* x, const int32_t* seed, __m256i& s0, __m256i& s1) {
  constexpr TypeInfo t = type_info(QT);
  s0 = _mm256_setzero_si256();
  s1 = _mm256_setzero_si256();
#if !defined(QG_AVXVNNI)
  if constexpr (int16_sums(t) != Int16Sums::kNone) {
    const __m256i ones = _mm256_set1_epi16(1);
    constexpr bool halves = int16_sums(t) == Int16Sums::kInt16Halves;
    __m256i p0 = _mm256_set1_epi32(t.offset != 0 ? seed[halves ? 0 : 2] : 0);
    __m256i p1 = halves ? _mm256_set1_epi32(seed[1]) : _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i xa = _mm256_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x + 4 * g))));
      const __m256i xb = _mm256_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x + 16 + 4 * g))));
      p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[g], xa));
      if constexpr (halves) {
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[g + 4], xb));
      } else {
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[g + 4], xb));
      }
    }
    s0 = _mm256_madd_epi16(p0, ones);
    if constexpr (halves) s1 = _mm256_madd_epi16(p1, ones);
    return;
  }
  if constexpr (!t.bytes8) {
    // maddubs products summed in int16 before one madd: exact while the sum fits, |q x| pair sums
    // being <= 2 x 127 x (15, 31, 63) for 4-, 5-, 6-bit values: 4, 4 and 2 of them per int16 lane
    // (MXFP4's looked-up values are <= 24: 4 x 2 x 127 x 24 = 24384 fits too).
    constexpr int per16 = t.planes == 2 ? 2 : 4;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g0 = 0; g0 < 4; g0 += per16) {
      __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
      for (int g = g0; g < g0 + per16; ++g) {
        const __m256i xa = _mm256_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x + 4 * g))));
        const __m256i xb = _mm256_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x + 16 + 4 * g))));
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[g], xa));
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[g + 4], xb));
      }
      s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p0, ones));
      s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, ones));
    }
    return;
  }
#endif
  for (int g = 0; g < 4; ++g) {
    s0 = dot4(s0, w[g], x + 4 * g, t.bytes8);
    s1 = dot4(s1, w[g + 4], x + 16 + 4 * g, t.bytes8);
  }
}

#if defined(QG_AVXVNNI)
constexpr bool kSignedDot8 = false;
#else
constexpr bool kSignedDot8 = true;  // dot4(wide) sums q x, not (q + 128) x
#endif

template <int QT>
inline void unpack(const uint8_t* ch, int h, __m256i* w) {
  constexpr TypeInfo t = type_info(QT);
  if constexpr (t.bytes8) {
    for (int g = 0; g < 8; ++g) w[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 64 * g + 32 * h));
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 64 * v + 32 * h));
      w[v] = _mm256_and_si256(raw, m4);
      w[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    }
    if constexpr (t.e2m1) {  // codes -> values + 12, one byte shuffle per k-group
      const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Plus12)));
      for (int g = 0; g < 8; ++g) w[g] = _mm256_shuffle_epi8(lut, w[g]);
    }
    if constexpr (t.planes == 1) {
      const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 256 + 32 * h));
      const __m256i bit = _mm256_set1_epi8(0x10);
      for (int g = 0; g < 8; ++g) {
        const __m256i sh = g <= 4 ? _mm256_slli_epi16(hv, 4 - g) : _mm256_srli_epi16(hv, g - 4);
        w[g] = _mm256_or_si256(w[g], _mm256_and_si256(sh, bit));
      }
    } else if constexpr (t.planes == 2) {
      const __m256i bits = _mm256_set1_epi8(0x30);
      for (int v = 0; v < 2; ++v) {
        const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 256 + 64 * v + 32 * h));
        w[4 * v + 0] = _mm256_or_si256(w[4 * v + 0], _mm256_and_si256(_mm256_slli_epi16(hv, 4), bits));
        w[4 * v + 1] = _mm256_or_si256(w[4 * v + 1], _mm256_and_si256(_mm256_slli_epi16(hv, 2), bits));
        w[4 * v + 2] = _mm256_or_si256(w[4 * v + 2], _mm256_and_si256(hv, bits));
        w[4 * v + 3] = _mm256_or_si256(w[4 * v + 3], _mm256_and_si256(_mm256_srli_epi16(hv, 2), bits));
      }
    }
  }
}

inline __m256 load_half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Half h's 8 columns' d of a superblock: fp16, or MXFP4's E8M0 bytes as e8m0_half does (integer ops only).
template <int QT>
inline __m256 load_scales8(const uint8_t* sbp, int h) {
  if constexpr (type_info(QT).e2m1) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sbp + 8 * h)));
    const __m256i normal = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1));
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(sub, norm, normal));
  } else {
    return load_half8(sbp + 16 * h);
  }
}

inline __m256 load_u8_8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load_i8_8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Chunk c's per-column scales for half h: ds (d, or d sc), dm (m, or dmin mn), ds2 (Q6_K's second half).
template <int QT>
inline void chunk_scales8(const uint8_t* sbp, int c, int h, __m256 d, __m256 m, __m256& ds, __m256& dm, __m256& ds2) {
  constexpr TypeInfo t = type_info(QT);
  ds = d;
  dm = m;
  ds2 = d;
  if constexpr (t.kind == Kind::kKMin) {
    ds = _mm256_mul_ps(d, load_u8_8(sbp + 64 + 16 * c + 8 * h));
    dm = _mm256_mul_ps(m, load_u8_8(sbp + 192 + 16 * c + 8 * h));
  } else if constexpr (t.kind == Kind::kK6) {
    ds = _mm256_mul_ps(d, load_i8_8(sbp + 32 + 16 * (2 * c) + 8 * h));
    ds2 = _mm256_mul_ps(d, load_i8_8(sbp + 32 + 16 * (2 * c + 1) + 8 * h));
  }
}

// One row's float step for chunk kc (8 columns): the same ops in the same order on every path below.
template <int QT>
inline __m256 combine8(__m256 acc, __m256i s0, __m256i s1, const QuantRows& xr, int64_t row, int64_t kc, __m256 ds,
                       __m256 dm, __m256 ds2) {
  constexpr TypeInfo t = type_info(QT);
  const __m256 dx = _mm256_set1_ps(xr.d[row * xr.chunks + kc]);
  if constexpr (t.kind == Kind::kK6) {
    if constexpr (!offset_in_sums(t)) {
      const int32_t* b16 = xr.b16 + row * xr.chunks * 2 + 2 * kc;
      s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(32 * b16[0]));
      s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(32 * b16[1]));
    }
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dx, ds), _mm256_cvtepi32_ps(s0), acc);
    return _mm256_fmadd_ps(_mm256_mul_ps(dx, ds2), _mm256_cvtepi32_ps(s1), acc);
  } else {
    __m256i sum = _mm256_add_epi32(s0, s1);
    if constexpr (t.kind == Kind::kOffset && !(t.bytes8 && kSignedDot8) && !offset_in_sums(t)) {
      sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(t.offset * xr.b[row * xr.chunks + kc]));
    }
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dx, ds), _mm256_cvtepi32_ps(sum), acc);
    if constexpr (t.kind == Kind::kMin) {
      acc = _mm256_fmadd_ps(dm, _mm256_set1_ps(xr.s[row * xr.chunks + kc]), acc);
    } else if constexpr (t.kind == Kind::kKMin) {
      acc = _mm256_fnmadd_ps(dm, _mm256_set1_ps(xr.s[row * xr.chunks + kc]), acc);
    }
    return acc;
  }
}

inline void store_rows8(const __m256* acc, int rows, int64_t r0, const float* bias, uint16_t* out, int64_t ldo,
                        int64_t cols) {
  for (int r = 0; r < rows; ++r) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, acc[r]);
    uint16_t* o = out + (r0 + r) * ldo;
    for (int64_t i = 0; i < cols; ++i) o[i] = round_bf16(bias != nullptr ? tmp[i] + bias[i] : tmp[i]);
  }
}

// Few rows (decode): both 8-column halves in one walk over the group's weights, so each chunk's
// bytes are used in full while they stream in (walking the group twice, once per half, left the
// second walk reading cache while memory sat idle).
template <int QT, int MR>
void tile_both(const uint8_t* wg, int64_t n_sb, const QuantRows& xr, int64_t r0, const float* bias, uint16_t* out,
               int64_t ldo, int64_t cols) {
  constexpr TypeInfo t = type_info(QT);
  constexpr int cpb = t.sb / 32;
  constexpr int64_t sbb = sb_bytes(t);
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < MR; ++r) acc[h][r] = _mm256_setzero_ps();
  const bool nta = stream_nta();
  for (int64_t s = 0; s < n_sb; ++s) {
    const uint8_t* sbp = wg + s * sbb;
    __m256 d[2], m[2];
    for (int h = 0; h < 2; ++h) {
      d[h] = load_scales8<QT>(sbp, h);
      m[h] = _mm256_setzero_ps();
      if constexpr (t.kind == Kind::kMin || t.kind == Kind::kKMin) m[h] = load_half8(sbp + 32 + 16 * h);
    }
    for (int c = 0; c < cpb; ++c) {
      const uint8_t* ch = sbp + t.hdr + c * chunk_bytes(t);
      prefetch_stream(ch, prefetch_bytes(t, c), nta);
      const int64_t kc = s * cpb + c;
      for (int h = 0; h < 2; ++h) {
        __m256i w[8];
        unpack<QT>(ch, h, w);
        __m256 ds, dm, ds2;
        chunk_scales8<QT>(sbp, c, h, d[h], m[h], ds, dm, ds2);
        for (int r = 0; r < MR; ++r) {
          __m256i s0, s1;
          k_sums<QT>(w, xr.q + (r0 + r) * xr.k + 32 * kc, xr.seed + ((r0 + r) * xr.chunks + kc) * 3, s0, s1);
          acc[h][r] = combine8<QT>(acc[h][r], s0, s1, xr, r0 + r, kc, ds, dm, ds2);
        }
      }
    }
  }
  store_rows8(acc[0], MR, r0, bias, out, ldo, std::min<int64_t>(cols, 8));
  if (cols > 8) store_rows8(acc[1], MR, r0, bias != nullptr ? bias + 8 : nullptr, out + 8, ldo, cols - 8);
}

// More rows: one 8-column half at a time (its accumulators and weights fill the 16 ymm registers).
template <int QT, int MR>
void tile_half(const uint8_t* wg, int h, int64_t n_sb, const QuantRows& xr, int64_t r0, const float* bias,
               uint16_t* out, int64_t ldo, int64_t cols) {
  constexpr TypeInfo t = type_info(QT);
  constexpr int cpb = t.sb / 32;
  constexpr int64_t sbb = sb_bytes(t);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < n_sb; ++s) {
    const uint8_t* sbp = wg + s * sbb;
    const __m256 d = load_scales8<QT>(sbp, h);
    __m256 m = _mm256_setzero_ps();
    if constexpr (t.kind == Kind::kMin || t.kind == Kind::kKMin) m = load_half8(sbp + 32 + 16 * h);
    for (int c = 0; c < cpb; ++c) {
      const uint8_t* ch = sbp + t.hdr + c * chunk_bytes(t);
      if (h == 0) prefetch_ahead(ch, prefetch_bytes(t, c));
      __m256i w[8];
      unpack<QT>(ch, h, w);
      const int64_t kc = s * cpb + c;
      __m256 ds, dm, ds2;
      chunk_scales8<QT>(sbp, c, h, d, m, ds, dm, ds2);
      for (int r = 0; r < MR; ++r) {
        __m256i s0, s1;
        k_sums<QT>(w, xr.q + (r0 + r) * xr.k + 32 * kc, xr.seed + ((r0 + r) * xr.chunks + kc) * 3, s0, s1);
        acc[r] = combine8<QT>(acc[r], s0, s1, xr, r0 + r, kc, ds, dm, ds2);
      }
    }
  }
  store_rows8(acc, MR, r0, bias, out, ldo, cols);
}

// ---- plain AVX2, Q4_K: activations per superblock, integer sums over the superblock ----
// A chunk's products go through maddubs into int16 pair sums (as k_sums), then madd multiplies them
// by the column's integer sub-block scale (instead of by ones) into int32: the superblock's
// sum_c sc_c S_c is exact, and its mins sum_c mn_c b_c too. One float step per superblock and row:
// acc += (dx d) S - (dx dmin) M. Every row runs these same ops whatever M is, so rows stay
// batch-invariant; only the activations' block differs from the other levels (one scale per 256,
// as llama.cpp's Q8_K), within the same stated tolerance. Q4_K only: Q6_K measured 0.83x this way
// at M = 1 (benchmarks/results.md, issue #26, "Tried and not landed"); Q5_K was not measured.
#if !defined(QG_AVXVNNI)
constexpr bool kSuperblockQ4K = true;
#else
constexpr bool kSuperblockQ4K = false;  // dpbusd gives int32 chunk sums: the per-chunk path
#endif

inline bool superblock_acts(int qt) { return kSuperblockQ4K && qt == kQ4_K; }

// Eight bytes (one per column) as int16 pairs: lanes 2i and 2i + 1 both hold byte i.
inline __m256i pairs_u8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}
// Two byte rows a, b (one per column) interleaved as int16 lanes (a_i, b_i).
inline __m256i interleave_u8(const uint8_t* a, const uint8_t* b) {
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}
inline __m256i int16_pair(int32_t lo, int32_t hi) { return _mm256_set1_epi32(int16_pair_word(lo, hi)); }

// acc + sc S(chunk), per column, exact: a lane's int16 sum is 8 maddubs pairs of 4-bit x int8
// (|pair| <= 2 x 15 x 127 = 3810, 8 x 3810 < 32768), then madd by sc <= 63 into int32.
inline __m256i sb_chunk_q4k(const __m256i* w, const int8_t* x, __m256i sc, __m256i acc) {
  __m256i p = _mm256_setzero_si256();
  for (int g = 0; g < 4; ++g) {
    const __m256i xa = _mm256_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x + 4 * g))));
    const __m256i xb = _mm256_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x + 16 + 4 * g))));
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[g], xa));
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[g + 4], xb));
  }
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
}

// The superblock's float step for half h and rows [r0, r0 + MR): acc += (dx d) S - (dx dmin) sum_c mn_c bx_c.
template <int MR>
inline void sb_q4k_step(const uint8_t* sbp, int h, const __m256i* isum, const QuantRows& xr, int64_t r0, int64_t s,
                        __m256* acc) {
  const __m256 d = load_half8(sbp + 16 * h), dmin = load_half8(sbp + 32 + 16 * h);
  __m256i mnp[4];  // mins of sub-blocks (2j, 2j + 1) as int16 pairs
  for (int j = 0; j < 4; ++j) mnp[j] = interleave_u8(sbp + 192 + 16 * (2 * j) + 8 * h, sbp + 192 + 16 * (2 * j + 1) + 8 * h);
  for (int r = 0; r < MR; ++r) {
    const int32_t* b = xr.b + (r0 + r) * xr.chunks + 8 * s;  // |b| <= 32 x 127: fits int16
    __m256i mins = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mnp[j], int16_pair(b[2 * j], b[2 * j + 1])));
    const __m256 dx = _mm256_set1_ps(xr.sd[(r0 + r) * (xr.k / 256) + s]);
    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dx, d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
    acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dx, dmin), _mm256_cvtepi32_ps(mins), acc[r]);
  }
}

// More rows: rows [r0, r0 + MR) x half h of one group, superblock by superblock.
template <int MR>
void tile_sb_q4k_half(const uint8_t* wg, int h, int64_t n_sb, const QuantRows& xr, int64_t r0, __m256 (*acc)[MR]) {
  constexpr TypeInfo t = type_info(kQ4_K);
  for (int64_t s = 0; s < n_sb; ++s) {
    const uint8_t* sbp = wg + s * sb_bytes(t);
    __m256i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const uint8_t* ch = sbp + t.hdr + c * chunk_bytes(t);
      if (h == 0) prefetch_ahead(ch, prefetch_bytes(t, c));
      __m256i w[8];
      unpack<kQ4_K>(ch, h, w);
      const __m256i sc = pairs_u8(sbp + 64 + 16 * c + 8 * h);
      for (int r = 0; r < MR; ++r) isum[r] = sb_chunk_q4k(w, xr.q + (r0 + r) * xr.k + 256 * s + 32 * c, sc, isum[r]);
    }
    sb_q4k_step<MR>(sbp, h, isum, xr, r0, s, acc[h]);
  }
}

// Few rows (decode): both halves per chunk in one pass, each activation broadcast once for both
// (1.05-1.10x at M = 1-2 over walking the superblock once per half, measured; the same bits).
template <int MR>
void tile_sb_q4k_both(const uint8_t* wg, int64_t n_sb, const QuantRows& xr, int64_t r0, __m256 (*acc)[MR]) {
  constexpr TypeInfo t = type_info(kQ4_K);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const bool nta = stream_nta();
  for (int64_t s = 0; s < n_sb; ++s) {
    const uint8_t* sbp = wg + s * sb_bytes(t);
    __m256i isum[2][MR];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < MR; ++r) isum[h][r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const uint8_t* ch = sbp + t.hdr + c * chunk_bytes(t);
      prefetch_stream(ch, prefetch_bytes(t, c), nta);
      __m256i p[2][MR];  // int16 pair sums, as in sb_chunk_q4k
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < MR; ++r) p[h][r] = _mm256_setzero_si256();
      for (int v = 0; v < 4; ++v) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 64 * v + 32 * h));
          lo[h] = _mm256_and_si256(raw, m4);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        }
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = xr.q + (r0 + r) * xr.k + 256 * s + 32 * c;
          const __m256i xa = _mm256_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x + 4 * v))));
          const __m256i xb = _mm256_set1_epi32(static_cast<int>(rd32(reinterpret_cast<const uint8_t*>(x + 16 + 4 * v))));
          for (int h = 0; h < 2; ++h) {
            p[h][r] = _mm256_add_epi16(p[h][r], _mm256_maddubs_epi16(lo[h], xa));
            p[h][r] = _mm256_add_epi16(p[h][r], _mm256_maddubs_epi16(hi[h], xb));
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i sc = pairs_u8(sbp + 64 + 16 * c + 8 * h);
        for (int r = 0; r < MR; ++r) isum[h][r] = _mm256_add_epi32(isum[h][r], _mm256_madd_epi16(p[h][r], sc));
      }
    }
    for (int h = 0; h < 2; ++h) sb_q4k_step<MR>(sbp, h, isum[h], xr, r0, s, acc[h]);
  }
}

template <int QT, int MR>
void tile(const uint8_t* wg, int64_t n_sb, const QuantRows& xr, int64_t r0, const float* bias, uint16_t* out,
          int64_t ldo, int64_t cols) {
  if constexpr (kSuperblockQ4K && QT == kQ4_K) {
    __m256 acc[2][MR];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < MR; ++r) acc[h][r] = _mm256_setzero_ps();
    if constexpr (MR <= kBothHalvesRows) {
      tile_sb_q4k_both<MR>(wg, n_sb, xr, r0, acc);
    } else {
      tile_sb_q4k_half<MR>(wg, 0, n_sb, xr, r0, acc);
      if (cols > 8) tile_sb_q4k_half<MR>(wg, 1, n_sb, xr, r0, acc);
    }
    store_rows8(acc[0], MR, r0, bias, out, ldo, std::min<int64_t>(cols, 8));
    if (cols > 8) store_rows8(acc[1], MR, r0, bias != nullptr ? bias + 8 : nullptr, out + 8, ldo, cols - 8);
  } else if constexpr (MR <= kBothHalvesRows) {
    tile_both<QT, MR>(wg, n_sb, xr, r0, bias, out, ldo, cols);
  } else {
    tile_half<QT, MR>(wg, 0, n_sb, xr, r0, bias, out, ldo, std::min<int64_t>(cols, 8));
    if (cols > 8) tile_half<QT, MR>(wg, 1, n_sb, xr, r0, bias != nullptr ? bias + 8 : nullptr, out + 8, ldo, cols - 8);
  }
}

#else  // portable C++: the same layout, lanes as arrays (the compiler vectorizes the 16-lane loops)
constexpr int kMaxRows = 4;
inline bool superblock_acts(int) { return false; }
inline bool seeded_sums(int) { return false; }

template <int QT>
inline void unpack(const uint8_t* ch, uint8_t w[8][64]) {
  constexpr TypeInfo t = type_info(QT);
  if constexpr (t.bytes8) {
    std::memcpy(w, ch, 512);
  } else {
    for (int v = 0; v < 4; ++v) {
      for (int j = 0; j < 64; ++j) {
        w[v][j] = ch[64 * v + j] & 15;
        w[v + 4][j] = ch[64 * v + j] >> 4;
      }
    }
    if constexpr (t.e2m1) {
      for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 64; ++j) w[g][j] = kE2M1Plus12[w[g][j]];
    }
    for (int g = 0; g < 8; ++g) {
      for (int j = 0; j < 64; ++j) {
        if constexpr (t.planes == 1) w[g][j] |= static_cast<uint8_t>(((ch[256 + j] >> g) & 1) << 4);
        if constexpr (t.planes == 2) {
          w[g][j] |= static_cast<uint8_t>(((ch[256 + 64 * (g / 4) + j] >> (2 * (g % 4))) & 3) << 4);
        }
      }
    }
  }
}

inline void load_halves(const uint8_t* p, float* out) {
  for (int i = 0; i < 16; ++i) out[i] = half_to_float(rd16(p + 2 * i));
}

// The 16 columns' d of a superblock: fp16, or MXFP4's E8M0 bytes.
template <int QT>
inline void load_scales(const uint8_t* sbp, float* d) {
  if constexpr (type_info(QT).e2m1) {
    for (int i = 0; i < 16; ++i) d[i] = e8m0_half(sbp[i]);
  } else {
    load_halves(sbp, d);
  }
}

template <int QT, int MR>
void tile(const uint8_t* wg, int64_t n_sb, const QuantRows& xr, int64_t r0, const float* bias, uint16_t* out,
          int64_t ldo, int64_t cols) {
  constexpr TypeInfo t = type_info(QT);
  constexpr int cpb = t.sb / 32;
  constexpr int64_t sbb = sb_bytes(t);
  float acc[MR][16] = {};
  alignas(64) uint8_t w[8][64];
  for (int64_t s = 0; s < n_sb; ++s) {
    const uint8_t* sbp = wg + s * sbb;
    float d[16], m[16] = {};
    load_scales<QT>(sbp, d);
    if constexpr (t.kind == Kind::kMin || t.kind == Kind::kKMin) load_halves(sbp + 32, m);
    for (int c = 0; c < cpb; ++c) {
      unpack<QT>(sbp + t.hdr + c * chunk_bytes(t), w);
      const int64_t kc = s * cpb + c;
      float ds[16], dm[16], ds2[16];
      for (int i = 0; i < 16; ++i) {
        ds[i] = d[i];
        dm[i] = m[i];
        ds2[i] = d[i];
        if constexpr (t.kind == Kind::kKMin) {
          ds[i] = d[i] * static_cast<float>(sbp[64 + 16 * c + i]);
          dm[i] = m[i] * static_cast<float>(sbp[192 + 16 * c + i]);
        } else if constexpr (t.kind == Kind::kK6) {
          ds[i] = d[i] * static_cast<float>(static_cast<int8_t>(sbp[32 + 16 * (2 * c) + i]));
          ds2[i] = d[i] * static_cast<float>(static_cast<int8_t>(sbp[32 + 16 * (2 * c + 1) + i]));
        }
      }
      for (int r = 0; r < MR; ++r) {
        const int64_t row = r0 + r;
        const int8_t* x = xr.q + row * xr.k + 32 * kc;
        const float dx = xr.d[row * xr.chunks + kc];
        int32_t s0[16] = {}, s1[16] = {};
        for (int g = 0; g < 4; ++g) {
          for (int i = 0; i < 16; ++i) {
            for (int tt = 0; tt < 4; ++tt) {
              s0[i] += static_cast<int32_t>(w[g][4 * i + tt]) * x[4 * g + tt];
              s1[i] += static_cast<int32_t>(w[g + 4][4 * i + tt]) * x[16 + 4 * g + tt];
            }
          }
        }
        for (int i = 0; i < 16; ++i) {
          if constexpr (t.kind == Kind::kK6) {
            const int32_t* b16 = xr.b16 + row * xr.chunks * 2 + 2 * kc;
            acc[r][i] = acc[r][i] + (dx * ds[i]) * static_cast<float>(s0[i] - 32 * b16[0]);
            acc[r][i] = acc[r][i] + (dx * ds2[i]) * static_cast<float>(s1[i] - 32 * b16[1]);
          } else {
            int32_t sum = s0[i] + s1[i];
            if constexpr (t.kind == Kind::kOffset) sum -= t.offset * xr.b[row * xr.chunks + kc];
            acc[r][i] = acc[r][i] + (dx * ds[i]) * static_cast<float>(sum);
            if constexpr (t.kind == Kind::kMin) acc[r][i] = acc[r][i] + dm[i] * xr.s[row * xr.chunks + kc];
            if constexpr (t.kind == Kind::kKMin) acc[r][i] = acc[r][i] - dm[i] * xr.s[row * xr.chunks + kc];
          }
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    uint16_t* o = out + (r0 + r) * ldo;
    for (int64_t i = 0; i < cols; ++i) o[i] = round_bf16(bias != nullptr ? acc[r][i] + bias[i] : acc[r][i]);
  }
}
#endif

using TileFn = void (*)(const uint8_t*, int64_t, const QuantRows&, int64_t, const float*, uint16_t*, int64_t, int64_t);

template <int QT>
TileFn tile_for(int rows) {
  switch (rows) {
    case 1: return &tile<QT, 1>;
    case 2: return &tile<QT, 2>;
    case 3: return &tile<QT, 3>;
    case 4: return &tile<QT, 4>;
#if defined(QG_AVX512)
    case 5: return &tile<QT, 5>;
    case 6: return &tile<QT, 6>;
    case 7: return &tile<QT, 7>;
    case 8: return &tile<QT, 8>;
#endif
    default: return nullptr;
  }
}

TileFn tile_fn(int qt, int rows) {
  switch (qt) {
    case kQ4_0: return tile_for<kQ4_0>(rows);
    case kQ4_1: return tile_for<kQ4_1>(rows);
    case kQ5_0: return tile_for<kQ5_0>(rows);
    case kQ5_1: return tile_for<kQ5_1>(rows);
    case kQ8_0: return tile_for<kQ8_0>(rows);
    case kQ4_K: return tile_for<kQ4_K>(rows);
    case kQ5_K: return tile_for<kQ5_K>(rows);
    case kQ6_K: return tile_for<kQ6_K>(rows);
    case kMXFP4: return tile_for<kMXFP4>(rows);
    default: return nullptr;
  }
}

// Rows [0, n) cut into `parts` near-equal consecutive blocks: where block i starts.
inline int64_t block_start(int64_t n, int64_t parts, int64_t i) {
  const int64_t base = n / parts, extra = n % parts;
  return i * base + std::min(i, extra);
}

constexpr int64_t kRowBlock = 64;  // rows per work item at large M (their int8 rows stay in L2)
// From here on, AMX blocks of 16 rows (the same bits either way): at 8 rows the VNNI tiles ran 2x faster than a
// half-empty AMX block, at 16 even, at 32 AMX 1.25x (Q4_K, Q6_K; benchmarks/results.md, issue #43).
constexpr int64_t kAmxMinRows = 16;

// The prefetch hint of the 1-2-row decode walks in this build on this CPU (see prefetch_stream).
std::string decode_prefetch() {
#if defined(QG_AVX2) && !defined(QG_AVXVNNI)
  return stream_nta() ? "prefetchnta" : "prefetcht1";
#elif defined(QG_GENERIC)
  return "none";
#else
  return "prefetcht0";
#endif
}

std::string level() {
#if defined(QG_AMX)
  return amx_enabled() ? "amx_int8" : "avx512_vnni";
#elif defined(QG_AVX512)
  return "avx512_vnni";
#elif defined(QG_AVX2) && defined(QG_AVXVNNI)
  return "avx2_vnni";
#elif defined(QG_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

// The int8 multiply-accumulates per second one thread of this level can issue at best, measured by a loop of
// independent products on registers (AMX: tdpbssd on full 16 x 64-byte tiles, 16 x 16 x 64 each; AVX-512
// VNNI: 12 vpdpbusd chains); 0 where not measured (AVX2, generic). benchmarks/quantized_gemm.py's peak.
double int8_peak_macs() {
  constexpr int64_t kReps = 200000;
#if defined(QG_AMX)
  if (amx_enabled()) {
    conveyor_amx::TileConfig cfg;
    for (int i = 0; i < 6; ++i) {
      cfg.rows[i] = 16;
      cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
    alignas(64) int8_t ones[1024];
    std::memset(ones, 1, sizeof(ones));
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kReps; ++i) {
      _tile_dpbssd(0, 4, 5);
      _tile_dpbssd(1, 4, 5);
      _tile_dpbssd(2, 4, 5);
      _tile_dpbssd(3, 4, 5);
    }
    alignas(64) int32_t sink[256];
    _tile_stored(0, sink, 64);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    _tile_release();
    return 4.0 * kReps * 16 * 16 * 64 / s;
  }
#endif
#if defined(QG_AVX512)
  // Twelve chains that start apart: started equal, GCC merged them into one (the same ops on the same values) and
  // this loop timed one dependent chain, reporting 12 / latency dpbusd per cycle instead of the throughput (1.5x
  // the true peak on an AMD Zen 5, latency 4 and two per cycle).
  __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2), a3 = _mm512_set1_epi32(3),
          a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5), a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7),
          a8 = _mm512_set1_epi32(8), a9 = _mm512_set1_epi32(9), a10 = _mm512_set1_epi32(10),
          a11 = _mm512_set1_epi32(11);
  __m512i w = _mm512_set1_epi8(1), x = _mm512_set1_epi8(2);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < 4 * kReps; ++i) {
    a0 = _mm512_dpbusd_epi32(a0, w, x), a1 = _mm512_dpbusd_epi32(a1, w, x), a2 = _mm512_dpbusd_epi32(a2, w, x);
    a3 = _mm512_dpbusd_epi32(a3, w, x), a4 = _mm512_dpbusd_epi32(a4, w, x), a5 = _mm512_dpbusd_epi32(a5, w, x);
    a6 = _mm512_dpbusd_epi32(a6, w, x), a7 = _mm512_dpbusd_epi32(a7, w, x), a8 = _mm512_dpbusd_epi32(a8, w, x);
    a9 = _mm512_dpbusd_epi32(a9, w, x), a10 = _mm512_dpbusd_epi32(a10, w, x), a11 = _mm512_dpbusd_epi32(a11, w, x);
    asm volatile("" : "+v"(w), "+v"(x));  // no hoisting the loop-invariant products
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile int sink = _mm512_reduce_add_epi32(_mm512_add_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
      _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)),
                       _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)))));
  (void)sink;
  return 4.0 * kReps * 12 * 64 / s;
#else
  return 0.0;
#endif
}

void check_packed(const torch::Tensor& packed, int qt, int64_t n, int64_t k) {
  TORCH_CHECK(supported(qt), "qgemm: GGML type ", qt, " is not supported");
  const TypeInfo t = type_info(qt);
  TORCH_CHECK(k % t.sb == 0, "qgemm: in_features ", k, " is not a multiple of ", t.sb);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3,
              "qgemm: weight not packed by qgemm.pack");
  TORCH_CHECK(packed.size(0) == (n + kGroup - 1) / kGroup, "qgemm: out_features mismatch");
  TORCH_CHECK(packed.size(1) == k / t.sb && packed.size(2) == sb_bytes(t), "qgemm: in_features mismatch");
}

}  // namespace

// raw: (N, row_bytes) uint8 GGML blocks -> (ceil(N/16), K/sb, sb_bytes) uint8.
torch::Tensor qgemm_pack(const torch::Tensor& raw, int64_t qt, int64_t k) {
  TORCH_CHECK(supported(static_cast<int>(qt)), "qgemm: GGML type ", qt, " is not supported");
  const TypeInfo t = type_info(static_cast<int>(qt));
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte, "qgemm.pack: raw must be a 2-D uint8 tensor");
  TORCH_CHECK(k % t.sb == 0, "qgemm.pack: in_features ", k, " is not a multiple of ", t.sb);
  const int64_t n = raw.size(0), n_sb = k / t.sb;
  TORCH_CHECK(raw.size(1) == n_sb * t.raw_bytes, "qgemm.pack: row bytes ", raw.size(1), " != ", n_sb * t.raw_bytes);
  const auto rc = raw.contiguous();
  const uint8_t* src = rc.data_ptr<uint8_t>();
  const int64_t groups = (n + kGroup - 1) / kGroup, sbb = sb_bytes(t);
  auto packed = torch::zeros({groups, n_sb, sbb}, raw.options());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  conveyor_parallel::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    Decoded o;
    for (int64_t g = begin; g < end; ++g) {
      for (int i = 0; i < kGroup && g * kGroup + i < n; ++i) {
        const uint8_t* row = src + (g * kGroup + i) * n_sb * t.raw_bytes;
        for (int64_t s = 0; s < n_sb; ++s) {
          decode_block(static_cast<int>(qt), row + s * t.raw_bytes, o);
          store_column(static_cast<int>(qt), o, i, dst + (g * n_sb + s) * sbb);
        }
      }
    }
  });
  return packed;
}

namespace {

// x's rows quantized (rows [m, m_pad) zeros: AMX reads whole 16-row blocks), in per-thread buffers at
// decode sizes, in `big` (a tensor for the call) at prefill sizes.
QuantRows quantize_rows(const torch::Tensor& xc, int64_t m, int64_t m_pad, int qt, torch::Tensor& big) {
  const int64_t k = xc.size(1), chunks = k / 32;
  const int64_t need = m_pad * k + m_pad * chunks * (4 + 4 + 4 + 8 + 12) + m_pad * (k / 256 + 1) * 4 +
                       m_pad * (k / 64) * 4;
  thread_local std::vector<uint8_t> small;
  uint8_t* buf;
  if (need <= (1 << 20)) {
    if (static_cast<int64_t>(small.size()) < need) small.resize(need);
    buf = small.data();
  } else {
    big = torch::empty({need}, xc.options().dtype(at::kByte));
    buf = big.data_ptr<uint8_t>();
  }
  QuantRows xr;
  xr.k = k;
  xr.chunks = chunks;
  xr.q = reinterpret_cast<int8_t*>(buf);
  xr.d = reinterpret_cast<float*>(buf + m_pad * k);
  xr.s = xr.d + m_pad * chunks;
  xr.b = reinterpret_cast<int32_t*>(xr.s + m_pad * chunks);
  xr.b16 = xr.b + m_pad * chunks;
  xr.seed = xr.b16 + 2 * m_pad * chunks;
  xr.sd = reinterpret_cast<float*>(xr.seed + 3 * m_pad * chunks);
  xr.b2 = reinterpret_cast<int32_t*>(xr.sd + m_pad * (k / 256 + 1));
  for (int64_t r = m; r < m_pad; ++r) {
    std::memset(xr.sd + r * (k / 256), 0, (k / 256) * sizeof(float));
    std::memset(xr.b2 + r * (k / 64), 0, (k / 64) * sizeof(int32_t));
    std::memset(xr.q + r * k, 0, k);
    std::memset(xr.d + r * chunks, 0, chunks * sizeof(float));
    std::memset(xr.s + r * chunks, 0, chunks * sizeof(float));
    std::memset(xr.b + r * chunks, 0, chunks * sizeof(int32_t));
    std::memset(xr.b16 + 2 * r * chunks, 0, 2 * chunks * sizeof(int32_t));
    std::memset(xr.seed + 3 * r * chunks, 0, 3 * chunks * sizeof(int32_t));
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const int64_t ldx = xc.stride(0);
  const bool per_superblock = superblock_acts(qt), seeded = seeded_sums(qt);
#if defined(QG_AVX512)
  const bool biased = per_superblock && qt == kQ6_K;
#else
  const bool biased = false;
#endif
  auto quant = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (per_superblock) {
        quantize_row_sb(xp + r * ldx, k, xr.q + r * k, xr.sd + r * (k / 256), xr.b + r * chunks,
                        xr.b16 + 2 * r * chunks);
        if (biased) {  // tile_sb_q6k's unsigned operand: x + 128, as a byte x ^ 0x80
          auto* u = reinterpret_cast<uint8_t*>(xr.q + r * k);
          for (int64_t j = 0; j < k; ++j) u[j] ^= 0x80;
        }
        for (int64_t j = 0; j < k / 64; ++j) {
          xr.b2[r * (k / 64) + j] = int16_pair_word(xr.b[r * chunks + 2 * j], xr.b[r * chunks + 2 * j + 1]);
        }
      } else {
        quantize_row(xp + r * ldx, k, xr.q + r * k, xr.d + r * chunks, xr.s + r * chunks, xr.b + r * chunks,
                     xr.b16 + 2 * r * chunks, seeded ? xr.seed + 3 * r * chunks : nullptr, type_info(qt).offset);
      }
    }
  };
  if (m * k < (1 << 15)) quant(0, m); else conveyor_parallel::parallel_for(0, m, 4, quant);
  return xr;
}

// The weight as the tiles read it: column groups of `group_bytes`, n_sb superblocks each.
struct PackedW {
  const uint8_t* w;
  int64_t n_sb, group_bytes, groups;
};

PackedW packed_w(const torch::Tensor& packed, int qt) {
  return {packed.data_ptr<uint8_t>(), packed.size(1), packed.size(1) * sb_bytes(type_info(qt)), packed.size(0)};
}

// Row block rb (of `row_blocks` over rows [base, base + m)) x column group g, on the non-AMX tiles: the
// row partition `linear` uses at this M, wherever the rows sit in x.
inline void run_item(int qt, const PackedW& pw, const QuantRows& xr, int64_t base, int64_t m, int64_t row_blocks,
                     int64_t rb, int64_t g, const float* bias, uint16_t* out, int64_t n) {
  const int64_t r_begin = block_start(m, row_blocks, rb), r_end = block_start(m, row_blocks, rb + 1);
  const int64_t rows = r_end - r_begin, parts = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t c0 = g * kGroup, cols = std::min<int64_t>(kGroup, n - c0);
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t rs = base + r_begin + block_start(rows, parts, part);
    const int64_t mr = base + r_begin + block_start(rows, parts, part + 1) - rs;
    tile_fn(qt, static_cast<int>(mr))(pw.w + g * pw.group_bytes, pw.n_sb, xr, rs,
                                      bias != nullptr ? bias + c0 : nullptr, out + c0, n, cols);
  }
}

torch::Tensor bias_f32(const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return {};
  auto b = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(b.numel() == n, "qgemm: bias must have out_features entries");
  return b;
}

bool uses_amx(int64_t m) {
#if defined(QG_AMX)
  return m >= kAmxMinRows && amx_enabled();
#else
  (void)m;
  return false;
#endif
}

}  // namespace

torch::Tensor qgemm_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t qt, int64_t n, int64_t k,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "qgemm: x must be a 2-D bf16 tensor");
  TORCH_CHECK(x.size(1) == k, "qgemm: x has ", x.size(1), " features, the weight ", k);
  check_packed(packed, static_cast<int>(qt), n, k);
  const int64_t m = x.size(0);
  auto out = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const torch::Tensor bf = bias_f32(bias, n);
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  const bool use_amx = uses_amx(m);
  torch::Tensor big;
  const QuantRows xr = quantize_rows(xc, m, use_amx ? (m + 15) / 16 * 16 : m, static_cast<int>(qt), big);
  const PackedW pw = packed_w(packed, static_cast<int>(qt));
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
#if defined(QG_AMX)
  if (use_amx) {
    // Work items (row span, column group), row span major: a thread's int8 rows stay in L2 across groups.
    const int64_t m_pad = (m + kAmxRows - 1) / kAmxRows * kAmxRows;
    const int64_t span = std::min(m_pad, std::max<int64_t>(kAmxRows, kAmxItemActBytes / k / kAmxRows * kAmxRows));
    const int64_t spans = (m_pad + span - 1) / span, groups = pw.groups;
    const AmxFn fn = amx_fn(static_cast<int>(qt));
    const bool halves = type_info(static_cast<int>(qt)).kind == Kind::kK6;
    const bool per_sb = superblock_acts(static_cast<int>(qt));
    const torch::Tensor tiled_rows = torch::empty({m_pad * k}, x.options().dtype(at::kByte));
    auto* tiled = reinterpret_cast<int8_t*>(tiled_rows.data_ptr<uint8_t>());
    amx_tile_rows(xr, m_pad, per_sb ? 64 : 32, tiled);
    conveyor_parallel::parallel_for(0, spans * groups, 1, [&](int64_t begin, int64_t end) {
      if (per_sb) amx_sb_configure(); else amx_configure(halves);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t g = item % groups, c0 = g * kGroup;
        fn(pw.w + g * pw.group_bytes, pw.n_sb, xr, tiled, item / groups * span, span, m,
           bp != nullptr ? bp + c0 : nullptr, op + c0, n, std::min<int64_t>(kGroup, n - c0));
      }
      _tile_release();
    });
    return out;
  }
#endif
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock, groups = pw.groups;
  // Work items (row block, column group), row block major: a thread keeps its rows' int8 in cache.
  conveyor_parallel::parallel_for(0, row_blocks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      run_item(static_cast<int>(qt), pw, xr, 0, m, row_blocks, item / groups, item % groups, bp, op, n);
    }
  });
  return out;
}

// A MoE layer's experts in one call: rows [offsets[e], offsets[e + 1]) of x through expert e's weight
// (all experts one type and shape), each row's bits those `linear` gives it on that expert's rows alone.
// All rows are quantized once (quantize_row is per row); one parallel_for runs every expert's (row
// block, column group) items with `linear`'s row partition at that expert's M. Experts that `linear`
// would run on AMX (m >= kAmxMinRows) go through `linear` itself after it: the same bits either way
// (see amx_block), but AMX is the faster path at those sizes.
torch::Tensor qgemm_linear_grouped(const torch::Tensor& x, const std::vector<torch::Tensor>& packed, int64_t qt,
                                   int64_t n, int64_t k, const std::vector<int64_t>& offsets,
                                   const std::vector<c10::optional<torch::Tensor>>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "qgemm: x must be a 2-D bf16 tensor");
  TORCH_CHECK(x.size(1) == k, "qgemm: x has ", x.size(1), " features, the weight ", k);
  const int64_t num_experts = static_cast<int64_t>(packed.size()), m_all = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == num_experts + 1, "qgemm: offsets must have experts + 1 entries");
  TORCH_CHECK(offsets.front() == 0 && offsets.back() == m_all, "qgemm: offsets must run from 0 to x's rows");
  TORCH_CHECK(bias.empty() || static_cast<int64_t>(bias.size()) == num_experts, "qgemm: one bias per expert, or none");
  auto out = torch::empty({m_all, n}, x.options());
  if (m_all == 0 || n == 0) return out;
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  std::vector<PackedW> pws(num_experts);
  std::vector<torch::Tensor> biases(num_experts);
  std::vector<int64_t> first_item(num_experts + 1, 0);  // expert e's items: [first_item[e], first_item[e + 1])
  std::vector<int64_t> row_blocks(num_experts, 0), amx_experts;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t m = offsets[e + 1] - offsets[e];
    TORCH_CHECK(m >= 0, "qgemm: offsets must not decrease");
    check_packed(packed[e], static_cast<int>(qt), n, k);
    pws[e] = packed_w(packed[e], static_cast<int>(qt));
    if (!bias.empty()) biases[e] = bias_f32(bias[e], n);
    if (m > 0 && uses_amx(m)) amx_experts.push_back(e);
    else row_blocks[e] = (m + kRowBlock - 1) / kRowBlock;
    first_item[e + 1] = first_item[e] + row_blocks[e] * pws[e].groups;
  }
  torch::Tensor big;
  const QuantRows xr = quantize_rows(xc, m_all, m_all, static_cast<int>(qt), big);
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  conveyor_parallel::parallel_for(0, first_item.back(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t local = item - first_item[e], groups = pws[e].groups;
      const float* bp = biases[e].defined() ? biases[e].data_ptr<float>() : nullptr;
      run_item(static_cast<int>(qt), pws[e], xr, offsets[e], offsets[e + 1] - offsets[e], row_blocks[e],
               local / groups, local % groups, bp, op, n);
    }
  });
  for (const int64_t e : amx_experts) {  // after the loop above: `linear` reuses this thread's row buffers
    const int64_t m = offsets[e + 1] - offsets[e];
    out.narrow(0, offsets[e], m).copy_(qgemm_linear(xc.narrow(0, offsets[e], m), packed[e], qt, n, k,
                                                    bias.empty() ? c10::optional<torch::Tensor>() : bias[e]));
  }
  return out;
}

// Rows `ids` of the weight (output features), dequantized as gguf-py does: (R, K) bf16.
torch::Tensor qgemm_dequantize_rows(const torch::Tensor& packed, int64_t qt, int64_t n, int64_t k,
                                    const torch::Tensor& ids) {
  check_packed(packed, static_cast<int>(qt), n, k);
  const TypeInfo t = type_info(static_cast<int>(qt));
  const auto idc = ids.to(at::kLong).contiguous();
  const int64_t r = idc.numel(), n_sb = packed.size(1), sbb = sb_bytes(t);
  auto out = torch::empty({r, k}, packed.options().dtype(at::kBFloat16));
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t j = 0; j < r; ++j) TORCH_CHECK(id[j] >= 0 && id[j] < n, "qgemm: row id ", id[j], " out of range");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  conveyor_parallel::parallel_for(0, r, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t g = id[j] / kGroup;
      const int i = static_cast<int>(id[j] % kGroup);
      for (int64_t s = 0; s < n_sb; ++s) {
        const uint8_t* sbp = wp + (g * n_sb + s) * sbb;
        const float d = t.e2m1 ? e8m0_half(sbp[i]) : half_to_float(rd16(sbp + 2 * i));
        const float m = (t.kind == Kind::kMin || t.kind == Kind::kKMin) ? half_to_float(rd16(sbp + 32 + 2 * i)) : 0.f;
        for (int c = 0; c < t.sb / 32; ++c) {
          const uint8_t* ch = sbp + t.hdr + c * chunk_bytes(t);
          for (int kk = 0; kk < 32; ++kk) {
            const int grp = kk / 4, tt = kk % 4, pos = 4 * i + tt;
            int q;
            if (t.bytes8) {
              q = ch[64 * grp + pos];
            } else {
              const uint8_t byte = ch[64 * (grp & 3) + pos];
              q = grp < 4 ? (byte & 15) : (byte >> 4);
              if (t.e2m1) q = kE2M1Plus12[q];
              if (t.planes == 1) q |= ((ch[256 + pos] >> grp) & 1) << 4;
              if (t.planes == 2) q |= ((ch[256 + 64 * (grp / 4) + pos] >> (2 * (grp % 4))) & 3) << 4;
            }
            float w;
            switch (t.kind) {
              case Kind::kOffset: w = d * static_cast<float>(q - t.offset); break;
              case Kind::kMin: w = d * static_cast<float>(q) + m; break;
              case Kind::kKMin:
                w = (d * static_cast<float>(sbp[64 + 16 * c + i])) * static_cast<float>(q) -
                    m * static_cast<float>(sbp[192 + 16 * c + i]);
                break;
              default: {
                const int sub = 2 * c + kk / 16;
                w = (d * static_cast<float>(static_cast<int8_t>(sbp[32 + 16 * sub + i]))) * static_cast<float>(q - 32);
              }
            }
            op[j * k + s * t.sb + 32 * c + kk] = round_bf16(w);
          }
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("isa", &conveyor_isa::compiled_level, "the -march level this module was compiled for");
  conveyor_parallel::def_pool_sharing(m);
  m.def("backend", &level, "the quantized GEMM's path in this build: avx512_vnni, avx2_vnni, avx2 or generic");
  m.def("decode_prefetch", &decode_prefetch,
        "the weight-stream prefetch of the 1-2-row decode walks here: prefetchnta (AVX2 on AMD), prefetcht1 (AVX2 "
        "elsewhere), prefetcht0 (AVX-512, AVX-VNNI) or none (portable C++)");
  m.def("int8_peak_macs", &int8_peak_macs,
        "int8 multiply-accumulates per second one thread issues at best on this level (0: not measured here)",
        release());
  m.def("supports", [](int64_t qt) { return supported(static_cast<int>(qt)); }, "whether a GGML type runs natively");
  m.def("pack", &qgemm_pack, "raw GGML rows (N, row_bytes) uint8 -> the kernel's layout", release());
  m.def("linear", &qgemm_linear, "x (M, K) bf16 @ W^T (+ b) -> (M, N) bf16, batch-invariant", release());
  m.def("linear_grouped", &qgemm_linear_grouped,
        "x (T, K) bf16, rows [offsets[e], offsets[e+1]) through expert e's packed weight (+ bias) -> (T, N) bf16",
        release());
  m.def("dequantize_rows", &qgemm_dequantize_rows, "rows of a packed weight as bf16 (R, K)", release());
}
