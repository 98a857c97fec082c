// Attention of a few query rows over a long KV cache, on CPUs with AVX2 and FMA (engine/attention.py).
//
// Decoding and short checks attend R = G * T query rows (a KV head's query heads folded with the
// call's T tokens) over S keys that none of them masks. torch's flash kernel spends several times
// the time of reading K and V there; this reads each K and V row once per 6 of the R rows (a KV
// head's query heads in decoding: 6 or 7), prefetched ahead of use, and splits the keys into chunks
// across threads (flash-decoding), merging the chunks by their log-sum-exp. Queries float32 or
// bfloat16, outputs float32; K and V float32 or bfloat16 (widened to float32 as they are loaded:
// a bf16 cache is half the bytes to read); the same sums as SDPA in another order. A bf16 model
// on a CPU with AVX512-BF16 takes its scores, and P.V with P rounded to bf16, in bf16 dot products
// (`bf16dots`, exact products); its calls of many rows (prefill chunks) take `attend_many`, which
// packs K and V once per chunk so that every instruction is a product.
// Beside it, the two other row-wise ops of a float32 or bf16 model's layer, RoPE and RMSNorm (at the
// end): in torch they are ~20 small ops a layer, a share of a float32 decoding step worth a kernel
// (history, "Measurements that were in code comments").
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Keys per task (flash-decoding's split). 512, not 128: each chunk's first keys come unprefetched
// and its partial output is merged; the 1.5B at 32K on an AVX2 EPYC, checks faster, one token no
// slower, 8K unchanged (history, "Longer attention chunks"; "Measurements that were in code comments").
constexpr int64_t kChunk = 512;
constexpr int64_t kBlock = 16;   // keys of V multiplied for all dims while they are in L1 (8 KiB at D = 128)
constexpr int64_t kAhead = 16;   // keys prefetched ahead of use: one memory latency of the loop's work (32: the same)

inline float hsum(__m256 x) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
}

inline float hmax(__m256 x) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
}

inline __m256 exp256(__m256 x) {  // e^x for x <= 0 (Cephes polynomial, relative error ~1e-7)
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {  // a bf16 is the top half of the float32 it stands for
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Into L2, ahead of the loads: on one core the hardware prefetchers alone leave the loop waiting on
// memory while it multiplies (well over the time of reading the cache). Into L2, not L1: less time
// on the AVX512-BF16 EPYC for one token over the 1.5B's 32K cache, in bf16 and in float32 (likely:
// T0's requests take L1 miss buffers the loop's own loads need; no counters here to tell; history,
// "The attention kernel's prefetches into L2, not L1"). A prefetch never faults, so one past the
// last key is harmless.
template <int D, int N, typename KV>
inline void prefetch_rows(const KV* row, int64_t row_stride) {
  for (int i = 0; i < N; ++i)
    for (int b = 0; b < int(D * sizeof(KV)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + i * row_stride) + b, _MM_HINT_T1);
}

// f(NR, r) for the query rows [r, r + NR) of R, NR = 6 while 6 are left, then the rest: the row
// kernels below keep 6 x 2 accumulators in registers
template <typename F>
inline void by_six_rows(int64_t R, F f) {
  using std::integral_constant;
  int64_t r = 0;
  for (; r + 6 <= R; r += 6) f(integral_constant<int, 6>{}, r);
  switch (R - r) {
    case 5: f(integral_constant<int, 5>{}, r); break;
    case 4: f(integral_constant<int, 4>{}, r); break;
    case 3: f(integral_constant<int, 3>{}, r); break;
    case 2: f(integral_constant<int, 2>{}, r); break;
    case 1: f(integral_constant<int, 1>{}, r); break;
  }
}

// lanes 0 and 1: the sums of a's and b's 8 lanes, each in an order that does not depend on the other
inline __m128 pair_sums(__m256 a, __m256 b) {
  const __m256 h = _mm256_hadd_ps(a, b);
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  return _mm_hadd_ps(t, t);
}

// s[r, j] = scale * q[r] . k[j] for NR <= 6 rows and the n <= kChunk keys of one chunk, two keys
// at a time: each loaded K vector serves NR rows (6 x 2 accumulators, 2 of K, q from memory), so
// K is read once per 6 rows
template <int D, int NR, typename KV>
void scores_rows(const float* q, const KV* k, int64_t k_row, int64_t n, float scale, float* s) {
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    prefetch_rows<D, 2>(k + (j + kAhead) * k_row, k_row);
    __m256 acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      const __m256 k0 = load8(k + j * k_row + d), k1 = load8(k + (j + 1) * k_row + d);
      for (int r = 0; r < NR; ++r) {
        const __m256 qd = _mm256_loadu_ps(q + r * D + d);
        acc[r][0] = _mm256_fmadd_ps(qd, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qd, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m128 t = pair_sums(acc[r][0], acc[r][1]);
      s[r * kChunk + j] = _mm_cvtss_f32(t) * scale;
      s[r * kChunk + j + 1] = _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1)) * scale;
    }
  }
  for (; j < n; ++j) {  // the same sums as in a pair, beside a zero
    for (int r = 0; r < NR; ++r) {
      __m256 acc = _mm256_setzero_ps();
      for (int d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), load8(k + j * k_row + d), acc);
      s[r * kChunk + j] = _mm_cvtss_f32(pair_sums(acc, _mm256_setzero_ps())) * scale;
    }
  }
}

