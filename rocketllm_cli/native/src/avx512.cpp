// The AVX-512 variant (F, BW, VL and VNNI): 16-lane fp32 FMAs for exact mode, VNNI dot products for int8.
// A CPU with AVX-512 but no VNNI (Skylake-SP) runs the AVX2 variant instead.
#include "kernels.h"

#if defined(__x86_64__) && !defined(RL_SCALAR_ONLY)
#include <immintrin.h>

#include <type_traits>

namespace rl {
namespace avx512 {

#define RL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#include "x86_codes.h"

using F = __m512;
constexpr int FW = 16, MT = 4;  // 4 rows of x per tile (exact: 4 × 2 accumulators; more rows gained nothing)

RL_INLINE F fzero() { return _mm512_setzero_ps(); }
RL_INLINE F fset(float v) { return _mm512_set1_ps(v); }
RL_INLINE F fload(const float* p) { return _mm512_loadu_ps(p); }
RL_INLINE F fadd(F a, F b) { return _mm512_add_ps(a, b); }
RL_INLINE F ffma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
RL_INLINE float fsum(F v) { return _mm512_reduce_add_ps(v); }
RL_INLINE void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }

template <bool SIGNED> RL_INLINE void to_float(__m256i codes, F* out) {
  const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
  for (int i = 0; i < 2; ++i)
    out[i] = _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(halves[i]) : _mm512_cvtepu8_epi32(halves[i]));
}

template <class T> RL_INLINE void codes_as_floats(const uint8_t* blk, int c, F* out) {
  to_float<T::SIGNED>(codes32<T>(blk, c), out);
}

RL_INLINE void signed_floats(const uint8_t* p, F* out) {  // 32 int8 at p -> fp32, each half converted from memory
  for (int i = 0; i < 2; ++i) out[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(p + 16 * i)));
}

RL_INLINE void scale_floats(__m256i s, float mult, float* out) {
  _mm512_store_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(s)), _mm512_set1_ps(mult)));
}

#include "x86_kernels.h"

// exact, types whose codes are 4 or 5 bits (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, IQ4_XS): the 16 (32) weights
// a 32-element group can hold, a · v + b for every code v, are made once per group in one register (two), and each
// code looks its weight up with vpermps (vpermt2ps), which reads only an index's low 4 (5) bits: a byte's two
// nibbles need no masking. The weights are x86_kernels.h's bit for bit (the same FMA per value); a lookup replaces
// the convert-to-float and the FMA per element: ~1.6x the rate on a 2-core Xeon.
template <class T> struct Lut { static constexpr bool ON = false; };
#define RL_LUT(name, bits, base_at) \
  template <> struct Lut<name> { static constexpr bool ON = true; static constexpr int BITS = bits, QS = base_at; };
RL_LUT(Q4_0, 4, 2) RL_LUT(Q4_1, 4, 4) RL_LUT(Q5_0, 5, 6) RL_LUT(Q5_1, 5, 8) RL_LUT(IQ4_NL, 4, 2)
RL_LUT(Q4_K, 4, 16) RL_LUT(Q5_K, 5, 48) RL_LUT(IQ4_XS, 4, 8)
#undef RL_LUT

