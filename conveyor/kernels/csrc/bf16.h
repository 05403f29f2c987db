// Scalar bf16 <-> fp32 with c10::BFloat16's rounding (nearest even, NaN -> 0x7FC0), shared by the
// GEMMs' scalar stores and widening so every kernel rounds exactly as torch does.
#pragma once
#include <cstdint>
#include <cstring>

namespace conveyor_bf16 {

inline uint16_t round_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float widen_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace conveyor_bf16
