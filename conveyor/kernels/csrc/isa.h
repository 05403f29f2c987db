// The instruction-set level this translation unit was compiled for (-march), as the backend
// name conveyor reports. Every kernel picks its code path from these same macros at compile
// time, so one build runs one fixed arithmetic path: batch invariance depends on it.
#pragma once

namespace conveyor_isa {

inline const char* compiled_level() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  return "amx";
#elif defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "generic";
#endif
}

}  // namespace conveyor_isa
