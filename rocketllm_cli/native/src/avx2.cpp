// The AVX2 + FMA + F16C variant: 8-lane fp32 FMAs for exact mode, maddubs / madd int8 dot products.
#include "kernels.h"

#if defined(__x86_64__) && !defined(RL_SCALAR_ONLY)
#include <immintrin.h>

#include <type_traits>

namespace rl {
namespace avx2 {

#define RL_TARGET __attribute__((target("avx2,fma,f16c")))
#include "x86_codes.h"

using F = __m256;
constexpr int FW = 8, MT = 2;  // 2 rows of x per tile: 2 × 4 accumulators + 4 weights fit in 16 registers

RL_INLINE F fzero() { return _mm256_setzero_ps(); }
RL_INLINE F fset(float v) { return _mm256_set1_ps(v); }
RL_INLINE F fload(const float* p) { return _mm256_loadu_ps(p); }
RL_INLINE F fadd(F a, F b) { return _mm256_add_ps(a, b); }
RL_INLINE F ffma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
RL_INLINE float fsum(F v) { return hsum256(v); }
RL_INLINE void fstore(float* p, F v) { _mm256_storeu_ps(p, v); }

template <bool SIGNED> RL_INLINE void to_float(__m256i codes, F* out) {
  const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i eight = i & 1 ? _mm_srli_si128(halves[i >> 1], 8) : halves[i >> 1];
    out[i] = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight));
  }
}

template <class T> RL_INLINE void codes_as_floats(const uint8_t* blk, int c, F* out) {
  to_float<T::SIGNED>(codes32<T>(blk, c), out);
}
// Q4_0 / Q4_1: each 8 bytes of qs zero-extended from memory to 8 lanes give elements 0..7 (8..15) as their low
// nibbles and 16..23 (24..31) as their high ones: two conversions and four bit operations where the byte codes'
// split into quarters took five shuffles.
template <int QS> RL_INLINE void nibble_floats(const uint8_t* blk, F* out) {
  const __m256i low = _mm256_set1_epi32(15);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + QS)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + QS + 8)));
  out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low));
  out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
  out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
template <> RL_INLINE void codes_as_floats<Q4_0>(const uint8_t* blk, int, F* out) { nibble_floats<2>(blk, out); }
template <> RL_INLINE void codes_as_floats<Q4_1>(const uint8_t* blk, int, F* out) { nibble_floats<4>(blk, out); }
// Q5_0 / Q5_1: the nibbles as Q4_0's, and bit 4 of element i (bit i of qh) moved into place by a variable shift of
// qh broadcast: lanes 8g .. 8g + 7 take bits 8g .. 8g + 7. No byte shuffles beyond the two conversions from memory,
// where building the 32 byte codes and widening them took ten.
template <int QS, int QH> RL_INLINE void five_bit_floats(const uint8_t* blk, F* out) {
  const __m256i low = _mm256_set1_epi32(15), bit4 = _mm256_set1_epi32(16);
  const uint32_t qh = u32_at(blk + QH);
  const __m256i h4 = _mm256_set1_epi32(int(qh << 4)), h = _mm256_set1_epi32(int(qh));  // bit i at i + 4, at i
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + QS)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + QS + 8)));
  const __m256i nibble[4] = {_mm256_and_si256(a, low), _mm256_and_si256(b, low), _mm256_srli_epi32(a, 4),
                             _mm256_srli_epi32(b, 4)};
  const __m256i high[4] = {_mm256_srlv_epi32(h4, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                           _mm256_srlv_epi32(h4, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)),
                           _mm256_srlv_epi32(h4, _mm256_setr_epi32(16, 17, 18, 19, 20, 21, 22, 23)),
                           _mm256_srlv_epi32(h, _mm256_setr_epi32(20, 21, 22, 23, 24, 25, 26, 27))};
  for (int i = 0; i < 4; ++i) out[i] = _mm256_cvtepi32_ps(_mm256_or_si256(nibble[i], _mm256_and_si256(high[i], bit4)));
}
// Q4_K: chunk c is the low (c even) or high nibbles of the 32 bytes at 16 + 32 · (c / 2), widened from memory
template <> RL_INLINE void codes_as_floats<Q4_K>(const uint8_t* blk, int c, F* out) {
  const uint8_t* p = blk + 16 + 32 * (c >> 1);
  for (int i = 0; i < 4; ++i) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
    out[i] = _mm256_cvtepi32_ps(c & 1 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15)));
  }
}
// Q5_K: Q4_K's nibbles at 48 + 32 · (c / 2), and bit c of qh[i] as bit 4, both widened from memory
template <> RL_INLINE void codes_as_floats<Q5_K>(const uint8_t* blk, int c, F* out) {
  const uint8_t* p = blk + 48 + 32 * (c >> 1);
  for (int i = 0; i < 4; ++i) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
    const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 16 + 8 * i)));
    const __m256i nibble = c & 1 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
    const __m256i bit = c < 4 ? _mm256_slli_epi32(h, 4 - c) : _mm256_srli_epi32(h, c - 4);
    out[i] = _mm256_cvtepi32_ps(_mm256_or_si256(nibble, _mm256_and_si256(bit, _mm256_set1_epi32(16))));
  }
}
template <> RL_INLINE void codes_as_floats<Q5_0>(const uint8_t* blk, int, F* out) { five_bit_floats<6, 2>(blk, out); }
template <> RL_INLINE void codes_as_floats<Q5_1>(const uint8_t* blk, int, F* out) { five_bit_floats<8, 4>(blk, out); }

