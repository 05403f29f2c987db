// Full (unmasked) attention over one sequence, for vision towers (Gemma 3's SigLIP at 896 px: 4096 patches, 16
// heads of 72): q, k, v (P, H * D) bf16 as the projections write them (rows may lie further apart: column slices of
// a fused qkv), out (P, H * D) bf16, the layout the output projection reads.
//
// One head's block of 16 queries at a time, never the whole score matrix: the block's P x 16 fp32 scores (256 KB
// at P = 4096) stay in the thread's cache beside the head's packed K and V, then an exact softmax (fp32 max, exp,
// sum over every key), then P V. Every output row is one fixed sequence of operations over the keys, whichever
// thread runs its block and whatever else is in the call: an image's tower output is the same bits every time.
//
// One build runs one path, fixed at compile time (plus CONVEYOR_DISABLE_AMX, read once per process):
//   amx (D even, D <= 96): both products as AMX bf16 tile products (fp32 accumulation); P rounded to bf16 for
//        the second, the sums taken before rounding (see below);
//   otherwise: fp32 throughout (bf16 inputs widened, products and sums in fp32, exp by vec_math where it
//        vectorizes, std::exp in the portable build).
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "amx.h"
#include "bf16.h"
#include "parallel.h"
#include "vec_math.h"