constexpr int LUT_SPAN = 64;  // 32-element blocks whose scales are converted at once
alignas(64) constexpr float IOTA32[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                          16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
alignas(64) constexpr float IQ4_FLOATS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// chunk c's 32 codes as two int32 index vectors (elements 0..15, 16..31); only their low BITS bits count
template <class T> RL_INLINE void lut_indices(const uint8_t* b, int c, __m512i& lo, __m512i& hi) {
  if constexpr (T::QK == 32 || std::is_same_v<T, IQ4_XS>) {  // 16 bytes: low nibbles, then high nibbles
    lo = _mm512_cvtepu8_epi32(load16(b + Lut<T>::QS + (T::QK == 32 ? 0 : 16 * c)));
    hi = _mm512_srli_epi32(lo, 4);
  } else {  // Q4_K / Q5_K: chunks 2h and 2h + 1 are the low and high nibbles of the same 32 bytes
    const uint8_t* qs = b + Lut<T>::QS + 32 * (c >> 1);
    lo = _mm512_cvtepu8_epi32(load16(qs));
    hi = _mm512_cvtepu8_epi32(load16(qs + 16));
    if (c & 1) { lo = _mm512_srli_epi32(lo, 4); hi = _mm512_srli_epi32(hi, 4); }
  }
  if constexpr (Lut<T>::BITS == 5) {  // bit 4: Q5_0 / Q5_1's qh bit i for element i, Q5_K's bit c of qh[i]
    const __m512i sixteen = _mm512_set1_epi32(16), fifteen = _mm512_set1_epi32(15);
    lo = _mm512_and_si512(lo, fifteen);  // vpermt2ps reads bit 4 too: the other nibble's must go
    hi = _mm512_and_si512(hi, fifteen);
    if constexpr (T::QK == 32) {
      const uint32_t qh = u32_at(b + Lut<T>::QS - 4);
      lo = _mm512_mask_or_epi32(lo, __mmask16(qh), lo, sixteen);
      hi = _mm512_mask_or_epi32(hi, __mmask16(qh >> 16), hi, sixteen);
    } else {
      const __m256i bit = _mm256_slli_epi16(field(load32(b + 16), c, 1), 7);  // bit c of each qh byte, to bit 7
      const uint32_t qh = uint32_t(_mm256_movemask_epi8(bit));
      lo = _mm512_mask_or_epi32(lo, __mmask16(qh), lo, sixteen);
      hi = _mm512_mask_or_epi32(hi, __mmask16(qh >> 16), hi, sixteen);
    }
  }
}

// one block's weights times x into acc, its (a, b) per 32 elements given in memory (a broadcast from memory is a load,
// not a shuffle: the shuffle port is the one the lookups need); SET picks which half of a one-row tile's accumulators
// (static indices keep them in registers: a run-time index spilled them and every FMA waited on a store)
template <class T, int M, int SET>
RL_INLINE void exact_lut_block(const uint8_t* blk, const float* a, const float* off, const float* x, int64_t k,
                               __m512 (*acc)[4]) {
  const __m512 base = _mm512_load_ps(T::SIGNED ? IQ4_FLOATS : IOTA32);
#pragma GCC unroll 8
  for (int c = 0; c < T::QK / 32; ++c) {
    const __m512 va = _mm512_set1_ps(a[c]), vb = _mm512_set1_ps(off[c]);
    const __m512 table = _mm512_fmadd_ps(va, base, vb);
    __m512i lo, hi;
    lut_indices<T>(blk, c, lo, hi);
    __m512 w0, w1;
    if constexpr (Lut<T>::BITS == 5) {
      const __m512 table_hi = _mm512_fmadd_ps(va, _mm512_load_ps(IOTA32 + 16), vb);
      w0 = _mm512_permutex2var_ps(table, lo, table_hi);
      w1 = _mm512_permutex2var_ps(table, hi, table_hi);
    } else {
      w0 = _mm512_permutexvar_ps(lo, table);
      w1 = _mm512_permutexvar_ps(hi, table);
    }
    const int set = M == 1 ? 2 * ((c + SET) & 1) : 0;
    for (int t = 0; t < M; ++t) {
      acc[t][set] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * k + 32 * c), acc[t][set]);
      acc[t][set + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * k + 32 * c + 16), acc[t][set + 1]);
    }
  }
}

// the 32-element types' a = d and b (m, or -OFF · d) of blocks [0, count) of `blk`, 16 blocks at a time: one
// gather of the 32 bits at each block's d (d, then m for a type with a min), converted from fp16 in registers.
// (Two scalar loads and stores per block, read back as a vector, were a third of a K = 576 row's time.)
template <class T> RL_INLINE void block_scales(const uint8_t* blk, int count, float* a, float* off) {
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(T::BYTES));
  for (int i = 0; i < count; i += 16) {
    const __mmask16 live = count - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
    const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at,
                                                       blk + i * T::BYTES + T::D_AT, 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
    _mm512_store_ps(a + i, d);
    if constexpr (T::MIN)  // Q4_1 / Q5_1: m follows d
      _mm512_store_ps(off + i, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16))));
    else
      _mm512_store_ps(off + i, _mm512_mul_ps(d, _mm512_set1_ps(-float(T::OFF))));
  }
}

