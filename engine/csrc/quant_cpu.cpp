// Linear layers over GGUF quantized weights kept as they are in the file (CPU, AVX2 + FMA + F16C,
// and AVX-512 where the CPU has it): y = x deq(W)^T in float32.
//
// A weight row is the file's row: K / B blocks of B values (B = 32, or 256 for the K-quants), each
// block some float16 scales and packed integers. Every vector of weights is unpacked in registers
// to the exact float32 values gguf's dequantize (numpy) gives: the products d * q are exact in
// float32 (an 11-bit float16 mantissa times a scale of at most 8 bits times a q of at most 6 bits,
// except Q6_K's (d * scale) * q, rounded once as numpy does), so fused or not they round the same.
// `dequantize` always gives those values; AVX2's Q4_K linear multiplies x with the codes instead
// and scales each sub-block's sum once (below "Grouped scales"): the same real sum, rounded in
// another grouping.
//
// Each output (m, n) sums x[m, k] * w[n, k] in kAcc accumulators of kWidth lanes (AVX2: 4 x 8,
// AVX-512: 2 x 16), accumulator a lane l holding k = 32 c + kWidth a + l over c in order, then
// adds them in a fixed order: the same operations whatever the number of x rows in the call, so a
// row's output does not depend on the rows beside it. Each weight vector is unpacked in registers
// once per chunk of at most kRegisterRows x rows (AVX2 3, AVX-512 8) and serves all of them (AVX2
// above 6 rows: unpacked once into a buffer, 3 weight rows at a time), so on AVX-512 a check of
// 5 rows costs 1.5 to 2.3 single rows, not 5 (AVX2: 2.6). Each thread owns whole output rows.
//
// The unpacking of each block type is written per instruction set (namespaces avx2, avx512); the
// loops over blocks and rows are written once, below `#else`, and compiled once per instruction
// set: this file includes itself (`#include __FILE__`, an absolute path as torch's builder passes
// it) in each namespace, the AVX-512 one under a target pragma, so each copy is compiled for its
// ISA and inlines its own intrinsics.
//
// Block types (ggml ids): Q4_0 2, Q4_1 3, Q5_0 6, Q8_0 8, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14.
//
// bf16 activations of Q4_K and Q6_K on CPUs with AVX512-BF16 (namespace avx512bf, below "bf16
// activations") multiply the integer codes in exact bf16 products instead, each group's scale
// applied to the group's sum: the same products, summed in float32 in another grouping. Decoding
// and checks take them, and Q5_0, from a copy of the blocks with 16 weight rows interleaved
// (`interleave`), so that one scale FMA serves 16 rows: the 1.5B's linears reach the memory's speed
// at 2 threads.
//
// `quick_linear` (below "Quick") is a second, lossy linear over the same blocks for a middle level:
// int8 activations and integer dot products (namespaces avx2q, and avx512q with VNNI; its loops
// below the second `#else`). `quant_linear`, the exact one, is untouched by it.
#if !defined(BOOKCHAT_QUANT_GENERIC) && !defined(BOOKCHAT_QUICK_GENERIC)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// AVX2: unpacking and multiplying must inline into each loop: GCC otherwise leaves a K-quant's
// block a call per vector once a function holds several row counts, which is slower. Forcing it
// in the AVX-512 path made that one slower (BOOKCHAT_UNPACK_INLINE;
// history, 'Measurements that were in code comments').
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define ALWAYS_INLINE_LAMBDA __attribute__((always_inline))

namespace {

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// Q4_K sub-block s's 6-bit scale and min, packed in the block's 12 bytes `sc` (ggml get_scale_min_k4).
inline void q4k_scale_min(const uint8_t* sc, int s, int& scale, int& min) {
  if (s < 4) {
    scale = sc[s] & 63;
    min = sc[s + 4] & 63;
  } else {
    scale = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
    min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
  }
}

// Q4_K's 12 bytes of 6-bit scales and mins -> 8 scales, then 8 mins (ggml get_scale_min_k4, as
// llama.cpp unpacks them: three 32-bit words).
inline void q4k_scales_mins(const uint8_t* sc, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, sc, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t mins_low = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = mins_low;
  u[0] &= k1;
  std::memcpy(out, u, 16);
}

// Q3_K's 12 bytes of 6-bit scales -> the 16 groups' signed scales (ggml's unpacking, as gguf's
// dequantize reads them): low 4 bits from bytes 0..7 (low nibble for groups 0..7, high for 8..15),
// high 2 bits from bytes 8..11 (byte 8 + g % 4, bits 2 (g / 4)), minus 32.
inline void q3k_scales(const uint8_t* sc, int8_t out[16]) {
  for (int g = 0; g < 16; ++g) {
    const int low = g < 8 ? sc[g] & 0xF : sc[g - 8] >> 4;
    const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
    out[g] = static_cast<int8_t>((low | high << 4) - 32);
  }
}

// x rounded to bf16 as torch rounds a float32 tensor to bf16: to nearest even (a NaN to 0x7FC0, as
// c10::BFloat16; torch's vectorized copy writes 0xFFFF, also a NaN)
inline void to_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                   _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), packed);
  }
  for (; i < n; ++i) out[i] = c10::BFloat16(x[i]).x;
}

namespace avx2 {

inline __m256i bytes8(const uint8_t* p) {  // 8 bytes -> 8 int32 lanes, zero-extended
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// 8 bytes, one load: their low nibbles and their high nibbles as float32 (two blocks' vectors in
// Q4_0, Q4_1, Q5_0; two sub-blocks' in Q4_K), exact
inline void nibbles8(const uint8_t* p, __m256& low, __m256& high) {
  const __m256i b = bytes8(p);
  low = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
  high = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

// 32 signed bytes -> 4 x 8 float32, in order (where byte-wide unpacking of 32 values pays: Q6_K's
// 6-bit codes, against each 8 unpacked as int32; Q5_0's did not)
inline void bytes_to_floats(__m256i q, __m256 w[4]) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// Q4_K's and Q5_K's sub-blocks s and s + 1: d * sc and dmin * m of each, broadcast (exact)
ALWAYS_INLINE void sub_block_scales(const uint8_t* sc, int s, float d, float dmin, __m256& ds0, __m256& dm0, __m256& ds1,
                                    __m256& dm1) {
  int scale0, min0, scale1, min1;
  q4k_scale_min(sc, s, scale0, min0);
  q4k_scale_min(sc, s + 1, scale1, min1);
  ds0 = _mm256_set1_ps(d * static_cast<float>(scale0));
  dm0 = _mm256_set1_ps(dmin * static_cast<float>(min0));
  ds1 = _mm256_set1_ps(d * static_cast<float>(scale1));
  dm1 = _mm256_set1_ps(dmin * static_cast<float>(min1));
}

// Each type: kValues per block, kBytes per block, and `block<NM>(b, f)` calling f(v, w) for the
// block's 8-weight vectors v = 0 .. kValues / 8 - 1, w the weights as float32, each accumulator's
// vectors (v % kAcc) in order. NM is how many x rows each vector serves: a type may unpack
// differently for one row (AVX-512 Q6_K), always to the same values.
struct Q8_0 {
  static constexpr int kValues = 32, kBytes = 34;
  template <int NM, class F> static ALWAYS_INLINE void block(const uint8_t* b, F&& f) {
    const __m256 d = _mm256_set1_ps(half(b));
    for (int v = 0; v < 4; ++v) {
      const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * v)));
      f(v, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
    }
  }
};

struct Q4_0 {  // value i: nibble (low for i < 16, high for i >= 16) of qs[i % 16], minus 8, times d
  static constexpr int kValues = 32, kBytes = 18;
  template <int NM, class F> static ALWAYS_INLINE void block(const uint8_t* b, F&& f) {
    const __m256 d = _mm256_set1_ps(half(b)), eight = _mm256_set1_ps(8.0f);
    for (int v = 0; v < 2; ++v) {  // vectors v (low nibbles) and v + 2 (high) share their bytes
      __m256 low, high;
      nibbles8(b + 2 + 8 * v, low, high);
      f(v, _mm256_mul_ps(_mm256_sub_ps(low, eight), d));
      f(v + 2, _mm256_mul_ps(_mm256_sub_ps(high, eight), d));
    }
  }
};

struct Q4_1 {  // value i: d * nibble + m
  static constexpr int kValues = 32, kBytes = 20;
  template <int NM, class F> static ALWAYS_INLINE void block(const uint8_t* b, F&& f) {
    const __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(half(b + 2));
    for (int v = 0; v < 2; ++v) {  // vectors v (low nibbles) and v + 2 (high) share their bytes
      __m256 low, high;
      nibbles8(b + 4 + 8 * v, low, high);
      f(v, _mm256_fmadd_ps(low, d, m));
      f(v + 2, _mm256_fmadd_ps(high, d, m));
    }
  }
};

// Q5_0 value i: (nibble | bit i of qh << 4) - 16, times d; the fifth bit as a float subtraction
// (faster than int32 shifts and ors: history, 'Measurements that were in code comments')
struct Q5_0 {
  static constexpr int kValues = 32, kBytes = 22;
  template <int NM, class F> static ALWAYS_INLINE void block(const uint8_t* b, F&& f) {
    const __m256 d = _mm256_set1_ps(half(b)), sixteen = _mm256_set1_ps(16.0f);
    uint32_t qh_bits;
    std::memcpy(&qh_bits, b + 2, 4);
    const __m256i qh = _mm256_set1_epi32(static_cast<int>(qh_bits)), zero = _mm256_setzero_si256();
    const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const uint8_t* qs = b + 6;
    for (int v = 0; v < 2; ++v) {  // vectors v (low nibbles) and v + 2 (high) share their bytes
      __m256 nibbles[2];
      nibbles8(qs + 8 * v, nibbles[0], nibbles[1]);
      for (int high = 0; high < 2; ++high) {
        const int u = v + 2 * high;
        // q - 16: nibble - 16 where bit 8 u + lane of qh is clear, the nibble where it is set (exact)
        const __m256i clear = _mm256_cmpeq_epi32(_mm256_and_si256(qh, _mm256_slli_epi32(lanes, 8 * u)), zero);
        const __m256 minus = _mm256_and_ps(_mm256_castsi256_ps(clear), sixteen);
        f(u, _mm256_mul_ps(_mm256_sub_ps(nibbles[high], minus), d));
      }
    }
  }
};

// Q4_K: 8 sub-blocks of 32, value 32 s + l = (d * sc_s) * nibble - dmin * m_s; each 8 bytes
// loaded once for two sub-blocks (faster than a load per sub-block: history, 'Measurements that were in code comments')
struct Q4_K {
  static constexpr int kValues = 256, kBytes = 144;
  template <int NM, class F> static ALWAYS_INLINE void block(const uint8_t* b, F&& f) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* sc = b + 4;
    const uint8_t* qs = b + 16;
    for (int s = 0; s < 8; s += 2) {  // sub-blocks s (low nibbles) and s + 1 (high) share their bytes
      __m256 ds0, dm0, ds1, dm1;
      sub_block_scales(sc, s, d, dmin, ds0, dm0, ds1, dm1);
      const uint8_t* q = qs + 16 * s;
      for (int v = 0; v < 4; ++v) {
        __m256 low, high;
        nibbles8(q + 8 * v, low, high);
        f(4 * s + v, _mm256_fmsub_ps(ds0, low, dm0));
        f(4 * s + 4 + v, _mm256_fmsub_ps(ds1, high, dm1));
      }
    }
  }
  // The linears take each sub-block's scale out of its sum (below "Grouped scales"); `block` above
  // serves `dequantize` (and the BLAS path).
  static constexpr bool kGroupedScales = true;
  // the 8 sub-blocks' d * sc_s to ds (exact), their dmin * m_s returned (exact)
  static ALWAYS_INLINE __m256 scales(const uint8_t* b, float ds[8]) {
    uint8_t sm[16];
    q4k_scales_mins(b + 4, sm);
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8(sm)), _mm256_set1_ps(half(b))));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8(sm + 8)), _mm256_set1_ps(half(b + 2)));
  }
  // vector v of sub-blocks s (low nibbles) and s + 1 (high), s even: the codes 0..15 as float32
  static ALWAYS_INLINE void codes(const uint8_t* b, int s, int v, __m256& low, __m256& high) {
    nibbles8(b + 16 + 16 * s + 8 * v, low, high);
  }
};

