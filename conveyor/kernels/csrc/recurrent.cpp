// Recurrent token mixers of hybrid models, over per-sequence state slots: the causal short
// convolution (LFM2, Mamba2's and gated DeltaNet's conv1d), the gated delta rule (Qwen3.5 /
// Qwen3-Next linear attention), the Mamba2 selective scan, and the gated norms and gates around them.
//
// Batch invariance: each (sequence, block of channels) or (sequence, head) is one task that walks its
// own tokens one by one in a fixed order, so a row's bits never depend on its batch-mates, and a
// prefill chunk of any size gives bitwise the state and outputs of token-by-token decoding (the
// chunked form *is* the recurrence, run in C++). Every nonlinearity is a function of its element
// alone: a scalar std:: call, or (the SiLUs of the short conv and the gated norm) vec_math's exp_ps
// on every lane of a zero-padded block. torch's vectorized exp/sigmoid would round differently in a
// tensor's tail, whose position depends on the batch. Reductions run in fp32 in index order.
//
// Snapshots: a task copies its state into other slots after given token counts (CSR per
// sequence), so prefix caching and speculation can resume from a block boundary or the last
// accepted token without recomputing.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "parallel.h"
#include "vec_math.h"

namespace {

template <typename scalar_t>
inline scalar_t round_to(float x) { return static_cast<scalar_t>(x); }
// x rounded to the dtype and back: the value a torch op in that dtype would hand on.
template <typename scalar_t>
inline float round_f(float x) { return static_cast<float>(static_cast<scalar_t>(x)); }

inline float silu(float x) { return x / (1.f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
// torch.nn.functional.softplus(x) with its default threshold 20.
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// The per-sequence layout of one forward, shared by every kernel here.
struct Sequences {
  const int64_t* starts;  // (S + 1,) first row of each sequence
  const int64_t* slots;   // (S,) state slot of each sequence
  const bool* reset;      // (S,) start from a zero state (the chunk begins at position 0)
  const int64_t* snap_starts;  // (S + 1,) CSR into snap_counts / snap_slots
  const int64_t* snap_counts;  // tokens of the chunk processed when the snapshot is taken (1..n)
  const int64_t* snap_slots;   // destination slot of each snapshot
  int64_t num;

  Sequences(const torch::Tensor& st, const torch::Tensor& sl, const torch::Tensor& rs, const torch::Tensor& ss,
            const torch::Tensor& sc, const torch::Tensor& sd)
      : starts(st.data_ptr<int64_t>()), slots(sl.data_ptr<int64_t>()), reset(rs.data_ptr<bool>()),
        snap_starts(ss.data_ptr<int64_t>()), snap_counts(sc.data_ptr<int64_t>()), snap_slots(sd.data_ptr<int64_t>()),
        num(sl.size(0)) {}
};

void check_sequences(const torch::Tensor& starts, const torch::Tensor& slots, const torch::Tensor& reset,
                     const torch::Tensor& snap_starts, const torch::Tensor& snap_counts,
                     const torch::Tensor& snap_slots, int64_t rows, int64_t num_slots) {
  TORCH_CHECK(starts.dtype() == torch::kInt64 && slots.dtype() == torch::kInt64 && reset.dtype() == torch::kBool &&
                  snap_starts.dtype() == torch::kInt64 && snap_counts.dtype() == torch::kInt64 &&
                  snap_slots.dtype() == torch::kInt64,
              "recurrent: index tensors must be int64 (reset: bool)");
  TORCH_CHECK(starts.is_contiguous() && slots.is_contiguous() && reset.is_contiguous() &&
                  snap_starts.is_contiguous() && snap_counts.is_contiguous() && snap_slots.is_contiguous(),
              "recurrent: index tensors must be contiguous");
  const int64_t S = slots.size(0);
  TORCH_CHECK(starts.size(0) == S + 1 && reset.size(0) == S && snap_starts.size(0) == S + 1,
              "recurrent: starts/reset/snap_starts must match the sequences");
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[S] == rows, "recurrent: sequence starts must cover the rows");
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(st[s] <= st[s + 1], "recurrent: sequence starts must not decrease");
    const int64_t slot = slots.data_ptr<int64_t>()[s];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "recurrent: state slot out of range");
  }
  const int64_t* ss = snap_starts.data_ptr<int64_t>();
  TORCH_CHECK(ss[0] == 0 && ss[S] == snap_counts.size(0) && snap_slots.size(0) == snap_counts.size(0),
              "recurrent: snapshot CSR is malformed");
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = ss[s]; i < ss[s + 1]; ++i) {
      const int64_t count = snap_counts.data_ptr<int64_t>()[i], slot = snap_slots.data_ptr<int64_t>()[i];
      TORCH_CHECK(count >= 1 && count <= st[s + 1] - st[s], "recurrent: snapshot count outside the chunk");
      TORCH_CHECK(slot >= 0 && slot < num_slots, "recurrent: snapshot slot out of range");
    }
}

// A (T, ...) input whose rows may lie apart, as a column slice of a wider projection does: rows `stride(0)`
// elements apart, each row's own elements contiguous. Anything else is made contiguous first. Reading the
// slice in place saves the copy torch would make (at decode sizes, a parallel region and its wake-ups).
torch::Tensor rows_apart(const torch::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return t.contiguous();
    expected *= t.size(d);
  }
  return t.dim() >= 1 && t.size(0) > 1 && t.stride(0) < expected ? t.contiguous() : t;
}