template <class T, int M>
RL_TARGET void exact_lut_tile(const Job& j, int64_t n, int64_t m0) {
  const uint8_t* row = j.w + n * j.row_bytes;
  const float* x = j.x + m0 * j.k;
  const int64_t nb = j.k / T::QK;
  __m512 acc[M][4];  // one row of x: consecutive chunks alternate between two sets of two
  for (int t = 0; t < M; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = _mm512_setzero_ps();
  if constexpr (T::QK == 32) {
    alignas(64) float a[LUT_SPAN], off[LUT_SPAN];
    for (int64_t b0 = 0; b0 < nb; b0 += LUT_SPAN) {
      const int count = int(nb - b0 < LUT_SPAN ? nb - b0 : LUT_SPAN);
      stream_ahead(row + b0 * T::BYTES, count * T::BYTES);
      block_scales<T>(row + b0 * T::BYTES, count, a, off);
      int i = 0;
      for (; i + 2 <= count; i += 2) {
        const int64_t b = b0 + i;
        exact_lut_block<T, M, 0>(row + b * T::BYTES, a + i, off + i, x + b * 32, j.k, acc);
        exact_lut_block<T, M, 1>(row + (b + 1) * T::BYTES, a + i + 1, off + i + 1, x + (b + 1) * 32, j.k, acc);
      }
      if (i < count) exact_lut_block<T, M, 0>(row + (b0 + i) * T::BYTES, a + i, off + i, x + (b0 + i) * 32, j.k, acc);
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * T::BYTES;
      stream_ahead(blk, T::BYTES);
      const Scales<T> s = scales_of<T>(blk);
      alignas(64) float a16[16], off16[16], a[8], off[8];
      scale_floats(s.sc, s.d, a16);
      if (T::MIN) scale_floats(s.mn, -s.dmin, off16); else scale_floats(s.sc, -float(T::OFF) * s.d, off16);
      for (int c = 0; c < 8; ++c) { a[c] = a16[2 * c]; off[c] = off16[2 * c]; }  // these types scale per 32
      exact_lut_block<T, M, 0>(blk, a, off, x + b * QK_K, j.k, acc);
    }
  }
  for (int t = 0; t < M; ++t) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3]));
    j.y[(m0 + t) * j.n + n] = _mm512_reduce_add_ps(sum);
  }
}

template <class T> RL_TARGET void exact_any_rows(const Job& j, int64_t n0, int64_t n1) {
  if constexpr (Lut<T>::ON) for_each_tile<MT>(j, n0, n1, exact_lut_tile<T, MT>, exact_lut_tile<T, 1>);
  else exact_rows<T>(j, n0, n1);
}

