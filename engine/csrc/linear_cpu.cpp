// Linear layers in float32 arithmetic over weights stored as bfloat16 (CPU, AVX2 + FMA): y = x W^T.
//
// A checkpoint published in bf16 and loaded as float32 holds nothing but bf16 values, so storing
// them as bf16 loses nothing, and a decoding step, which reads every weight once, reads half the
// bytes. Each weight is widened to the float32 it stands for as it is loaded and multiplied in
// float32: the same products as a float32 linear, summed in another order.
//
// Weights are blocked once (`block_weight`): [N/8, K/2, 8, 2], eight output rows side by side,
// each row's weights k and k+1 in one 32-bit lane. One 256-bit load then holds 8 rows x 2 inputs,
// and two integer ops widen it without a shuffle: lane j shifted up is row j's weight k (`even`),
// lane j masked is its weight k+1 (`odd`). Each output lane sums its row's products over even k
// and over odd k, each in order of k, then adds the two, whatever the number of x rows: a row's
// output does not depend on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace {

// y[m, 8g + j] for NX rows of x and NG groups of 8 weight rows: 2 x NX x NG accumulators of 8
// lanes (even and odd k apart: no FMA waits for the one before it in the same k pair).
// (NX, NG) in {(1, 6), (1, 4), (2, 2), (3, 1), (4, 1)}: 6 to 12 of the 16 registers.
template <int NX, int NG>
void tile(const float* x, int64_t K, const uint32_t* w, int64_t group_stride, float* y, int64_t N) {
  __m256 even_acc[NX][NG], odd_acc[NX][NG];
  for (int m = 0; m < NX; ++m)
    for (int g = 0; g < NG; ++g) even_acc[m][g] = odd_acc[m][g] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kk = 0; kk < K / 2; ++kk) {
    for (int g = 0; g < NG; ++g) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * group_stride + kk * 8));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(bits, high));
      for (int m = 0; m < NX; ++m) {
        even_acc[m][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + 2 * kk), even, even_acc[m][g]);
        odd_acc[m][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + 2 * kk + 1), odd, odd_acc[m][g]);
      }
    }
  }
  for (int m = 0; m < NX; ++m)
    for (int g = 0; g < NG; ++g) _mm256_storeu_ps(y + m * N + 8 * g, _mm256_add_ps(even_acc[m][g], odd_acc[m][g]));
}

template <int NX, int NG>
void groups(const float* x, int64_t K, const uint32_t* w, float* y, int64_t N, int64_t g0, int64_t g1) {
  const int64_t group_stride = K / 2 * 8;  // 32-bit lanes per group of 8 rows
  int64_t g = g0;
  for (; g + NG <= g1; g += NG) tile<NX, NG>(x, K, w + g * group_stride, group_stride, y + 8 * g, N);
  for (; g < g1; ++g) tile<NX, 1>(x, K, w + g * group_stride, group_stride, y + 8 * g, N);
}

// All M rows of x against groups [g0, g1). One row streams the weights once, six groups at a
// time; more rows take 12 groups at a time (12 x 8 rows x K bf16: in L2 for K = 896) and pass
// over them four rows at a time, then the rest. Side by side with the tiles before these (8 or 9
// chained sums: (1, 8), (4, 2), ...), every 0.5B linear: the same at 1 and 5 rows, faster at 9 and
// 16, a little slower at 2 and 3 (history, "Measurements that were in code comments").
// Splitting K so a super-block stays in L2 for the 4,864-wide down projection changed nothing;
// 3 x 2 and 2 x 3 tiles with split sums were slower (spills).
void rows(const float* x, int64_t M, int64_t K, const uint32_t* w, float* y, int64_t N, int64_t g0, int64_t g1) {
  if (M == 1) return groups<1, 6>(x, K, w, y, N, g0, g1);
  constexpr int64_t kSuper = 12;  // a multiple of the 1, 2 and 4 groups of the tiles below
  for (int64_t s0 = g0; s0 < g1; s0 += kSuper) {
    const int64_t s1 = std::min(g1, s0 + kSuper);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) groups<4, 1>(x + m * K, K, w, y + m * N, N, s0, s1);
    switch (M - m) {
      case 3: groups<3, 1>(x + m * K, K, w, y + m * N, N, s0, s1); break;
      case 2: groups<2, 2>(x + m * K, K, w, y + m * N, N, s0, s1); break;
      case 1: groups<1, 4>(x + m * K, K, w, y + m * N, N, s0, s1); break;
      default: break;
    }
  }
}

// w [N, K] bfloat16 -> [N/8, K/2, 8, 2] (see the top of this file)
torch::Tensor block_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2, "block_weight: bfloat16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 8 == 0 && K % 2 == 0, "block_weight: N a multiple of 8, K even");
  return w.view({N / 8, 8, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] float32 contiguous, w [N/8, K/2, 8, 2] bfloat16 from `block_weight`. Returns y [M, N]
// float32 = x W^T with every weight widened to float32.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kBFloat16,
              "bf16_linear: float32 x, bfloat16 w");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "bf16_linear: x [M, K] contiguous");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 8 && w.size(3) == 2 && w.is_contiguous() && w.size(1) * 2 == x.size(1),
              "bf16_linear: w [N/8, K/2, 8, 2] from block_weight");
  const int64_t M = x.size(0), K = x.size(1), n_groups = w.size(0), N = 8 * n_groups;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  constexpr int64_t kGroupsPerTask = 24;  // 192 weight rows; a multiple of 6 and 12
  const int64_t n_tasks = (n_groups + kGroupsPerTask - 1) / kGroupsPerTask;
  at::parallel_for(0, n_tasks, 1, [&](int64_t begin, int64_t end) {
    rows(xp, M, K, wp, yp, N, begin * kGroupsPerTask, std::min(n_groups, end * kGroupsPerTask));
  });
  return y;
}

// w [N/8, K/2, 8, 2] bfloat16 from `block_weight` -> out, float32 [K, N] contiguous: W^T, for
// BLAS on calls of many rows. Lane j of `even` is W[8g + j, k]: each 8 lanes store contiguously.
torch::Tensor widen_weight(const torch::Tensor& w, torch::Tensor out) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 4 && w.size(2) == 8 && w.size(3) == 2 && w.is_contiguous(),
              "widen_weight: w [N/8, K/2, 8, 2] from block_weight");
  const int64_t n_groups = w.size(0), K = 2 * w.size(1), N = 8 * n_groups;
  TORCH_CHECK(out.scalar_type() == torch::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == K &&
              out.size(1) == N, "widen_weight: out float32 [K, N] contiguous");
  const auto* wp = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  at::parallel_for(0, n_groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t kk = 0; kk < K / 2; ++kk)  // along output rows: whole cache lines written
      for (int64_t g = begin; g < end; ++g) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (g * K / 2 + kk) * 8));
        _mm256_storeu_ps(op + (2 * kk) * N + 8 * g, _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)));
        _mm256_storeu_ps(op + (2 * kk + 1) * N + 8 * g, _mm256_castsi256_ps(_mm256_and_si256(bits, high)));
      }
  });
  return out;
}

}  // namespace

using nogil = py::call_guard<py::gil_scoped_release>;  // as quant_cpu.cpp says why

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_weight", &block_weight, "bfloat16 w [N, K] -> [N/8, K/2, 8, 2], the layout bf16_linear reads", nogil());
  m.def("widen_weight", &widen_weight, "blocked bfloat16 w -> out = float32 w^T [K, N]", nogil());
  m.def("bf16_linear", &bf16_linear, "y = x w^T: float32 x [M, K], blocked bfloat16 w, float32 arithmetic", nogil());
}