// fp32 vectors of the level (AVX-512: 16 lanes, AVX2: 8), for the state copies and the delta rule's register
// blocks below; without them (plain x86-64, NEON) both take their scalar paths.
#if defined(__AVX512F__)
constexpr int kVecLanes = 16;
using FVec = __m512;
inline FVec fv_load(const float* p) { return _mm512_loadu_ps(p); }
inline void fv_store(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline void fv_stream(float* p, FVec v) { _mm512_stream_ps(p, v); }
inline FVec fv_set1(float x) { return _mm512_set1_ps(x); }
inline FVec fv_zero() { return _mm512_setzero_ps(); }
inline FVec fv_mul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec fv_add(FVec a, FVec b) { return _mm512_add_ps(a, b); }
#define CONVEYOR_FVEC 1
#elif defined(__AVX2__)
constexpr int kVecLanes = 8;
using FVec = __m256;
inline FVec fv_load(const float* p) { return _mm256_loadu_ps(p); }
inline void fv_store(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline void fv_stream(float* p, FVec v) { _mm256_stream_ps(p, v); }
inline FVec fv_set1(float x) { return _mm256_set1_ps(x); }
inline FVec fv_zero() { return _mm256_setzero_ps(); }
inline FVec fv_mul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec fv_add(FVec a, FVec b) { return _mm256_add_ps(a, b); }
#define CONVEYOR_FVEC 1
#else
constexpr int kVecLanes = 0;
#endif

// A state snapshot: a copy into a slot nothing reads until a rejected draft restores it (a verify takes one per
// draft token: 3 x 64 KB per head and layer on a Qwen3.5-0.8B shape). Non-temporal stores write it without first
// reading the cold destination lines (half the memory traffic of memcpy) and keep it out of the caches the walk
// uses. Same bytes either way; unaligned or odd sizes take memcpy.
inline bool streams_rows(const float* dst, int64_t n) {
  return kVecLanes != 0 && reinterpret_cast<uintptr_t>(dst) % (4 * kVecLanes) == 0 && n % kVecLanes == 0;
}

inline void stream_fence() {
#if defined(CONVEYOR_FVEC)
  _mm_sfence();  // the streamed lines are visible before the kernel returns
#endif
}

// n floats; `stream` (streams_rows(dst, n), and every later row alike): non-temporal, fenced by the caller.
inline void copy_row(float* __restrict dst, const float* __restrict src, int64_t n, bool stream) {
#if defined(CONVEYOR_FVEC)
  if (stream) {
    for (int64_t i = 0; i < n; i += kVecLanes) fv_stream(dst + i, fv_load(src + i));
    return;
  }
#endif
  std::memcpy(dst, src, n * sizeof(float));
}

inline void copy_snapshot(float* __restrict dst, const float* __restrict src, int64_t n) {
  const bool stream = streams_rows(dst, n);
  copy_row(dst, src, n, stream);
  if (stream) stream_fence();
}

// ---- causal short convolution -------------------------------------------------------------------
// out[t, c] = sum_j w[c, j] * in[t - (K-1) + j, c] (+ bias), rounded to the dtype, then SiLU if asked
// (rounded again: torch's conv then its activation). The state holds the last K-1 inputs (fp32,
// exact copies of the dtype's values), oldest first.
// Elementwise steps over a block of channels, the same function for every lane (a padded block's spare
// lanes too), so a channel's bits never depend on where its block ends.
template <typename scalar_t>
inline void round_block(float* y, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return;
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
#if defined(__AVX512F__)
    for (int64_t j = 0; j < n; j += 16) _mm512_storeu_ps(y + j, conveyor_vec::round_bf16(_mm512_loadu_ps(y + j)));
    return;
#elif defined(CONVEYOR_AVX2)
    for (int64_t j = 0; j < n; j += 8) _mm256_storeu_ps(y + j, conveyor_vec::round_bf16(_mm256_loadu_ps(y + j)));
    return;
#endif
  }
  for (int64_t j = 0; j < n; ++j) y[j] = round_f<scalar_t>(y[j]);
}

// y / (1 + exp(-y)) (SiLU, kTimesInput) or 1 / (1 + exp(-y)) (sigmoid) on n (a multiple of 16) values: vec_math's
// exp_ps where there is one (~1 ulp of std::exp, the same bits for every lane), else std::exp per element.
template <bool kTimesInput>
inline void logistic_block(float* y, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 v = _mm512_loadu_ps(y + j);
    const __m512 e = conveyor_vec::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v)), one = _mm512_set1_ps(1.f);
    _mm512_storeu_ps(y + j, _mm512_div_ps(kTimesInput ? v : one, _mm512_add_ps(one, e)));
  }
#elif defined(CONVEYOR_AVX2)
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 v = _mm256_loadu_ps(y + j);
    const __m256 e = conveyor_vec::exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v)), one = _mm256_set1_ps(1.f);
    _mm256_storeu_ps(y + j, _mm256_div_ps(kTimesInput ? v : one, _mm256_add_ps(one, e)));
  }
#else
  for (int64_t j = 0; j < n; ++j) y[j] = kTimesInput ? silu(y[j]) : sigmoid(y[j]);
#endif
}
inline void silu_block(float* y, int64_t n) { logistic_block<true>(y, n); }
inline void sigmoid_block(float* y, int64_t n) { logistic_block<false>(y, n); }

using conveyor_vec::prefetch_lines;

// Tokens ahead whose input row short_conv prefetches: x is usually a column slice of a projection, so a task's
// successive rows lie a whole projection row apart (~20 KB for Qwen3.5), past what the hardware prefetchers follow,
// and each token waited on memory for its 128 bytes (~70 % of the kernel's time in a 1,500-token prefill).
constexpr int64_t kConvAhead = 8;