// int8, 64 bytes at a time: two 32-element blocks, or two chunks of a K-quant block, per instruction. The
// integer sums are avx2.cpp's int8_tile's (see there), so the results agree up to the fp32 order.
RL_INLINE __m512i join(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }
RL_INLINE __m512i signed_like(__m512i x, __m512i w) {  // x where w >= 0, -x where w < 0 (AVX-512 has no vpsignb)
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
// The codes of two 32-element blocks, [first | second] (x86_codes.h's order, two at a time): each block's 16 bytes
// broadcast into the two 128-bit lanes of its half (loads, and one blend), the second lane of each shifted down a
// nibble, then masked. No instruction here needs the shuffle port, which the scales' one permute takes.
RL_INLINE __m512i nibbles64(const uint8_t* q0, const uint8_t* q1) {
  const __m512i both = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(load16(q0)), 0xFF00, load16(q1));
  const __m512i shifted = _mm512_srlv_epi64(both, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
  return _mm512_and_si512(shifted, _mm512_set1_epi8(15));  // lo0 hi0 lo1 hi1
}
RL_INLINE __m512i high_bits64(uint32_t qh0, uint32_t qh1) {  // Q5: 0x10 in byte i where bit i is set
  return _mm512_and_si512(_mm512_movm_epi8(uint64_t(qh0) | uint64_t(qh1) << 32), _mm512_set1_epi8(0x10));
}
template <class T> RL_INLINE __m512i pair_codes(const uint8_t* b0, const uint8_t* b1);
template <> RL_INLINE __m512i pair_codes<Q4_0>(const uint8_t* b0, const uint8_t* b1) {
  return nibbles64(b0 + 2, b1 + 2);
}
template <> RL_INLINE __m512i pair_codes<Q4_1>(const uint8_t* b0, const uint8_t* b1) {
  return nibbles64(b0 + 4, b1 + 4);
}
template <> RL_INLINE __m512i pair_codes<Q5_0>(const uint8_t* b0, const uint8_t* b1) {
  return _mm512_or_si512(nibbles64(b0 + 6, b1 + 6), high_bits64(u32_at(b0 + 2), u32_at(b1 + 2)));
}
template <> RL_INLINE __m512i pair_codes<Q5_1>(const uint8_t* b0, const uint8_t* b1) {
  return _mm512_or_si512(nibbles64(b0 + 8, b1 + 8), high_bits64(u32_at(b0 + 4), u32_at(b1 + 4)));
}
// Signed weights (Q8_0, IQ4_NL) multiply as unsigned codes w + 128, their -128 · Σq going with the offsets
// (int8_tile32): VNNI's dot product takes unsigned bytes times signed ones, and its 32-bit sums cannot saturate as
// AVX2's 16-bit ones would, so no pair needs a sign fix-up (an absolute value, a sign mask and a negation).
template <class T> constexpr int INT8_OFF = T::SIGNED ? 128 : T::OFF;
alignas(16) constexpr uint8_t IQ4_UNSIGNED[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                                  129, 141, 153, 166, 181, 197, 217, 241};
constexpr bool iq4_unsigned_is_shifted(int i = 0) {
  return i == 16 || (IQ4_UNSIGNED[i] == IQ4_VALUES[i] + 128 && iq4_unsigned_is_shifted(i + 1));
}
static_assert(iq4_unsigned_is_shifted(), "IQ4_UNSIGNED is the codebook plus 128");
template <> RL_INLINE __m512i pair_codes<Q8_0>(const uint8_t* b0, const uint8_t* b1) {
  return _mm512_xor_si512(join(load32(b0 + 2), load32(b1 + 2)), _mm512_set1_epi8(char(0x80)));  // + 128 (mod 256)
}
template <> RL_INLINE __m512i pair_codes<IQ4_NL>(const uint8_t* b0, const uint8_t* b1) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_UNSIGNED)));
  return _mm512_shuffle_epi8(table, nibbles64(b0 + 2, b1 + 2));
}

// int16 sums over byte pairs w·q (as avx2.cpp's pair_products): the K-quants' integer part
template <class T> RL_INLINE __m512i pair_products(__m512i codes, __m512i q) {
  if constexpr (T::SIGNED) return _mm512_maddubs_epi16(_mm512_abs_epi8(codes), signed_like(q, codes));
  const __m512i p = _mm512_maddubs_epi16(codes, q);
  return T::OFF ? _mm512_sub_epi16(p, _mm512_maddubs_epi16(_mm512_set1_epi8(char(T::OFF)), q)) : p;
}

// 32-element types. Each weight is d · code + off in its block (blocks.h; off = m, or -OFF · d), so with the block's
// x scale dx and Σq over the block,
//   y = Σ_b d_b · dx_b · Σ_i code_i · q_i  +  Σ_b off_b · dx_b · Σq_b.
// Per block pair: one VNNI dot product (lanes 0..7 block b, 8..15 block b + 1) and one FMA by its d · dx; the
// pair's fp16 scales convert in one instruction, [d, m (or d)] of each block, and multiply the row's ds
// ([dx, dx · Σq] per block, Q8Rows) at once, so the min terms are a vector sum too: nothing per block is scalar.
// Consecutive pairs take two sets of accumulators, so that no FMA waits on the one before. Signed weights' codes
// are w + 128 (pair_codes), their offset -128 · d.

