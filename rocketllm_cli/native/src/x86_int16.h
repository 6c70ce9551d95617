// The x86 int16 kernels, written once with 256-bit vectors, and the translation unit that holds them: avx2_int16.cpp
// and avx512_int16.cpp define RL_INT16_NS (the variant's namespace), RL_INT16_TARGET (its target attribute),
// RL_INT16_MT (rows of x per tile, as its other kernels take them), RL_INT16_MASKS (1 where the target has AVX-512 BW
// and VL: lane masks), RL_INT16_VNNI (1 where it has AVX-512 VNNI) and RL_INT16_FILL (the weak fill function of
// kernels.h), then include this. A file of their own per variant, so that a first run compiles them beside the exact
// and int8 kernels rather than after them.
#pragma once
#include "kernels.h"

#if defined(__x86_64__) && !defined(RL_SCALAR_ONLY)
#include <immintrin.h>

#include <type_traits>

namespace rl {
namespace RL_INT16_NS {

#define RL_TARGET __attribute__((target(RL_INT16_TARGET)))
#include "x86_codes.h"

constexpr int MT = RL_INT16_MT;

// int16: x's codes per 32 elements (kernels.h's Q16Rows) against each chunk's 32 weight codes widened to int16 less
// their offset; madd gives 8 int32 lanes of Σ (code − OFF) · q per 16 elements, exactly, and one FMA by the
// group's a_g · dx turns them to fp32. A min's part, dmin · Σ mn_g · xs_g (m · Σ x for Q4_1 / Q5_1), takes x's own
// fp32 sums: the one rounding left is x's to 16 bits (|x − q · dx| ≤ dx / 2 = max|x| / 65534), ~250x under int8's.
// Written with 256-bit vectors alone, so that both x86 variants run the same code: 512-bit products (one madd per row
// and chunk, its two halves joined first) measured slower on a 2-core Xeon, Q4_0 6.7 GB/s against 10.2.

template <class T> RL_INLINE void codes16(const uint8_t* blk, int c, __m256i& lo, __m256i& hi) {
  const __m256i codes = codes32<T>(blk, c);
  const __m128i a = _mm256_castsi256_si128(codes), b = _mm256_extracti128_si256(codes, 1);
  if constexpr (T::SIGNED) {
    lo = _mm256_cvtepi8_epi16(a);
    hi = _mm256_cvtepi8_epi16(b);
  } else {
    lo = _mm256_cvtepu8_epi16(a);
    hi = _mm256_cvtepu8_epi16(b);
    if constexpr (T::OFF != 0) {
      lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(T::OFF));
      hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(T::OFF));
    }
  }
}
// Q4_0 / Q4_1 / IQ4_NL: the 16 bytes of qs widened from memory hold elements 0..15 in their low nibbles and
// 16..31 in their high ones: one conversion and two bit operations for the 32 codes
template <int QS, bool IQ4> RL_INLINE void nibble_codes16(const uint8_t* blk, __m256i& lo, __m256i& hi) {
  if constexpr (IQ4) {  // the codebook's int8 values, looked up per byte before widening
    const __m128i q = load16(blk + QS), low = _mm_set1_epi8(15);
    const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES));
    lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(q, low)));
    hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low)));
  } else {
    const __m256i w = _mm256_cvtepu8_epi16(load16(blk + QS));
    lo = _mm256_and_si256(w, _mm256_set1_epi16(15));
    hi = _mm256_srli_epi16(w, 4);
  }
}
template <> RL_INLINE void codes16<Q4_0>(const uint8_t* blk, int, __m256i& lo, __m256i& hi) {
  nibble_codes16<2, false>(blk, lo, hi);
  lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(8));
  hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(8));
}
template <> RL_INLINE void codes16<Q4_1>(const uint8_t* blk, int, __m256i& lo, __m256i& hi) {
  nibble_codes16<4, false>(blk, lo, hi);
}
template <> RL_INLINE void codes16<IQ4_NL>(const uint8_t* blk, int, __m256i& lo, __m256i& hi) {
  nibble_codes16<2, true>(blk, lo, hi);
}
template <> RL_INLINE void codes16<IQ4_XS>(const uint8_t* blk, int c, __m256i& lo, __m256i& hi) {
  nibble_codes16<8, true>(blk + 16 * c, lo, hi);
}
// Q5_0 / Q5_1: Q4_0's nibbles, and bit 4 of element i from bit i of qh, tested per 16-bit lane; with AVX-512 BW and
// VL each half of qh is the lane mask of one masked add (Q5_1: + 16 where the bit is set) or subtract (Q5_0: − 16
// where it is clear, so the offset comes with it), where AVX2 spends a broadcast, a test, a select and an add or
// subtract per half
template <int QS, int QH, int OFF> RL_INLINE void five_bit_codes16(const uint8_t* blk, __m256i& lo, __m256i& hi) {
  nibble_codes16<QS, false>(blk, lo, hi);
  const uint32_t qh = u32_at(blk + QH);
#if RL_INT16_MASKS
  static_assert(OFF == 0 || OFF == 16, "a set bit 4 adds 16; Q5_0's offset is that 16");
  const __m256i sixteen = _mm256_set1_epi16(16);
  const __mmask16 k0 = __mmask16(qh & 0xFFFF), k1 = __mmask16(qh >> 16);
  if constexpr (OFF != 0) {
    lo = _mm256_mask_sub_epi16(lo, __mmask16(~k0), lo, sixteen);
    hi = _mm256_mask_sub_epi16(hi, __mmask16(~k1), hi, sixteen);
  } else {
    lo = _mm256_mask_add_epi16(lo, k0, lo, sixteen);
    hi = _mm256_mask_add_epi16(hi, k1, hi, sixteen);
  }
#else
  const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                        int16_t(0x8000));
  const __m256i h0 = _mm256_set1_epi16(int16_t(qh & 0xFFFF)), h1 = _mm256_set1_epi16(int16_t(qh >> 16));
  const __m256i sixteen = _mm256_set1_epi16(16);
  lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h0, bit), bit), sixteen));
  hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h1, bit), bit), sixteen));
  if constexpr (OFF != 0) {
    lo = _mm256_sub_epi16(lo, sixteen);
    hi = _mm256_sub_epi16(hi, sixteen);
  }