// Tasks are (sequence, block of 64 channels): the block's window (K x 64 fp32) stays in registers / L1 while
// the sequence's tokens pass, and every step is a plain loop over the block's channels (vectorized).
template <typename scalar_t>
void short_conv_impl(const scalar_t* x, int64_t x_stride, const float* w, const float* bias, float* state,
                     scalar_t* out, const Sequences& seqs, int64_t C, int64_t K, bool apply_silu) {
  constexpr int64_t kBlock = 64;
  const int64_t W = K - 1;
  const int64_t slot_stride = C * W;
  const int64_t num_blocks = (C + kBlock - 1) / kBlock;
  conveyor_parallel::parallel_for(0, seqs.num * num_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> window(K * kBlock);  // (K, kBlock): rows 0..W-1 the state, oldest first; row W the input
    // The block's taps by row (K, kBlock), zero past C, and its bias: each tap's weights one contiguous row. Made
    // per task (in parallel), not for the whole weight per call on the calling thread (~40 % of a decode call).
    std::vector<float> taps(K * kBlock), bias_p(kBlock);
    alignas(64) float acc[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_blocks, c0 = (task % num_blocks) * kBlock, cn = std::min(kBlock, C - c0);
      std::fill(taps.begin(), taps.end(), 0.f);
      std::fill(bias_p.begin(), bias_p.end(), 0.f);
      for (int64_t c = 0; c < cn; ++c) {
        for (int64_t j = 0; j < K; ++j) taps[j * kBlock + c] = w[(c0 + c) * K + j];
        if (bias != nullptr) bias_p[c] = bias[c0 + c];
      }
      float* st = state + seqs.slots[s] * slot_stride + c0 * W;
      std::fill(window.begin(), window.end(), 0.f);
      if (!seqs.reset[s])
        for (int64_t c = 0; c < cn; ++c)
          for (int64_t j = 0; j < W; ++j) window[j * kBlock + c] = st[c * W + j];
      int64_t snap = seqs.snap_starts[s];
      const int64_t first = seqs.starts[s], n = seqs.starts[s + 1] - first;
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* xr = x + (first + t) * x_stride + c0;
        if (t + kConvAhead < n) prefetch_lines(xr + kConvAhead * x_stride, cn * sizeof(scalar_t));
        float* input = window.data() + W * kBlock;
        for (int64_t c = 0; c < cn; ++c) input[c] = static_cast<float>(xr[c]);
        for (int64_t c = 0; c < kBlock; ++c) acc[c] = 0.f;
        for (int64_t j = 0; j < K; ++j) {
          const float* wj = taps.data() + j * kBlock;
          const float* xj = window.data() + j * kBlock;
          for (int64_t c = 0; c < kBlock; ++c) acc[c] = acc[c] + wj[c] * xj[c];
        }
        if (bias != nullptr)
          for (int64_t c = 0; c < kBlock; ++c) acc[c] = acc[c] + bias_p[c];
        round_block<scalar_t>(acc, kBlock);
        if (apply_silu) {
          silu_block(acc, kBlock);
          round_block<scalar_t>(acc, kBlock);
        }
        scalar_t* o = out + (first + t) * C + c0;
        for (int64_t c = 0; c < cn; ++c) o[c] = round_to<scalar_t>(acc[c]);  // exact: already rounded
        std::memmove(window.data(), window.data() + kBlock, W * kBlock * sizeof(float));
        for (; snap < seqs.snap_starts[s + 1] && seqs.snap_counts[snap] == t + 1; ++snap) {
          float* dst = state + seqs.snap_slots[snap] * slot_stride + c0 * W;
          for (int64_t c = 0; c < cn; ++c)
            for (int64_t j = 0; j < W; ++j) dst[c * W + j] = window[j * kBlock + c];
        }
      }
      for (int64_t c = 0; c < cn; ++c)
        for (int64_t j = 0; j < W; ++j) st[c * W + j] = window[j * kBlock + c];
    }
  });
}

torch::Tensor short_conv(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, torch::Tensor state,
                         torch::Tensor starts, torch::Tensor slots, torch::Tensor reset, torch::Tensor snap_starts,
                         torch::Tensor snap_counts, torch::Tensor snap_slots, bool apply_silu) {
  TORCH_CHECK(x.dim() == 2, "short_conv: x must be (T, C)");
  x = rows_apart(x);
  const int64_t C = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.dtype() == torch::kFloat32 && weight.is_contiguous(),
              "short_conv: weight must be contiguous float32 (C, K)");
  const int64_t K = weight.size(1);
  TORCH_CHECK(K >= 2, "short_conv: kernel size must be at least 2");
  TORCH_CHECK(state.dim() == 3 && state.size(1) == C && state.size(2) == K - 1 && state.dtype() == torch::kFloat32 &&
                  state.is_contiguous(),
              "short_conv: state must be contiguous float32 (slots, C, K - 1)");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->numel() == C && bias->is_contiguous(),
                "short_conv: bias must be contiguous float32 (C,)");
    b = bias->data_ptr<float>();
  }
  check_sequences(starts, slots, reset, snap_starts, snap_counts, snap_slots, x.size(0), state.size(0));
  auto out = torch::empty(x.sizes(), x.options());
  const Sequences seqs(starts, slots, reset, snap_starts, snap_counts, snap_slots);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "short_conv", [&] {
    short_conv_impl<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<float>(), b, state.data_ptr<float>(),
                              out.data_ptr<scalar_t>(), seqs, C, K, apply_silu);
  });
  return out;
}

// ---- gated delta rule (Qwen3.5 / Qwen3-Next) ---------------------------------------------------
// Per value head, with q/k of head h / (Hv / Hk), all in fp32:
//   q, k <- l2norm (x * rsqrt(sum x^2 + 1e-6)); q <- q / sqrt(dk)
//   g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b) rounded to the dtype
//   S <- S * exp(g);  delta = (v - S^T k) * beta;  S <- S + k delta^T;  o = S^T q
// transformers' torch_recurrent_gated_delta_rule, token by token.
template <typename scalar_t>
void l2norm_into(const scalar_t* x, float* out, int64_t n, float extra_scale) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(x[i]) * inv;
    if (extra_scale != 1.f) out[i] = out[i] / extra_scale;
  }
}