template <int D, typename KV>
void chunk_scores(const float* q, int64_t R, const KV* k, int64_t k_row, int64_t n, float scale, float* s) {
  by_six_rows(R, [&](auto nr, int64_t r) { scores_rows<D, decltype(nr)::value, KV>(q + r * D, k, k_row, n, scale, s + r * kChunk); });
}

// bf16 queries and keys (a bf16 model's): AVX512-BF16 `vdpbf16ps` multiplies 32 pairs exactly and
// sums them in pairs into 16 float32 lanes, twice an FMA's products per instruction and no
// widening of K. NR <= 6 rows x 4 keys (24 accumulators), each key's 16 lanes added across at the
// end in a fixed order (`sum4`); keys past the last 4 one at a time, in the same order. Subnormal
// bf16 inputs (below 1.2e-38) count as zero. Qwen's and SmolLM2's head dims (64, 128) are
// multiples of 32. Less time than widened float32 FMAs, for checks and for one token
// (history, "Measurements that were in code comments").
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace bf16dots {

inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {  // lane i: the sum of the 16 lanes of a, b, c, d
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  // 4 lanes each
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
}

inline __m512bh load32(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

template <int D, int NR>
void scores_rows(const at::BFloat16* q, const at::BFloat16* k, int64_t k_row, int64_t n, float scale, float* s) {
  static_assert(D % 32 == 0, "32 dims per dot product");
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    prefetch_rows<D, 4>(k + (j + kAhead) * k_row, k_row);
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
      __m512bh kv[4];
      for (int i = 0; i < 4; ++i) kv[i] = load32(k + (j + i) * k_row + d);
      for (int r = 0; r < NR; ++r) {
        const __m512bh qd = load32(q + r * D + d);
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], qd, kv[i]);
      }
    }
    for (int r = 0; r < NR; ++r)
      _mm_storeu_ps(s + r * kChunk + j, _mm_mul_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(scale)));
  }
  for (; j < n; ++j)  // the same sums as in a group of 4, beside zeros
    for (int r = 0; r < NR; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 32) acc = _mm512_dpbf16_ps(acc, load32(q + r * D + d), load32(k + j * k_row + d));
      const __m512 zero = _mm512_setzero_ps();
      s[r * kChunk + j] = _mm_cvtss_f32(sum4(acc, zero, zero, zero)) * scale;
    }
}

template <int D>
void chunk_scores(const at::BFloat16* q, int64_t R, const at::BFloat16* k, int64_t k_row, int64_t n, float scale, float* s) {
  by_six_rows(R, [&](auto nr, int64_t r) { scores_rows<D, decltype(nr)::value>(q + r * D, k, k_row, n, scale, s + r * kChunk); });
}