// blocks b and b + 1 side by side (SINGLE: block b alone, the last of an odd count)
template <class T, int M, int SET, bool SINGLE>
RL_INLINE void int8_pair(const Job& j, const uint8_t* blk, int64_t b, int64_t m0, __m512 (*acc)[2],
                         __m128 (*mins)[2]) {
  const __m512i codes = pair_codes<T>(blk, SINGLE ? blk : blk + T::BYTES);  // SINGLE: x's upper half is 0
  const uint64_t bits = scale_bits<T>(blk) | (SINGLE ? 0 : uint64_t(scale_bits<T>(blk + T::BYTES)) << 32);
  const __m128 scales = _mm_cvtph_ps(_mm_cvtsi64_si128(int64_t(bits)));  // [d, m] of b, then of b + 1
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  for (int t = 0; t < M; ++t) {
    const int64_t r = m0 + t;
    const int8_t* q = j.q8.q + r * j.k + b * 32;
    const __m512i x = SINGLE ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, q) : _mm512_loadu_si512(q);
    const float* ds = j.q8.ds + r * (2 * j.k / 32) + 2 * b;
    const __m128 xs = SINGLE ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ds))) : _mm_loadu_ps(ds);
    const __m128 both = _mm_mul_ps(scales, xs);  // [d · dx, m · dx · Σq] of b, then of b + 1
    const __m512 dd = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(both));
    const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x);
    acc[t][SET] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), dd, acc[t][SET]);
    if constexpr (T::MIN || INT8_OFF<T>) mins[t][SET] = _mm_add_ps(mins[t][SET], both);
  }
}

template <class T, int M>
RL_TARGET void int8_tile32(const Job& j, int64_t n, int64_t m0) {
  const uint8_t* row = j.w + n * j.row_bytes;
  const int64_t nb = j.k / 32;
  __m512 acc[M][2];
  __m128 mins[M][2];  // lanes 1 and 3: Σ m · dx · Σq (Q4_1, Q5_1), or Σ d · dx · Σq (the others: times -INT8_OFF)
  for (int t = 0; t < M; ++t) {
    acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    mins[t][0] = mins[t][1] = _mm_setzero_ps();
  }
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    stream_ahead(row + b * T::BYTES, 4 * T::BYTES);
    int8_pair<T, M, 0, false>(j, row + b * T::BYTES, b, m0, acc, mins);
    int8_pair<T, M, 1, false>(j, row + (b + 2) * T::BYTES, b + 2, m0, acc, mins);
  }
  if (b + 2 <= nb) {
    stream_ahead(row + b * T::BYTES, 2 * T::BYTES);
    int8_pair<T, M, 0, false>(j, row + b * T::BYTES, b, m0, acc, mins);
    b += 2;
  }
  if (b < nb) {
    stream_ahead(row + b * T::BYTES, T::BYTES);
    int8_pair<T, M, 1, true>(j, row + b * T::BYTES, b, m0, acc, mins);
  }
  for (int t = 0; t < M; ++t) {
    const float y = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
    constexpr bool SPLIT = T::MIN || INT8_OFF<T>;
    j.y[(m0 + t) * j.n + n] = SPLIT ? y + offset_part<T, INT8_OFF<T>>(mins[t][0], mins[t][1]) : y;
  }
}

// K-quants: maddubs' int16 lane l holds elements 2l and 2l + 1 of the 64: group l / 8 of the four
alignas(64) constexpr int16_t LANE_GROUP[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};