namespace conveyor_dense {

constexpr int64_t kQueryRows = 16;  // queries per block: an AMX tile's rows

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Problem {
  const uint16_t *q, *k, *v;  // bf16 bits; head h of row i at i * ldq (ldk, ldv) + h * D
  int64_t ldq, ldk, ldv;
  uint16_t* out;  // (P, H * D), contiguous
  int64_t P, H, D;
  float scale;
};

// ---------------------------------------------------------------------------------------------
// AMX (D even, D <= 96): the products run transposed, so K's rows are A tiles as they are and the
// softmax needs no horizontal reductions (a vector lane is a query):
//   S^T (keys x 16 queries) = K Q^T:  A = 16 key rows of the head's K (d blocks of 32, then the
//       tail), B = the block's Q^T (d pairs x 16 queries), resident in tmm2-4;
//   softmax down the keys, lane by lane (max, exp2, sum in key order), P^T rounded to bf16 in
//       the pair layout a B tile reads (key pairs x 16 queries);
//   O^T (d x 16 queries) = V^T P^T:   A = V^T (packed once per call: d rows x keys), B = P^T.
// Measured on a 2-vCPU Sapphire Rapids VM, a 1 KB tile load costs ~3x a tile product: the work is
// laid out for few loads (Q^T resident, the score tails D % 32 as narrow tiles, not zero-padded).
// K, V^T and Q^T are packed once per call, each head contiguous (tile loads straight from the
// projections, a head's rows 2 KB+ apart, ran ~2x slower). Keys past P: zeros.
// ---------------------------------------------------------------------------------------------
#if CONVEYOR_HAS_AMX && defined(__AVX512BF16__)
#define CONVEYOR_DENSE_AMX 1

inline bool amx_on() {
  static const bool ok = std::getenv("CONVEYOR_DISABLE_AMX") == nullptr && conveyor_amx::request_permission();
  return ok;
}

inline bool amx_fits(int64_t D) { return D % 2 == 0 && D <= 96; }

struct AmxLayout {
  int64_t full, tail;  // D = 32 * full + tail (tail even)
  int64_t n_pad;       // keys (and queries) padded to 32
  int64_t q_rows;      // pair rows of one block's Q^T (D / 2)
  int64_t dv, ldv;     // V^T: rows (D padded to 16), row stride (n_pad + 32: off 4 KB multiples)
};

inline AmxLayout amx_layout(const Problem& pr) {
  AmxLayout l;
  l.full = pr.D / 32;
  l.tail = pr.D % 32;
  l.n_pad = round_up(pr.P, 32);
  l.q_rows = pr.D / 2;
  l.dv = round_up(pr.D, 16);
  l.ldv = l.n_pad + 32;
  return l;
}

// Scores: tmm0-1 S^T, tmm2-4 Q^T (the tail, if any, in tmm4: tail / 2 pair rows), tmm5-6 K, tmm7 K's tail
// (16 rows x tail d). Values: every tile 16 x 64 bytes (tmm0-4 O^T, tmm5 P^T, tmm6-7 V^T).
inline void configure(const AmxLayout& l, bool scores) {
  conveyor_amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  if (scores && l.tail > 0) {
    cfg.rows[4] = static_cast<uint8_t>(l.tail / 2);
    cfg.colsb[7] = static_cast<uint16_t>(l.tail * 2);
  }
  _tile_loadconfig(&cfg);
}

// Uninitialized storage kept by a thread between calls (grown, never shrunk): a zero-filled fresh
// allocation per call cost ~5 ms of page faults and memsets per image layer.
// 64-byte aligned: every tile row we load is one whole cache line.
template <typename T>
struct Scratch {
  struct Free {
    void operator()(T* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<T[], Free> data;
  int64_t size = 0;
  T* get(int64_t n) {
    if (n > size) {
      data.reset(static_cast<T*>(::operator new[](n * sizeof(T), std::align_val_t(64))));
      size = n;
    }
    return data.get();
  }
};

struct AmxPacked {  // per head, contiguous; every element written by amx_pack / amx_block (zeros past P and D)
  uint16_t* k;   // (n_pad, D)
  uint16_t* vt;  // (dv, ldv)
  uint32_t* qt;  // per block of 16 queries: (q_rows, 16) words, word (i, q) = (q[2i], q[2i + 1])
  uint16_t* o;   // (n_pad, D): the output, copied into (P, H * D) at the end
  AmxPacked(const Problem& pr, const AmxLayout& l) {
    thread_local Scratch<uint16_t> storage;
    // Sections in multiples of 32 bf16 (n_pad is): each starts on a cache line.
    const int64_t kn = pr.H * l.n_pad * pr.D, on = pr.H * l.n_pad * pr.D, vn = pr.H * l.dv * l.ldv;
    const int64_t qn = 2 * pr.H * l.n_pad * l.q_rows;
    k = storage.get(kn + on + vn + qn);
    o = k + kn;
    vt = o + on;
    qt = reinterpret_cast<uint32_t*>(vt + vn);
  }
};

// One pass in chunks of 32 rows, each row read whole (all heads: sequential, prefetcher-friendly).
inline void amx_pack(const Problem& pr, const AmxLayout& l, AmxPacked& pk) {
  const int64_t D = pr.D;
  conveyor_parallel::parallel_for(0, l.n_pad / 32, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t vrows[32 * 96];
    for (int64_t c = begin; c < end; ++c) {
      const int64_t j0 = c * 32, nj = std::min<int64_t>(32, pr.P - j0);
      for (int64_t h = 0; h < pr.H; ++h) {
        uint16_t* kd = pk.k + (h * l.n_pad + j0) * pr.D;
        uint32_t* qd = pk.qt + (h * l.n_pad + j0) * l.q_rows;  // two blocks of 16 queries
        std::fill(qd, qd + 32 * l.q_rows, 0);
        for (int64_t j = 0; j < nj; ++j) {
          std::memcpy(kd + j * pr.D, pr.k + (j0 + j) * pr.ldk + h * D, D * sizeof(uint16_t));
          const uint16_t* q = pr.q + (j0 + j) * pr.ldq + h * D;
          uint32_t* qb = qd + (j / 16) * 16 * l.q_rows + j % 16;
          for (int64_t i = 0; i < l.q_rows; ++i) qb[i * 16] = q[2 * i] | static_cast<uint32_t>(q[2 * i + 1]) << 16;
        }
        std::fill(kd + nj * pr.D, kd + 32 * pr.D, 0);
        // V^T: the 32 rows into L1 first (zero rows past P), then transposed from there.
        for (int64_t j = 0; j < 32; ++j) {
          if (j < nj)
            std::memcpy(vrows + j * D, pr.v + (j0 + j) * pr.ldv + h * D, D * sizeof(uint16_t));
          else
            std::fill(vrows + j * D, vrows + (j + 1) * D, 0);
        }
        uint16_t* vd = pk.vt + h * l.dv * l.ldv + j0;
        for (int64_t d = 0; d < D; ++d)
          for (int64_t j = 0; j < 32; ++j) vd[d * l.ldv + j] = vrows[j * D + d];
        for (int64_t d = D; d < l.dv; ++d) std::fill(vd + d * l.ldv, vd + d * l.ldv + 32, 0);
      }
    }
  });
}

struct AmxBuffers {  // one thread's (kept between calls)
  float* st;     // S^T: n_pad x 16
  uint16_t* pt;  // P^T: n_pad / 2 pair rows x 16 x 2
  float* ot;     // O^T: dv x 16
  explicit AmxBuffers(const AmxLayout& l) {
    thread_local Scratch<float> storage;
    st = storage.get(l.n_pad * 16 + l.n_pad * 8 + l.dv * 16);
    pt = reinterpret_cast<uint16_t*>(st + l.n_pad * 16);
    ot = st + l.n_pad * 24;
  }
};

// 2^x for x <= 0 (lanes far below give 0): x = k + f, f in [-0.5, 0.5], 2^f by a degree-5 fit (2.6e-7 relative).
inline __m512 exp2_ps(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, k);
  __m512 p = _mm512_set1_ps(1.3400432653725147e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.676037356257439e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550327152013779e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402210682630539e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471824645996e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, k);
}

// One head's block of 16 queries from row q0 (rows past P are zeros, computed, not stored).
inline void amx_block(const Problem& pr, const AmxLayout& l, AmxPacked& pk, int64_t h, int64_t q0, AmxBuffers& buf) {
  const int64_t P = pr.P;
  const uint16_t* qt = reinterpret_cast<const uint16_t*>(pk.qt + (h * l.n_pad + q0) * l.q_rows);
  configure(l, true);
  if (l.full > 0) _tile_loadd(2, qt, 64);
  if (l.full > 1) _tile_loadd(3, qt + 512, 64);
  if (l.full > 2 || l.tail > 0) _tile_loadd(4, qt + 512 * std::min<int64_t>(l.full, 2), 64);
  const uint16_t* kh = pk.k + h * l.n_pad * pr.D;
  const int64_t s0 = pr.D * 2, s1 = s0;  // a key row's bytes
  float* st = buf.st;
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = lowest, m1 = lowest;
  for (int64_t kb = 0; kb < l.n_pad / 16; kb += 2) {
    const uint16_t *k0 = kh + kb * 16 * pr.D, *k1 = k0 + 16 * pr.D;
    _tile_zero(0);
    _tile_zero(1);
    if (l.full > 0) {
      _tile_loadd(5, k0, s0);
      _tile_dpbf16ps(0, 5, 2);
      _tile_loadd(6, k1, s1);
      _tile_dpbf16ps(1, 6, 2);
    }
    if (l.full > 1) {
      _tile_loadd(5, k0 + 32, s0);
      _tile_dpbf16ps(0, 5, 3);
      _tile_loadd(6, k1 + 32, s1);
      _tile_dpbf16ps(1, 6, 3);
    }
    if (l.full > 2) {
      _tile_loadd(5, k0 + 64, s0);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(6, k1 + 64, s1);
      _tile_dpbf16ps(1, 6, 4);
    }
    if (l.tail > 0) {
      _tile_loadd(7, k0 + 32 * l.full, s0);
      _tile_dpbf16ps(0, 7, 4);
      _tile_loadd(7, k1 + 32 * l.full, s1);
      _tile_dpbf16ps(1, 7, 4);
    }
    float* s = st + kb * 16 * 16;
    _tile_stored(0, s, 64);
    _tile_stored(1, s + 256, 64);
    // The running max of each query (lane) over the real keys, while the scores are in L1 (max is order-free).
    const int64_t n = std::min<int64_t>(32, P - kb * 16);
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + 16 * j));
      m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + 16 * j + 16));
    }
    if (j < n) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + 16 * j));
  }
  // p = 2^(c s - c m), c = scale * log2(e); the sums in four key-strided chains, combined in a fixed order.
  const __m512 c = _mm512_set1_ps(pr.scale * 1.4426950408889634f);
  const __m512 shift = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_max_ps(m0, m1)), c);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  uint16_t* pt = buf.pt;
  auto pair = [&](int64_t j, __m512 p0, __m512 p1) {  // keys j, j + 1 -> one 64-byte pair row of P^T
    const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0's 16 bf16, then p1's
    _mm512_storeu_si512(pt + j * 16, _mm512_permutexvar_epi16(interleave, w));
  };
  auto prob = [&](int64_t j) { return exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(st + 16 * j), c, shift)); };
  int64_t j = 0;
  for (; j + 4 <= P; j += 4) {
    const __m512 p0 = prob(j), p1 = prob(j + 1), p2 = prob(j + 2), p3 = prob(j + 3);
    a0 = _mm512_add_ps(a0, p0);
    a1 = _mm512_add_ps(a1, p1);
    a2 = _mm512_add_ps(a2, p2);
    a3 = _mm512_add_ps(a3, p3);
    pair(j, p0, p1);
    pair(j + 2, p2, p3);
  }
  for (; j < P; j += 2) {  // the last 1-3 keys; a key past P has p = 0
    const __m512 p0 = prob(j), p1 = j + 1 < P ? prob(j + 1) : _mm512_setzero_ps();
    a0 = _mm512_add_ps(a0, p0);
    a1 = _mm512_add_ps(a1, p1);
    pair(j, p0, p1);
  }
  std::fill(pt + j * 16, pt + l.n_pad * 16, 0);
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  // O^T = V^T P^T, up to five d tiles at a time.
  configure(l, false);
  const uint16_t* vh = pk.vt + h * l.dv * l.ldv;
  for (int64_t g = 0; g < l.dv / 16; g += 5) {
    const int64_t cnt = std::min<int64_t>(5, l.dv / 16 - g);
    const uint16_t* a = vh + g * 16 * l.ldv;
    const int64_t lda = l.ldv * 2, step = 16 * l.ldv;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    for (int64_t kb = 0; kb < l.n_pad / 32; ++kb, a += 32) {
      _tile_loadd(5, pt + kb * 512, 64);
      _tile_loadd(6, a, lda);
      _tile_dpbf16ps(0, 6, 5);
      if (cnt > 1) {
        _tile_loadd(7, a + step, lda);
        _tile_dpbf16ps(1, 7, 5);
      }
      if (cnt > 2) {
        _tile_loadd(6, a + 2 * step, lda);
        _tile_dpbf16ps(2, 6, 5);
      }
      if (cnt > 3) {
        _tile_loadd(7, a + 3 * step, lda);
        _tile_dpbf16ps(3, 7, 5);
      }
      if (cnt > 4) {
        _tile_loadd(6, a + 4 * step, lda);
        _tile_dpbf16ps(4, 6, 5);
      }
    }
    float* o = buf.ot + g * 256;
    _tile_stored(0, o, 64);
    if (cnt > 1) _tile_stored(1, o + 256, 64);
    if (cnt > 2) _tile_stored(2, o + 512, 64);
    if (cnt > 3) _tile_stored(3, o + 768, 64);
    if (cnt > 4) _tile_stored(4, o + 1024, 64);
  }
  // O[q][d] = O^T[d][q] / sum[q], rounded, into the head's contiguous rows (bf16 first, then a 16-bit transpose).
  alignas(64) uint16_t ob[96 * 16];
  for (int64_t d = 0; d < pr.D; ++d) {
    const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(buf.ot + d * 16), inv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ob + d * 16), (__m256i)_mm512_cvtneps_pbh(o));
  }
  uint16_t* dst = pk.o + (h * l.n_pad + q0) * pr.D;
  for (int64_t q = 0; q < kQueryRows; ++q)
    for (int64_t d = 0; d < pr.D; ++d) dst[q * pr.D + d] = ob[d * 16 + q];
}