// o[r] = sum_j bf16(p[r, j]) v[j]: the probabilities rounded to bf16 (as torch's CPU flash kernel
// and FlashAttention do for a bf16 model; l, the sum they are divided by, stays that of the float32
// p), each product exact, two keys per lane: `vdpbf16ps` over V rows j and j + 1 interleaved
// (unpacklo/hi: lane i of `lo` holds dim 8 (i / 4) + i % 4, of `hi` the 4 after), the rows' sums
// un-interleaved at the end. Keys in pairs (0, 1), (2, 3) ... whatever the row count, and a
// missing last key is a zero, so a row's output is what it alone gives. Half the instructions of
// the widened loop; kBlock keys at a time for all dims while their V rows are in L1. Checks take
// less time than with the widened loop, one token the same (history, "Measurements that were in
// code comments").
template <int D, int NR>
void values_rows(const float* p, const at::BFloat16* v, int64_t v_row, int64_t n, float* o) {
  static_assert(D % 32 == 0 && kBlock % 2 == 0, "32 dims per dot product, keys in pairs");
  constexpr int kRowsPerPass = kBlock * 32 / D;  // the next block's rows, prefetched over the passes
  alignas(64) uint32_t pairs[NR][kChunk / 2];  // row r's (bf16 p[2 i], bf16 p[2 i + 1]) as word i
  alignas(64) float sums[NR][D];  // interleaved as the lanes are
  for (int r = 0; r < NR; ++r) {
    auto* bf = reinterpret_cast<uint16_t*>(pairs[r]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 keep = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      _mm256_mask_storeu_epi16(bf + j, keep, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, p + r * kChunk + j)));
    }
    if (n % 2) bf[n] = 0;
    std::fill(sums[r], sums[r] + D, 0.f);
  }
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = std::min(n, j0 + kBlock);
    for (int d0 = 0; d0 < D; d0 += 32) {
      prefetch_rows<D, kRowsPerPass>(v + (j0 + kAhead + d0 / 32 * kRowsPerPass) * v_row, v_row);
      __m512 acc[NR][2];
      for (int r = 0; r < NR; ++r) acc[r][0] = _mm512_load_ps(sums[r] + d0), acc[r][1] = _mm512_load_ps(sums[r] + d0 + 16);
      const auto pair = [&](int64_t j, __m512i a, __m512i b) {
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int r = 0; r < NR; ++r) {
          const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][j / 2]));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pj, lo);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pj, hi);
        }
      };
      int64_t j = j0;
      for (; j + 4 <= j1; j += 4) {
        const __m512i a = _mm512_loadu_si512(v + j * v_row + d0), b = _mm512_loadu_si512(v + (j + 1) * v_row + d0);
        const __m512i c = _mm512_loadu_si512(v + (j + 2) * v_row + d0), e = _mm512_loadu_si512(v + (j + 3) * v_row + d0);
        pair(j, a, b);
        pair(j + 2, c, e);
      }
      for (; j < j1; j += 2)
        pair(j, _mm512_loadu_si512(v + j * v_row + d0),
             j + 1 < j1 ? _mm512_loadu_si512(v + (j + 1) * v_row + d0) : _mm512_setzero_si512());
      for (int r = 0; r < NR; ++r) _mm512_store_ps(sums[r] + d0, acc[r][0]), _mm512_store_ps(sums[r] + d0 + 16, acc[r][1]);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int r = 0; r < NR; ++r)
    for (int d0 = 0; d0 < D; d0 += 32) {
      const __m512 lo = _mm512_load_ps(sums[r] + d0), hi = _mm512_load_ps(sums[r] + d0 + 16);
      _mm512_storeu_ps(o + r * D + d0, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(o + r * D + d0 + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}

template <int D>
void chunk_values(int64_t R, const float* p, const at::BFloat16* v, int64_t v_row, int64_t n, float* o) {
  by_six_rows(R, [&](auto nr, int64_t r) { values_rows<D, decltype(nr)::value>(p + r * kChunk, v, v_row, n, o + r * D); });
}

// Many rows (a bf16 model's prefill chunk): GEMM-shaped, so K and V are packed once for all rows
// and every instruction is a product. K goes key-block major, [16-key block][D/2][16 keys][2 dims],
// so one `vdpbf16ps` gives 16 keys' partial scores with no sums across lanes; V goes in key pairs,
// [pair][D][2 keys], so P.V needs no interleave. Each row's score is then one sequential sum over
// its dims (not the few-row path's lanes added across): the same exact products in another order,
// so a row's output here is not bit for bit that of the few-row path, only within float32 rounding.
constexpr int64_t kKeyBlock = 16;

template <int D>
void pack_keys(const at::BFloat16* k, int64_t k_row, int64_t n, uint32_t* kp) {  // n <= kChunk; zeros past n
  for (int64_t b = 0; b < (n + kKeyBlock - 1) / kKeyBlock; ++b)
    for (int64_t jj = 0; jj < kKeyBlock; ++jj) {
      const int64_t j = b * kKeyBlock + jj;
      const uint32_t* row = reinterpret_cast<const uint32_t*>(k + j * k_row);
      uint32_t* out = kp + b * (D / 2) * kKeyBlock + jj;
      for (int i = 0; i < D / 2; ++i) out[i * kKeyBlock] = j < n ? row[i] : 0u;
    }
}

template <int D>
void pack_values(const at::BFloat16* v, int64_t v_row, int64_t n, uint32_t* vp) {  // pairs (2p, 2p + 1); zero past n
  const auto* bits = reinterpret_cast<const uint16_t*>(v);
  for (int64_t p = 0; p < (n + 1) / 2; ++p)
    for (int d = 0; d < D; ++d) {
      const uint32_t lo = bits[2 * p * v_row + d], hi = 2 * p + 1 < n ? bits[(2 * p + 1) * v_row + d] : 0u;
      vp[p * D + d] = lo | hi << 16;
    }
}

// s[r, j] = scale * q[r] . k[j] for NR <= 6 rows over the n keys of a packed chunk, 4 key blocks
// (64 keys) at a time: 6 x 4 accumulators, each dim pair of q broadcast once for 4 blocks
template <int D, int NR>
void packed_scores(const at::BFloat16* q, const uint32_t* kp, int64_t n, float scale, float* s) {
  const auto* q32 = reinterpret_cast<const int*>(q);
  const int64_t n_blocks = (n + kKeyBlock - 1) / kKeyBlock;
  for (int64_t b0 = 0; b0 < n_blocks; b0 += 4) {
    const int nb = static_cast<int>(std::min<int64_t>(4, n_blocks - b0));
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
    const uint32_t* kb = kp + b0 * (D / 2) * kKeyBlock;
    for (int i = 0; i < D / 2; ++i) {
      __m512bh kv[4];
      for (int b = 0; b < 4; ++b) kv[b] = b < nb ? (__m512bh)_mm512_loadu_si512(kb + (b * (D / 2) + i) * kKeyBlock) : kv[0];
      for (int r = 0; r < NR; ++r) {
        const __m512bh qi = (__m512bh)_mm512_set1_epi32(q32[r * (D / 2) + i]);
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qi, kv[b]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int b = 0; b < nb; ++b)
        _mm512_storeu_ps(s + r * kChunk + (b0 + b) * kKeyBlock, _mm512_mul_ps(acc[r][b], _mm512_set1_ps(scale)));
  }
}

inline __m512 exp512(__m512 x) {  // e^x for x <= 0: exp256 on each half
  return _mm512_insertf32x8(_mm512_castps256_ps512(exp256(_mm512_castps512_ps256(x))),
                            exp256(_mm512_extractf32x8_ps(x, 1)), 1);
}

// Per row of a chunk's scores s: m = max over its n[r] keys, l = sum of p = exp(s - m), and p
// rounded to bf16 into `pairs` (two keys a word), zero from n[r] on and past the chunk's n keys
template <int NR>
void softmax_pairs(const float* s, const int64_t* rows_n, int64_t n, float* m, float* l, uint32_t (*pairs)[kChunk / 2]) {
  for (int r = 0; r < NR; ++r) {
    const float* sr = s + r * kChunk;
    const int64_t nr = rows_n[r];
    auto* bf = reinterpret_cast<uint16_t*>(pairs[r]);
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < nr; j += 16) {
      const __mmask16 keep = nr - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nr - j)) - 1);
      mx = _mm512_mask_max_ps(mx, keep, mx, _mm512_maskz_loadu_ps(keep, sr + j));
    }
    const float mr = _mm512_reduce_max_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const int64_t left = std::clamp<int64_t>(nr - j, 0, 16);
      const __mmask16 keep = left == 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __m512 e = _mm512_maskz_mov_ps(keep, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, sr + j), _mm512_set1_ps(mr))));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bf + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    m[r] = nr ? mr : -std::numeric_limits<float>::infinity();
    l[r] = nr ? _mm512_reduce_add_ps(sum) : 0.f;
  }
}