template <class T, int M>
RL_TARGET void int8_tile(const Job& j, int64_t n, int64_t m0) {
  static_assert(T::SCALED, "the 32-element types take int8_tile32");
  const uint8_t* row = j.w + n * j.row_bytes;
  const int64_t nb = j.k / T::QK;
  __m512 acc[M];
  __m256 mins[M];  // dmin · dx · Σ mn · bs
  for (int t = 0; t < M; ++t) { acc[t] = _mm512_setzero_ps(); mins[t] = _mm256_setzero_ps(); }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * T::BYTES;
    stream_ahead(blk, T::BYTES);
    const Scales<T> s = scales_of<T>(blk);
    const __m512i sc = _mm512_castsi256_si512(s.sc);
    __m512i isum[M];
    for (int t = 0; t < M; ++t) isum[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {  // elements 64p .. 64p + 63: groups 4p .. 4p + 3
      const __m512i codes = join(codes32<T>(blk, 2 * p), codes32<T>(blk, 2 * p + 1));
      const __m512i group = _mm512_add_epi16(_mm512_load_si512(LANE_GROUP), _mm512_set1_epi16(short(4 * p)));
      const __m512i scale = _mm512_permutexvar_epi16(group, sc);  // sc of each int16 lane
      for (int t = 0; t < M; ++t) {
        const __m512i x = _mm512_loadu_si512(j.q8.q + (m0 + t) * j.k + b * QK_K + 64 * p);
        isum[t] = _mm512_dpwssd_epi32(isum[t], pair_products<T>(codes, x), scale);
      }
    }
    for (int t = 0; t < M; ++t) {
      const int64_t row_m = m0 + t;
      const float dx = j.q8.d[row_m * nb + b];
      if (T::MIN) {
        const int16_t* bs = j.q8.bs + row_m * (j.k / 16) + b * 16;
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs));
        mins[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums, s.mn)), _mm256_set1_ps(s.dmin * dx),
                                  mins[t]);
      }
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_set1_ps(s.d * dx), acc[t]);
    }
  }
  for (int t = 0; t < M; ++t)
    j.y[(m0 + t) * j.n + n] = _mm512_reduce_add_ps(acc[t]) - hsum256(mins[t]);
}

template <class T> RL_TARGET void int8_rows(const Job& j, int64_t n0, int64_t n1) {
  if constexpr (T::QK == 32) for_each_tile<MT>(j, n0, n1, int8_tile32<T, MT>, int8_tile32<T, 1>);
  else for_each_tile<MT>(j, n0, n1, int8_tile<T, MT>, int8_tile<T, 1>);
}

// scalar.cpp's quantize_row, 16 values at a time (the same operations, so the same codes)
RL_TARGET void quantize_row(const float* x, int64_t k, int qx, int8_t* q, float* d, int16_t* bs) {
  for (int64_t b = 0; b < k / qx; ++b) {
    const float* xb = x + b * qx;
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int i = 0; i < qx; i += 16) {
      const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xb + i));
      vmax = _mm512_max_ps(vmax, a);
      bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(FLT_BIG), _CMP_NLE_UQ);
    }
    float inv;
    d[b] = q8_scale(_mm512_reduce_max_ps(vmax), bad == 0, &inv);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int i = 0; i < qx; i += 16) {
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vinv));
      if (bad) v = _mm512_setzero_si512();  // inf · 0 is NaN, not 0
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * qx + i), _mm512_cvtsepi32_epi8(v));
      bs[(b * qx + i) / 16] = int16_t(_mm512_reduce_add_epi32(v));
    }
  }
}

#define RL_ATTEND_TARGET RL_TARGET
#include "attend.h"

}  // namespace avx512

const Variant* avx512_variant() {
  static const Variant v = [] {
    Variant t{};
#define RL_FILL(name, id) t.rows[EXACT][T_##name] = avx512::exact_any_rows<name>; \
    t.rows[INT8][T_##name] = avx512::int8_rows<name>; \
    t.dequant[T_##name] = avx512::dequant_rows<name>;
    RL_FOR_EACH_TYPE(RL_FILL)
#undef RL_FILL
    t.quantize = avx512::quantize_row;
    t.attend = avx512::attend_items;
    if (&avx512_int16_fill != nullptr) avx512_int16_fill(t);  // null where its file is not built
    return t;
  }();
  return &v;
}

}  // namespace rl

#else
namespace rl {
const Variant* avx512_variant() { return nullptr; }
}  // namespace rl
#endif