#endif
}
template <> RL_INLINE void codes16<Q5_0>(const uint8_t* blk, int, __m256i& lo, __m256i& hi) {
  five_bit_codes16<6, 2, 16>(blk, lo, hi);
}
template <> RL_INLINE void codes16<Q5_1>(const uint8_t* blk, int, __m256i& lo, __m256i& hi) {
  five_bit_codes16<8, 4, 0>(blk, lo, hi);
}
template <> RL_INLINE void codes16<Q8_0>(const uint8_t* blk, int, __m256i& lo, __m256i& hi) {
  lo = _mm256_cvtepi8_epi16(load16(blk + 2));  // signed bytes widened from memory
  hi = _mm256_cvtepi8_epi16(load16(blk + 18));
}
// Q4_K: chunk c is the low (c even) or high nibbles of the 32 bytes at 16 + 32 · (c / 2), each half widened
template <> RL_INLINE void codes16<Q4_K>(const uint8_t* blk, int c, __m256i& lo, __m256i& hi) {
  const uint8_t* p = blk + 16 + 32 * (c >> 1);
  const __m256i a = _mm256_cvtepu8_epi16(load16(p)), b = _mm256_cvtepu8_epi16(load16(p + 16));
  if (c & 1) {
    lo = _mm256_srli_epi16(a, 4);
    hi = _mm256_srli_epi16(b, 4);
  } else {
    lo = _mm256_and_si256(a, _mm256_set1_epi16(15));
    hi = _mm256_and_si256(b, _mm256_set1_epi16(15));
  }
}
// Q5_K: Q4_K's nibbles at 48 + 32 · (c / 2), and bit c of qh[i] (bytes 16..47) as bit 4
template <> RL_INLINE void codes16<Q5_K>(const uint8_t* blk, int c, __m256i& lo, __m256i& hi) {
  const uint8_t* p = blk + 48 + 32 * (c >> 1);
  const __m256i a = _mm256_cvtepu8_epi16(load16(p)), b = _mm256_cvtepu8_epi16(load16(p + 16));
  const __m256i ha = _mm256_cvtepu8_epi16(load16(blk + 16)), hb = _mm256_cvtepu8_epi16(load16(blk + 32));
  const __m256i low = _mm256_set1_epi16(15), bit4 = _mm256_set1_epi16(16);
  lo = c & 1 ? _mm256_srli_epi16(a, 4) : _mm256_and_si256(a, low);
  hi = c & 1 ? _mm256_srli_epi16(b, 4) : _mm256_and_si256(b, low);
  const __m256i sa = c < 4 ? _mm256_slli_epi16(ha, 4 - c) : _mm256_srli_epi16(ha, c - 4);
  const __m256i sb = c < 4 ? _mm256_slli_epi16(hb, 4 - c) : _mm256_srli_epi16(hb, c - 4);
  lo = _mm256_or_si256(lo, _mm256_and_si256(sa, bit4));
  hi = _mm256_or_si256(hi, _mm256_and_si256(sb, bit4));
}