// One head's walk over a sequence's tokens on its state S (dk x dv), in place, in row-major sweeps:
//   first token:  S <- S * decay_0, and acc = S^T k_0 accumulated row by row (acc: dv floats in L1);
//   token t:      S <- S + k_t delta_t^T and o_t = S^T q_t, and in the same sweep (row i is final for token t once
//                 updated) S <- S * decay_{t+1} and acc = S^T k_{t+1} for the next token,
// so n tokens take n + 1 sweeps of the state instead of 2n (a verify's 4 rows: 5 instead of 8; half a long
// prefill's). A snapshot after token t copies each row as the sweep finishes it for t, before the next decay.
// Row-major sweeps stream the state from memory in order (the prefetcher's case); the last sweep finds it in L2,
// and meanwhile fetches `next` (the next task's state, or null) so that its first sweep finds it in cache:
// at 16 sequences the states (16 MiB a layer) stream from memory, and the wait was most of the time.
// Per element the operations and their order are the token-by-token loops' (fp32, rows in ascending order,
// multiply then add: -ffp-contract=off), so fusing the sweeps and vectorizing the inner loops changes no bit.
struct DeltaToken {  // one token's inputs for one head, in fp32
  std::vector<float> q, k, v;
  float decay = 0.f, beta = 0.f;
  DeltaToken(int64_t dk, int64_t dv) : q(dk), k(dk), v(dv) {}
};

// delta_update with the columns in register blocks (kDeltaVecs vectors = kDeltaCols columns): a block's delta, o
// and next-token projection stay in registers while the rows pass, so each row is one load and one store of S
// (the plain loops round-trip o and acc through L1 on every row). Per element the same operations in the same
// order (explicit multiply then add, never fused), so the bits are delta_update's. Used where dv is a multiple of
// kDeltaCols (Qwen3.5 / Qwen3-Next: 128); other shapes take delta_update.
#if defined(CONVEYOR_FVEC)
constexpr int kDeltaVecs = kVecLanes == 16 ? 4 : 2;  // 64 columns on AVX-512, 16 on AVX2
constexpr int64_t kDeltaCols = kDeltaVecs * kVecLanes;

// delta (dv) already formed; writes o and, with nt, acc (the next token's projection).
inline void delta_update_blocked(float* __restrict S, const DeltaToken& t, const DeltaToken* nt,
                                 const float* __restrict delta, float* __restrict acc, float* __restrict o,
                                 float* snap, bool stream, const float* prefetch, int64_t dk, int64_t dv) {
  for (int64_t j0 = 0; j0 < dv; j0 += kDeltaCols) {
    FVec d[kDeltaVecs], ov[kDeltaVecs], av[kDeltaVecs];
    for (int v = 0; v < kDeltaVecs; ++v) {
      d[v] = fv_load(delta + j0 + v * kVecLanes);
      ov[v] = fv_zero();
      av[v] = fv_zero();
    }
    const FVec decay = fv_set1(nt != nullptr ? nt->decay : 0.f);
    for (int64_t i = 0; i < dk; ++i) {
      float* Si = S + i * dv + j0;
      if (prefetch != nullptr && j0 == 0)
        for (int64_t j = 0; j < dv; j += 16) __builtin_prefetch(prefetch + i * dv + j);
      const FVec ki = fv_set1(t.k[i]), qi = fv_set1(t.q[i]);
      FVec sv[kDeltaVecs];
      for (int v = 0; v < kDeltaVecs; ++v) {
        sv[v] = fv_add(fv_load(Si + v * kVecLanes), fv_mul(ki, d[v]));
        ov[v] = fv_add(ov[v], fv_mul(sv[v], qi));
      }
      if (snap != nullptr) {
        float* dst = snap + i * dv + j0;
        for (int v = 0; v < kDeltaVecs; ++v) {
          if (stream) fv_stream(dst + v * kVecLanes, sv[v]);
          else fv_store(dst + v * kVecLanes, sv[v]);
        }
      }
      if (nt != nullptr) {
        const FVec nk = fv_set1(nt->k[i]);
        for (int v = 0; v < kDeltaVecs; ++v) {
          sv[v] = fv_mul(sv[v], decay);
          av[v] = fv_add(av[v], fv_mul(sv[v], nk));
        }
      }
      for (int v = 0; v < kDeltaVecs; ++v) fv_store(Si + v * kVecLanes, sv[v]);
    }
    for (int v = 0; v < kDeltaVecs; ++v) {
      fv_store(o + j0 + v * kVecLanes, ov[v]);
      if (nt != nullptr) fv_store(acc + j0 + v * kVecLanes, av[v]);
    }
  }
}
#endif

inline void delta_decay_project(float* __restrict S, const DeltaToken& t, float* __restrict acc, int64_t dk,
                                int64_t dv) {
  for (int64_t j = 0; j < dv; ++j) acc[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict Si = S + i * dv;
    const float ki = t.k[i], decay = t.decay;
    for (int64_t j = 0; j < dv; ++j) {
      Si[j] = Si[j] * decay;
      acc[j] = acc[j] + Si[j] * ki;
    }
  }
}