struct Q6_K {  // value 128 h + 32 t + l: (d * scales[8 h + 2 t + l / 16]) * (6-bit q - 32)
  static constexpr int kValues = 256, kBytes = 210;
  static ALWAYS_INLINE void group_scales(const uint8_t* b, float ds[16]) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 d = _mm256_set1_ps(half(b + 208));
    _mm256_store_ps(ds, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d));
    _mm256_store_ps(ds + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d));
  }
  template <int NM, class F> static ALWAYS_INLINE void block(const uint8_t* b, F&& f) {
    // d * scales[g]: the same products either way; for one row, 16 at once up front, for more
    // rows where they are used: each the faster there (history, 'Measurements that were in code comments')
    const float d = half(b + 208);
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
    alignas(32) float ds[16];
    if constexpr (NM == 1) group_scales(b, ds);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), thirty_two = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      for (int t = 0; t < 4; ++t) {  // 32 bytes of q - 32 (-32 .. 31), value 128 h + 32 t + l in byte l
        const __m256i lq = t & 1 ? ql1 : ql0;
        const __m256i low = _mm256_and_si256(t < 2 ? lq : _mm256_srli_epi16(lq, 4), m4);
        const __m256i high = _mm256_and_si256(t == 0 ? _mm256_slli_epi16(qh, 4) : t == 1 ? _mm256_slli_epi16(qh, 2)
                                              : t == 2 ? qh : _mm256_srli_epi16(qh, 2), m30);
        __m256 w[4];
        bytes_to_floats(_mm256_sub_epi8(_mm256_or_si256(low, high), thirty_two), w);
        for (int v = 0; v < 4; ++v) {
          const int g = 8 * h + 2 * t + v / 2;
          const __m256 dg = NM == 1 ? _mm256_broadcast_ss(ds + g) : _mm256_set1_ps(d * static_cast<float>(scales[g]));
          f(16 * h + 4 * t + v, _mm256_mul_ps(dg, w[v]));
        }
      }
    }
  }
};

// Q5_K: Q4_K's sub-blocks with a fifth bit, value 32 s + l = (d * sc_s) * q - dmin * m_s, q = the
// nibble (low for even s, high for odd, of qs[32 (s / 2) + l]) | bit s of qh[l] << 4. The product
// is exact in float32 (11 + 6 + 5 bits), so fused or not it rounds as numpy's two operations do.
struct Q5_K {
  static constexpr int kValues = 256, kBytes = 176;
  template <int NM, class F> static ALWAYS_INLINE void block(const uint8_t* b, F&& f) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* sc = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    const __m256i nibble = _mm256_set1_epi32(0xF), sixteen = _mm256_set1_epi32(16);
    for (int s = 0; s < 8; s += 2) {  // sub-blocks s (low nibbles) and s + 1 (high) share their bytes
      __m256 ds0, dm0, ds1, dm1;
      sub_block_scales(sc, s, d, dmin, ds0, dm0, ds1, dm1);
      for (int v = 0; v < 4; ++v) {
        const __m256i bytes = bytes8(qs + 16 * s + 8 * v), high = bytes8(qh + 8 * v);
        const __m256i q0 = _mm256_or_si256(_mm256_and_si256(bytes, nibble),
                                           _mm256_and_si256(_mm256_slli_epi32(_mm256_srli_epi32(high, s), 4), sixteen));
        const __m256i q1 = _mm256_or_si256(_mm256_srli_epi32(bytes, 4),
                                           _mm256_and_si256(_mm256_slli_epi32(_mm256_srli_epi32(high, s + 1), 4), sixteen));
        f(4 * s + v, _mm256_fmsub_ps(ds0, _mm256_cvtepi32_ps(q0), dm0));
        f(4 * s + 4 + v, _mm256_fmsub_ps(ds1, _mm256_cvtepi32_ps(q1), dm1));
      }
    }
  }
};

// Q3_K: value 128 j + 32 t + l = (d * scale_g) * q, g its group of 16 (scales: q3k_scales), q the
// 2 bits 2 t of qs[32 j + l], minus 4 where bit 4 j + t of hmask[l] is clear (-4 .. 3): exact
// products (11 + 6 + 3 bits). 32 codes at a time in bytes, widened as Q6_K's are.
struct Q3_K {
  static constexpr int kValues = 256, kBytes = 110;
  static ALWAYS_INLINE __m256i codes(__m256i qs, __m256i hmask, int shift, int bit) {  // 32 codes q, int8
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, shift), _mm256_set1_epi8(3));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hmask, bit), _mm256_set1_epi8(1));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)), _mm256_set1_epi8(4));
  }
  template <int NM, class F> static ALWAYS_INLINE void block(const uint8_t* b, F&& f) {
    const float d = half(b + 108);
    int8_t scales[16];
    q3k_scales(b + 96, scales);
    const __m256i hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    for (int j = 0; j < 2; ++j) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * j));
      for (int t = 0; t < 4; ++t) {
        __m256 w[4];
        bytes_to_floats(codes(qs, hmask, 2 * t, 4 * j + t), w);
        for (int v = 0; v < 4; ++v)
          f(16 * j + 4 * t + v, _mm256_mul_ps(_mm256_set1_ps(d * static_cast<float>(scales[8 * j + 2 * t + v / 2])), w[v]));
      }
    }
  }
};

inline float sum_lanes(__m256 a) {  // fixed order: (0+4, 1+5, 2+6, 3+7), then pairs
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

struct Isa {
  using V = __m256;
  static constexpr int kWidth = 8, kAcc = 4;
  static constexpr int kRegisterRows = 3;  // 16 registers: 12 accumulators
  // above 6 rows each weight row is unpacked once into a buffer, where that became the faster
  // (history, 'Measurements that were in code comments') ...
  static constexpr int64_t kUnpackOnceAbove = 6;
  // ... 3 weight rows at a time: 9 accumulators, 3 x vectors, 1 weight vector
  static constexpr int kUnpackedWeightRows = 3;
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V set1(float a) { return _mm256_set1_ps(a); }
  static inline float sum(V a) { return sum_lanes(a); }
  static inline float reduce(const V* acc) { return sum(add(add(acc[0], acc[1]), add(acc[2], acc[3]))); }
};

#define BOOKCHAT_QUANT_GENERIC
#define BOOKCHAT_UNPACK_INLINE ALWAYS_INLINE
#define BOOKCHAT_UNPACK_INLINE_LAMBDA ALWAYS_INLINE_LAMBDA
#include __FILE__
#undef BOOKCHAT_UNPACK_INLINE
#undef BOOKCHAT_UNPACK_INLINE_LAMBDA
#undef BOOKCHAT_QUANT_GENERIC

}  // namespace avx2

// AVX-512 (F, BW, VL, DQ), chosen at run time where the CPU has it: 16 weights per vector, the 4-
// and 5-bit types looked up in per-block tables (below), Q5_0's fifth bits set through a mask
// register: faster than the AVX2 path on the same CPU (history, 'Measurements that were in code comments'). Its rows are
// independent of each other as the AVX2 path's are, in another summation order.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512 {

inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
template <int I> inline __m512 floats16(__m512i q) {  // signed bytes 16 I .. 16 I + 15 -> float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, I)));
}

struct Q8_0 {
  static constexpr int kValues = 32, kBytes = 34;
  template <int NM, class F> static inline void block(const uint8_t* b, F&& f) {
    const __m512 d = _mm512_set1_ps(half(b));
    for (int v = 0; v < 2; ++v) {
      const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * v)));
      f(v, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
    }
  }
};

// The 4- and 5-bit types look each weight up in a table of the values its code can take, computed
// once per block (per sub-block in Q4_K) by the operations that unpacked each weight before, on
// the same operands, so the same bits: one permute per 16 weights instead of a conversion and a
// multiply (`vpermps` reads an index lane's low 4 bits, `vpermt2ps` its low 5); history, 'Measurements that were in code comments'.
struct Q4_0 {  // value i: (nibble - 8) * d
  static constexpr int kValues = 32, kBytes = 18;
  template <int NM, class F> static inline void block(const uint8_t* b, F&& f) {
    const __m512 table = _mm512_mul_ps(_mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)), _mm512_set1_ps(half(b)));
    const __m512i bytes = bytes16(b + 2);
    f(0, _mm512_permutexvar_ps(bytes, table));
    f(1, _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table));
  }
};

struct Q4_1 {  // value i: d * nibble + m
  static constexpr int kValues = 32, kBytes = 20;
  template <int NM, class F> static inline void block(const uint8_t* b, F&& f) {
    const __m512 table = _mm512_fmadd_ps(iota16(), _mm512_set1_ps(half(b)), _mm512_set1_ps(half(b + 2)));
    const __m512i bytes = bytes16(b + 4);
    f(0, _mm512_permutexvar_ps(bytes, table));
    f(1, _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table));
  }
};

struct Q5_0 {  // value i: (q - 16) * d, q = nibble | fifth bit << 4 (set through a mask register)
  static constexpr int kValues = 32, kBytes = 22;
  template <int NM, class F> static inline void block(const uint8_t* b, F&& f) {
    const __m512 d = _mm512_set1_ps(half(b));
    const __m512 below = _mm512_mul_ps(_mm512_sub_ps(iota16(), _mm512_set1_ps(16.0f)), d);  // q = 0 .. 15
    const __m512 above = _mm512_mul_ps(iota16(), d);                                       // q = 16 .. 31
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m512i bytes = bytes16(b + 6), sixteen = _mm512_set1_epi32(16);
    const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), high = _mm512_srli_epi32(bytes, 4);
    const __m512i q0 = _mm512_mask_or_epi32(low, static_cast<__mmask16>(qh & 0xFFFF), low, sixteen);
    const __m512i q1 = _mm512_mask_or_epi32(high, static_cast<__mmask16>(qh >> 16), high, sixteen);
    f(0, _mm512_permutex2var_ps(below, q0, above));
    f(1, _mm512_permutex2var_ps(below, q1, above));
  }
};

// Q4_K: value 32 s + l = (d * sc_s) * nibble - dmin * m_s, sub-blocks s (low nibbles) and s + 1
// (high) from one load of each 16 bytes
struct Q4_K {
  static constexpr int kValues = 256, kBytes = 144;
  template <int NM, class F> static inline void block(const uint8_t* b, F&& f) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* sc = b + 4;
    const uint8_t* qs = b + 16;
    const __m512 iota = iota16();
    for (int s = 0; s < 8; s += 2) {
      int scale0, min0, scale1, min1;
      q4k_scale_min(sc, s, scale0, min0);
      q4k_scale_min(sc, s + 1, scale1, min1);
      const __m512 table0 = _mm512_fmsub_ps(_mm512_set1_ps(d * static_cast<float>(scale0)), iota,
                                            _mm512_set1_ps(dmin * static_cast<float>(min0)));
      const __m512 table1 = _mm512_fmsub_ps(_mm512_set1_ps(d * static_cast<float>(scale1)), iota,
                                            _mm512_set1_ps(dmin * static_cast<float>(min1)));
      for (int u = 0; u < 2; ++u) {  // vector 2 s + u, then 2 s + 2 + u: each accumulator still in order
        const __m512i bytes = bytes16(qs + 16 * s + 16 * u);
        f(2 * s + u, _mm512_permutexvar_ps(bytes, table0));
        f(2 * s + 2 + u, _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table1));
      }
    }
  }
};

// Q6_K: value 128 h + 32 t + l = (d * scales[8 h + 2 t + l / 16]) * (6-bit q - 32). For one row, 64
// codes at a time in byte-wide registers (low 4 bits from ql's 64 bytes, high 2 from qh's 32,
// shifted per half), then widened 16 at a time. For several rows each 16 codes as int32, which
// was the faster there (history, 'Measurements that were in code comments').
struct Q6_K {
  static constexpr int kValues = 256, kBytes = 210;
  template <int NM, class F> static inline void block(const uint8_t* b, F&& f) {
    const float d = half(b + 208);
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
    if constexpr (NM == 1) {
      const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), thirty_two = _mm512_set1_epi8(32);
      // qh's shifts for t = 2 p (low 256 bits) and t = 2 p + 1 (high): left 4 and 2, then right 0 and 2
      const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
      const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
        for (int p = 0; p < 2; ++p) {  // byte 32 j + l: value 128 h + 32 (2 p + j) + l, as q - 32
          const __m512i low = _mm512_and_si512(p == 0 ? ql : _mm512_srli_epi16(ql, 4), m4);
          const __m512i high = _mm512_and_si512(p == 0 ? _mm512_sllv_epi16(qh, left) : _mm512_srlv_epi16(qh, right), m30);
          const __m512i q = _mm512_sub_epi8(_mm512_or_si512(low, high), thirty_two);
          const int v = 8 * h + 4 * p;  // vector v + i = 8 h + 2 t + u, widened as it is used
          f(v, _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(scales[v])), floats16<0>(q)));
          f(v + 1, _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(scales[v + 1])), floats16<1>(q)));
          f(v + 2, _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(scales[v + 2])), floats16<2>(q)));
          f(v + 3, _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(scales[v + 3])), floats16<3>(q)));
        }
      }
    } else {
      const __m512i three = _mm512_set1_epi32(3), thirty_two = _mm512_set1_epi32(32), nibble = _mm512_set1_epi32(0xF);
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t)
          for (int u = 0; u < 2; ++u) {
            const __m512i low_bytes = bytes16(b + 64 * h + 32 * (t & 1) + 16 * u);
            const __m512i low = t < 2 ? _mm512_and_si512(low_bytes, nibble) : _mm512_srli_epi32(low_bytes, 4);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi32(bytes16(b + 128 + 32 * h + 16 * u), 2 * t), three);
            const __m512i q = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), thirty_two);
            const __m512 ds = _mm512_set1_ps(d * static_cast<float>(scales[8 * h + 2 * t + u]));
            f(8 * h + 2 * t + u, _mm512_mul_ps(ds, _mm512_cvtepi32_ps(q)));
          }
    }
  }
};