inline void amx_attention(const Problem& pr) {
  const AmxLayout l = amx_layout(pr);
  AmxPacked pk(pr, l);
  amx_pack(pr, l, pk);
  const int64_t blocks = (pr.P + kQueryRows - 1) / kQueryRows;
  // Head-major: a thread's consecutive blocks share one head's K and V^T in its cache.
  conveyor_parallel::parallel_for(0, pr.H * blocks, 1, [&](int64_t begin, int64_t end) {
    AmxBuffers buf(l);
    for (int64_t t = begin; t < end; ++t)
      amx_block(pr, l, pk, t / blocks, (t % blocks) * kQueryRows, buf);
    _tile_release();
  });
  conveyor_parallel::parallel_for(0, pr.P, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t h = 0; h < pr.H; ++h)
        std::memcpy(pr.out + (i * pr.H + h) * pr.D, pk.o + (h * l.n_pad + i) * pr.D, pr.D * sizeof(uint16_t));
  });
}
#endif  // CONVEYOR_DENSE_AMX

// ---------------------------------------------------------------------------------------------
// Every other build: fp32, the AMX path's shape with a vector lane per query (16 lanes as GCC /
// Clang vector extensions: one zmm, two ymm, four xmm or NEON registers). Per head, packed once per
// call: Q^T blocks (D x 16), K and V rows, widened to fp32. For a block of 16 queries:
//   s[j][q] = sum_d k[j][d] q[d][q] (d order), the max per lane, p = exp(scale (s - m)) with the
//   sum per lane in key order, o[d][q] = sum_j v[j][d] p[j][q] (key order), out = o / sum.
// Every reduction is one chain per lane (fused multiply-adds where the ISA has them, else a multiply
// then an add: -ffp-contract=off).
// ---------------------------------------------------------------------------------------------
constexpr int kLanes = 16;
constexpr int kKeysAtOnce = 4;  // score rows per pass over Q^T
constexpr int kDimsAtOnce = 8;  // output rows per pass over the probabilities