// Token t's update and output from acc = S^T k_t (turned into delta here); with `next`, the next token's decay and
// projection into acc in the same sweep. `snap` (or null): where the state after token t goes.
inline void delta_update(float* __restrict S, const DeltaToken& t, const DeltaToken* nt, float* __restrict acc,
                         float* __restrict delta, float* __restrict o, float* snap, const float* prefetch,
                         int64_t dk, int64_t dv) {
  for (int64_t j = 0; j < dv; ++j) delta[j] = (t.v[j] - acc[j]) * t.beta;
  const bool stream = snap != nullptr && streams_rows(snap, dv);
#if defined(CONVEYOR_FVEC)
  if (dv % kDeltaCols == 0) {
    delta_update_blocked(S, t, nt, delta, acc, o, snap, stream, prefetch, dk, dv);
    if (stream) stream_fence();
    return;
  }
#endif
  for (int64_t j = 0; j < dv; ++j) {
    o[j] = 0.f;
    acc[j] = 0.f;
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict Si = S + i * dv;
    const float ki = t.k[i], qi = t.q[i];
    if (prefetch != nullptr)
      for (int64_t j = 0; j < dv; j += 16) __builtin_prefetch(prefetch + i * dv + j);  // one 64-byte line per 16 floats
    for (int64_t j = 0; j < dv; ++j) {
      Si[j] = Si[j] + ki * delta[j];
      o[j] = o[j] + Si[j] * qi;
    }
    if (snap != nullptr) copy_row(snap + i * dv, Si, dv, stream);
    if (nt != nullptr) {
      const float nk = nt->k[i], decay = nt->decay;
      for (int64_t j = 0; j < dv; ++j) {
        Si[j] = Si[j] * decay;
        acc[j] = acc[j] + Si[j] * nk;
      }
    }
  }
  if (stream) stream_fence();
}

// Tokens ahead whose q, k, v, a, b rows gated_delta_rule prefetches: they are column slices of one projection (rows a
// projection row apart, past the hardware prefetchers' reach), and each token's first reads waited on memory
// (~25 % of the kernel's time in a 1,500-token prefill of the Qwen3.5-0.8B shape).
constexpr int64_t kDeltaAhead = 2;

template <typename scalar_t>
void gated_delta_rule_impl(const scalar_t* q, const scalar_t* k, const scalar_t* v, const scalar_t* a,
                           const scalar_t* b, const int64_t* strides, const float* A_log, const float* dt_bias,
                           float* state, scalar_t* out, const Sequences& seqs, int64_t Hk, int64_t Hv, int64_t dk,
                           int64_t dv) {
  const int64_t sq = strides[0], sk = strides[1], sv = strides[2], sa = strides[3], sb = strides[4];  // rows apart
  const int64_t slot_stride = Hv * dk * dv;
  const int64_t group = Hv / Hk;
  const float q_scale = std::sqrt(static_cast<float>(dk));
  conveyor_parallel::parallel_for(0, seqs.num * Hv, 1, [&](int64_t begin, int64_t end) {
    DeltaToken cur(dk, dv), nxt(dk, dv);
    std::vector<float> acc(dv), delta(dv), o(dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / Hv, h = task % Hv, hk = h / group;
      // The slot's state is updated in place (no private copy).
      float* S = state + seqs.slots[s] * slot_stride + h * dk * dv;
      if (seqs.reset[s]) std::fill(S, S + dk * dv, 0.f);
      const float A = -std::exp(A_log[h]);
      const auto load = [&](int64_t row, DeltaToken& t) {
        l2norm_into(q + row * sq + hk * dk, t.q.data(), dk, q_scale);
        l2norm_into(k + row * sk + hk * dk, t.k.data(), dk, 1.f);
        t.decay = std::exp(A * softplus(static_cast<float>(a[row * sa + h]) + dt_bias[h]));
        t.beta = static_cast<float>(round_to<scalar_t>(sigmoid(static_cast<float>(b[row * sb + h]))));
        const scalar_t* vr = v + row * sv + h * dv;
        for (int64_t j = 0; j < dv; ++j) t.v[j] = static_cast<float>(vr[j]);
      };
      int64_t snap = seqs.snap_starts[s];
      const int64_t first = seqs.starts[s], n = seqs.starts[s + 1] - first;
      const auto prefetch_inputs = [&](int64_t row) {  // a later token's rows (see kDeltaAhead)
        if (row >= first + n) return;
        prefetch_lines(q + row * sq + hk * dk, dk * sizeof(scalar_t));
        prefetch_lines(k + row * sk + hk * dk, dk * sizeof(scalar_t));
        prefetch_lines(v + row * sv + h * dv, dv * sizeof(scalar_t));
        prefetch_lines(a + row * sa + h, sizeof(scalar_t));
        prefetch_lines(b + row * sb + h, sizeof(scalar_t));
      };
      for (int64_t t = 1; t < kDeltaAhead; ++t) prefetch_inputs(first + t);  // (the first is read at once)
      if (n > 0) {
        load(first, cur);
        delta_decay_project(S, cur, acc.data(), dk, dv);
      }
      for (int64_t t = 0; t < n; ++t) {
        const int64_t row = first + t;
        const bool more = t + 1 < n;
        prefetch_inputs(row + kDeltaAhead);
        if (more) load(row + 1, nxt);
        const float* next = nullptr;  // on the last token, the next task's state (see above)
        if (!more && task + 1 < end) {
          const int64_t s2 = (task + 1) / Hv, h2 = (task + 1) % Hv;
          if (!seqs.reset[s2]) next = state + seqs.slots[s2] * slot_stride + h2 * dk * dv;
        }
        float* snap_dst = nullptr;  // snapshots after the same count go to one slot each: the first by the sweep
        if (snap < seqs.snap_starts[s + 1] && seqs.snap_counts[snap] == t + 1)
          snap_dst = state + seqs.snap_slots[snap++] * slot_stride + h * dk * dv;
        delta_update(S, cur, more ? &nxt : nullptr, acc.data(), delta.data(), o.data(), snap_dst, next, dk, dv);
        scalar_t* orow = out + (row * Hv + h) * dv;
        for (int64_t j = 0; j < dv; ++j) orow[j] = round_to<scalar_t>(o[j]);
        for (; snap < seqs.snap_starts[s + 1] && seqs.snap_counts[snap] == t + 1; ++snap)  // (rare) more at t + 1
          copy_snapshot(state + seqs.snap_slots[snap] * slot_stride + h * dk * dv, snap_dst, dk * dv);
        std::swap(cur, nxt);
      }
    }
  });
}