// o[r] = sum_j p[r, j] v[j] for NR <= 6 rows over a packed chunk, p as bf16 pairs: half the dims
// at a time (D <= 64: all), 6 x 4 accumulators held over every key pair of the chunk
template <int D, int NR>
void packed_values(const uint32_t (*pairs)[kChunk / 2], const uint32_t* vp, int64_t n, float* o) {
  constexpr int kDims = D < 64 ? D : 64, kVecs = kDims / 16;
  for (int d0 = 0; d0 < D; d0 += kDims) {
    __m512 acc[NR][kVecs];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t pr = 0; pr < (n + 1) / 2; ++pr) {
      __m512bh vv[kVecs];
      for (int c = 0; c < kVecs; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + pr * D + d0 + 16 * c);
      for (int r = 0; r < NR; ++r) {
        const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][pr]));
        for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pj, vv[c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
  }
}

}  // namespace bf16dots
#pragma GCC pop_options

bool g_no_dots = false;  // tests and benchmarks: widen bf16 queries even where the dots run

bool has_bf16_dots() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
}

// Per row of one chunk: m = max score, p = exp(s - m) in place, l = sum p, over the row's n[r]
// first keys of the chunk; p = 0 from there to the chunk's `n_all` (no key: m = -inf, l = 0)
void chunk_softmax(int64_t R, const int64_t* rows_n, int64_t n_all, float* s, float* m, float* l) {
  for (int64_t r = 0; r < R; ++r) {
    float* p = s + r * kChunk;
    const int64_t n = rows_n[r];
    std::fill(p + n, p + n_all, 0.f);
    if (n == 0) {
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.f;
      continue;
    }
    float mr = -std::numeric_limits<float>::infinity();
    int64_t j = 0;
    __m256 max8 = _mm256_set1_ps(mr);
    for (; j + 8 <= n; j += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(p + j));
    for (; j < n; ++j) mr = std::max(mr, p[j]);
    mr = std::max(mr, hmax(max8));
    __m256 m8 = _mm256_set1_ps(mr), l8 = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
      __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + j), m8));
      _mm256_storeu_ps(p + j, e);
      l8 = _mm256_add_ps(l8, e);
    }
    float lr = hsum(l8);
    for (; j < n; ++j) lr += (p[j] = std::exp(p[j] - mr));
    m[r] = mr;
    l[r] = lr;
  }
}