// Q5_K (see avx2::Q5_K): Q4_K's tables twice as long, the fifth bit choosing the upper half
// (`vpermt2ps`), as in Q5_0
struct Q5_K {
  static constexpr int kValues = 256, kBytes = 176;
  template <int NM, class F> static inline void block(const uint8_t* b, F&& f) {
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* sc = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    const __m512 iota = iota16(), iota_high = _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f));
    const __m512i nibble = _mm512_set1_epi32(0xF), sixteen = _mm512_set1_epi32(16);
    for (int s = 0; s < 8; s += 2) {
      int scale[2], min[2];
      q4k_scale_min(sc, s, scale[0], min[0]);
      q4k_scale_min(sc, s + 1, scale[1], min[1]);
      __m512 below[2], above[2];  // the values of codes 0 .. 15 and 16 .. 31 of sub-blocks s and s + 1
      for (int i = 0; i < 2; ++i) {
        const __m512 ds = _mm512_set1_ps(d * static_cast<float>(scale[i]));
        const __m512 dm = _mm512_set1_ps(dmin * static_cast<float>(min[i]));
        below[i] = _mm512_fmsub_ps(ds, iota, dm);
        above[i] = _mm512_fmsub_ps(ds, iota_high, dm);
      }
      for (int u = 0; u < 2; ++u) {  // vector 2 s + u, then 2 s + 2 + u: each accumulator still in order
        const __m512i bytes = bytes16(qs + 16 * s + 16 * u), high = bytes16(qh + 16 * u);
        const __m512i q0 = _mm512_or_si512(_mm512_and_si512(bytes, nibble),
                                           _mm512_and_si512(_mm512_slli_epi32(_mm512_srli_epi32(high, s), 4), sixteen));
        const __m512i q1 = _mm512_or_si512(_mm512_srli_epi32(bytes, 4),
                                           _mm512_and_si512(_mm512_slli_epi32(_mm512_srli_epi32(high, s + 1), 4), sixteen));
        f(2 * s + u, _mm512_permutex2var_ps(below[0], q0, above[0]));
        f(2 * s + 2 + u, _mm512_permutex2var_ps(below[1], q1, above[1]));
      }
    }
  }
};

// Q3_K (see avx2::Q3_K): 32 codes at a time in bytes, widened 16 at a time, one group each
struct Q3_K {
  static constexpr int kValues = 256, kBytes = 110;
  template <int NM, class F> static inline void block(const uint8_t* b, F&& f) {
    const float d = half(b + 108);
    int8_t scales[16];
    q3k_scales(b + 96, scales);
    const __m256i hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    for (int j = 0; j < 2; ++j) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * j));
      for (int t = 0; t < 4; ++t) {
        const __m256i q = avx2::Q3_K::codes(qs, hmask, 2 * t, 4 * j + t);
        const int g = 8 * j + 2 * t;  // vectors g and g + 1: groups g and g + 1
        f(g, _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(scales[g])),
                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
        f(g + 1, _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(scales[g + 1])),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
      }
    }
  }
};

inline float sum16(__m512 a) {
  return avx2::sum_lanes(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
}

struct Isa {
  using V = __m512;
  static constexpr int kWidth = 16, kAcc = 2;
  static constexpr int kRegisterRows = 8;  // 32 registers: 16 accumulators, the rest unpack
  static constexpr int64_t kUnpackOnceAbove = INT64_MAX;  // unpacking per 8 rows is the faster
  static constexpr int kUnpackedWeightRows = 1;  // (never unpacked into a buffer)
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V set1(float a) { return _mm512_set1_ps(a); }
  static inline float sum(V a) { return sum16(a); }
  static inline float reduce(const V* acc) { return sum(add(acc[0], acc[1])); }
};

#define BOOKCHAT_QUANT_GENERIC
#define BOOKCHAT_UNPACK_INLINE inline  // forced inlining was slower here (the history, as above)
#define BOOKCHAT_UNPACK_INLINE_LAMBDA
#include __FILE__
#undef BOOKCHAT_UNPACK_INLINE
#undef BOOKCHAT_UNPACK_INLINE_LAMBDA
#undef BOOKCHAT_QUANT_GENERIC

}  // namespace avx512
#pragma GCC pop_options

// ---- bf16 activations: AVX512-BF16 dot products (exact products, float32 sums) ------------------
//
// A bf16 model's activations are bf16 values, and the K-quants' codes are small integers, also
// exact in bf16: `vdpbf16ps` multiplies 32 such pairs exactly and adds them, in pairs, into 16
// float32 lanes, twice the products per instruction of a float32 FMA. Each group of codes that
// shares a scale is summed first, then scaled once, in float32:
//   Q4_K: y = sum_s (d sc_s) (sum_j x_j q_j) - sum_s (dmin m_s) (sum_j x_j)   (sub-blocks s of 32)
//   Q6_K: y = sum_g (d sc_g) (sum_j x_j (q_j - 32))                           (groups g of 16)
// d sc_s, dmin m_s and d sc_g are exact in float32, so every product is the exact product with
// gguf's dequantized weight, as in the float32 path, and only the sums round: the same real sum in
// another grouping. (`vdpbf16ps` flushes subnormal inputs and outputs, below 1.2e-38, to zero.)
// Rows are independent as in the float32 path. Faster than the float32 path (history, 'Measurements that were in code comments').
// Each Q4_K sub-block's scale is applied once to its dot product, not per weight,
// and its mins once per block against the row's sums of 32 values. Other types, and CPUs without
// AVX512-BF16, widen the activations to float32 and take the float32 path.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace avx512bf {

inline float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// bf16 of 0 .. 15, twice: a low nibble's byte indexes it unmasked (`vpermw` reads 5 bits)
alignas(64) static const uint16_t kNibbles[32] = {0,      0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                                  0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
                                                  0,      0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                                  0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
// bf16 of q - 32 for Q6_K's 6-bit codes q = 0 .. 63 (`vpermt2w` reads 6 bits: the 2 halves' 64 words)
alignas(64) static const uint16_t kSixBits[64] = {
    0xc200, 0xc1f8, 0xc1f0, 0xc1e8, 0xc1e0, 0xc1d8, 0xc1d0, 0xc1c8, 0xc1c0, 0xc1b8, 0xc1b0, 0xc1a8, 0xc1a0,
    0xc198, 0xc190, 0xc188, 0xc180, 0xc170, 0xc160, 0xc150, 0xc140, 0xc130, 0xc120, 0xc110, 0xc100, 0xc0e0,
    0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0,      0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0,
    0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4188, 0x4190, 0x4198,
    0x41a0, 0x41a8, 0x41b0, 0x41b8, 0x41c0, 0x41c8, 0x41d0, 0x41d8, 0x41e0, 0x41e8, 0x41f0, 0x41f8};

// Each type: `block(b, f)` calls f(v, q, scale) for the block's slices v = 0 .. 7 of 32 values,
// q their codes as bf16 and scale the float32 scale of each of the 16 lanes `vdpbf16ps` sums them
// into (lane i: values 2 i and 2 i + 1), and returns the 8 sub-blocks' offsets (Q4_K: -dmin m_s).
struct Q4_K {  // slice 2 c: the low nibbles of qs[32 c .. 32 c + 31], slice 2 c + 1: the high ones
  static constexpr int kValues = 256, kBytes = 144;
  static constexpr bool kOffsets = true;
  template <class F> static inline __m256 block(const uint8_t* b, F&& f) {
    uint8_t sm[16];
    q4k_scales_mins(b + 4, sm);
    const __m128i scales_mins = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sm));
    alignas(32) float ds[8];  // d sc_s, broadcast from memory
    _mm256_store_ps(ds, _mm256_mul_ps(_mm256_set1_ps(half(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scales_mins))));
    const __m512i table = _mm512_load_si512(kNibbles);
    for (int c = 0; c < 4; ++c) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c)));
      f(2 * c, (__m512bh)_mm512_permutexvar_epi16(bytes, table), _mm512_set1_ps(ds[2 * c]));
      f(2 * c + 1, (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table), _mm512_set1_ps(ds[2 * c + 1]));
    }
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales_mins, 8)));
    return _mm256_mul_ps(_mm256_set1_ps(-half(b + 2)), mins);
  }
};

struct Q6_K {  // slice 4 h + t: value 128 h + 32 t + l, code (ql nibble) | (2 bits of qh) << 4, as above
  static constexpr int kValues = 256, kBytes = 210;
  static constexpr bool kOffsets = false;
  template <class F> static inline __m256 block(const uint8_t* b, F&& f) {
    const __m512 ds = _mm512_mul_ps(_mm512_set1_ps(half(b + 208)),
                                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
    const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);  // lanes 8-15: + 1
    const __m512i low_table = _mm512_load_si512(kSixBits), high_table = _mm512_load_si512(kSixBits + 32);
    const __m512i nibble = _mm512_set1_epi16(0x000F);
    for (int h = 0; h < 2; ++h) {
      const auto words = [&](int at) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + at))); };
      const __m512i ql0 = words(64 * h), ql1 = words(64 * h + 32), qh = words(128 + 32 * h);
      // bits 0-3 from ql (0xE4: C ? A : B bitwise), bits 4-5 from qh shifted there, above: ignored
      const __m512i codes[4] = {_mm512_ternarylogic_epi32(ql0, _mm512_slli_epi16(qh, 4), nibble, 0xE4),
                                _mm512_ternarylogic_epi32(ql1, _mm512_slli_epi16(qh, 2), nibble, 0xE4),
                                _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql0, 4), qh, nibble, 0xE4),
                                _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql1, 4), _mm512_srli_epi16(qh, 2), nibble, 0xE4)};
      for (int t = 0; t < 4; ++t) {  // lanes 0-7: group 8 h + 2 t, 8-15: the next
        const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(halves, _mm512_set1_epi32(8 * h + 2 * t)), ds);
        f(4 * h + t, (__m512bh)_mm512_permutex2var_epi16(low_table, codes[t], high_table), scale);
      }
    }
    return _mm256_setzero_ps();  // no offsets
  }
};

// the sums of each 32 of x's n bf16 values, each in order (Q4_K's mins multiply them)
inline std::vector<float> sums32(const at::BFloat16* x, int64_t n) {
  std::vector<float> out(n / 32);
  for (size_t i = 0; i < out.size(); ++i) {
    float s = 0.f;
    for (int j = 0; j < 32; ++j) s += static_cast<float>(x[32 * i + j]);
    out[i] = s;
  }
  return out;
}

// NM rows of x (bf16, row stride K; xsum: each row's sums of 32 values) against one weight row
template <class Q, int NM>
inline void dot_rows(const at::BFloat16* x, const float* xsum, int64_t K, const uint8_t* w, float* y, int64_t N) {
  __m512 acc[NM][2];
  __m256 off[NM];
  for (int m = 0; m < NM; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps(), off[m] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < K / Q::kValues; ++blk) {
    const at::BFloat16* xb = x + blk * Q::kValues;
    const __m256 o = Q::block(w + blk * Q::kBytes, [&](int v, __m512bh q, __m512 scale) {
      for (int m = 0; m < NM; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * K + 32 * v);
        acc[m][v % 2] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, xv), scale, acc[m][v % 2]);
      }
    });
    if constexpr (Q::kOffsets)
      for (int m = 0; m < NM; ++m) off[m] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xsum + m * (K / 32) + 8 * blk), off[m]);
  }
  for (int m = 0; m < NM; ++m) y[m * N] = avx512::sum16(_mm512_add_ps(acc[m][0], acc[m][1])) + sum8(off[m]);
}

template <class Q, int R>
inline void in_registers(const at::BFloat16* x, const float* xsum, int64_t M, int64_t K, const uint8_t* w, float* y,
                         int64_t N) {
  if constexpr (R > 1) {
    if (M < R) return in_registers<Q, R - 1>(x, xsum, M, K, w, y, N);
  }
  dot_rows<Q, R>(x, xsum, K, w, y, N);
}