torch::Tensor gated_delta_rule(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor a, torch::Tensor b,
                               torch::Tensor A_log, torch::Tensor dt_bias, torch::Tensor state, torch::Tensor starts,
                               torch::Tensor slots, torch::Tensor reset, torch::Tensor snap_starts,
                               torch::Tensor snap_counts, torch::Tensor snap_slots) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gated_delta_rule: q, k (T, Hk, dk) and v (T, Hv, dv)");
  q = rows_apart(q); k = rows_apart(k); v = rows_apart(v); a = rows_apart(a); b = rows_apart(b);
  const int64_t T = q.size(0), Hk = q.size(1), dk = q.size(2), Hv = v.size(1), dv = v.size(2);
  TORCH_CHECK(Hv % Hk == 0, "gated_delta_rule: value heads must be a multiple of key heads");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  a.scalar_type() == q.scalar_type() && b.scalar_type() == q.scalar_type(),
              "gated_delta_rule: q, k, v, a, b must share a dtype");
  TORCH_CHECK(a.dim() == 2 && a.size(0) == T && a.size(1) == Hv && b.sizes() == a.sizes(),
              "gated_delta_rule: a and b must be (T, Hv)");
  TORCH_CHECK(A_log.dtype() == torch::kFloat32 && dt_bias.dtype() == torch::kFloat32 && A_log.numel() == Hv &&
                  dt_bias.numel() == Hv && A_log.is_contiguous() && dt_bias.is_contiguous(),
              "gated_delta_rule: A_log and dt_bias must be contiguous float32 (Hv,)");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == Hv && state.size(2) == dk && state.size(3) == dv &&
                  state.dtype() == torch::kFloat32 && state.is_contiguous(),
              "gated_delta_rule: state must be contiguous float32 (slots, Hv, dk, dv)");
  check_sequences(starts, slots, reset, snap_starts, snap_counts, snap_slots, T, state.size(0));
  auto out = torch::empty(v.sizes(), v.options());
  const Sequences seqs(starts, slots, reset, snap_starts, snap_counts, snap_slots);
  const int64_t strides[5] = {q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "gated_delta_rule", [&] {
    gated_delta_rule_impl<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                    a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), strides, A_log.data_ptr<float>(),
                                    dt_bias.data_ptr<float>(), state.data_ptr<float>(), out.data_ptr<scalar_t>(),
                                    seqs, Hk, Hv, dk, dv);
  });
  return out;
}

// ---- Mamba2 selective scan (SSD, recurrent form) -----------------------------------------------
// Per head h (group g = h / (H / G)):
//   dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max), each step rounded to the dtype;
//   dA = exp(dt * A), A = -exp(A_log);  in fp32:
//   S[p, n] <- S[p, n] * dA + (dt * x[p]) * B[n];   y[p] = sum_n S[p, n] * C[n] + D * x[p]
// transformers' chunked torch path (mamba2_chunk_scan), token by token: dt is computed in the model
// dtype, everything after in fp32, and y stays fp32 (the gated norm after it rounds once). Its
// single-token decode branch skips the dt clamp and rounds y; the chunked form is the one every
// chunking can agree with.
template <typename scalar_t>
void ssm_scan_impl(const scalar_t* x, const scalar_t* dt, const scalar_t* B, const scalar_t* Cm, const float* A_log,
                   const float* dt_bias, const float* D, float* state, float* out, const Sequences& seqs,
                   int64_t H, int64_t P, int64_t G, int64_t N, float dt_min, float dt_max) {
  const int64_t slot_stride = H * P * N;
  const int64_t heads_per_group = H / G;
  conveyor_parallel::parallel_for(0, seqs.num * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S(P * N);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / H, h = task % H, g = h / heads_per_group;
      float* st = state + seqs.slots[s] * slot_stride + h * P * N;
      if (seqs.reset[s]) std::fill(S.begin(), S.end(), 0.f);
      else std::memcpy(S.data(), st, P * N * sizeof(float));
      const float A = -std::exp(A_log[h]);
      int64_t snap = seqs.snap_starts[s];
      const int64_t first = seqs.starts[s], n = seqs.starts[s + 1] - first;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t row = first + t;
        float step = round_f<scalar_t>(static_cast<float>(dt[row * H + h]) + dt_bias[h]);
        step = round_f<scalar_t>(softplus(step));
        step = round_f<scalar_t>(std::min(std::max(step, dt_min), dt_max));
        const float dA = std::exp(step * A);
        const scalar_t* xr = x + (row * H + h) * P;
        const scalar_t* Br = B + (row * G + g) * N;
        const scalar_t* Cr = Cm + (row * G + g) * N;
        float* yr = out + (row * H + h) * P;
        for (int64_t p = 0; p < P; ++p) {
          const float xdt = static_cast<float>(xr[p]) * step;
          float* Sp = S.data() + p * N;
          float y = 0.f;
          for (int64_t j = 0; j < N; ++j) {
            Sp[j] = Sp[j] * dA + xdt * static_cast<float>(Br[j]);
            y += Sp[j] * static_cast<float>(Cr[j]);
          }
          yr[p] = y + D[h] * static_cast<float>(xr[p]);
        }
        for (; snap < seqs.snap_starts[s + 1] && seqs.snap_counts[snap] == t + 1; ++snap)
          copy_snapshot(state + seqs.snap_slots[snap] * slot_stride + h * P * N, S.data(), P * N);
      }
      std::memcpy(st, S.data(), P * N * sizeof(float));
    }
  });
}

