// Paged attention on AMX tiles (the amx build, bf16 K/V caches, head dims 16..256 in steps of 16): a tile of 16
// query rows (token, head) pairs of one sequence and one KV head, against that sequence's keys read in place
// through its block table. Decode rows run the very same code, one token's G heads in a padded tile.
//
// Per absolute key block [64 b, 64 b + 64), in 16-key tile products:
//   S^T (16 keys x 16 rows) = K Q^T: A = 16 key rows straight from the cache, B = the tile's Q^T (d pairs x rows);
//   S = transpose (registers), a row's 16 keys per vector; online softmax per row in log2 units:
//       m' = max(m, block's visible t),  alpha = 2^(m - m'),  p = 2^(t - m') rounded to bf16 (0 where not visible),
//       l' = alpha l + sum(p),  O' = alpha O + P V;
//   P V on tiles with V's rows as they lie in the cache (no repack): B = 16 key rows x 32 d, A = P "spread",
//       even tile (p_k, 0) per key k -> C_e (rows x even d), odd tile (0, p_k) -> C_o (odd d).
// Out = O / l (+0, so a zero has one sign), rounded to bf16. Denormals flush to zero throughout (FTZ, DAZ).
//
// Why a row's bits never depend on its tile-mates, its chunk or its batch (prefill == decode):
//   - every tile product element (key, row) / (row, d) is one fixed chain over its own A row and B column;
//   - block boundaries are absolute positions, so a row meets the same blocks in any chunking;
//   - a block a row sees no key of leaves its state untouched (skipped, not multiplied by 2^0);
//   - a key the row does not see gets p = +0 exactly; its product 0 * v is +-0, which never changes a nonzero
//     sum, and the final +0 gives zeros one sign. Keys outside every row's range are zero rows, never read
//     from the cache (stale or unwritten slots may hold anything). Keys inside the tile's range that one row
//     does not see are the sequence's own written K/V: finite, as every model output is assumed to be.
#pragma once
#if defined(CONVEYOR_DENSE_AMX)
#define CONVEYOR_PAGED_AMX 1
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "dense_attention.h"
#include "parallel.h"
#include "vec_math.h"

namespace conveyor_paged_amx {

constexpr int64_t kRows = 16;       // query rows per tile
constexpr int64_t kSub = 16;        // keys per tile product
constexpr int64_t kBlockKeys = 64;  // keys per online-softmax step, at absolute positions
constexpr int64_t kSubs = kBlockKeys / kSub;
constexpr int64_t kMaxD = 256;
constexpr float kLog2e = 1.4426950408889634f;

// Decided once per process (CONVEYOR_PAGED_AMX=0 opts out, CONVEYOR_DISABLE_AMX drops AMX altogether), so every
// call of a process takes one arithmetic path.
inline bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("CONVEYOR_PAGED_AMX");
    return (v == nullptr || std::strcmp(v, "0") != 0) && conveyor_dense::amx_on();
  }();
  return on;
}

// Head dims of 16..256 in steps of 16; one not a multiple of 32 (the tiny test models' 16) is read through the
// copies with zero columns up to the next 32 (below).
inline bool fits(int64_t D) { return D % 16 == 0 && D >= 16 && D <= kMaxD; }

struct Row {
  int64_t t, h;         // token row of the call, query head
  int64_t first, end;   // visible keys [first, end)
};

struct Call {
  const uint16_t* q;  // (T, H, D) bf16 bits
  uint16_t* out;      // (T, H, D)
  int64_t H, D;
  const uint16_t *kc, *vc;  // caches, offset to the KV head
  int64_t kv_block, kv_tok;  // strides in elements
  int bs_shift;
  float c;               // scale * log2(e)
  float scale, softcap;  // softcap > 0: Gemma 2's c tanh(s / c) on the scaled score
  const float* sinks;    // per query head, or nullptr
};

inline const uint16_t* cache_row(const uint16_t* base, const int32_t* table, int64_t key, const Call& c) {
  return base + table[key >> c.bs_shift] * c.kv_block + (key & ((int64_t{1} << c.bs_shift) - 1)) * c.kv_tok;
}