bool supports(int64_t qtype) { return qtype == 12 || qtype == 14; }

// x [M, K] bf16, y [M, N]: weight rows in groups of 16, x rows in chunks of at most 7 (the float32
// path's loop, `rows`, written out again: one helper for the chunk loop, taking the loop body as a
// lambda, gave the same bits but made the AVX-512 float32 path slower at one row: history, 'Measurements that were in code comments')
void quant_linear(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y,
                  int64_t N, int64_t qtype) {
  const std::vector<float> xsum = qtype == 12 ? sums32(x, M * K) : std::vector<float>();  // Q4_K's mins
  const auto run = [&](auto q) {
    using Q = decltype(q);
    constexpr int64_t kGroup = 16, kMost = 7;
    const int64_t chunks = (M + kMost - 1) / kMost;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t g = n0; g < n1; g += kGroup) {
        const int64_t g1 = std::min(g + kGroup, n1);
        for (int64_t c = 0, m = 0; c < chunks; ++c) {
          const int64_t size = (M - m) / (chunks - c);
          for (int64_t n = g; n < g1; ++n)
            in_registers<Q, kMost>(x + m * K, xsum.data() + m * (K / 32), size, K, w + n * row_bytes, y + m * N + n, N);
          m += size;
        }
      }
    });
  };
  if (qtype == 12) return run(Q4_K{});
  run(Q6_K{});
}


// Q4_K, Q6_K and Q5_0 with 16 weight rows interleaved (`interleave`, made once from the file's rows).
// The row-major loops above spend an FMA on every 32 products, to scale a group's dot product;
// here each of `vdpbf16ps`'s 16 lanes is one weight row, so one instruction takes a pair of values
// of 16 rows, and a group's scales are applied once per 16 rows: one FMA per 8 (Q6_K) or 16
// (Q4_K, Q5_0) dot products. The same exact products and per-group scales as above; each row's sum in
// its own fixed order (Q4_K: the block's mins, then each sub-block's pairs in order, scaled; Q6_K:
// each group's pairs, scaled; Q5_0: each block's pairs, scaled), so a row's output still does not
// depend on the rows beside it.
// At 2 threads the 1.5B's linears then read their blocks at about the memory's speed (history, 'Measurements that were in code comments'). Q5_0 is
// here as most of the 0.5B's linears are (without this, widened to float32). The copy costs the
// blocks' bytes again (the file's are then mapped, not copied: engine/loading.py `read_gguf_tensors`).
// A group of 16 rows (the last padded with zero rows) and one block column (256 values; Q5_0 32,
// its layout at Q5016) is 16 blocks' bytes, rearranged:
//   Q4_K: d [16] and dmin [16] fp16; the 12 scale bytes [12][16]; for c = 0..3 and pairs p = 0..15
//         the 32 bytes qs[32 c + 2 p + e] of rows r at 2 r + e (low nibble: value 64 c + 2 p + e,
//         high nibble: value 64 c + 32 + 2 p + e, as in the file's bytes).
//   Q6_K: d [16] fp16; the scales [16 groups][16]; for halves h = 0, 1 and pairs p = 0..15 three
//         times 32 bytes, rows r at 2 r + e: ql[64 h + 2 p + e] (values 128 h + 2 p + e, low
//         nibble, and + 64, high), ql[64 h + 32 + 2 p + e] (+ 32, + 96), qh[32 h + 2 p + e] (their
//         top 2 bits, in that order).
constexpr int64_t kGroupRows = 16;

inline __m512i words32(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline __m512 times_bytes(__m512 d, __m128i u8) { return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u8))); }

// x[0], x[1] (a pair of one row's bf16 values) as 16 copies
inline __m512bh pair(const at::BFloat16* x) {
  int32_t bits;
  std::memcpy(&bits, x, 4);
  return (__m512bh)_mm512_set1_epi32(bits);
}

struct Q4K16 {
  static constexpr int64_t kValues = 256, kBlockBytes = 144, kBytes = 144 * kGroupRows;
  static constexpr bool kMins = true;  // - dmin m_s times the sub-block's sum of x
  static void interleave(const uint8_t* b, int64_t r, uint8_t* o) {  // row r's block b into group block o
    std::memcpy(o + 2 * r, b, 2);
    std::memcpy(o + 32 + 2 * r, b + 2, 2);
    for (int k = 0; k < 12; ++k) o[64 + kGroupRows * k + r] = b[4 + k];
    for (int c = 0; c < 4; ++c)
      for (int p = 0; p < 16; ++p)
        for (int e = 0; e < 2; ++e) o[256 + 32 * (16 * c + p) + 2 * r + e] = b[16 + 32 * c + 2 * p + e];
  }
  // the 8 sub-blocks' 6-bit scales and mins of 16 rows, a byte per row (`q4k_scales_mins` lane-wise)
  static inline void scales_mins(const uint8_t* s, __m128i sc[8], __m128i mn[8]) {
    __m128i b[12];
    for (int k = 0; k < 12; ++k) b[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + kGroupRows * k));
    const __m128i k63 = _mm_set1_epi8(63), k15 = _mm_set1_epi8(15), top = _mm_set1_epi8(char(0xC0));
    for (int i = 0; i < 4; ++i) {
      sc[i] = _mm_and_si128(b[i], k63);
      mn[i] = _mm_and_si128(b[i + 4], k63);
      // the top 2 bits of bytes i and i + 4, moved to bits 4-5 (16-bit shifts: the masks keep bytes apart)
      sc[i + 4] = _mm_or_si128(_mm_and_si128(b[i + 8], k15), _mm_srli_epi16(_mm_and_si128(b[i], top), 2));
      mn[i + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b[i + 8], 4), k15), _mm_srli_epi16(_mm_and_si128(b[i + 4], top), 2));
    }
  }
  // acc[m] += the 16 rows' dot products with x row m over one block column (x: its 256 values)
  template <int NM>
  static inline void block(const at::BFloat16* x, int64_t K, const float* xsum, int64_t xsum_stride, const uint8_t* o,
                           __m512 acc[NM]) {
    const __m512i table = _mm512_load_si512(kNibbles);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32)));
    __m128i sc[8], mn[8];
    scales_mins(o + 64, sc, mn);
    for (int s = 0; s < 8; ++s) {  // - dmin m_s (sum of the sub-block's x)
      const __m512 mins = times_bytes(dmin, mn[s]);
      for (int m = 0; m < NM; ++m) acc[m] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(xsum[m * xsum_stride + s]), acc[m]);
    }
    for (int c = 0; c < 4; ++c) {
      __m512 lo[NM], hi[NM];  // sub-blocks 2 c and 2 c + 1
      for (int m = 0; m < NM; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
      for (int p = 0; p < 16; ++p) {
        const __m512i bytes = words32(o + 256 + 32 * (16 * c + p));
        const __m512bh q0 = (__m512bh)_mm512_permutexvar_epi16(bytes, table);  // vpermw reads 5 bits
        const __m512bh q1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
        for (int m = 0; m < NM; ++m) {
          lo[m] = _mm512_dpbf16_ps(lo[m], q0, pair(x + m * K + 64 * c + 2 * p));
          hi[m] = _mm512_dpbf16_ps(hi[m], q1, pair(x + m * K + 64 * c + 32 + 2 * p));
        }
      }
      const __m512 s0 = times_bytes(d, sc[2 * c]), s1 = times_bytes(d, sc[2 * c + 1]);
      for (int m = 0; m < NM; ++m) acc[m] = _mm512_fmadd_ps(hi[m], s1, _mm512_fmadd_ps(lo[m], s0, acc[m]));
    }
  }
};

struct Q6K16 {
  static constexpr int64_t kValues = 256, kBlockBytes = 210, kBytes = 210 * kGroupRows;
  static constexpr bool kMins = false;
  static void interleave(const uint8_t* b, int64_t r, uint8_t* o) {
    std::memcpy(o + 2 * r, b + 208, 2);
    for (int g = 0; g < 16; ++g) o[32 + kGroupRows * g + r] = b[192 + g];
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 16; ++p)
        for (int e = 0; e < 2; ++e) {
          uint8_t* chunks = o + 288 + 96 * (16 * h + p) + 2 * r + e;
          chunks[0] = b[64 * h + 2 * p + e];
          chunks[32] = b[64 * h + 32 + 2 * p + e];
          chunks[64] = b[128 + 32 * h + 2 * p + e];
        }
  }
  template <int NM>
  static inline void block(const at::BFloat16* x, int64_t K, const float*, int64_t, const uint8_t* o, __m512 acc[NM]) {
    const __m512i low_table = _mm512_load_si512(kSixBits), high_table = _mm512_load_si512(kSixBits + 32);
    const __m512i nibble = _mm512_set1_epi16(0x000F);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o)));
    const auto code = [&](__m512i low4, __m512i top2) {  // bits 0-3 from low4 (0xE4: C ? A : B), 4-5 from top2
      return (__m512bh)_mm512_permutex2var_epi16(low_table, _mm512_ternarylogic_epi32(low4, top2, nibble, 0xE4), high_table);
    };
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half)     // pairs 8 half .. 8 half + 7: groups 8 h + 2 t + half
        for (int v = 0; v < 2; ++v) {          // values + 32 v (t = v) and + 64 + 32 v (t = v + 2)
          __m512 lo[NM], hi[NM];
          for (int m = 0; m < NM; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
          for (int p = 8 * half; p < 8 * half + 8; ++p) {
            const uint8_t* chunks = o + 288 + 96 * (16 * h + p);
            const __m512i ql = words32(chunks + 32 * v), qh = words32(chunks + 64);
            const __m512bh q0 = code(ql, v == 0 ? _mm512_slli_epi16(qh, 4) : _mm512_slli_epi16(qh, 2));
            const __m512bh q1 = code(_mm512_srli_epi16(ql, 4), v == 0 ? qh : _mm512_srli_epi16(qh, 2));
            for (int m = 0; m < NM; ++m) {
              const at::BFloat16* xp = x + m * K + 128 * h + 32 * v + 2 * p;
              lo[m] = _mm512_dpbf16_ps(lo[m], q0, pair(xp));
              hi[m] = _mm512_dpbf16_ps(hi[m], q1, pair(xp + 64));
            }
          }
          const auto scale = [&](int g) {
            const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 32 + kGroupRows * g));
            return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8)));
          };
          const __m512 s0 = scale(8 * h + 2 * v + half), s1 = scale(8 * h + 2 * (v + 2) + half);
          for (int m = 0; m < NM; ++m) acc[m] = _mm512_fmadd_ps(hi[m], s1, _mm512_fmadd_ps(lo[m], s0, acc[m]));
        }
  }
};

struct Q5016 {  // per block of 32: d [16] fp16, then for pairs p = 0..7 the 32 bytes qs[2 p + e] of
  // rows r at 2 r + e (low nibble: value 2 p + e, high: 16 + 2 p + e) and two 32-bit masks of their
  // fifth bits (bit 2 r + e: qh bit 2 p + e, then bit 16 + 2 p + e)
  static constexpr int64_t kValues = 32, kBlockBytes = 22, kBytes = 22 * kGroupRows;
  static constexpr bool kMins = false;
  static void interleave(const uint8_t* b, int64_t r, uint8_t* o) {
    std::memcpy(o + 2 * r, b, 2);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int p = 0; p < 8; ++p) {
      uint8_t* chunk = o + 32 + 40 * p;
      uint32_t masks[2];
      std::memcpy(masks, chunk + 32, 8);
      for (int e = 0; e < 2; ++e) {
        chunk[2 * r + e] = b[6 + 2 * p + e];
        masks[0] |= ((qh >> (2 * p + e)) & 1u) << (2 * r + e);
        masks[1] |= ((qh >> (16 + 2 * p + e)) & 1u) << (2 * r + e);
      }
      std::memcpy(chunk + 32, masks, 8);
    }
  }
  template <int NM>
  static inline void block(const at::BFloat16* x, int64_t K, const float*, int64_t, const uint8_t* o, __m512 acc[NM]) {
    static const std::array<uint16_t, 32> kTable = [] {  // bf16 of q - 16, q = 0 .. 31 (exact)
      std::array<uint16_t, 32> t{};
      for (int q = 0; q < 32; ++q) t[q] = static_cast<uint16_t>(c10::bit_cast<uint32_t>(float(q - 16)) >> 16);
      return t;
    }();
    const __m512i table = _mm512_loadu_si512(kTable.data()), nibble = _mm512_set1_epi16(15), fifth = _mm512_set1_epi16(16);
    __m512 sums[NM];
    for (int m = 0; m < NM; ++m) sums[m] = _mm512_setzero_ps();
    for (int p = 0; p < 8; ++p) {
      const uint8_t* chunk = o + 32 + 40 * p;
      __mmask32 masks[2];
      std::memcpy(masks, chunk + 32, 8);
      const __m512i bytes = words32(chunk);
      const __m512i low = _mm512_and_si512(bytes, nibble), high = _mm512_srli_epi16(bytes, 4);
      const __m512bh q0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_mask_add_epi16(low, masks[0], low, fifth), table);
      const __m512bh q1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_mask_add_epi16(high, masks[1], high, fifth), table);
      for (int m = 0; m < NM; ++m) {
        sums[m] = _mm512_dpbf16_ps(sums[m], q0, pair(x + m * K + 2 * p));
        sums[m] = _mm512_dpbf16_ps(sums[m], q1, pair(x + m * K + 16 + 2 * p));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o)));
    for (int m = 0; m < NM; ++m) acc[m] = _mm512_fmadd_ps(sums[m], d, acc[m]);
  }
};