torch::Tensor ssm_scan(torch::Tensor x, torch::Tensor dt, torch::Tensor B, torch::Tensor C, torch::Tensor A_log,
                       torch::Tensor dt_bias, torch::Tensor D, torch::Tensor state, torch::Tensor starts,
                       torch::Tensor slots, torch::Tensor reset, torch::Tensor snap_starts, torch::Tensor snap_counts,
                       torch::Tensor snap_slots, double dt_min, double dt_max) {
  TORCH_CHECK(x.dim() == 3 && dt.dim() == 2 && B.dim() == 3 && C.sizes() == B.sizes(),
              "ssm_scan: x (T, H, P), dt (T, H), B and C (T, G, N)");
  x = x.contiguous(); dt = dt.contiguous(); B = B.contiguous(); C = C.contiguous();
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2), G = B.size(1), N = B.size(2);
  TORCH_CHECK(dt.size(0) == T && dt.size(1) == H && B.size(0) == T && H % G == 0,
              "ssm_scan: shapes disagree (heads must be a multiple of groups)");
  TORCH_CHECK(dt.scalar_type() == x.scalar_type() && B.scalar_type() == x.scalar_type() &&
                  C.scalar_type() == x.scalar_type(), "ssm_scan: x, dt, B, C must share a dtype");
  for (const auto* p : {&A_log, &dt_bias, &D})
    TORCH_CHECK(p->dtype() == torch::kFloat32 && p->numel() == H && p->is_contiguous(),
                "ssm_scan: A_log, dt_bias and D must be contiguous float32 (H,)");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == H && state.size(2) == P && state.size(3) == N &&
                  state.dtype() == torch::kFloat32 && state.is_contiguous(),
              "ssm_scan: state must be contiguous float32 (slots, H, P, N)");
  check_sequences(starts, slots, reset, snap_starts, snap_counts, snap_slots, T, state.size(0));
  auto out = torch::empty(x.sizes(), x.options().dtype(torch::kFloat32));
  const Sequences seqs(starts, slots, reset, snap_starts, snap_counts, snap_slots);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ssm_scan", [&] {
    ssm_scan_impl<scalar_t>(x.data_ptr<scalar_t>(), dt.data_ptr<scalar_t>(), B.data_ptr<scalar_t>(),
                            C.data_ptr<scalar_t>(), A_log.data_ptr<float>(), dt_bias.data_ptr<float>(),
                            D.data_ptr<float>(), state.data_ptr<float>(), out.data_ptr<float>(), seqs, H, P, G, N,
                            static_cast<float>(dt_min), static_cast<float>(dt_max));
  });
  return out;
}

// ---- gated RMSNorm and the SiLU / sigmoid gates -------------------------------------------------
// x comes in the model dtype (Qwen3.5's delta rule) or fp32 (Mamba2's scan, which transformers keeps in
// fp32 up to the norm); gate and weight are in the model dtype, and so is the output. Steps round to
// x's dtype, as torch's would with x as the norm's input; only the output rounds to the model dtype.
// norm_before_gate (Qwen3.5, Falcon-H1's option): out = (w * round(x * rsqrt(mean x^2 + eps))) * silu(gate).
// gate first (Mamba2):                          h = x * silu(gate) [fp32], then per group of `group`
//                                               columns: out = w * round(h * rsqrt(mean h^2 + eps)).
// Row by row; each step is a loop over the whole row, padded to 16 lanes (the SiLU is silu_block's), and each
// group's sum of squares runs in index order, so a row's bits depend only on the row.
// Row r of x (and of the gate) is head r % heads of token r / heads: token rows x_stride (gate_stride) apart.
template <typename x_t, typename scalar_t>
void gated_rms_norm_impl(const x_t* x, int64_t x_stride, const scalar_t* gate, int64_t gate_stride,
                         const scalar_t* w, scalar_t* out, int64_t rows, int64_t heads, int64_t n, int64_t group,
                         float eps, bool norm_before_gate) {
  const int64_t padded = (n + 15) / 16 * 16;
  conveyor_parallel::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(padded, 0.f), sg(padded, 0.f), wf(padded, 0.f);
    for (int64_t j = 0; j < n; ++j) wf[j] = static_cast<float>(w[j]);
    for (int64_t r = begin; r < end; ++r) {
      const x_t* xr = x + (r / heads) * x_stride + (r % heads) * n;
      const scalar_t* gr = gate + (r / heads) * gate_stride + (r % heads) * n;
      scalar_t* o = out + r * n;
      for (int64_t j = 0; j < n; ++j) {
        h[j] = static_cast<float>(xr[j]);
        sg[j] = static_cast<float>(gr[j]);
      }
      silu_block(sg.data(), padded);
      if (!norm_before_gate)
        for (int64_t j = 0; j < n; ++j) h[j] = h[j] * sg[j];
      for (int64_t g0 = 0; g0 < n; g0 += group) {
        float sum = 0.f;
        for (int64_t j = g0; j < g0 + group; ++j) sum += h[j] * h[j];
        const float inv = 1.f / std::sqrt(sum / static_cast<float>(group) + eps);
        for (int64_t j = g0; j < g0 + group; ++j) h[j] = h[j] * inv;
      }
      round_block<x_t>(h.data(), padded);  // normed
      for (int64_t j = 0; j < padded; ++j) h[j] = wf[j] * h[j];
      round_block<x_t>(h.data(), padded);  // scaled
      if (norm_before_gate)
        for (int64_t j = 0; j < padded; ++j) h[j] = h[j] * sg[j];
      round_block<scalar_t>(h.data(), padded);
      for (int64_t j = 0; j < n; ++j) o[j] = round_to<scalar_t>(h[j]);  // exact: already rounded
    }
  });
}