// o[r] = sum_j p[r, j] v[j] for NR <= 6 rows: kBlock keys at a time, all dims for them while their V
// rows are in L1, 16 dims at a time (6 x 2 accumulators, 2 of V, 1 broadcast: 15 of 16 registers);
// each loaded V vector serves NR rows
template <int D, int NR, typename KV>
void values_rows(const float* p, const KV* v, int64_t v_row, int64_t n, float* o) {
  constexpr int kRowsPerPass = kBlock * 16 / D;  // the next block's rows, prefetched over the passes
  for (int r = 0; r < NR; ++r) std::fill(o + r * D, o + r * D + D, 0.f);
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = std::min(n, j0 + kBlock);
    for (int d0 = 0; d0 < D; d0 += 16) {
      prefetch_rows<D, kRowsPerPass>(v + (j0 + kAhead + d0 / 16 * kRowsPerPass) * v_row, v_row);
      __m256 acc[NR][2];
      for (int r = 0; r < NR; ++r) {
        acc[r][0] = _mm256_loadu_ps(o + r * D + d0);
        acc[r][1] = _mm256_loadu_ps(o + r * D + d0 + 8);
      }
      for (int64_t j = j0; j < j1; ++j) {
        const __m256 v0 = load8(v + j * v_row + d0), v1 = load8(v + j * v_row + d0 + 8);
        for (int r = 0; r < NR; ++r) {
          const __m256 prj = _mm256_broadcast_ss(p + r * kChunk + j);
          acc[r][0] = _mm256_fmadd_ps(prj, v0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(prj, v1, acc[r][1]);
        }
      }
      for (int r = 0; r < NR; ++r) {
        _mm256_storeu_ps(o + r * D + d0, acc[r][0]);
        _mm256_storeu_ps(o + r * D + d0 + 8, acc[r][1]);
      }
    }
  }
}

template <int D, typename KV>
void chunk_values(int64_t R, const float* p, const KV* v, int64_t v_row, int64_t n, float* o) {
  by_six_rows(R, [&](auto nr, int64_t r) { values_rows<D, decltype(nr)::value, KV>(p + r * kChunk, v, v_row, n, o + r * D); });
}

constexpr int64_t kFewRows = 64;  // more rows than this (engine/attention.py FEW_ROWS): `attend_many`

// Many bf16 rows over a bf16 cache (a prefill chunk): tasks of a KV head's rows, as few tasks as
// give every thread one, so each chunk's K and V, packed once per task into L2, serve as many rows
// as possible; the task goes through the chunks 6 rows at a time, merging each chunk into the
// rows' running max, sum and output as flash attention does. Faster than torch's flash kernel on a
// prefill chunk (history, "Prefill attention in BF16 dot products"; "Measurements that were in code
// comments").
template <int D>
std::vector<torch::Tensor> attend_many(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const std::vector<int64_t>& keys) {
  const int64_t B = q.size(0), Hkv = q.size(1), R = q.size(2);
  const int64_t n_chunks = (*std::max_element(keys.begin(), keys.end()) + kChunk - 1) / kChunk;
  const int64_t per_head = (at::get_num_threads() + B * Hkv - 1) / (B * Hkv);  // row blocks of a head
  const int64_t block = (R / per_head + 6) / 6 * 6, n_blocks = (R + block - 1) / block;
  const auto options = q.options().dtype(torch::kFloat);
  auto out = torch::zeros({B, Hkv, R, D}, options);
  auto lse = torch::empty({B, Hkv, R}, options);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const at::BFloat16 *qb = q.data_ptr<at::BFloat16>(), *kb = k.data_ptr<at::BFloat16>(), *vb = v.data_ptr<at::BFloat16>();
  float *outp = out.data_ptr<float>(), *lsep = lse.data_ptr<float>();
  at::parallel_for(0, B * Hkv * n_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> kp(kChunk * D / 2), vp(kChunk * D / 2);
    std::vector<float> s(6 * kChunk), oc(6 * D), m(6), l(6), run_m(block), run_l(block);
    std::vector<int64_t> rows_n(6);
    alignas(64) uint32_t pairs[6][kChunk / 2];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / n_blocks, b = bh / Hkv, h = bh % Hkv;
      const int64_t r0 = (t % n_blocks) * block, r1 = std::min(R, r0 + block);
      std::fill(run_m.begin(), run_m.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_l.begin(), run_l.end(), 0.f);
      for (int64_t c = 0; c < n_chunks; ++c) {
        const int64_t j0 = c * kChunk;
        int64_t n_chunk = 0;  // keys of this chunk any row of the task reads
        for (int64_t r = r0; r < r1; ++r) n_chunk = std::max(n_chunk, std::clamp<int64_t>(keys[r] - j0, 0, kChunk));
        if (n_chunk == 0) continue;
        bf16dots::pack_keys<D>(kb + b * k.stride(0) + h * k.stride(1) + j0 * k.stride(2), k.stride(2), n_chunk, kp.data());
        bf16dots::pack_values<D>(vb + b * v.stride(0) + h * v.stride(1) + j0 * v.stride(2), v.stride(2), n_chunk, vp.data());
        by_six_rows(r1 - r0, [&](auto nr, int64_t rr) {
          constexpr int NR = decltype(nr)::value;
          int64_t n = 0;
          for (int i = 0; i < NR; ++i) n = std::max(n, rows_n[i] = std::clamp<int64_t>(keys[r0 + rr + i] - j0, 0, kChunk));
          if (n == 0) return;
          bf16dots::packed_scores<D, NR>(qb + (bh * R + r0 + rr) * D, kp.data(), n, scale, s.data());
          bf16dots::softmax_pairs<NR>(s.data(), rows_n.data(), n, m.data(), l.data(), pairs);
          bf16dots::packed_values<D, NR>(pairs, vp.data(), n, oc.data());
          for (int i = 0; i < NR; ++i) {  // into the row's running max, sum and output
            if (l[i] == 0.f) continue;
            float &mr = run_m[rr + i], &lr = run_l[rr + i];
            const float mx = std::max(mr, m[i]), a = std::exp(mr - mx), w = std::exp(m[i] - mx);
            float* orow = outp + (bh * R + r0 + rr + i) * D;
            for (int d = 0; d < D; ++d) orow[d] = orow[d] * a + oc[i * D + d] * w;
            lr = lr * a + l[i] * w;
            mr = mx;
          }
        });
      }
      for (int64_t r = r0; r < r1; ++r) {
        float* orow = outp + (bh * R + r) * D;
        for (int d = 0; d < D; ++d) orow[d] /= run_l[r - r0];
        lsep[bh * R + r] = run_m[r - r0] + std::log(run_l[r - r0]);
      }
    }
  });
  return {out, lse};
}

