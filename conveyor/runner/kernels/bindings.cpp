// The Python bindings of our CPU kernels (one extension module, built from every .cpp here).
#include <torch/extension.h>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor argmax_rows(torch::Tensor logits);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor signed_sin, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor slot_mapping, int64_t num_heads);

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor token_seq, torch::Tensor token_pos, double scale,
                              int64_t window);
std::string bf16_linear_backend();
torch::Tensor bf16_linear_pack(const torch::Tensor& weight);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                          const c10::optional<torch::Tensor>& bias);

// NOTE: every entry point releases the GIL, as torch's own ops do; holding it here stalled the
// server's event loop for whole kernels and then made the engine wait out the GIL switch interval.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, "Row-invariant paged attention (CPU)", release());
  m.def("rms_norm", &rms_norm, "RMSNorm with transformers' rounding (CPU)", release());
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta)) with torch's rounding (CPU)", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up over a fused (T, 2I) gate|up (CPU)", release());
  m.def("argmax_rows", &argmax_rows, "first-max argmax per row (CPU)", release());
  m.def("rope_write_kv", &rope_write_kv, "rotary on q|k and K/V scatter into cache slots (CPU)", release());
  m.def("bf16_linear_backend", &bf16_linear_backend, "bf16_linear's kernel in this process: amx, avx512_bf16 or empty");
  m.def("bf16_linear_pack", &bf16_linear_pack, "pack a (N, K) bf16 weight for bf16_linear", release());
  m.def("bf16_linear", &bf16_linear, "row-invariant bf16 x W^T (+ b) (CPU, AVX-512 BF16)", release());
}
