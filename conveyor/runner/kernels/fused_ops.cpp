// Small fused CPU ops for the decode hot path. Each replaces several torch ops (and their
// per-op dispatch cost, which dominates at decode sizes) with one pass over the row, and
// reduces every row in a fixed order of its own.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>

namespace {

template <typename scalar_t>
inline scalar_t round_to(float x) { return static_cast<scalar_t>(x); }

// transformers' LlamaRMSNorm: fp32 statistics, cast to the input dtype, then times the weight.
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * n;
      float part[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) {
          const float v = static_cast<float>(xr[i + l]);
          part[l] += v * v;
        }
      for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) part[l] += part[l + width];
      float sum = part[0];
      for (; i < n; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      scalar_t* o = out + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const scalar_t normed = round_to<scalar_t>(static_cast<float>(xr[j]) * inv);
        o[j] = round_to<scalar_t>(static_cast<float>(w[j]) * static_cast<float>(normed));
      }
    }
  });
}

// silu(gate) * up on a fused (rows, 2 * n) gate|up tensor, rounding like torch does per op.
template <typename scalar_t>
void silu_mul_rows(const scalar_t* gu, scalar_t* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gu + r * 2 * n;
      const scalar_t* u = g + n;
      scalar_t* o = out + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const float gv = static_cast<float>(g[j]);
        const scalar_t act = round_to<scalar_t>(gv / (1.f + std::exp(-gv)));
        o[j] = round_to<scalar_t>(static_cast<float>(act) * static_cast<float>(u[j]));
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: dtype mismatch");
  x = x.contiguous();
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n, "rms_norm: weight size mismatch");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.contiguous().data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.numel() / n, n, static_cast<float>(eps));
  });
  return out;
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  gate_up = gate_up.contiguous();
  const int64_t n = gate_up.size(-1) / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.numel() / (2 * n), n);
  });
  return out;
}

// argmax per row of fp32 logits; the first maximum wins, as torch.argmax does.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32, "argmax_rows: (R, V) float32 only");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * n;
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) best = xr[j] > best ? xr[j] : best;  // vectorizes: max is order-free
      int64_t index = 0;
      while (index < n && !(xr[index] == best)) ++index;
      o[r] = index < n ? index : 0;  // all-NaN row: 0
    }
  });
  return out;
}