// q float32, or bf16 with a bf16 cache where the CPU has AVX512-BF16 and D % 32 == 0 (the dots above).
// Row r attends to the first keys[r] keys (a check's chain: each token up to itself); in a call of
// at most kFewRows rows a row's output is then what a call with that row alone over those keys
// gives, bit for bit. More bf16 rows (a prefill chunk) take `attend_many`.
template <int D, typename KV>
std::vector<torch::Tensor> attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const std::vector<int64_t>& keys) {
  const int64_t B = q.size(0), Hkv = q.size(1), R = q.size(2), S = k.size(2);
  if constexpr (std::is_same_v<KV, at::BFloat16> && D % 32 == 0) {
    if (q.scalar_type() == torch::kBFloat16 && R > kFewRows) return attend_many<D>(q, k, v, keys);
  }
  const int64_t n_chunks = (S + kChunk - 1) / kChunk, n_tasks = B * Hkv * n_chunks;
  const auto options = q.options().dtype(torch::kFloat);
  auto o_part = torch::empty({n_tasks, R, D}, options);
  auto m_part = torch::empty({n_tasks, R}, options);
  auto l_part = torch::empty({n_tasks, R}, options);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const bool dots = q.scalar_type() == torch::kBFloat16;
  const float* qp = dots ? nullptr : q.data_ptr<float>();
  const at::BFloat16* qb = dots ? q.data_ptr<at::BFloat16>() : nullptr;
  const KV *kp = k.data_ptr<KV>(), *vp = v.data_ptr<KV>();
  float *op = o_part.data_ptr<float>(), *mp = m_part.data_ptr<float>(), *lp = l_part.data_ptr<float>();
  at::parallel_for(0, n_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(R * kChunk);
    std::vector<int64_t> rows_n(R);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / n_chunks, b = bh / Hkv, h = bh % Hkv, j0 = (t % n_chunks) * kChunk;
      int64_t n = 0;  // the chunk's keys any row attends to
      for (int64_t r = 0; r < R; ++r) n = std::max(n, rows_n[r] = std::clamp<int64_t>(keys[r] - j0, 0, kChunk));
      const KV* kc = kp + b * k.stride(0) + h * k.stride(1) + j0 * k.stride(2);
      const KV* vc = vp + b * v.stride(0) + h * v.stride(1) + j0 * v.stride(2);
      if constexpr (std::is_same_v<KV, at::BFloat16> && D % 32 == 0) {
        if (dots) bf16dots::chunk_scores<D>(qb + bh * R * D, R, kc, k.stride(2), n, scale, s.data());
        else chunk_scores<D, KV>(qp + bh * R * D, R, kc, k.stride(2), n, scale, s.data());
      } else {
        chunk_scores<D, KV>(qp + bh * R * D, R, kc, k.stride(2), n, scale, s.data());
      }
      chunk_softmax(R, rows_n.data(), n, s.data(), mp + t * R, lp + t * R);
      if constexpr (std::is_same_v<KV, at::BFloat16> && D % 32 == 0) {
        if (dots) {
          bf16dots::chunk_values<D>(R, s.data(), vc, v.stride(2), n, op + t * R * D);
          continue;
        }
      }
      chunk_values<D, KV>(R, s.data(), vc, v.stride(2), n, op + t * R * D);
    }
  });
  auto out = torch::empty({B, Hkv, R, D}, options);
  auto lse = torch::empty({B, Hkv, R}, options);
  float *outp = out.data_ptr<float>(), *lsep = lse.data_ptr<float>();
  at::parallel_for(0, B * Hkv * R, 16, [&](int64_t begin, int64_t end) {  // merge the chunks by log-sum-exp
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / R, r = i % R, t0 = bh * n_chunks;
      const int64_t row_chunks = (keys[r] + kChunk - 1) / kChunk;  // the chunks holding its keys
      float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t c = 0; c < row_chunks; ++c) mx = std::max(mx, mp[(t0 + c) * R + r]);
      float* orow = outp + i * D;
      std::fill(orow, orow + D, 0.f);
      for (int64_t c = 0; c < row_chunks; ++c) {
        const float w = std::exp(mp[(t0 + c) * R + r] - mx);
        total += w * lp[(t0 + c) * R + r];
        const float* oc = op + ((t0 + c) * R + r) * D;
        for (int d = 0; d < D; ++d) orow[d] += w * oc[d];
      }
      for (int d = 0; d < D; ++d) orow[d] /= total;
      lsep[i] = mx + std::log(total);
    }
  });
  return {out, lse};
}