template <class G>
void interleave(const uint8_t* w, int64_t N, int64_t blocks, uint8_t* out) {
  at::parallel_for(0, (N + kGroupRows - 1) / kGroupRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        uint8_t* o = out + (g * blocks + blk) * G::kBytes;
        std::memset(o, 0, G::kBytes);
        for (int64_t r = 0; r < kGroupRows && g * kGroupRows + r < N; ++r)
          G::interleave(w + ((g * kGroupRows + r) * blocks + blk) * G::kBlockBytes, r, o);
      }
  });
}

// NM rows of x against one interleaved group: y[m * N + r] for its 16 rows r (`rows` of them real)
template <class G, int NM>
inline void group_rows(const at::BFloat16* x, const float* xsum, int64_t M, int64_t K, const uint8_t* wg, float* y,
                       int64_t N, int64_t rows) {
  if constexpr (NM > 1) {
    if (M < NM) return group_rows<G, NM - 1>(x, xsum, M, K, wg, y, N, rows);
  }
  __m512 acc[NM];
  for (int m = 0; m < NM; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < K / G::kValues; ++blk)
    G::template block<NM>(x + G::kValues * blk, K, G::kMins ? xsum + G::kValues / 32 * blk : nullptr, K / 32,
                          wg + blk * G::kBytes, acc);
  const __mmask16 real = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < NM; ++m) _mm512_mask_storeu_ps(y + m * N, real, acc[m]);
}

// x [M, K] bf16, y [M, N], the interleaved groups: each group against x rows in chunks of at most 6
template <class G>
void quant_linear16(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* packed, float* y, int64_t N) {
  const std::vector<float> xsum = G::kMins ? sums32(x, M * K) : std::vector<float>();
  constexpr int64_t kMost = 6;
  const int64_t chunks = (M + kMost - 1) / kMost, group_bytes = K / G::kValues * G::kBytes;
  at::parallel_for(0, (N + kGroupRows - 1) / kGroupRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0, m = 0; c < chunks; ++c) {
        const int64_t size = (M - m) / (chunks - c);
        group_rows<G, kMost>(x + m * K, G::kMins ? xsum.data() + m * (K / 32) : nullptr, size, K,
                             packed + g * group_bytes, y + m * N + g * kGroupRows, N,
                             std::min(kGroupRows, N - g * kGroupRows));
        m += size;
      }
  });
}

bool interleaves(int64_t qtype) { return qtype == 6 || qtype == 12 || qtype == 14; }

template <class Body>
void dispatch16(int64_t qtype, Body&& body) {
  if (qtype == 6) return body(Q5016{});
  if (qtype == 12) return body(Q4K16{});
  body(Q6K16{});
}

}  // namespace avx512bf
#pragma GCC pop_options

// ---- Quick (lossy) linears: llama.cpp-style int8 activations ------------------------------------
//
// `quick_linear` is NOT the model in the file: each activation row is quantized to int8 in blocks
// of 32 (scale dx = max|x| / 127, rounded to nearest), and each weight block's integer codes are
// multiplied with them in integer dot products (AVX-512 VNNI `vpdpbusd` where the CPU has it, on
// unsigned codes; else AVX2 `vpmaddubsw` + `vpmaddwd`, the 32-value types' codes signed), scaled
// in float32: y = sum over groups g of d_g dx_g isum_g + offset_g dx_g sum_g(q), the offsets the
// K-quants' -dmin m (Q4_K) and -32 d scale (Q6_K: 6-bit codes 0..63, the -32 taken out), and
// for the 32-value types on AVX-512 -C (Q8_0 128, Q5_0 16, Q4_0 8, codes w + C), started in
// each dot product's integer accumulator. On AVX-512 each row's dx is folded into a block's
// float scales once per block (`row_scale`), then permuted to the dot products' lanes.
// Its error is the activations' rounding: about 0.5% relative on y (tests/engine/test_quick.py
// derives the bound), a middle level's draft, verified by the exact top level. Types: Q4_0,
// Q5_0, Q8_0, Q4_K, Q6_K; Q4_1 has no quick path (`quick_supports`): Python keeps the exact kernel.
// Rows are independent: a row's output does not depend on the rows beside it.
struct QuickAct {  // a call's activations: x[m] ~= dx[m, k / 32] * q[m, k]
  const int8_t* q;     // [M, K]
  const float* dx;     // [M, K / 32]
  const float* dxl;    // [M, K / 4]: dx of value 4 i, one per int32 lane of a dot product (AVX2)
  const float* xs16;   // [M, K / 16]: dx * sum of q over each 16 values
  const float* xs32;   // [M, K / 32]: over each 32
  const int32_t* init;  // [M, K / 4]: -C * (q[4 i] + .. + q[4 i + 3]), a dot product lane's start (codes q + C)
  int64_t K;
};

inline void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* q, float* dxs, float* dxl, float* xs16,
                                 float* xs32, int32_t* init, int init_offset, bool q4k_order) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* xb = x + m * K + 32 * b;
      // Q4_K order (AVX-512): the 32-value blocks of each 128 stored as 0, 2, 1, 3 (see avx512q::Q4_K)
      const int64_t at = q4k_order ? 128 * (b / 4) + 32 * (b % 4 == 1 ? 2 : b % 4 == 2 ? 1 : b % 4) : 32 * b;
      int8_t* qb = q + m * K + at;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int sums[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        const int v = static_cast<int>(std::nearbyint(std::min(127.0f, std::max(-127.0f, xb[i] * inv))));
        qb[i] = static_cast<int8_t>(v);
        sums[i / 16] += v;
      }
      xs16[m * (K / 16) + 2 * b] = dx * static_cast<float>(sums[0]);
      xs16[m * (K / 16) + 2 * b + 1] = dx * static_cast<float>(sums[1]);
      xs32[m * (K / 32) + b] = dx * static_cast<float>(sums[0] + sums[1]);
      dxs[m * (K / 32) + b] = dx;
      for (int l = 0; l < 8; ++l) {
        dxl[m * (K / 4) + 8 * b + l] = dx;
        if (init_offset != 0) init[m * (K / 4) + 8 * b + l] = -init_offset * (qb[4 * l] + qb[4 * l + 1] + qb[4 * l + 2] + qb[4 * l + 3]);
      }
    }
}

struct QuickType {  // what a quick type is unless it says otherwise (each ISA's types below)
  static constexpr bool kRowScaled = false;  // each row's dx folded into the block's scales (AVX-512)
  static constexpr int kInitOffset = 0;       // codes stored as w + C: each dot product starts at -C sum(x)
  static constexpr bool kQ4KOrder = false;    // activations in Q4_K order (see avx512q::Q4_K)
  static constexpr bool kSigned = false;      // signed codes (AVX2 `maddubs` with sign tricks)
};

namespace avx2q {  // 32 values per vector, `maddubs` + `madd` (codes <= 63 or signed: no int16 saturation)

using VI = __m256i;
using VF = __m256;

// value i of a 32-value Q4_0 / Q5_0 block: nibble of qs[i % 16] (low for i < 16)
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), f = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), f), _mm_and_si128(b, f));
}

inline __m256i bits_to_bytes(const uint8_t* p) {  // bit i of 32 -> byte i 0xFF / 0 (as llama.cpp)
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

inline __m256i q5_0_codes(const uint8_t* b) {  // signed q - 16
  const __m256i high = _mm256_and_si256(bits_to_bytes(b + 2), _mm256_set1_epi8(0x10));
  return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), high), _mm256_set1_epi8(16));
}

struct QIsa {
  static constexpr int kChunk = 32, kRows = 4;  // 16 registers: 4 x 2 accumulators
  static inline VF zero() { return _mm256_setzero_ps(); }
  static inline VF loadf(const float* p) { return _mm256_loadu_ps(p); }
  static inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  static inline VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
  template <bool kSigned> static inline VF dot(VI q, const int8_t* x, const int32_t*) {  // 8 lanes, each 4 products
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    if constexpr (kSigned) {  // |w| (<= 128) times x with w's sign: 128 * 127 * 2 < 32768
      xv = _mm256_sign_epi8(xv, q);
      q = _mm256_sign_epi8(q, q);
    }
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1)));
  }
  static inline float reduce(VF a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
};

struct Q4_K : QuickType {
  static constexpr int kValues = 256, kBytes = 144, kChunks = 8, kOffVecs = 1;
  struct Block {
    const uint8_t* qs;
    float ds[8];
    __m256 ov[1];
    explicit ALWAYS_INLINE Block(const uint8_t* b) : qs(b + 16) {
      uint8_t sm[16];
      q4k_scales_mins(b + 4, sm);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm))));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8))));
      _mm256_storeu_ps(ds, _mm256_mul_ps(sc, _mm256_set1_ps(half(b))));
      ov[0] = _mm256_mul_ps(mn, _mm256_set1_ps(-half(b + 2)));
    }
    ALWAYS_INLINE VI codes(int c) const {  // sub-block c: nibbles of qs[32 (c / 2) ..], low for even c
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (c / 2)));
      return _mm256_and_si256(c % 2 == 0 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0xF));
    }
    ALWAYS_INLINE VF scale(int c) const { return _mm256_set1_ps(ds[c]); }
  };
  static const float* off_x(const QuickAct& a, int64_t m, int64_t blk, int) { return a.xs32 + m * (a.K / 32) + 8 * blk; }
};

struct Q6_K : QuickType {
  static constexpr int kValues = 256, kBytes = 210, kChunks = 8, kOffVecs = 2;
  struct Block {
    const uint8_t* b;
    float ds[16];
    __m256 ov[2];
    explicit ALWAYS_INLINE Block(const uint8_t* p) : b(p) {
      const __m256 d = _mm256_set1_ps(half(p + 208)), minus32 = _mm256_set1_ps(-32.0f);
      for (int i = 0; i < 2; ++i) {
        const __m256 s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 192 + 8 * i)))));
        _mm256_storeu_ps(ds + 8 * i, s);
        ov[i] = _mm256_mul_ps(s, minus32);
      }
    }
    ALWAYS_INLINE VI codes(int c) const {  // values 128 h + 32 t .. + 31, c = 4 h + t: 6-bit codes 0..63
      const int h = c / 4, t = c % 4;
      const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (t & 1)));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i low = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0xF));
      const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
      return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
    ALWAYS_INLINE VF scale(int c) const {  // lanes 0-3: scale 2 c, 4-7: 2 c + 1
      return _mm256_set_m128(_mm_set1_ps(ds[2 * c + 1]), _mm_set1_ps(ds[2 * c]));
    }
  };
  static const float* off_x(const QuickAct& a, int64_t m, int64_t blk, int i) {
    return a.xs16 + m * (a.K / 16) + 16 * blk + 8 * i;
  }
};

// a 32-value type with signed codes (T::codes_of a block) and one float16 scale at its start: no offsets
template <class T, int kBlockBytes>
struct Small : QuickType {
  static constexpr int kValues = 32, kBytes = kBlockBytes, kChunks = 1, kOffVecs = 0;
  static constexpr bool kSigned = true;
  static const float* off_x(const QuickAct&, int64_t, int64_t, int) { return nullptr; }
  struct Block {
    const uint8_t* b;
    __m256 ov[1];
    explicit ALWAYS_INLINE Block(const uint8_t* p) : b(p) {}
    ALWAYS_INLINE VI codes(int) const { return T::codes_of(b); }
    ALWAYS_INLINE VF scale(int) const { return _mm256_set1_ps(half(b)); }
  };
};

struct Q8_0 : Small<Q8_0, 34> {
  static ALWAYS_INLINE VI codes_of(const uint8_t* b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)); }
};

struct Q5_0 : Small<Q5_0, 22> {
  static ALWAYS_INLINE VI codes_of(const uint8_t* b) { return q5_0_codes(b); }
};

struct Q4_0 : Small<Q4_0, 18> {
  static ALWAYS_INLINE VI codes_of(const uint8_t* b) { return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)); }
};

#define BOOKCHAT_QUICK_GENERIC
#include __FILE__
#undef BOOKCHAT_QUICK_GENERIC

}  // namespace avx2q