RL_INLINE void signed_floats(const uint8_t* p, F* out) {  // 32 int8 at p -> fp32, 8 at a time from memory
  for (int i = 0; i < 4; ++i)
    out[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
}

RL_INLINE void scale_floats(__m256i s, float mult, float* out) {
  const __m256 m = _mm256_set1_ps(mult);
  _mm256_store_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s))), m));
  _mm256_store_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1))), m));
}

#include "x86_kernels.h"

// int8, K-quants: per block and row of x, 8 int32 lanes of Σ sc_g · code_i · q_i over the block (exact; a signed
// type's int8 weight itself for code), then one FMA by d · dx; the mins' dmin · Σ mn_g · bs_g, or an offset type's
// OFF · d · Σ sc_g · bs_g (w = sc · (code − OFF)), go to accumulators of their own from the group sums bs the
// quantizer keeps: one madd a block where subtracting OFF · q took two operations per 32 codes and row.

// int16 sums of byte pairs w·q (maddubs takes unsigned × signed bytes): unsigned codes as they are (a type's OFF is
// summed apart, int8_tile; no saturation: codes ≤ 63, |q| ≤ 127); signed weights as |w| · (q with w's sign)
template <class T> RL_INLINE __m256i pair_products(__m256i codes, __m256i q) {
  if constexpr (T::SIGNED) return _mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(q, codes));
  return _mm256_maddubs_epi16(codes, q);
}
RL_INLINE __m256i scale_pair(__m256i sc, int c) {  // int16: sc[2c] in the low 16 bytes, sc[2c + 1] in the high
  const __m256i pick = _mm256_set_epi64x(0x0302030203020302, 0x0302030203020302, 0x0100010001000100,
                                         0x0100010001000100);
  return _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc, _mm256_set1_epi32(c)), pick);
}

template <class T, int M>
RL_TARGET void int8_tile(const Job& j, int64_t n, int64_t m0) {
  static_assert(T::SCALED, "the 32-element types take int8_tile32");
  const uint8_t* row = j.w + n * j.row_bytes;
  const int64_t nb = j.k / T::QK;
  const int8_t* q = j.q8.q + m0 * j.k;
  __m256 acc[M], mins[M];
  for (int t = 0; t < M; ++t) { acc[t] = _mm256_setzero_ps(); mins[t] = _mm256_setzero_ps(); }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * T::BYTES;
    stream_ahead(blk, T::BYTES);
    const Scales<T> s = scales_of<T>(blk);
    __m256i isum[M];
    for (int t = 0; t < M; ++t) isum[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < T::QK / 32; ++c) {
      const __m256i codes = codes32<T>(blk, c);
      const __m256i scale = scale_pair(s.sc, c);
      for (int t = 0; t < M; ++t) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * j.k + b * T::QK + 32 * c));
        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(pair_products<T>(codes, x), scale));
      }
    }
    for (int t = 0; t < M; ++t) {
      const int64_t row_m = m0 + t;
      const float dx = j.q8.d[row_m * nb + b];
      if (T::MIN || T::OFF) {  // dmin · Σ mn_g · bs_g, or (Q3_K, Q6_K) OFF · d · Σ sc_g · bs_g
        const int16_t* bs = j.q8.bs + row_m * (j.k / 16) + b * (T::QK / 16);
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs));  // 16 group sums
        const __m256i by = T::MIN ? s.mn : s.sc;
        const float factor = T::MIN ? s.dmin * dx : float(T::OFF) * s.d * dx;
        mins[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums, by)), _mm256_set1_ps(factor), mins[t]);
      }
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(s.d * dx), acc[t]);
    }
  }
  for (int t = 0; t < M; ++t) j.y[(m0 + t) * j.n + n] = hsum256(_mm256_sub_ps(acc[t], mins[t]));
}

