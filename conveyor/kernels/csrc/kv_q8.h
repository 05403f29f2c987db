// Q8_0 K/V cache rows (--cache-type-k / -v q8_0): one row per (token, KV head), head_dim / 32
// GGML block_q8_0 blocks of 34 bytes each: the fp16 scale d, then 32 int8 values q, x ~ d * q.
// The same bytes as llama.cpp's Q8_0 (gguf-py dequantizes them), so a row is what llama.cpp keeps.
//
// Quantization is scalar IEEE arithmetic only (no FMA, round to nearest even), per 32-block of
// one row: the same bits whichever kernel writes the row, and the same bits as the torch twin in
// conveyor/kernels/kv_quant.py (tests check both).
#pragma once
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace conveyor_q8 {

constexpr int64_t kBlock = 32;
constexpr int64_t kBlockBytes = 34;  // fp16 d, then 32 int8

inline int64_t row_bytes(int64_t head_dim) { return head_dim / kBlock * kBlockBytes; }

// 32 values -> 32 int8 in [-127, 127] and their fp32 scale (amax / 127): llama.cpp's
// quantize_row_q8_0_ref, with round-half-even for roundf (torch.round's rule, so the twins agree).
inline float quantize_block(const float* x, int8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  for (int64_t i = 0; i < kBlock; ++i) {
    float r = std::nearbyint(x[i] * inv);
    r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
    q[i] = static_cast<int8_t>(r);
  }
  return d;
}

// One head row (D values, any dtype) -> row_bytes(D) bytes of Q8_0 blocks.
template <typename scalar_t>
inline void quantize_row(const scalar_t* x, uint8_t* dst, int64_t D) {
  float v[kBlock];
  for (int64_t b = 0; b < D / kBlock; ++b) {
    for (int64_t i = 0; i < kBlock; ++i) v[i] = static_cast<float>(x[b * kBlock + i]);
    uint8_t* blk = dst + b * kBlockBytes;
    const c10::Half d(quantize_block(v, reinterpret_cast<int8_t*>(blk + 2)));
    std::memcpy(blk, &d.x, sizeof(d.x));
  }
}

// A block's fp16 scale as stored (vector code converts several at once), and as fp32.
inline uint16_t scale_bits(const uint8_t* blk) {
  uint16_t bits;
  std::memcpy(&bits, blk, sizeof(bits));
  return bits;
}

inline float block_scale(const uint8_t* blk) {
  return static_cast<float>(c10::Half(scale_bits(blk), c10::Half::from_bits()));
}

inline const int8_t* block_values(const uint8_t* blk) { return reinterpret_cast<const int8_t*>(blk + 2); }

}  // namespace conveyor_q8
