// Intel AMX tiles, shared by the GEMM and attention kernels. Every tile we use is 16 rows x
// 64 bytes (16 fp32, or 32 bf16, or 16 bf16 pairs), so one configuration serves both.
#pragma once
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define CONVEYOR_HAS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace conveyor_amx {

// Linux hands out the AMX tile state only to processes that ask for it.
inline bool request_permission() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Decided once per process (CONVEYOR_DISABLE_AMX=1 opts out), so every call of every kernel
// takes the same arithmetic path: batch invariance depends on it.
bool enabled();

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-6 all 16 rows x 64 bytes. Tile state is per thread: configure in each worker, release after.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace conveyor_amx
#else
#define CONVEYOR_HAS_AMX 0
#endif