// AVX-512 VNNI (Zen 4, Ice Lake and later): 64 values per vector, `vpdpbusd`. The 32-value types
// go two blocks at a time (K a multiple of 64) with unsigned codes w + C (Q8_0: C = 128, Q5_0: 16,
// Q4_0: 8), each dot product lane started at -C times its 4 activations' sum (QuickAct::init).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace avx512q {

using VI = __m512i;
using VF = __m512;

struct QIsa {
  static constexpr int kChunk = 64, kRows = 8;  // 32 registers: 8 x (1 + 1 ymm) accumulators
  static inline VF zero() { return _mm512_setzero_ps(); }
  static inline VF loadf(const float* p) { return _mm512_loadu_ps(p); }
  static inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  static inline VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
  template <bool kSigned> static inline VF dot(VI q, const int8_t* x, const int32_t* init) {  // 16 lanes, 4 products each
    static_assert(!kSigned, "vpdpbusd: unsigned codes");
    const __m512i start = init == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(init);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, q, _mm512_loadu_si512(x)));
  }
  static inline float reduce(VF a) { return avx2q::QIsa::reduce(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1))); }
};

inline __m512 halves(float a, float b) {  // lanes 0-7 a, 8-15 b
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1);
}

inline __m512i join(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }

struct Q4_K : QuickType {  // the activations' dx folded into the 8 sub-block scales once per block and row
  // The activations come in Q4_K order: per 128 values, blocks of 32 stored as 0, 2, 1, 3, so
  // the low nibbles of 64 bytes of qs (sub-blocks 4 g and 4 g + 2) and their high nibbles
  // (4 g + 1, 4 g + 3) each meet 64 consecutive activations.
  static constexpr int kValues = 256, kBytes = 144, kChunks = 4, kOffVecs = 1;
  static constexpr bool kRowScaled = true, kQ4KOrder = true;
  struct Block {
    const uint8_t* qs;
    __m256 ds;  // d * scale of the 8 sub-blocks
    __m256 ov[1];
    explicit inline Block(const uint8_t* b) : qs(b + 16) {
      uint8_t sm[16];
      q4k_scales_mins(b + 4, sm);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm))));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8))));
      ds = _mm256_mul_ps(sc, _mm256_set1_ps(half(b)));
      ov[0] = _mm256_mul_ps(mn, _mm256_set1_ps(-half(b + 2)));
    }
    inline VI codes(int c) const {  // c = 2 g + h: sub-blocks 4 g + h and 4 g + 2 + h
      const __m512i v = _mm512_loadu_si512(qs + 64 * (c / 2));
      return _mm512_and_si512(c % 2 == 0 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0xF));
    }
    inline __m512 row_scale(const float* dx) const { return _mm512_castps256_ps512(_mm256_mul_ps(ds, _mm256_loadu_ps(dx))); }
    static inline VF scale_of(__m512 row, int c) {  // lanes 0-7: sub-block 4 g + h, 8-15: 4 g + 2 + h
      const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
      return _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(4 * (c / 2) + c % 2)), row);
    }
  };
  static const float* off_x(const QuickAct& a, int64_t m, int64_t blk, int) { return a.xs32 + m * (a.K / 32) + 8 * blk; }
};

struct Q6_K : QuickType {  // the activations' dx folded into the 16 group scales once per block and row
  static constexpr int kValues = 256, kBytes = 210, kChunks = 4, kOffVecs = 2;
  static constexpr bool kRowScaled = true;
  struct Block {
    const uint8_t* b;
    __m512 ds;  // d * scale of the 16 groups of 16
    __m256 ov[2];
    explicit inline Block(const uint8_t* p) : b(p) {
      ds = _mm512_mul_ps(_mm512_set1_ps(half(p + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)))));
      ov[0] = _mm256_mul_ps(_mm512_castps512_ps256(ds), _mm256_set1_ps(-32.0f));
      ov[1] = _mm256_mul_ps(_mm512_extractf32x8_ps(ds, 1), _mm256_set1_ps(-32.0f));
    }
    inline VI codes(int c) const {  // values 64 c .. + 63, c = 2 h + p: t = 2 p and 2 p + 1
      const int h = c / 2, p = c % 2;
      const __m512i ql = _mm512_loadu_si512(b + 64 * h), f = _mm512_set1_epi8(0xF);
      const __m512i low = _mm512_and_si512(p == 0 ? ql : _mm512_srli_epi16(ql, 4), f);
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
      const __m512i shift = _mm512_set_epi64(4 * p + 2, 4 * p + 2, 4 * p + 2, 4 * p + 2, 4 * p, 4 * p, 4 * p, 4 * p);
      const __m512i high = _mm512_and_si512(_mm512_srlv_epi64(qh, shift), _mm512_set1_epi8(3));
      return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
    }
    inline __m512 row_scale(const float* dx) const {  // group g: d * scale_g * dx[g / 2]
      const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
      return _mm512_mul_ps(ds, _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(dx))));
    }
    static inline VF scale_of(__m512 row, int c) {  // lane l: group 4 c + l / 4
      const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * c),
                                           _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
      return _mm512_permutexvar_ps(idx, row);
    }
  };
  static const float* off_x(const QuickAct& a, int64_t m, int64_t blk, int i) {
    return a.xs16 + m * (a.K / 16) + 16 * blk + 8 * i;
  }
};

// two blocks of a 32-value type: codes w + kOffset (unsigned, T::codes_of two blocks), each dot
// started at -kOffset sum(x)
template <class T, int kBlockBytes, int kOffset>
struct Pair : QuickType {
  static constexpr int kValues = 64, kBytes = 2 * kBlockBytes, kChunks = 1, kOffVecs = 0;
  static constexpr bool kRowScaled = true;  // (d_a dx_a, d_b dx_b) once per pair and row
  static constexpr int kInitOffset = kOffset;
  static const float* off_x(const QuickAct&, int64_t, int64_t, int) { return nullptr; }
  static inline __m128 scales(const uint8_t* b) { return _mm_setr_ps(half(b), half(b + kBlockBytes), 0.0f, 0.0f); }
  static inline __m512 row_scale_of(__m128 ds, const float* dx) {  // lanes 0, 1: d_a dx_a, d_b dx_b
    return _mm512_castps128_ps512(_mm_mul_ps(ds, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx)))));
  }
  static inline VF lanes_of(__m512 row) {  // lanes 0-7: block a, 8-15: block b
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), row);
  }
  struct Block {
    const uint8_t* b;
    __m128 ds;
    __m256 ov[1];
    explicit inline Block(const uint8_t* p) : b(p), ds(scales(p)) {}
    inline __m512 row_scale(const float* dx) const { return row_scale_of(ds, dx); }
    static inline VF scale_of(__m512 row, int) { return lanes_of(row); }
    inline VI codes(int) const { return T::codes_of(b); }
  };
};

// the nibbles of two 16-byte qs: [a low, a high, b low, b high] (values 0-31 of a, then of b)
inline __m512i pair_nibbles(const uint8_t* qa, const uint8_t* qb) {
  const __m512i t = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qa))),
                                                0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
  return _mm512_and_si512(_mm512_srlv_epi64(t, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(0xF));
}

struct Q8_0 : Pair<Q8_0, 34, 128> {  // codes w + 128
  static inline VI codes_of(const uint8_t* b) {
    return _mm512_xor_si512(join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 36))),
                            _mm512_set1_epi8(-128));
  }
};

struct Q5_0 : Pair<Q5_0, 22, 16> {  // codes 0..31: nibble, and 16 where qh's bit is set
  static inline VI codes_of(const uint8_t* b) {
    uint32_t qa, qb;
    std::memcpy(&qa, b + 2, 4);
    std::memcpy(&qb, b + 24, 4);
    const __m512i nibbles = pair_nibbles(b + 6, b + 28);
    return _mm512_mask_add_epi8(nibbles, _cvtu64_mask64(qa | static_cast<uint64_t>(qb) << 32), nibbles, _mm512_set1_epi8(16));
  }
};

struct Q4_0 : Pair<Q4_0, 18, 8> {  // codes 0..15
  static inline VI codes_of(const uint8_t* b) { return pair_nibbles(b + 2, b + 20); }
};

#define BOOKCHAT_QUICK_GENERIC
#include __FILE__
#undef BOOKCHAT_QUICK_GENERIC

}  // namespace avx512q
#pragma GCC pop_options

template <class Body>
void dispatch(int64_t qtype, Body&& body) {  // kValues / kBytes are the same in both namespaces
  avx2::dispatch(qtype, body);
}

int g_isa = -1;  // -1: the best this CPU runs; 0: AVX2; 1: AVX-512; 2: AVX-512 and BF16 dots (tests pin each)

bool use_avx512() {
  if (g_isa >= 0) return g_isa >= 1;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool use_bf16_dots() {
  if (g_isa >= 0) return g_isa == 2;
  __builtin_cpu_init();
  return use_avx512() && __builtin_cpu_supports("avx512bf16");
}

template <class Q>
void check_weight(const torch::Tensor& w, int64_t K) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "quant_cpu: w uint8 [N, row bytes]");
  TORCH_CHECK(K % Q::kValues == 0 && w.size(1) == K / Q::kValues * Q::kBytes,
              "quant_cpu: a row of ", K, " values is ", K / Q::kValues * Q::kBytes, " bytes of this type, not ", w.size(1));
}

// y + bias, rounded once to bf16 (to nearest even, as torch's `.to`) when asked: what a layer did
// after the call in three small torch ops, each a call's overhead (history, 'Measurements that were in code comments').
torch::Tensor epilogue(torch::Tensor y, const c10::optional<torch::Tensor>& bias, bool bf16_out) {
  const int64_t M = y.size(0), N = y.size(1);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_linear: bias float32 [N]");
    b = bias->data_ptr<float>();
  }
  float* yp = y.data_ptr<float>();
  if (b != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] += b[n];
  if (!bf16_out) return y;
  auto out = torch::empty({M, N}, y.options().dtype(torch::kBFloat16));
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * N; ++i) op[i] = at::BFloat16(yp[i]);  // c10's rounding: to nearest even
  return out;
}

// Q5_0's, Q4_K's or Q6_K's blocks w [N, row bytes] with 16 rows interleaved (avx512bf::interleave):
// [ceil(N / 16), K / values per block * 16 blocks' bytes] uint8
torch::Tensor interleave(const torch::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(avx512bf::interleaves(qtype), "interleave: Q5_0, Q4_K or Q6_K (ggml types 6, 12, 14), not ", qtype);
  torch::Tensor out;
  avx512bf::dispatch16(qtype, [&](auto g) {
    using G = decltype(g);
    dispatch(qtype, [&](auto q) { check_weight<decltype(q)>(w, K); });
    const int64_t N = w.size(0), groups = (N + avx512bf::kGroupRows - 1) / avx512bf::kGroupRows;
    out = torch::empty({groups, K / G::kValues * G::kBytes}, w.options());
    avx512bf::interleave<G>(w.data_ptr<uint8_t>(), N, K / G::kValues, out.data_ptr<uint8_t>());
  });
  return out;
}

torch::Tensor quant_linear_interleaved(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype,
                                       const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                                       bool bf16_out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant_linear: x bfloat16 [M, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  avx512bf::dispatch16(qtype, [&](auto g) {
    using G = decltype(g);
    dispatch(qtype, [&](auto q) { check_weight<decltype(q)>(w, K); });
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                    packed.size(0) == (N + avx512bf::kGroupRows - 1) / avx512bf::kGroupRows &&
                    packed.size(1) == K / G::kValues * G::kBytes,
                "quant_linear: `interleaved` is not interleave() of these blocks");
    if (M > 0 && N > 0)
      avx512bf::quant_linear16<G>(x.data_ptr<at::BFloat16>(), M, K, packed.data_ptr<uint8_t>(), y.data_ptr<float>(), N);
  });
  return epilogue(y, bias, bf16_out);
}