// One 16-key sub-block's rows of one cache as a tile source: in place when all 16 lie in [lo, hi) (one cache
// block: sub-blocks are 16-aligned and blocks hold >= 16) and D is whole 32-d blocks, else copied (row stride
// D padded to 32, zero columns past D) with zero rows outside [lo, hi).
inline const uint16_t* sub_rows(const uint16_t* base, const int32_t* table, int64_t s0, int64_t lo, int64_t hi,
                                const Call& c, uint16_t* buf, int64_t& stride_bytes) {
  const int64_t dp = (c.D + 31) / 32 * 32;
  if (s0 >= lo && s0 + kSub <= hi && c.bs_shift >= 4 && dp == c.D) {
    stride_bytes = c.kv_tok * 2;
    return cache_row(base, table, s0, c);
  }
  for (int64_t j = 0; j < kSub; ++j) {
    const int64_t key = s0 + j;
    uint16_t* dst = buf + j * dp;
    if (key >= lo && key < hi) {
      std::memcpy(dst, cache_row(base, table, key, c), c.D * sizeof(uint16_t));
      std::memset(dst + c.D, 0, (dp - c.D) * sizeof(uint16_t));
    } else {
      std::memset(dst, 0, dp * sizeof(uint16_t));
    }
  }
  stride_bytes = dp * 2;
  return buf;
}