typedef float Lanes __attribute__((vector_size(64)));

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_lanes(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

// acc + a * b, lane by lane.
inline Lanes madd(float a, Lanes b, Lanes acc) {
#if defined(__AVX512F__)
  return (Lanes)_mm512_fmadd_ps(_mm512_set1_ps(a), (__m512)b, (__m512)acc);
#elif defined(CONVEYOR_AVX2)
  alignas(64) float tb[kLanes], ta[kLanes];
  store_lanes(tb, b);
  store_lanes(ta, acc);
  const __m256 va = _mm256_set1_ps(a);
  _mm256_store_ps(ta, _mm256_fmadd_ps(va, _mm256_load_ps(tb), _mm256_load_ps(ta)));
  _mm256_store_ps(ta + 8, _mm256_fmadd_ps(va, _mm256_load_ps(tb + 8), _mm256_load_ps(ta + 8)));
  return load_lanes(ta);
#else
  return acc + a * b;
#endif
}

inline Lanes exp_lanes(Lanes x) {
#if defined(__AVX512F__)
  return (Lanes)conveyor_vec::exp_ps((__m512)x);
#elif defined(CONVEYOR_AVX2)
  alignas(64) float t[kLanes];
  store_lanes(t, x);
  _mm256_store_ps(t, conveyor_vec::exp_ps(_mm256_load_ps(t)));
  _mm256_store_ps(t + 8, conveyor_vec::exp_ps(_mm256_load_ps(t + 8)));
  return load_lanes(t);
#else
  for (int q = 0; q < kLanes; ++q) x[q] = std::exp(x[q]);
  return x;
#endif
}

struct F32Packed {
  std::vector<float> qt;  // per head and block of 16 queries: (D, 16)
  std::vector<float> k;   // per head: (P, D), then kKeysAtOnce zero rows
  std::vector<float> v;   // per head: (P, D), then kDimsAtOnce zero columns at the end
};

inline void f32_block(const Problem& pr, const F32Packed& pk, int64_t h, int64_t q0, float* s, float* o) {
  const int64_t P = pr.P, D = pr.D, blocks = (P + kLanes - 1) / kLanes, k_head = (P + kKeysAtOnce) * D;
  const float* qt = pk.qt.data() + (h * blocks + q0 / kLanes) * D * kLanes;
  const float* kh = pk.k.data() + h * k_head;
  const float* vh = pk.v.data() + h * P * D;
  const Lanes zero = {};
  Lanes m = zero - std::numeric_limits<float>::infinity();
  for (int64_t j0 = 0; j0 < P; j0 += kKeysAtOnce) {  // rows past P read the zero rows after the head's keys
    Lanes acc[kKeysAtOnce] = {};
    for (int64_t d = 0; d < D; ++d) {
      const Lanes qd = load_lanes(qt + d * kLanes);
      for (int r = 0; r < kKeysAtOnce; ++r) acc[r] = madd(kh[(j0 + r) * D + d], qd, acc[r]);
    }
    for (int r = 0; r < kKeysAtOnce && j0 + r < P; ++r) {
      store_lanes(s + (j0 + r) * kLanes, acc[r]);
      m = acc[r] > m ? acc[r] : m;
    }
  }
  Lanes sum = zero;
  for (int64_t j = 0; j < P; ++j) {
    const Lanes p = exp_lanes((load_lanes(s + j * kLanes) - m) * pr.scale);
    store_lanes(s + j * kLanes, p);
    sum = sum + p;
  }
  for (int64_t d0 = 0; d0 < D; d0 += kDimsAtOnce) {  // columns past D read zeros (v's tail)
    Lanes acc[kDimsAtOnce] = {};
    for (int64_t j = 0; j < P; ++j) {
      const Lanes pj = load_lanes(s + j * kLanes);
      for (int g = 0; g < kDimsAtOnce; ++g) acc[g] = madd(vh[j * D + d0 + g], pj, acc[g]);
    }
    for (int g = 0; g < kDimsAtOnce && d0 + g < D; ++g) store_lanes(o + (d0 + g) * kLanes, acc[g] / sum);
  }
  const int64_t rows = std::min<int64_t>(kLanes, P - q0);
  for (int64_t q = 0; q < rows; ++q) {
    uint16_t* dst = pr.out + (q0 + q) * pr.H * D + h * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = conveyor_bf16::round_bf16(o[d * kLanes + q]);
  }
}

inline void f32_attention(const Problem& pr) {
  const int64_t P = pr.P, D = pr.D, H = pr.H, blocks = (P + kLanes - 1) / kLanes, k_head = (P + kKeysAtOnce) * D;
  F32Packed pk;
  pk.qt.assign(H * blocks * D * kLanes, 0.f);
  pk.k.assign(H * k_head, 0.f);
  pk.v.assign(H * P * D + kDimsAtOnce, 0.f);
  conveyor_parallel::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          pk.k[h * k_head + j * D + d] = conveyor_bf16::widen_bf16(pr.k[j * pr.ldk + h * D + d]);
          pk.v[(h * P + j) * D + d] = conveyor_bf16::widen_bf16(pr.v[j * pr.ldv + h * D + d]);
          pk.qt[((h * blocks + j / kLanes) * D + d) * kLanes + j % kLanes] =
              conveyor_bf16::widen_bf16(pr.q[j * pr.ldq + h * D + d]);
        }
  });
  conveyor_parallel::parallel_for(0, H * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(P * kLanes), o(D * kLanes);
    for (int64_t t = begin; t < end; ++t) f32_block(pr, pk, t / blocks, (t % blocks) * kLanes, s.data(), o.data());
  });
}