// x [M, K] float32 or bf16 contiguous, w [N, K / B * block bytes] uint8 (the file's rows), bias
// float32 [N] or none. y [M, N] float32, or bf16 with `bf16_out`. bf16 x: the BF16 dot products
// where the CPU and the type have them, else widened. `interleaved`: `interleave(w, qtype, K)`,
// taken by bf16 x where the BF16 dot products run (else ignored).
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype,
                           const c10::optional<torch::Tensor>& bias, bool bf16_out,
                           const c10::optional<torch::Tensor>& interleaved) {
  const bool bf16_dots = x.scalar_type() == torch::kBFloat16 && use_bf16_dots();
  if (bf16_dots && interleaved.has_value() && avx512bf::interleaves(qtype))
    return quant_linear_interleaved(x, w, qtype, *interleaved, bias, bf16_out);
  if (x.scalar_type() == torch::kBFloat16 && !(bf16_dots && avx512bf::supports(qtype)))
    return quant_linear(x.to(torch::kFloat), w, qtype, bias, bf16_out, c10::nullopt);
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
              "quant_linear: x float32 or bfloat16 [M, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  dispatch(qtype, [&](auto q) {
    using Q = decltype(q);
    check_weight<Q>(w, K);
    if (M == 0 || N == 0) return;
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    const int64_t row_bytes = w.size(1);
    if (x.scalar_type() == torch::kBFloat16)
      return avx512bf::quant_linear(x.data_ptr<at::BFloat16>(), M, K, wp, row_bytes, yp, N, qtype);
    const float* xp = x.data_ptr<float>();
    if (use_avx512()) return avx512::quant_linear(xp, M, K, wp, row_bytes, yp, N, qtype);
    avx2::quant_linear(xp, M, K, wp, row_bytes, yp, N, qtype);
  });
  return epilogue(y, bias, bf16_out);
}

// w [N, row bytes] uint8 -> out float32 [N, K] contiguous: the weights gguf's dequantize gives; or
// out bf16: those weights rounded as `.to(torch.bfloat16)` rounds them (no float32 copy in memory)
torch::Tensor dequantize(const torch::Tensor& w, int64_t qtype, torch::Tensor out) {
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || out.scalar_type() == torch::kFloat) && out.dim() == 2 && out.is_contiguous() && out.size(0) == w.size(0),
              "dequantize: out float32 or bfloat16 [N, K] contiguous");
  const int64_t K = out.size(1);
  dispatch(qtype, [&](auto q) {
    using Q = decltype(q);
    check_weight<Q>(w, K);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* op = bf16 ? nullptr : out.data_ptr<float>();
    auto* op16 = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
    const int64_t row_bytes = w.size(1);
    if (use_avx512()) return avx512::dequantize(wp, w.size(0), row_bytes, K, op, op16, qtype);
    avx2::dequantize(wp, w.size(0), row_bytes, K, op, op16, qtype);
  });
  return out;
}

bool use_quick_avx512() {
  __builtin_cpu_init();
  return use_avx512() && __builtin_cpu_supports("avx512vnni");
}

bool quick_supports(int64_t qtype, int64_t K) {
  return use_quick_avx512() ? avx512q::quick_supports(qtype, K) : avx2q::quick_supports(qtype, K);
}

// x [M, K] float32 contiguous, w [N, row bytes] uint8: y [M, N] float32 ~= x deq(w)^T, with x
// rounded to int8 per 32 values (lossy: see "Quick" above). A type or K without a quick path
// raises (Python asks `quick_supports` first and keeps the exact kernel for those).
torch::Tensor quick_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(), "quick_linear: x float32 [M, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  dispatch(qtype, [&](auto q) { check_weight<decltype(q)>(w, K); });
  TORCH_CHECK(quick_supports(qtype, K), "quick_linear: no quick path for ggml type ", qtype, " at K = ", K);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * K / 32), dxl(M * K / 4), xs16(M * K / 16), xs32(M * K / 32);
  const bool vnni = use_quick_avx512();
  const int init_offset = vnni ? avx512q::quick_init_offset(qtype) : avx2q::quick_init_offset(qtype);
  const bool q4k_order = vnni && avx512q::quick_q4k_order(qtype);
  std::vector<int32_t> init(init_offset != 0 ? M * K / 4 : 0);
  quantize_activations(x.data_ptr<float>(), M, K, xq.data(), dx.data(), dxl.data(), xs16.data(), xs32.data(), init.data(),
                       init_offset, q4k_order);
  const QuickAct a{xq.data(), dx.data(), dxl.data(), xs16.data(), xs32.data(), init.data(), K};
  if (vnni) {
    avx512q::quick_linear(a, M, w.data_ptr<uint8_t>(), w.size(1), y.data_ptr<float>(), N, qtype);
  } else {
    avx2q::quick_linear(a, M, w.data_ptr<uint8_t>(), w.size(1), y.data_ptr<float>(), N, qtype);
  }
  return y;
}

}  // namespace

// The kernels run without the GIL, as torch's own ops do: in the app the engine decodes in one
// thread while the UI's threads stream the answer, and a kernel holding the GIL (a linear is half
// a step) made them wait for it, and the engine for them (RESULTS, "The app's own cost while it
// streams": no change in TBT measurable by itself through the noise).
using nogil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x deq(w)^T (+ bias): float32 or bf16 x [M, K], GGUF blocks w [N, row bytes], "
        "ggml type; float32 out, or rounded to bf16", py::arg("x"), py::arg("w"), py::arg("qtype"),
        py::arg("bias") = py::none(), py::arg("bf16_out") = false, py::arg("interleaved") = py::none(), nogil());
  m.def("interleave", &interleave, "Q5_0 / Q4_K / Q6_K blocks [N, row bytes], ggml type, K -> 16 rows interleaved, for bf16 "
        "quant_linear", nogil());
  m.def("dequantize", &dequantize, "GGUF blocks w [N, row bytes], ggml type -> out float32 or bfloat16 [N, K]", nogil());
  m.def("set_isa", [](int64_t isa) { g_isa = static_cast<int>(isa); }, "-1 best available, 0 AVX2, 1 AVX-512, 2 AVX-512 and BF16 dots");
  m.def("uses_avx512", &use_avx512, "whether calls run the AVX-512 kernel");
  m.def("uses_bf16_dots", &use_bf16_dots, "whether bf16 activations of Q4_K / Q6_K run BF16 dot products");
  m.def("quick_linear", &quick_linear, "y ~= x deq(w)^T with x rounded to int8 per 32 values (lossy, integer dots)", nogil());
  m.def("quick_supports", &quick_supports, "whether quick_linear has a path for ggml type `qtype` at K inputs");
  m.def("quick_uses_vnni", &use_quick_avx512, "whether quick_linear runs AVX-512 VNNI");
}

#elif defined(BOOKCHAT_QUANT_GENERIC)  // the loops, compiled once per instruction set (namespaces avx2, avx512)

using V = Isa::V;
constexpr int kWidth = Isa::kWidth, kAcc = Isa::kAcc;
static_assert(kWidth * kAcc == 32, "accumulator a lane l holds k = 32 c + kWidth a + l");

// NM rows of x (row stride K) against one weight row unpacked in registers: y[m * N] for m < NM.
template <class Q, int NM>
BOOKCHAT_UNPACK_INLINE void dot_rows(const float* x, int64_t K, const uint8_t* w, float* y, int64_t N) {
  V acc[NM][kAcc];
  for (int m = 0; m < NM; ++m)
    for (int a = 0; a < kAcc; ++a) acc[m][a] = Isa::zero();
  for (int64_t blk = 0; blk < K / Q::kValues; ++blk) {
    const float* xb = x + blk * Q::kValues;
    Q::template block<NM>(w + blk * Q::kBytes, [&](int v, V wv) BOOKCHAT_UNPACK_INLINE_LAMBDA {
      for (int m = 0; m < NM; ++m)
        acc[m][v % kAcc] = Isa::fma(wv, Isa::load(xb + m * K + kWidth * v), acc[m][v % kAcc]);
    });
  }
  for (int m = 0; m < NM; ++m) y[m * N] = Isa::reduce(acc[m]);
}

// M <= R rows of x against one weight row unpacked in registers.
template <class Q, int R>
inline void in_registers(const float* x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t N) {
  if constexpr (R > 1) {
    if (M < R) return in_registers<Q, R - 1>(x, M, K, w, y, N);
  }
  dot_rows<Q, R>(x, K, w, y, N);
}

template <class Q>
inline void dequantize_row(const uint8_t* w, int64_t K, float* out) {
  for (int64_t blk = 0; blk < K / Q::kValues; ++blk) {
    float* o = out + blk * Q::kValues;
    Q::template block<1>(w + blk * Q::kBytes, [&](int v, V wv) BOOKCHAT_UNPACK_INLINE_LAMBDA { Isa::store(o + kWidth * v, wv); });
  }
}

// NM rows of x against NN weight rows already unpacked to float32 (w, row stride K): `dot_rows`'s
// accumulators in its order, hence the same bits. Accumulator a of output (m, n) takes vector
// j = 32 c / kWidth + a of the row in order of c whatever loops around it, so the loops go one
// accumulator index at a time over a segment of K that stays in L1, and each loaded weight vector
// serves NM rows and each x vector NN weight rows: 2 loads per 3 FMAs at 3 x 3, where a weight
// row at a time (NN = 1) loaded 4 per 3.
template <int NN, int NM>
inline void tile_unpacked(const float* x, int64_t K, const float* w, float* y, int64_t N) {
  constexpr int64_t kSegment = 512;  // floats of each row per pass: (NN + NM) x 2 KB
  V acc[kAcc][NN][NM];
  for (int a = 0; a < kAcc; ++a)
    for (int n = 0; n < NN; ++n)
      for (int m = 0; m < NM; ++m) acc[a][n][m] = Isa::zero();
  for (int64_t k0 = 0; k0 < K; k0 += kSegment) {
    const int64_t k1 = std::min(K, k0 + kSegment);  // K and kSegment are multiples of 32
    for (int a = 0; a < kAcc; ++a) {
      V s[NN][NM];
      for (int n = 0; n < NN; ++n)
        for (int m = 0; m < NM; ++m) s[n][m] = acc[a][n][m];
      for (int64_t k = k0 + kWidth * a; k < k1; k += 32) {
        V xv[NM];
        for (int m = 0; m < NM; ++m) xv[m] = Isa::load(x + m * K + k);
        for (int n = 0; n < NN; ++n) {
          const V wv = Isa::load(w + n * K + k);
          for (int m = 0; m < NM; ++m) s[n][m] = Isa::fma(wv, xv[m], s[n][m]);
        }
      }
      for (int n = 0; n < NN; ++n)
        for (int m = 0; m < NM; ++m) acc[a][n][m] = s[n][m];
    }
  }
  for (int n = 0; n < NN; ++n)
    for (int m = 0; m < NM; ++m) {
      V sums[kAcc];
      for (int a = 0; a < kAcc; ++a) sums[a] = acc[a][n][m];
      y[m * N + n] = Isa::reduce(sums);
    }
}

// M <= NM rows of x against n_rows <= NN unpacked weight rows.
template <int NN, int NM>
inline void unpacked_tile(const float* x, int64_t M, int64_t n_rows, int64_t K, const float* w, float* y,
                          int64_t N) {
  if constexpr (NN > 1) {
    if (n_rows < NN) return unpacked_tile<NN - 1, NM>(x, M, n_rows, K, w, y, N);
  }
  if constexpr (NM > 1) {
    if (M < NM) return unpacked_tile<NN, NM - 1>(x, M, n_rows, K, w, y, N);
  }
  tile_unpacked<NN, NM>(x, K, w, y, N);
}

// ---- Grouped scales (types with kGroupedScales: AVX2's Q4_K) --------------------------------------
//
// y = sum_s (d sc_s) (sum_j x_j q_j) - sum_s (dmin m_s) (sum_j x_j), sub-blocks s of 32: each
// sub-block's codes multiplied with x and summed (4 vectors in order), then scaled once, and the
// mins applied once per block against the row's sums of 32 values (`xsums`). d sc_s and dmin m_s
// are exact, so this is the real sum of x times the file's weights, rounded in float32 in another
// grouping (as the bf16 dot products: products with codes, partial sums and scalings each round
// once), with one FMA per 8 weights instead of two (see benchmarks/RESULTS.md, "Q4_K's scales out
// of the sums"). A row's operations are the same in any call, with any rows beside it.
template <class Q, class = void> struct GroupedScales : std::false_type {};
template <class Q> struct GroupedScales<Q, std::void_t<decltype(Q::kGroupedScales)>> : std::true_type {};

// each row's sums of 32 values: the 32 / kWidth vectors added in order, then the lanes
inline std::vector<float> sums32(const float* x, int64_t M, int64_t K) {
  std::vector<float> out(M * K / 32);
  for (size_t i = 0; i < out.size(); ++i) {
    V s = Isa::load(x + 32 * i);
    for (int v = 1; v < 32 / kWidth; ++v) s = Isa::add(s, Isa::load(x + 32 * i + kWidth * v));
    out[i] = Isa::sum(s);
  }
  return out;
}