inline void configure() {
  conveyor_amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

inline float exp2_scalar(float x) { return _mm512_cvtss_f32(conveyor_dense::exp2_ps(_mm512_set1_ps(x))); }

// Scores of one row's 16 keys in log2 units: t = s c, or with soft-capping t = (cap tanh(s scale / cap)) log2(e).
inline __m512 log2_scores(__m512 s, const Call& c) {
  if (c.softcap <= 0.f) return _mm512_mul_ps(s, _mm512_set1_ps(c.c));
  alignas(64) float x[16];
  _mm512_store_ps(x, s);
  for (float& v : x) v = c.softcap * std::tanh(v * c.scale / c.softcap) * kLog2e;
  return _mm512_load_ps(x);
}

// One tile's own state through its key blocks.
struct Tile {
  alignas(64) uint32_t qt[kMaxD / 32][16][16];  // per 32-d block: pair rows x query rows
  alignas(64) float o[kRows][kMaxD];            // per 32-d block: 16 even d, then 16 odd d
  float m[kRows], l[kRows];
  Row rows[kRows];
  int64_t nr, lo, hi;  // rows, and the keys any of them sees: [lo, hi)
};

// A thread's scratch for one key block (kept between calls).
struct Scratch {
  alignas(64) float st[kSubs][16][16];                        // S^T per sub-block
  alignas(64) uint32_t ae[kSubs][16][16], ao[kSubs][16][16];  // P spread, even and odd
  alignas(64) float pv[kMaxD / 32][2][16][16];                // C_e, C_o per 32-d block
  alignas(64) uint16_t kbuf[kSubs][kSub * kMaxD], vbuf[kSubs][kSub * kMaxD];
  float alpha[kRows];
  bool active[kRows];
};

// A tile's rows [0, nr): Q^T packed, the softmax state at its start.
inline void start_tile(const Call& c, Tile& tile) {
  const int64_t D = c.D, nd = (D + 31) / 32;
  std::memset(tile.qt, 0, nd * sizeof(tile.qt[0]));
  tile.lo = std::numeric_limits<int64_t>::max();
  tile.hi = 0;
  for (int64_t r = 0; r < tile.nr; ++r) {
    const Row& row = tile.rows[r];
    const uint16_t* q = c.q + (row.t * c.H + row.h) * D;
    for (int64_t i = 0; i < D / 2; ++i)
      tile.qt[i / 16][i % 16][r] = q[2 * i] | static_cast<uint32_t>(q[2 * i + 1]) << 16;
    tile.lo = std::min(tile.lo, row.first);
    tile.hi = std::max(tile.hi, row.end);
    // GPT-OSS's sink: a logit with no value, in the max and the denominator from the start.
    tile.m[r] = c.sinks != nullptr ? c.sinks[row.h] * kLog2e : -std::numeric_limits<float>::infinity();
    tile.l[r] = c.sinks != nullptr ? exp2_scalar(0.f) : 0.f;
    std::fill(tile.o[r], tile.o[r] + 32 * nd, 0.f);
  }
}

// Tile products name their tiles by immediates: sub-block i's S^T accumulates in tmm i (0-3).
#define CONVEYOR_PAGED_SUB(op) \
  switch (i) {                 \
    case 0: op(0); break;      \
    case 1: op(1); break;      \
    case 2: op(2); break;      \
    default: op(3); break;     \
  }

// One tile against key block [b0, b0 + 64): its present sub-blocks' K and V rows at ksrc / vsrc.
inline void tile_block(const Call& c, Tile& tile, int64_t b0, const bool* present_g, const uint16_t* const* ksrc,
                       const int64_t* kstride, const uint16_t* const* vsrc, const int64_t* vstride, Scratch& sc) {
  const int64_t nd = (c.D + 31) / 32;
  bool present[kSubs];
  for (int64_t i = 0; i < kSubs; ++i) {
    const int64_t s0 = b0 + i * kSub;
    present[i] = present_g[i] && s0 < tile.hi && s0 + kSub > tile.lo;
  }
  // S^T = K Q^T: Q^T's d block in tmm5 once for every sub-block, K in tmm4.
  for (int64_t i = 0; i < kSubs; ++i) {
#define ZERO(t) _tile_zero(t)
    if (present[i]) CONVEYOR_PAGED_SUB(ZERO)
#undef ZERO
  }
  for (int64_t db = 0; db < nd; ++db) {
    _tile_loadd(5, tile.qt[db], 64);
    for (int64_t i = 0; i < kSubs; ++i) {
      if (!present[i]) continue;
      _tile_loadd(4, ksrc[i] + 32 * db, kstride[i]);
#define DP(t) _tile_dpbf16ps(t, 4, 5)
      CONVEYOR_PAGED_SUB(DP)
#undef DP
    }
  }
  for (int64_t i = 0; i < kSubs; ++i) {
#define STORE(t) _tile_stored(t, sc.st[i], 64)
    if (present[i]) CONVEYOR_PAGED_SUB(STORE)
#undef STORE
  }
  // S^T -> S: s[i][r] holds row r's scores for sub-block i's 16 keys.
  __m512 s[kSubs][16];
  for (int64_t i = 0; i < kSubs; ++i) {
    if (!present[i]) continue;
    __m512i x[16];
    for (int j = 0; j < 16; ++j) x[j] = _mm512_castps_si512(_mm512_load_ps(sc.st[i][j]));
    conveyor_vec::transpose16x16_epi32(x);
    for (int r = 0; r < 16; ++r) s[i][r] = _mm512_castsi512_ps(x[r]);
  }
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < tile.nr; ++r) {
    const Row& row = tile.rows[r];
    const int64_t kf = std::max(row.first, b0), ke = std::min(row.end, b0 + kBlockKeys);
    sc.active[r] = kf < ke;
    if (!sc.active[r]) continue;
    __m512 t[kSubs];
    __mmask16 mask[kSubs];
    __m512 bmax = lowest;
    for (int64_t i = 0; i < kSubs; ++i) {
      mask[i] = 0;
      if (!present[i]) continue;
      const __m512i key = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(b0 + i * kSub)));
      mask[i] = _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(kf))) &
                _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(ke)));
      t[i] = _mm512_mask_mov_ps(lowest, mask[i], log2_scores(s[i][r], c));
      bmax = _mm512_max_ps(bmax, t[i]);
    }
    const float m_old = tile.m[r], m_new = std::max(m_old, _mm512_reduce_max_ps(bmax));
    // The same max again multiplies by exactly 1 (2^0 by the polynomial would not be 1).
    sc.alpha[r] = m_new == m_old ? 1.f : m_old == -std::numeric_limits<float>::infinity() ? 0.f
                                                                                         : exp2_scalar(m_old - m_new);
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < kSubs; ++i) {
      if (!present[i]) continue;
      if (mask[i] == 0) {  // this row sees none of these 16 keys: p = 0 (a stale row would add its old p)
        _mm512_store_si512(sc.ae[i][r], _mm512_setzero_si512());
        _mm512_store_si512(sc.ao[i][r], _mm512_setzero_si512());
        continue;
      }
      const __m512 p = _mm512_maskz_mov_ps(mask[i], conveyor_dense::exp2_ps(_mm512_sub_ps(t[i], vm)));
      const __m256i pb = (__m256i)_mm512_cvtneps_pbh(p);
      const __m512i spread = _mm512_cvtepu16_epi32(pb);  // (p, 0) per key
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(spread, 16)));  // the bf16 p, widened
      _mm512_store_si512(sc.ae[i][r], spread);
      _mm512_store_si512(sc.ao[i][r], _mm512_slli_epi32(spread, 16));
    }
    const __m128 l = _mm_fmadd_ss(_mm_set_ss(tile.l[r]), _mm_set_ss(sc.alpha[r]), _mm_set_ss(_mm512_reduce_add_ps(sum)));
    tile.l[r] = _mm_cvtss_f32(l);
    tile.m[r] = m_new;
  }
  // P V, two 32-d blocks at a time: C_e, C_o in tmm0-1 (and tmm2-3), P spread in tmm4-5, V in tmm6 (and tmm7).
  for (int64_t db = 0; db < nd; db += 2) {
    const bool two = db + 1 < nd;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < kSubs; ++i) {
      if (!present[i]) continue;
      _tile_loadd(4, sc.ae[i], 64);
      _tile_loadd(5, sc.ao[i], 64);
      _tile_loadd(6, vsrc[i] + 32 * db, vstride[i]);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, vsrc[i] + 32 * (db + 1), vstride[i]);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sc.pv[db][0], 64);
    _tile_stored(1, sc.pv[db][1], 64);
    if (two) {
      _tile_stored(2, sc.pv[db + 1][0], 64);
      _tile_stored(3, sc.pv[db + 1][1], 64);
    }
  }
  // O = alpha O + P V
  for (int64_t r = 0; r < tile.nr; ++r) {
    if (!sc.active[r]) continue;
    const __m512 a = _mm512_set1_ps(sc.alpha[r]);
    for (int64_t db = 0; db < nd; ++db) {
      float* o = tile.o[r] + 32 * db;
      _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), a, _mm512_load_ps(sc.pv[db][0][r])));
      _mm512_store_ps(o + 16, _mm512_fmadd_ps(_mm512_load_ps(o + 16), a, _mm512_load_ps(sc.pv[db][1][r])));
    }
  }
}
#undef CONVEYOR_PAGED_SUB