template <typename KV>
std::vector<torch::Tensor> attend_dim(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      const std::vector<int64_t>& keys) {
  switch (q.size(3)) {
    case 16: return attend<16, KV>(q, k, v, keys);
    case 32: return attend<32, KV>(q, k, v, keys);
    case 64: return attend<64, KV>(q, k, v, keys);
    case 128: return attend<128, KV>(q, k, v, keys);
    default: TORCH_CHECK(false, "few_row_attention: head dim 16, 32, 64 or 128 only");
  }
}

// q [B, Hkv, R, D] contiguous float32 (or bfloat16: its scores in BF16 dot products where the cache
// is bf16 too and the CPU has them, else widened); k, v [B, Hkv, S, D] float32 or bfloat16 (both
// the same) with contiguous rows, S >= 1.
// `row_keys` (optional, R int64 in 1..S): row r attends to the first row_keys[r] keys only (a
// check's causal chain), its output bit for bit that of the row alone over those keys.
// Returns float32 (out [B, Hkv, R, D], lse [B, Hkv, R]): softmax(q k^T / sqrt(D)) v and its log-sum-exp.
std::vector<torch::Tensor> few_row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                             const c10::optional<torch::Tensor>& row_keys) {
  if (q.scalar_type() == torch::kBFloat16 &&
      !(k.scalar_type() == torch::kBFloat16 && q.size(3) % 32 == 0 && has_bf16_dots() && !g_no_dots))
    return few_row_attention(q.to(torch::kFloat), k, v, row_keys);
  TORCH_CHECK((q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16) && k.scalar_type() == v.scalar_type() &&
              (k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kBFloat16),
              "few_row_attention: float32 or bfloat16 queries, float32 or bfloat16 keys and values");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.is_contiguous(), "few_row_attention: q contiguous [B, Hkv, R, D]");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.size(2) == v.size(2) && k.size(2) >= 1, "few_row_attention: k, v rows");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3), "few_row_attention: shapes");
  const int64_t R = q.size(2), S = k.size(2);
  std::vector<int64_t> keys(R, S);
  if (row_keys.has_value()) {
    const torch::Tensor n = row_keys->to(torch::kLong).contiguous();
    TORCH_CHECK(n.numel() == R, "few_row_attention: row_keys holds one count per query row");
    keys.assign(n.data_ptr<int64_t>(), n.data_ptr<int64_t>() + R);
    for (int64_t c : keys) TORCH_CHECK(c >= 1 && c <= S, "few_row_attention: row_keys in 1..S");
  }
  return k.scalar_type() == torch::kFloat ? attend_dim<float>(q, k, v, keys) : attend_dim<at::BFloat16>(q, k, v, keys);
}