torch::Tensor gated_rms_norm(torch::Tensor x, torch::Tensor gate, torch::Tensor weight, double eps, int64_t group,
                             bool norm_before_gate) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && gate.sizes() == x.sizes() && weight.numel() == x.size(-1),
              "gated_rms_norm: x and gate (R, n) or (T, heads, n), weight (n,)");
  TORCH_CHECK(weight.scalar_type() == gate.scalar_type() &&
                  (x.scalar_type() == gate.scalar_type() || x.scalar_type() == torch::kFloat32),
              "gated_rms_norm: gate and weight must share a dtype, x that one or float32");
  TORCH_CHECK(group > 0 && x.size(-1) % group == 0, "gated_rms_norm: group must divide the row");
  x = rows_apart(x); gate = rows_apart(gate); weight = weight.contiguous();
  auto out = torch::empty(gate.sizes(), gate.options());
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1, n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "gated_rms_norm", [&] {
    const scalar_t* g = gate.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const float e = static_cast<float>(eps);
    if (x.scalar_type() == torch::kFloat32)
      gated_rms_norm_impl<float, scalar_t>(x.data_ptr<float>(), x.stride(0), g, gate.stride(0), w, o, rows, heads, n,
                                           group, e, norm_before_gate);
    else
      gated_rms_norm_impl<scalar_t, scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), g, gate.stride(0), w, o, rows,
                                              heads, n, group, e, norm_before_gate);
  });
  return out;
}

// x * silu(gate) as torch rounds `x * silu(gate)`: silu in the gate's dtype, the product in x's
// (fp32 or the gate's), the output in the gate's (Falcon-H1's Mamba2 output without its norm).
template <typename x_t, typename scalar_t>
void silu_gate_impl(const x_t* x, const scalar_t* gate, scalar_t* out, int64_t n) {
  conveyor_parallel::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float sg = round_f<scalar_t>(silu(static_cast<float>(gate[i])));
      out[i] = round_to<scalar_t>(round_f<x_t>(static_cast<float>(x[i]) * sg));
    }
  });
}

torch::Tensor silu_gate(torch::Tensor x, torch::Tensor gate) {
  TORCH_CHECK(x.sizes() == gate.sizes() &&
                  (x.scalar_type() == gate.scalar_type() || x.scalar_type() == torch::kFloat32),
              "silu_gate: x and gate must match in shape; x in the gate's dtype or float32");
  x = x.contiguous(); gate = gate.contiguous();
  auto out = torch::empty_like(gate);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "silu_gate", [&] {
    if (x.scalar_type() == torch::kFloat32)
      silu_gate_impl<float, scalar_t>(x.data_ptr<float>(), gate.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                      x.numel());
    else
      silu_gate_impl<scalar_t, scalar_t>(x.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                         x.numel());
  });
  return out;
}

// x * sigmoid(gate), each op rounded to the dtype as torch's two ops would (Qwen3.5's gated attention).
torch::Tensor sigmoid_mul(torch::Tensor x, torch::Tensor gate) {
  TORCH_CHECK(x.sizes() == gate.sizes() && x.scalar_type() == gate.scalar_type(),
              "sigmoid_mul: x and gate must match");
  x = x.contiguous(); gate = gate.contiguous();
  auto out = torch::empty_like(x);
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "sigmoid_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = gate.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // Blocks of 64 elements, the last zero-padded: sigmoid_block on every lane, so an element's bits never depend on
    // where it sits (a scalar std::exp per element was ~2 ns an element: 6.4 ms a layer of a 1,500-token prefill).
    constexpr int64_t kBlock = 64;
    conveyor_parallel::parallel_for(0, (n + kBlock - 1) / kBlock, 64, [&](int64_t begin, int64_t end) {
      alignas(64) float sg[kBlock];
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t i0 = blk * kBlock, m = std::min(kBlock, n - i0);
        for (int64_t j = 0; j < m; ++j) sg[j] = static_cast<float>(gp[i0 + j]);
        for (int64_t j = m; j < kBlock; ++j) sg[j] = 0.f;
        sigmoid_block(sg, kBlock);
        round_block<scalar_t>(sg, kBlock);
        for (int64_t j = 0; j < m; ++j) op[i0 + j] = round_to<scalar_t>(static_cast<float>(xp[i0 + j]) * sg[j]);
      }
    });
  });
  return out;
}

// sigmoid(x) per element, rounded to the dtype as torch.sigmoid would: MoE routers' sigmoid scores
// (LFM2-MoE) and shared experts' gates (Qwen3-Next), whose rows torch would round by batch position.
torch::Tensor sigmoid_tensor(torch::Tensor x) {
  x = x.contiguous();
  auto out = torch::empty_like(x);
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "sigmoid", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    conveyor_parallel::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) op[i] = round_to<scalar_t>(sigmoid(static_cast<float>(xp[i])));
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("isa", &conveyor_isa::compiled_level, "the -march level this module was compiled for");
  conveyor_parallel::def_pool_sharing(m);
  m.def("short_conv", &short_conv, "causal depthwise conv1d over state slots (CPU)", release());
  m.def("gated_delta_rule", &gated_delta_rule, "gated delta rule over state slots (CPU)", release());
  m.def("ssm_scan", &ssm_scan, "Mamba2 selective scan over state slots (CPU)", release());
  m.def("gated_rms_norm", &gated_rms_norm, "RMSNorm with a SiLU gate (CPU)", release());
  m.def("silu_gate", &silu_gate, "x * silu(gate) with torch's rounding (CPU)", release());
  m.def("sigmoid_mul", &sigmoid_mul, "x * sigmoid(gate) with torch's rounding (CPU)", release());
  m.def("sigmoid", &sigmoid_tensor, "sigmoid(x) with torch's rounding (CPU)", release());
}