// Σ code · q over 32 elements, 8 int32 lanes. With VNNI the second madd and the add are one vpdpwssd (the same exact
// integer sums): 5-25% more GB/s per type on a 2-core Xeon, single thread, weights in L2.
RL_INLINE __m256i dot16(__m256i lo, __m256i hi, const int16_t* q) {
  const __m256i p = _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m256i q_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16));
#if RL_INT16_VNNI
  return _mm256_dpwssd_epi32(p, hi, q_hi);
#else
  return _mm256_add_epi32(p, _mm256_madd_epi16(hi, q_hi));
#endif
}

// 32-element types: y = Σ_b d_b · dx_b · Σ (code − OFF) · q  +  Σ_b m_b · Σ x_b; consecutive blocks take two sets of
// accumulators. The min's part (Q4_1, Q5_1) eight blocks at a time: their m gathered and converted, times x's block
// sums, one FMA of 8 lanes. A scalar sum per block was a chain of dependent adds beside the dot products: 3-17% of
// Q4_1's and Q5_1's rate on a 2-core Xeon. (d the same way measured 2-9% slower for the other types: d stays
// per block.)
template <class T> RL_INLINE __m256 mins8(const uint8_t* row, int64_t b) {  // 8 blocks' m (bytes 2..3), as fp32
  const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(T::BYTES));
  const int* heads = reinterpret_cast<const int*>(row + b * T::BYTES);
  const __m256i m = _mm256_srli_epi32(_mm256_i32gather_epi32(heads, at, 1), 16);
  const __m256i packed = _mm256_packus_epi32(m, _mm256_setzero_si256());  // per 128-bit lane: 4 halves, 4 zeros
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}
RL_INLINE __m256 pair_sums(const float* xs) {  // xs[2i] + xs[2i + 1] for i < 8, in order
  const __m256 h = _mm256_hadd_ps(_mm256_loadu_ps(xs), _mm256_loadu_ps(xs + 8));  // per 128-bit lane: a01 a23 b01 b23
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
}

template <class T, int M, int SET>
RL_INLINE void int16_block32(const Job& j, const uint8_t* blk, int64_t b, int64_t m0, __m256 (*acc)[2]) {
  __m256i lo, hi;
  codes16<T>(blk, 0, lo, hi);
  const float d = fp16(u16_at(blk + T::D_AT));
  for (int t = 0; t < M; ++t) {
    const int64_t r = m0 + t;
    const __m256i p = dot16(lo, hi, j.q16.q + r * j.k + b * 32);
    acc[t][SET] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * j.q16.d[r * (j.k / 32) + b]), acc[t][SET]);
  }
}