// 32-element types, as avx512.cpp's int8_tile32 one block at a time: y = Σ_b d_b · dx_b · Σ code · q +
// off_b · dx_b · Σq_b, the block's [d, m] (or [d, d]) converted at once and multiplied by the row's [dx, dx · Σq];
// consecutive blocks take two sets of accumulators.
template <class T, int M, int SET>
RL_INLINE void int8_block32(const Job& j, const uint8_t* blk, int64_t b, int64_t m0, __m256 (*acc)[2],
                            __m128 (*mins)[2]) {
  const __m256i codes = codes32<T>(blk, 0), ones = _mm256_set1_epi16(1);
  const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(int(scale_bits<T>(blk))));  // [d, m or d, 0, 0]
  for (int t = 0; t < M; ++t) {
    const int64_t r = m0 + t;
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(j.q8.q + r * j.k + b * 32));
    const __m256i p = T::SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(x, codes))
                                : _mm256_maddubs_epi16(codes, x);
    const double* ds = reinterpret_cast<const double*>(j.q8.ds + r * (2 * j.k / 32) + 2 * b);
    const __m128 both = _mm_mul_ps(scales, _mm_castpd_ps(_mm_load_sd(ds)));  // [d · dx, m · dx · Σq]
    acc[t][SET] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_broadcastss_ps(both),
                                  acc[t][SET]);
    if constexpr (T::MIN || T::OFF) mins[t][SET] = _mm_add_ps(mins[t][SET], both);
  }
}

template <class T, int M>
RL_TARGET void int8_tile32(const Job& j, int64_t n, int64_t m0) {
  const uint8_t* row = j.w + n * j.row_bytes;
  const int64_t nb = j.k / 32;
  __m256 acc[M][2];
  __m128 mins[M][2];  // lane 1: Σ m · dx · Σq (Q4_1, Q5_1), or Σ d · dx · Σq (Q4_0, Q5_0); lane 3 stays 0
  for (int t = 0; t < M; ++t) {
    acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    mins[t][0] = mins[t][1] = _mm_setzero_ps();
  }
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    stream_ahead(row + b * T::BYTES, 2 * T::BYTES);
    int8_block32<T, M, 0>(j, row + b * T::BYTES, b, m0, acc, mins);
    int8_block32<T, M, 1>(j, row + (b + 1) * T::BYTES, b + 1, m0, acc, mins);
  }
  if (b < nb) {
    stream_ahead(row + b * T::BYTES, T::BYTES);
    int8_block32<T, M, 0>(j, row + b * T::BYTES, b, m0, acc, mins);
  }
  for (int t = 0; t < M; ++t) {
    const float y = hsum256(_mm256_add_ps(acc[t][0], acc[t][1]));
    j.y[(m0 + t) * j.n + n] = T::MIN || T::OFF ? y + offset_part<T>(mins[t][0], mins[t][1]) : y;
  }
}

template <class T> RL_TARGET void int8_rows(const Job& j, int64_t n0, int64_t n1) {
  if constexpr (T::QK == 32) for_each_tile<MT>(j, n0, n1, int8_tile32<T, MT>, int8_tile32<T, 1>);
  else for_each_tile<MT>(j, n0, n1, int8_tile<T, MT>, int8_tile<T, 1>);
}

// scalar.cpp's quantize_row, 32 values at a time (the same operations, so the same codes)
RL_TARGET void quantize_row(const float* x, int64_t k, int qx, int8_t* q, float* d, int16_t* bs) {
  for (int64_t b = 0; b < k / qx; ++b) {
    const float* xb = x + b * qx;
    bool finite;
    float inv;
    const float amax = abs_max(xb, qx, &finite);  // before `finite` is read
    d[b] = q8_scale(amax, finite, &inv);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int i = 0; i < qx; i += 32) {
      __m256i v[4];
      for (int r = 0; r < 4; ++r) v[r] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * r), vinv));
      if (!finite)
        for (int r = 0; r < 4; ++r) v[r] = _mm256_setzero_si256();  // inf · 0 is NaN, not 0
      const __m256i sum01 = _mm256_add_epi32(v[0], v[1]), sum23 = _mm256_add_epi32(v[2], v[3]);
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * qx + i), ordered);
      const int64_t g = (b * qx + i) / 16;
      bs[g] = int16_t(hsum256(_mm256_cvtepi32_ps(sum01)));  // |sum| <= 16 · 127: exact in fp32
      bs[g + 1] = int16_t(hsum256(_mm256_cvtepi32_ps(sum23)));
    }
  }
}

#define RL_ATTEND_TARGET RL_TARGET
#include "attend.h"

}  // namespace avx2

const Variant* avx2_variant() {
  static const Variant v = [] {
    Variant t{};
#define RL_FILL(name, id) t.rows[EXACT][T_##name] = avx2::exact_rows<name>; \
    t.rows[INT8][T_##name] = avx2::int8_rows<name>; \
    t.dequant[T_##name] = avx2::dequant_rows<name>;
    RL_FOR_EACH_TYPE(RL_FILL)
#undef RL_FILL
    t.quantize = avx2::quantize_row;
    t.attend = avx2::attend_items;
    if (&avx2_int16_fill != nullptr) avx2_int16_fill(t);  // null where its file is not built
    return t;
  }();
  return &v;
}

}  // namespace rl

#else
namespace rl {
const Variant* avx2_variant() { return nullptr; }
}  // namespace rl
#endif