// out[d] = O[d] / l: even and odd d back in order, + 0 (one sign for zero), bf16.
inline void finish_tile(const Call& c, const Tile& tile) {
  const int64_t D = c.D, nd = (D + 31) / 32;
  const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t r = 0; r < tile.nr; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / tile.l[r]);
    uint16_t* dst = c.out + (tile.rows[r].t * c.H + tile.rows[r].h) * D;
    for (int64_t db = 0; db < nd; ++db) {
      const __m512 e = _mm512_load_ps(tile.o[r] + 32 * db), od = _mm512_load_ps(tile.o[r] + 32 * db + 16);
      const __m512 y0 = _mm512_add_ps(_mm512_mul_ps(_mm512_permutex2var_ps(e, lo_idx, od), inv), _mm512_setzero_ps());
      const __m512 y1 = _mm512_add_ps(_mm512_mul_ps(_mm512_permutex2var_ps(e, hi_idx, od), inv), _mm512_setzero_ps());
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * db), (__m256i)_mm512_cvtneps_pbh(y0));
      if (32 * db + 16 < D)  // D % 32 == 16: the last block's upper half is padding
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * db + 16), (__m256i)_mm512_cvtneps_pbh(y1));
    }
  }
}

// Up to kGroupTiles tiles of one sequence and KV head, key block by key block: each block's K and V rows are
// read (or copied) once for all of them, while they are in L1. The rows' union range [lo, hi) decides which
// rows are copied as zeros; every key in it is the sequence's own, written before the call.
constexpr int64_t kGroupTiles = 8;