template <class T, int M>
RL_TARGET void int16_tile32(const Job& j, int64_t n, int64_t m0) {
  static_assert(!T::MIN || T::DMIN_AT == 2, "mins8 reads m at byte 2");
  const uint8_t* row = j.w + n * j.row_bytes;
  const int64_t nb = j.k / 32;
  __m256 acc[M][2], mins[M];
  for (int t = 0; t < M; ++t) acc[t][0] = acc[t][1] = mins[t] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    if constexpr (T::MIN) {
      const __m256 m = mins8<T>(row, b);
      for (int t = 0; t < M; ++t)
        mins[t] = _mm256_fmadd_ps(m, pair_sums(j.q16.xs + (m0 + t) * (j.k / 16) + 2 * b), mins[t]);
    }
    stream_ahead(row + b * T::BYTES, 8 * T::BYTES);
    for (int i = 0; i < 8; i += 2) {
      int16_block32<T, M, 0>(j, row + (b + i) * T::BYTES, b + i, m0, acc);
      int16_block32<T, M, 1>(j, row + (b + i + 1) * T::BYTES, b + i + 1, m0, acc);
    }
  }
  float tail[M] = {};  // the last nb % 8 blocks' mins
  for (; b < nb; ++b) {
    stream_ahead(row + b * T::BYTES, T::BYTES);
    int16_block32<T, M, 0>(j, row + b * T::BYTES, b, m0, acc);
    if constexpr (T::MIN)
      for (int t = 0; t < M; ++t) {
        const float* xs = j.q16.xs + (m0 + t) * (j.k / 16) + 2 * b;
        tail[t] += fp16(u16_at(row + b * T::BYTES + T::DMIN_AT)) * (xs[0] + xs[1]);
      }
  }
  for (int t = 0; t < M; ++t)
    j.y[(m0 + t) * j.n + n] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), mins[t])) + tail[t];
}

// K-quants: each chunk of 32 gives one FMA by d · sc · dx (a Q4_K, Q5_K or IQ4_XS scale spans the chunk) or, where
// the scale changes every 16 (Q2_K, Q3_K, Q6_K), by d · dx, its codes multiplied by their group's scale in int16
// first (|sc · (code − OFF)| ≤ 128 · 32: 4 such products times |q| ≤ 32767 per int32 lane); consecutive chunks
// alternate between two accumulators
template <class T> constexpr bool SCALE_PER_32 = std::is_same_v<T, Q4_K> || std::is_same_v<T, Q5_K> ||
                                                 std::is_same_v<T, IQ4_XS>;

template <class T, int M>
RL_TARGET void int16_tile(const Job& j, int64_t n, int64_t m0) {
  static_assert(T::SCALED, "the 32-element types take int16_tile32");
  const uint8_t* row = j.w + n * j.row_bytes;
  const int64_t nb = j.k / T::QK;
  __m256 acc[M][2], mins[M];
  for (int t = 0; t < M; ++t) acc[t][0] = acc[t][1] = mins[t] = _mm256_setzero_ps();
  static_assert(T::QK == 256, "eight chunks of 32 a block: one 8-lane vector of their factors");
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * T::BYTES;
    stream_ahead(blk, T::BYTES);
    const Scales<T> s = scales_of<T>(blk);
    alignas(32) int16_t sc[16];
    // Where a scale spans a chunk: each chunk's d · sc_c (sc holds it in both int16 halves of lane c, so an
    // arithmetic shift by 16 takes it out) times each row's dx for the chunk, eight chunks in one multiply, then one
    // lane per chunk: the same two roundings as the scalar d · sc_c, then · dx. A scalar product and a broadcast per
    // chunk and row had been a fifth of Q4_K's instructions: Q4_K +9%, IQ4_XS +12% on an AVX-512 EPYC, 2 threads,
    // the same on its AVX2 variant. Where the scale is d (Q2_K, Q3_K, Q6_K) the vector form measured 3% slower.
    __m256 factor[M];
    if constexpr (SCALE_PER_32<T>) {
      const __m256 scale8 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(s.sc, 16)), _mm256_set1_ps(s.d));
      for (int t = 0; t < M; ++t)
        factor[t] = _mm256_mul_ps(scale8, _mm256_loadu_ps(j.q16.d + (m0 + t) * (j.k / 32) + b * (T::QK / 32)));
    } else {
      _mm256_store_si256(reinterpret_cast<__m256i*>(sc), s.sc);
    }
