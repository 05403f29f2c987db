// y = x W^T (+ b) for bf16 on AVX-512 BF16 CPUs, row-invariant by construction.
//
// Why our own GEMM: at decode sizes (M = 1..32 rows) oneDNN streamed the weights at ~40% of
// this machine's memory bandwidth, and its kernel choice changes with M, so rows were bitwise
// stable only in tiles of <= 32. Here every output element is one fixed sequence of
// vdpbf16ps over k (pairs of bf16 products into an fp32 accumulator), whatever M is and
// wherever the row sits, so a request's logits never depend on its batch-mates.
//
// Weight layout (packed once at load): panels of 64 output columns, each panel
// [K/2][64][2] bf16, so one k-pair of a panel is four contiguous 64-byte vectors and a
// thread reading its panels walks one sequential stream.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "isa.h"

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

namespace {

// Chosen once per process, so every call (every M) of every layer goes through the same kernel.
enum class Backend { kNone, kAvx512, kAmx };

Backend backend() {
  static const Backend chosen = [] {
#if CONVEYOR_HAS_AMX
    if (conveyor_amx::enabled()) return Backend::kAmx;
#endif
    return CONVEYOR_HAS_BF16_LINEAR ? Backend::kAvx512 : Backend::kNone;
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
    case Backend::kAvx512: return "avx512_bf16";
    default: return "";
  }
}

// (N, K) bf16 -> (ceil(N/64), ceil(K/32)*16, 64, 2) bf16, zero-padded: panels of 64 output
// columns, k in pairs, k padded to whole AMX k-blocks of 32.
torch::Tensor bf16_linear_pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be a 2-D bf16 tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t n_pad = (n + kPanel - 1) / kPanel * kPanel, k_pad = (k + 31) / 32 * 32;
  auto padded = torch::zeros({n_pad, k_pad}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({n_pad / kPanel, kPanel, k_pad / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(backend() != Backend::kNone, "bf16_linear needs a CPU with AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a 2-D bf16 tensor");
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
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
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
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("isa", &conveyor_isa::compiled_level, "the -march level this module was compiled for");
  m.def("backend", &bf16_linear_backend, "bf16_linear's kernel in this process: amx, avx512_bf16, ... or empty");
  m.def("pack", &bf16_linear_pack, "pack a (N, K) bf16 weight for bf16_linear", release());
  m.def("linear", &bf16_linear, "row-invariant bf16 x W^T (+ b) (CPU)", release());
}