// A float32 or bf16 row as 8 float32 lanes. A bf16 value widens exactly, and `round` narrows a
// float32 result to bf16 (to nearest even, NaN to 0x7FC0, as c10::BFloat16), kept in float32 lanes:
// torch computes each op of a bf16 tensor in float32 and rounds its result so, and the row ops below
// round where its ops do. For float32 rows `round` is nothing.
template <typename T>
struct Lanes {
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
  static __m256 round(__m256 x) { return x; }
};
template <>
struct Lanes<at::BFloat16> {
  static __m256 load(const at::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(at::BFloat16* p, __m256 x) {  // x already a bf16 value: its high halves
    const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
  }
  static __m256 round(__m256 x) {
    const __m256i u = _mm256_castps_si256(x), one = _mm256_set1_epi32(1);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    const __m256 y = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    return _mm256_blendv_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
};

// The RMSNorm before each layer's attention and MLP (and the last), as Qwen's and Llama's:
// y = w * (x / sqrt(mean(x^2) + eps)), the normalized row in float32 (rounded to the model's dtype
// before the weight, as transformers does). Its place is here, beside attention, as one kernel of a
// decoding step on CPU: torch's composite norm is 6 ops a call, 57 calls a token for the 1.5B, each
// call many times this kernel's time (history, "Measurements that were in code comments"). Each
// row's sum of squares in 4 x 8 lanes in order of k, then the lanes added in a fixed order: a row's
// output does not depend on the rows beside it (float32 rounding, not torch's order: every path of
// a model goes through one of the two, engine/model.py RMSNorm).
template <typename T>
void norm_rows(const T* xp, const T* wp, T* yp, int64_t M, int64_t D, float eps) {
  using L = Lanes<T>;
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = xp + m * D;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t k = 0; k < D; k += 32)
        for (int a = 0; a < 4; ++a) {
          const __m256 v = L::load(xr + k + 8 * a);
          acc[a] = _mm256_fmadd_ps(v, v, acc[a]);
        }
      const float ss = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
      const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(D) + eps));
      for (int64_t k = 0; k < D; k += 8)
        L::store(yp + m * D + k, L::round(_mm256_mul_ps(L::load(wp + k), L::round(_mm256_mul_ps(L::load(xr + k), r)))));
    }
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && w.scalar_type() == dt && x.is_contiguous() &&
              w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0) && w.size(0) % 32 == 0,
              "rms_norm: contiguous float32 or bfloat16 rows whose length is the weight's, a multiple of 32, and a weight of their dtype");
  const int64_t D = w.size(0), M = x.numel() / D;
  auto y = torch::empty_like(x);
  if (dt == torch::kFloat)
    norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, D, static_cast<float>(eps));
  else
    norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), M, D, static_cast<float>(eps));
  return y;
}

// RoPE in place on a projection's output by heads, x [B, T, H, D] (q or k before the transpose),
// cos and sin [B, T, D] of x's dtype as transformers' rotary embedding gives them (any scaling in
// them): x * cos + rotate_half(x) * sin, each product and the sum rounded once as torch's ops are
// (no FMA; in a bf16 model, each to bf16), so bit for bit transformers' `apply_rotary_pos_emb`, in
// one call for q and k instead of 14 ops a layer, whose time showed in a float32 1.5B step
// (history, "Measurements that were in code comments").
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_rows(T* x, int64_t H, int64_t D, const T* c, const T* s) {
  using L = Lanes<T>;
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H; ++h, x += D)
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 x1 = L::load(x + i), x2 = L::load(x + half + i);
      const __m256 a1 = L::round(_mm256_mul_ps(x1, L::load(c + i))), b1 = L::round(_mm256_mul_ps(x2, L::load(s + i)));
      const __m256 a2 = L::round(_mm256_mul_ps(x2, L::load(c + half + i))), b2 = L::round(_mm256_mul_ps(x1, L::load(s + half + i)));
      L::store(x + i, L::round(_mm256_sub_ps(a1, b1)));
      L::store(x + half + i, L::round(_mm256_add_ps(a2, b2)));
    }
}

template <typename T>
void rope_rows(T* qp, T* kp, const T* cp, const T* sp, int64_t BT, int64_t Hq, int64_t Hk, int64_t D) {
  at::parallel_for(0, BT, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rotate_rows(qp + r * Hq * D, Hq, D, cp + r * D, sp + r * D);
      rotate_rows(kp + r * Hk * D, Hk, D, cp + r * D, sp + r * D);
    }
  });
}

void rope_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto dt = q.scalar_type();
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &cos, &sin})
    TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && t->scalar_type() == dt && t->is_contiguous(),
                "rope_: contiguous tensors, all float32 or all bfloat16");
  const int64_t B = q.size(0), T = q.size(1), D = q.size(3);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(0) == B && k.size(1) == T && k.size(3) == D && D % 16 == 0 &&
              cos.numel() == B * T * D && sin.numel() == B * T * D, "rope_: q, k [B, T, H, D], D % 16 == 0; cos, sin [B, T, D]");
  if (dt == torch::kFloat)
    rope_rows(q.data_ptr<float>(), k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), B * T, q.size(2), k.size(2), D);
  else
    rope_rows(q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(),
              sin.data_ptr<at::BFloat16>(), B * T, q.size(2), k.size(2), D);
}

}  // namespace

using nogil = py::call_guard<py::gil_scoped_release>;  // as quant_cpu.cpp says why

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("few_row_attention", &few_row_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("row_keys") = py::none(), nogil());
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("w"), py::arg("eps"), nogil());
  m.def("rope_", &rope_, py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"), nogil());
  m.def("uses_bf16_dots", [] { return has_bf16_dots() && !g_no_dots; }, "whether bf16 queries over a bf16 cache run BF16 dots");
  m.def("set_bf16_dots", [](bool on) { g_no_dots = !on; }, "off: widen bf16 queries to float32 (the AVX2 path)");
}