#pragma GCC unroll 8
    for (int c = 0; c < T::QK / 32; ++c) {
      __m256i lo, hi;
      codes16<T>(blk, c, lo, hi);
      if constexpr (!SCALE_PER_32<T>) {
        lo = _mm256_mullo_epi16(lo, _mm256_set1_epi16(sc[2 * c]));
        hi = _mm256_mullo_epi16(hi, _mm256_set1_epi16(sc[2 * c + 1]));
      }
      for (int t = 0; t < M; ++t) {
        const int16_t* q = j.q16.q + (m0 + t) * j.k + b * T::QK + 32 * c;
        const __m256 f = SCALE_PER_32<T> ? _mm256_permutevar8x32_ps(factor[t], _mm256_set1_epi32(c))
                                         : _mm256_set1_ps(s.d * j.q16.d[(m0 + t) * (j.k / 32) + b * 8 + c]);
        acc[t][c & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(lo, hi, q)), f, acc[t][c & 1]);
      }
    }
    if constexpr (T::MIN) {  // dmin · Σ_g mn_g · xs_g
      const __m256 mn0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s.mn)));
      const __m256 mn1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(s.mn, 1)));
      for (int t = 0; t < M; ++t) {
        const float* xs = j.q16.xs + (m0 + t) * (j.k / 16) + b * 16;
        const __m256 v = _mm256_fmadd_ps(mn0, _mm256_loadu_ps(xs), _mm256_mul_ps(mn1, _mm256_loadu_ps(xs + 8)));
        mins[t] = _mm256_fmadd_ps(v, _mm256_set1_ps(s.dmin), mins[t]);
      }
    }
  }
  for (int t = 0; t < M; ++t)
    j.y[(m0 + t) * j.n + n] = hsum256(_mm256_sub_ps(_mm256_add_ps(acc[t][0], acc[t][1]), mins[t]));
}

template <class T> RL_TARGET void int16_rows(const Job& j, int64_t n0, int64_t n1) {
  if constexpr (T::QK == 32) for_each_tile<MT>(j, n0, n1, int16_tile32<T, MT>, int16_tile32<T, 1>);
  else for_each_tile<MT>(j, n0, n1, int16_tile<T, MT>, int16_tile<T, 1>);
}

// scalar.cpp's quantize16_row, 32 values at a time (the same codes and scales; x's sums in another order)
RL_TARGET void quantize16_row(const float* x, int64_t k, int16_t* q, float* d, float* xs) {
  for (int64_t b = 0; b < k / Q16_BLOCK; ++b) {
    const float* xb = x + b * Q16_BLOCK;
    bool finite;
    float inv;
    const float amax = abs_max(xb, Q16_BLOCK, &finite);  // before `finite` is read
    d[b] = code_scale(amax, finite, Q16_MAX, &inv);
    __m256 v[4];
    for (int r = 0; r < 4; ++r) v[r] = _mm256_loadu_ps(xb + 8 * r);
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i c[4];
    for (int r = 0; r < 4; ++r)
      c[r] = finite ? _mm256_cvtps_epi32(_mm256_mul_ps(v[r], vinv)) : _mm256_setzero_si256();  // inf · 0 is NaN
    for (int h = 0; h < 2; ++h)  // packs works per 128-bit lane: 64-bit quarters 0, 2, 1, 3 put them in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * Q16_BLOCK + 16 * h),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2 * h], c[2 * h + 1]), 0xD8));
    xs[2 * b] = hsum256(_mm256_add_ps(v[0], v[1]));
    xs[2 * b + 1] = hsum256(_mm256_add_ps(v[2], v[3]));
  }
}

}  // namespace RL_INT16_NS

void RL_INT16_FILL(Variant& t) {
#define RL_FILL(name, id) t.rows[INT16][T_##name] = RL_INT16_NS::int16_rows<name>;
  RL_FOR_EACH_TYPE(RL_FILL)
#undef RL_FILL
  t.quantize16 = RL_INT16_NS::quantize16_row;
}

}  // namespace rl
#endif