// The path dense_attention takes for this head dim in this process.
inline const char* path(int64_t head_dim) {
#if CONVEYOR_DENSE_AMX
  if (amx_on() && amx_fits(head_dim)) return "amx";
#endif
  (void)head_dim;
  return "fp32";
}

}  // namespace conveyor_dense

// q, k, v: (P, H * D) bf16, unit column stride (rows may be apart); -> (P, H * D) bf16.
inline torch::Tensor dense_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     int64_t num_heads, double scale) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kBFloat16 && t->stride(1) == 1,
                "dense_attention: q, k, v must be 2-D bf16 with unit column stride");
    TORCH_CHECK(t->sizes() == q.sizes(), "dense_attention: q, k, v shapes differ");
  }
  TORCH_CHECK(num_heads > 0 && q.size(1) % num_heads == 0, "dense_attention: width not a multiple of num_heads");
  TORCH_CHECK(scale > 0, "dense_attention: scale must be positive");
  auto out = torch::empty({q.size(0), q.size(1)}, q.options());
  if (q.size(0) == 0) return out;
  conveyor_dense::Problem pr;
  pr.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  pr.k = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  pr.v = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  pr.ldq = q.stride(0);
  pr.ldk = k.stride(0);
  pr.ldv = v.stride(0);
  pr.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  pr.P = q.size(0);
  pr.H = num_heads;
  pr.D = q.size(1) / num_heads;
  pr.scale = static_cast<float>(scale);
#if CONVEYOR_DENSE_AMX
  if (conveyor_dense::amx_on() && conveyor_dense::amx_fits(pr.D)) {
    conveyor_dense::amx_attention(pr);
    return out;
  }
#endif
  conveyor_dense::f32_attention(pr);
  return out;
}