inline void run_group(const Call& c, const int32_t* table, Tile* tiles, int64_t num_tiles, Scratch& sc) {
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t g = 0; g < num_tiles; ++g) {
    start_tile(c, tiles[g]);
    lo = std::min(lo, tiles[g].lo);
    hi = std::max(hi, tiles[g].hi);
  }
  configure();
  for (int64_t b0 = lo / kBlockKeys * kBlockKeys; b0 < hi; b0 += kBlockKeys) {
    bool present[kSubs];
    const uint16_t *ksrc[kSubs], *vsrc[kSubs];
    int64_t kstride[kSubs], vstride[kSubs];
    for (int64_t i = 0; i < kSubs; ++i) {
      const int64_t s0 = b0 + i * kSub;
      present[i] = s0 < hi && s0 + kSub > lo;
      if (!present[i]) continue;
      ksrc[i] = sub_rows(c.kc, table, s0, lo, hi, c, sc.kbuf[i], kstride[i]);
      vsrc[i] = sub_rows(c.vc, table, s0, lo, hi, c, sc.vbuf[i], vstride[i]);
    }
    for (int64_t g = 0; g < num_tiles; ++g)
      if (b0 < tiles[g].hi && b0 + kBlockKeys > tiles[g].lo)
        tile_block(c, tiles[g], b0, present, ksrc, kstride, vsrc, vstride, sc);
  }
  for (int64_t g = 0; g < num_tiles; ++g) finish_tile(c, tiles[g]);
}

// Every row of the call: rows grouped by sequence (in call order within one), each sequence's (token, head)
// rows of one KV head cut into tiles of 16 (a token's G heads adjacent), tiles in groups of kGroupTiles. One
// task per (sequence, KV head, group); a row's result does not depend on its task, group or tile-mates.
// first/end: each token row's visible keys [first, end).
inline void attend(const Call& call, const int32_t* bt, int64_t num_seqs, int64_t max_blocks, const int32_t* seq,
                   const int64_t* first, const int64_t* end, int64_t T, int64_t KVH, int64_t G) {
  std::vector<int64_t> start(num_seqs + 1, 0), order(T);
  for (int64_t t = 0; t < T; ++t) ++start[seq[t] + 1];
  for (int64_t s = 0; s < num_seqs; ++s) start[s + 1] += start[s];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < T; ++t) order[fill[seq[t]]++] = t;
  }
  struct Task {
    int64_t s, kvh, row0;
  };
  constexpr int64_t kGroupRows = kGroupTiles * kRows;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = (start[s + 1] - start[s]) * G;
    for (int64_t kvh = 0; kvh < KVH; ++kvh)
      for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) tasks.push_back({s, kvh, r0});
  }
  conveyor_parallel::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t stop) {
    // Denormals flushed to zero (FTZ) and read as zero (DAZ) while this path runs, on every thread and call, so
    // still one arithmetic: a peaked softmax's tiny p and alpha took microcode assists that made a 1B layer's
    // 1,480-row call 3x slower (AMX's own products already flush).
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    thread_local std::unique_ptr<Scratch> scratch;
    thread_local std::unique_ptr<Tile[]> tiles;
    if (!scratch) {
      scratch.reset(new Scratch);
      tiles.reset(new Tile[kGroupTiles]);
    }
    for (int64_t i = begin; i < stop; ++i) {
      const Task& task = tasks[i];
      const int64_t rows = std::min(kGroupRows, (start[task.s + 1] - start[task.s]) * G - task.row0);
      const int64_t num_tiles = (rows + kRows - 1) / kRows;
      for (int64_t g = 0; g < num_tiles; ++g) {
        Tile& tile = tiles[g];
        tile.nr = std::min(kRows, rows - g * kRows);
        for (int64_t r = 0; r < tile.nr; ++r) {
          const int64_t ri = task.row0 + g * kRows + r, t = order[start[task.s] + ri / G];
          tile.rows[r] = {t, task.kvh * G + ri % G, first[t], end[t]};
        }
      }
      Call c = call;
      c.kc += task.kvh * call.D;
      c.vc += task.kvh * call.D;
      run_group(c, bt + task.s * max_blocks, tiles.get(), num_tiles, *scratch);
    }
    _tile_release();
    _mm_setcsr(csr);
  });
}

}  // namespace conveyor_paged_amx
#endif  // CONVEYOR_DENSE_AMX