// NM rows of x (row stride K; xsums theirs, stride K / 32) against one weight row unpacked in
// registers; its own function for each NM (inlined into `grouped_rows` it was slower: history, 'Measurements that were in code comments')
template <class Q, int NM>
__attribute__((noinline)) void dot_rows_grouped(const float* x, const float* xsums, int64_t K, const uint8_t* w,
                                                float* y, int64_t N) {
  static_assert(Q::kValues == 256 && Isa::kWidth == 8, "8 sub-blocks of 32, 4 vectors each");
  V acc[NM][2];  // even and odd sub-blocks
  for (int m = 0; m < NM; ++m) acc[m][0] = acc[m][1] = Isa::zero();
  for (int64_t blk = 0; blk < K / 256; ++blk) {
    const uint8_t* b = w + blk * Q::kBytes;
    const float* xb = x + 256 * blk;
    float ds[8];
    const V dm = Q::scales(b, ds);
    for (int m = 0; m < NM; ++m) acc[m][0] = Isa::fnma(dm, Isa::load(xsums + m * (K / 32) + 8 * blk), acc[m][0]);
    for (int s = 0; s < 8; s += 2) {
      V t[NM][2], low, high;
      Q::codes(b, s, 0, low, high);
      for (int m = 0; m < NM; ++m) {
        t[m][0] = Isa::mul(low, Isa::load(xb + m * K + 32 * s));
        t[m][1] = Isa::mul(high, Isa::load(xb + m * K + 32 * s + 32));
      }
      for (int v = 1; v < 4; ++v) {
        Q::codes(b, s, v, low, high);
        for (int m = 0; m < NM; ++m) {
          const float* xv = xb + m * K + 32 * s + 8 * v;
          t[m][0] = Isa::fma(low, Isa::load(xv), t[m][0]);
          t[m][1] = Isa::fma(high, Isa::load(xv + 32), t[m][1]);
        }
      }
      for (int m = 0; m < NM; ++m) {
        acc[m][0] = Isa::fma(Isa::set1(ds[s]), t[m][0], acc[m][0]);
        acc[m][1] = Isa::fma(Isa::set1(ds[s + 1]), t[m][1], acc[m][1]);
      }
    }
  }
  for (int m = 0; m < NM; ++m) y[m * N] = Isa::sum(Isa::add(acc[m][0], acc[m][1]));
}

template <class Q, int R>
inline void grouped_in_registers(const float* x, const float* xsums, int64_t M, int64_t K, const uint8_t* w, float* y,
                                 int64_t N) {
  if constexpr (R > 1) {
    if (M < R) return grouped_in_registers<Q, R - 1>(x, xsums, M, K, w, y, N);
  }
  dot_rows_grouped<Q, R>(x, xsums, K, w, y, N);
}

// `rows` for a grouped type: weight rows in groups of 16, each unpacked in registers once per chunk
// of at most kRegisterRows x rows, at every M (against the float weights' path: faster at a few
// rows, a little slower at many; a buffer of unpacked codes read back 3 rows at a time was slower
// still: history, 'Measurements that were in code comments')
template <class Q>
void grouped_rows(const float* x, const float* xsums, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                  float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int R = Isa::kRegisterRows;
  constexpr int64_t kGroup = 16;
  const int64_t chunks = (M + R - 1) / R;
  for (int64_t g = n0; g < n1; g += kGroup) {
    const int64_t g1 = std::min(g + kGroup, n1);
    for (int64_t c = 0, m = 0; c < chunks; ++c) {
      const int64_t size = (M - m) / (chunks - c);
      for (int64_t n = g; n < g1; ++n)
        grouped_in_registers<Q, R>(x + m * K, xsums + m * (K / 32), size, K, w + n * row_bytes, y + m * N + n, N);
      m += size;
    }
  }
}

// All M rows of x against weight rows [n0, n1), in chunks of at most kRegisterRows x rows (as
// even as possible). Up to kUnpackOnceAbove rows, each weight row is unpacked in registers once per
// chunk and each weight vector serves the chunk's rows; weight rows go in groups of 16, chunk
// after chunk, so their blocks stay in L1 (faster on AVX-512 than unpacking each weight row once
// to a buffer and passing 6 rows at a time over it). Above kUnpackOnceAbove rows (AVX2: 6), that:
// each weight row unpacked once into a buffer, then chunk after chunk, 3 weight rows at a time
// (`tile_unpacked`, faster there than one weight row at a time). History, 'measurements that were in code comments'.
//
// At most 7 rows a chunk where 8 were slower than two chunks of 4 (AVX-512, Zen 4): Q4_K, whose
// 8-row loop spills, and every type at K > 1024, where 8 rows of x (32 KB at K = 1024) leave Zen 4's
// 32 KB L1. A chunk's size
// changes no output bit: each row's accumulators take the same operations in any chunk.
template <class Q>
void rows(const float* x, const float* xsums, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y,
          int64_t N, int64_t n0, int64_t n1) {
  if constexpr (GroupedScales<Q>::value) return grouped_rows<Q>(x, xsums, M, K, w, row_bytes, y, N, n0, n1);
  constexpr int R = Isa::kRegisterRows;
  constexpr int64_t kGroup = 16;
  const int64_t most = std::min<int64_t>(R, std::is_same_v<Q, Q4_K> || K > 1024 ? 7 : 8);
  const int64_t chunks = (M + most - 1) / most;
  if (M > Isa::kUnpackOnceAbove) {
    constexpr int64_t NN = Isa::kUnpackedWeightRows;  // weight rows unpacked at a time
    std::vector<float> unpacked(NN * K);
    for (int64_t n = n0; n < n1; n += NN) {
      const int64_t n_rows = std::min(NN, n1 - n);
      for (int64_t j = 0; j < n_rows; ++j) dequantize_row<Q>(w + (n + j) * row_bytes, K, unpacked.data() + j * K);
      for (int64_t c = 0, m = 0; c < chunks; ++c) {
        const int64_t size = (M - m) / (chunks - c);
        unpacked_tile<NN, R>(x + m * K, size, n_rows, K, unpacked.data(), y + m * N + n, N);
        m += size;
      }
    }
    return;
  }
  for (int64_t g = n0; g < n1; g += kGroup) {
    const int64_t g1 = std::min(g + kGroup, n1);
    for (int64_t c = 0, m = 0; c < chunks; ++c) {
      const int64_t size = (M - m) / (chunks - c);
      for (int64_t n = g; n < g1; ++n) in_registers<Q, R>(x + m * K, size, K, w + n * row_bytes, y + m * N + n, N);
      m += size;
    }
  }
}

// rows [n0, n1) of w dequantized into out (float32), or into out16 (bf16, rounded as torch rounds
// them) through one row of float32 in L1
template <class Q>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t K, float* out, uint16_t* out16, int64_t n0, int64_t n1) {
  std::vector<float> row(out16 ? K : 0);
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_row<Q>(w + n * row_bytes, K, out16 ? row.data() : out + n * K);
    if (out16) to_bf16(row.data(), K, out16 + n * K);
  }
}

template <class Body>
void dispatch(int64_t qtype, Body&& body) {
  switch (qtype) {
    case 2: return body(Q4_0{});
    case 3: return body(Q4_1{});
    case 6: return body(Q5_0{});
    case 8: return body(Q8_0{});
    case 11: return body(Q3_K{});
    case 12: return body(Q4_K{});
    case 13: return body(Q5_K{});
    case 14: return body(Q6_K{});
    default: TORCH_CHECK(false, "quant_cpu: ggml type ", qtype, " is not supported");
  }
}

void quant_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N,
                  int64_t qtype) {
  dispatch(qtype, [&](auto q) {
    using Q = decltype(q);
    const std::vector<float> xsums = GroupedScales<Q>::value ? sums32(x, M, K) : std::vector<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { rows<Q>(x, xsums.data(), M, K, w, row_bytes, y, N, n0, n1); });
  });
}

void dequantize(const uint8_t* w, int64_t N, int64_t row_bytes, int64_t K, float* out, uint16_t* out16, int64_t qtype) {
  dispatch(qtype, [&](auto q) {
    using Q = decltype(q);
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { dequantize_rows<Q>(w, row_bytes, K, out, out16, n0, n1); });
  });
}

#else  // BOOKCHAT_QUICK_GENERIC: the quick loops, compiled once per instruction set (avx2q, avx512q)

// NM activation rows (from row m0) against one weight row: y[m * N] for m < NM.
template <class Q, int NM>
inline void quick_dot_rows(const QuickAct& a, int64_t m0, const uint8_t* w, float* y, int64_t N) {
  VF acc[NM];
  __m256 off[NM];
  for (int m = 0; m < NM; ++m) {
    acc[m] = QIsa::zero();
    off[m] = _mm256_setzero_ps();
  }
  const int64_t K = a.K;
  for (int64_t blk = 0; blk < K / Q::kValues; ++blk) {
    const typename Q::Block block(w + blk * Q::kBytes);
    if constexpr (Q::kRowScaled) {  // each row's dx folded into the block's scales once
      VF rows[NM];
      for (int m = 0; m < NM; ++m) rows[m] = block.row_scale(a.dx + (m0 + m) * (K / 32) + blk * (Q::kValues / 32));
      for (int c = 0; c < Q::kChunks; ++c) {
        const VI q = block.codes(c);
        const int64_t k = blk * Q::kValues + c * QIsa::kChunk;
        for (int m = 0; m < NM; ++m) {
          const int32_t* init = Q::kInitOffset == 0 ? nullptr : a.init + (m0 + m) * (K / 4) + k / 4;
          acc[m] = QIsa::fma(QIsa::template dot<Q::kSigned>(q, a.q + (m0 + m) * K + k, init), Q::Block::scale_of(rows[m], c),
                             acc[m]);
        }
      }
    } else {
      for (int c = 0; c < Q::kChunks; ++c) {
        const VI q = block.codes(c);
        const VF s = block.scale(c);
        const int64_t k = blk * Q::kValues + c * QIsa::kChunk;
        for (int m = 0; m < NM; ++m) {
          const VF sx = QIsa::mul(s, QIsa::loadf(a.dxl + (m0 + m) * (K / 4) + k / 4));
          const int32_t* init = Q::kInitOffset == 0 ? nullptr : a.init + (m0 + m) * (K / 4) + k / 4;
          acc[m] = QIsa::fma(QIsa::template dot<Q::kSigned>(q, a.q + (m0 + m) * K + k, init), sx, acc[m]);
        }
      }
    }
    for (int i = 0; i < Q::kOffVecs; ++i)
      for (int m = 0; m < NM; ++m) {
        off[m] = _mm256_fmadd_ps(block.ov[i], _mm256_loadu_ps(Q::off_x(a, m0 + m, blk, i)), off[m]);
      }
  }
  for (int m = 0; m < NM; ++m) y[m * N] = QIsa::reduce(acc[m]) + avx2q::QIsa::reduce(off[m]);
}

template <class Q, int R>
inline void quick_in_registers(const QuickAct& a, int64_t m0, int64_t M, const uint8_t* w, float* y, int64_t N) {
  if constexpr (R > 1) {
    if (M < R) return quick_in_registers<Q, R - 1>(a, m0, M, w, y, N);
  }
  quick_dot_rows<Q, R>(a, m0, w, y, N);
}

template <class Body>
bool quick_dispatch(int64_t qtype, Body&& body) {
  switch (qtype) {
    case 2: body(Q4_0{}); return true;
    case 6: body(Q5_0{}); return true;
    case 8: body(Q8_0{}); return true;
    case 12: body(Q4_K{}); return true;
    case 14: body(Q6_K{}); return true;
    default: return false;
  }
}

bool quick_q4k_order(int64_t qtype) {
  bool order = false;
  quick_dispatch(qtype, [&](auto q) { order = decltype(q)::kQ4KOrder; });
  return order;
}

int quick_init_offset(int64_t qtype) {
  int offset = 0;
  quick_dispatch(qtype, [&](auto q) { offset = decltype(q)::kInitOffset; });
  return offset;
}

bool quick_supports(int64_t qtype, int64_t K) {
  bool ok = false;
  quick_dispatch(qtype, [&](auto q) { ok = K % decltype(q)::kValues == 0 && K % 64 == 0; });
  return ok;
}

// Weight rows in groups of 16, each against all M rows in chunks of at most QIsa::kRows, as the
// exact kernel goes: a group's blocks stay in L1 across chunks.
void quick_linear(const QuickAct& a, int64_t M, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t qtype) {
  quick_dispatch(qtype, [&](auto q) {
    using Q = decltype(q);
    constexpr int R = QIsa::kRows;
    const int64_t chunks = (M + R - 1) / R;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t g = n0; g < n1; g += 16) {
        const int64_t g1 = std::min(g + 16, n1);
        for (int64_t c = 0, m = 0; c < chunks; ++c) {
          const int64_t size = (M - m) / (chunks - c);
          for (int64_t n = g; n < g1; ++n) quick_in_registers<Q, R>(a, m, size, w + n * row_bytes, y + m * N + n, N);
          m += size;
        }
      }
    });
  });
}

#endif  // BOOKCHAT_QUANT_GENERIC / BOOKCHAT_QUICK_GENERIC
