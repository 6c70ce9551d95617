// The x86 exact kernels, written once over the variant's float vector F (FW lanes), and included by avx2.cpp and
// avx512.cpp inside their namespace after x86_codes.h and these ops of theirs:
//   F fzero(), fset(float), fload(const float*), fadd(F, F), ffma(F, F, F); float fsum(F)
//   to_float<SIGNED>(__m256i codes, F out[32 / FW]): the 32 codes as fp32, unsigned or signed bytes
//   scale_floats(__m256i s, float mult, float out[16]): out[g] = mult · s[g] for 16 int16 s (64-byte aligned out)
//   signed_floats(const uint8_t* p, F out[32 / FW]): the 32 int8 at p as fp32
//   codes_as_floats<T>(const uint8_t* blk, int c, F out[32 / FW]): chunk c's 32 codes as fp32
//   constexpr int MT: rows of x per tile
// The int8 kernels differ more between the two (VNNI, 64-byte vectors) and live in each file.
// (No include guard on purpose.)

// A block's fp16 d and dmin, and a SCALED type's scales and mins in registers
template <class T> struct Scales {
  float d, dmin;
  __m256i sc, mn;
};
template <class T> RL_INLINE Scales<T> scales_of(const uint8_t* blk) {
  Scales<T> s{fp16(u16_at(blk + T::D_AT)), T::MIN ? fp16(u16_at(blk + T::DMIN_AT)) : 0.0f, _mm256_setzero_si256(),
              _mm256_setzero_si256()};
  if constexpr (T::SCALED) scales16<T>(blk, s.sc, s.mn);
  return s;
}

// exact: fp32 weights a_g · code + b_g (blocks.h) in registers, FMA'd with fp32 x. With one row of x, the chunks
// alternate between two sets of accumulators so that consecutive FMAs do not wait on each other.
template <class T, int M, int P>
RL_INLINE void exact_block(const uint8_t* blk, const float* x, int64_t k, F (*acc)[(M == 1 ? 2 : 1) * (32 / FW)]) {
  constexpr int NV = 32 / FW;
  const Scales<T> s = scales_of<T>(blk);
  alignas(64) float a[16], off[16];  // per 16 elements (the 32-element types use [0] and [1])
  if constexpr (T::SCALED) {
    scale_floats(s.sc, s.d, a);
    if (T::MIN) scale_floats(s.mn, -s.dmin, off); else scale_floats(s.sc, -float(T::OFF) * s.d, off);
  } else {
    a[0] = a[1] = s.d;
    off[0] = off[1] = T::MIN ? s.dmin : -float(T::OFF) * s.d;  // Q4_1 / Q5_1: + m
  }
#pragma GCC unroll 8
  for (int c = 0; c < T::QK / 32; ++c) {
    F w[NV];
    codes_as_floats<T>(blk, c, w);
    for (int v = 0; v < NV; ++v) {
      const int g = 2 * c + v * FW / 16;
      w[v] = ffma(fset(a[g]), w[v], fset(off[g]));  // rounds a·code + b once, as gguf does
    }
    const int set = M == 1 ? ((c + P) & 1) * NV : 0;
    for (int t = 0; t < M; ++t)
      for (int v = 0; v < NV; ++v) acc[t][set + v] = ffma(w[v], fload(x + t * k + 32 * c + FW * v), acc[t][set + v]);
  }
}

template <class T, int M>
RL_TARGET void exact_tile(const Job& j, int64_t n, int64_t m0) {
  constexpr int NA = (M == 1 ? 2 : 1) * (32 / FW);
  const uint8_t* row = j.w + n * j.row_bytes;
  const float* x = j.x + m0 * j.k;
  const int64_t nb = j.k / T::QK;
  F acc[M][NA];
  for (int t = 0; t < M; ++t)
    for (int v = 0; v < NA; ++v) acc[t][v] = fzero();
  int64_t b = 0;
  if (T::QK == 32)  // blocks in pairs: the second takes the other set of accumulators
    for (; b + 2 <= nb; b += 2) {
      exact_block<T, M, 0>(row + b * T::BYTES, x + b * T::QK, j.k, acc);
      exact_block<T, M, 1>(row + (b + 1) * T::BYTES, x + (b + 1) * T::QK, j.k, acc);
    }
  for (; b < nb; ++b) exact_block<T, M, 0>(row + b * T::BYTES, x + b * T::QK, j.k, acc);
  for (int t = 0; t < M; ++t) {
    F sum = acc[t][0];
    for (int v = 1; v < NA; ++v) sum = fadd(sum, acc[t][v]);
    j.y[(m0 + t) * j.n + n] = fsum(sum);
  }
}

// exact, Q8_0: each weight d · code is exact in fp32 (an 11-bit d times a 7-bit code), so a block's products sum as
// d · Σ code · x: the codes multiply x as they convert, and one FMA by d per block and row replaces one per weight.
// The sum's order differs from exact_tile's; its error stays within fp32 rounding of Σ |w| · |x|.
template <int M, int P>
RL_INLINE void exact_q8_block(const uint8_t* blk, const float* x, int64_t k, F (*acc)[2]) {
  constexpr int NV = 32 / FW;
  F w[NV];
  signed_floats(blk + 2, w);
  const F d = fset(fp16(u16_at(blk)));
  for (int t = 0; t < M; ++t) {
    F s[2] = {ffma(w[0], fload(x + t * k), fzero()), fzero()};
    for (int v = 1; v < NV; ++v) s[v & 1] = ffma(w[v], fload(x + t * k + FW * v), s[v & 1]);
    acc[t][P] = ffma(NV > 1 ? fadd(s[0], s[1]) : s[0], d, acc[t][P]);
  }
}

template <int M>
RL_TARGET void exact_q8_tile(const Job& j, int64_t n, int64_t m0) {
  const uint8_t* row = j.w + n * j.row_bytes;
  const float* x = j.x + m0 * j.k;
  const int64_t nb = j.k / 32;
  F acc[M][2];  // consecutive blocks alternate between the two
  for (int t = 0; t < M; ++t) acc[t][0] = acc[t][1] = fzero();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    exact_q8_block<M, 0>(row + b * Q8_0::BYTES, x + b * 32, j.k, acc);
    exact_q8_block<M, 1>(row + (b + 1) * Q8_0::BYTES, x + (b + 1) * 32, j.k, acc);
  }
  if (b < nb) exact_q8_block<M, 0>(row + b * Q8_0::BYTES, x + b * 32, j.k, acc);
  for (int t = 0; t < M; ++t) j.y[(m0 + t) * j.n + n] = fsum(fadd(acc[t][0], acc[t][1]));
}

template <class T> RL_TARGET void exact_rows(const Job& j, int64_t n0, int64_t n1) {
  if constexpr (std::is_same_v<T, Q8_0>)
    for_each_tile<MT>(j, n0, n1, exact_q8_tile<MT>, exact_q8_tile<1>);
  else
    for_each_tile<MT>(j, n0, n1, exact_tile<T, MT>, exact_tile<T, 1>);
}

// int8, 32-element types: [d, m] of a block with a min, else [d, d], as 32 bits of fp16 (one conversion gives the
// two factors its dot products and its Σq are multiplied by; avx2.cpp's and avx512.cpp's int8 kernels)
template <class T> RL_INLINE uint32_t scale_bits(const uint8_t* blk) {
  static_assert(!T::MIN || T::DMIN_AT == T::D_AT + 2, "a min's fp16 follows d");
  if constexpr (T::MIN) return u32_at(blk + T::D_AT);  // Q4_1 / Q5_1: d, then m
  const uint32_t d = u16_at(blk + T::D_AT);
  return d | d << 16;
}

// int8, 32-element types: a row's min or offset part from its two sets of [d · dx, s · dx · Σq] lanes (a block in
// lanes 0-1, the next of a pair in lanes 2-3, zeros where there is none): Σ m · dx · Σq for a type with a min,
// -OFF · Σ d · dx · Σq for one with an offset (the type's own, or the one a kernel gives its codes)
template <class T, int OFF = T::OFF> RL_INLINE float offset_part(__m128 a, __m128 b) {
  const __m128 m = _mm_add_ps(a, b);
  const float sum = _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)) + _mm_cvtss_f32(_mm_shuffle_ps(m, m, 3));
  return T::MIN ? sum : -float(OFF) * sum;
}

// int16: x's codes per 32 elements (kernels.h's Q16Rows) against each chunk's 32 weight codes widened to int16 less
// their offset; madd gives 8 int32 lanes of Σ (code − OFF) · q per 16 elements, exactly, and one FMA by the
// group's a_g · dx turns them to fp32. A min's part, dmin · Σ mn_g · xs_g (m · Σ x for Q4_1 / Q5_1), takes x's own
// fp32 sums: the one rounding left is x's to 16 bits (|x − q · dx| ≤ dx / 2 = max|x| / 65534), ~250x under int8's.
// Written with 256-bit vectors alone, so that both x86 variants run the same code.
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
// Q5_0 / Q5_1: Q4_0's nibbles, and bit 4 of element i from bit i of qh, tested per 16-bit lane
template <int QS, int QH, int OFF> RL_INLINE void five_bit_codes16(const uint8_t* blk, __m256i& lo, __m256i& hi) {
  nibble_codes16<QS, false>(blk, lo, hi);
  const uint32_t qh = u32_at(blk + QH);
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

RL_INLINE __m256i dot16(__m256i lo, __m256i hi, const int16_t* q) {  // Σ code · q over 32 elements, 8 int32 lanes
  return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
                          _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16))));
}

// 32-element types: y = Σ_b d_b · dx_b · Σ (code − OFF) · q  +  Σ_b m_b · Σ x_b; consecutive blocks take two sets of
// accumulators
template <class T, int M, int SET>
RL_INLINE void int16_block32(const Job& j, const uint8_t* blk, int64_t b, int64_t m0, __m256 (*acc)[2], float* mins) {
  __m256i lo, hi;
  codes16<T>(blk, 0, lo, hi);
  const float d = fp16(u16_at(blk + T::D_AT));
  for (int t = 0; t < M; ++t) {
    const int64_t r = m0 + t;
    const __m256i p = dot16(lo, hi, j.q16.q + r * j.k + b * 32);
    acc[t][SET] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * j.q16.d[r * (j.k / 32) + b]), acc[t][SET]);
    if constexpr (T::MIN) {
      const float* xs = j.q16.xs + r * (j.k / 16) + 2 * b;
      mins[t] += fp16(u16_at(blk + T::DMIN_AT)) * (xs[0] + xs[1]);
    }
  }
}

template <class T, int M>
RL_TARGET void int16_tile32(const Job& j, int64_t n, int64_t m0) {
  const uint8_t* row = j.w + n * j.row_bytes;
  const int64_t nb = j.k / 32;
  __m256 acc[M][2];
  float mins[M];
  for (int t = 0; t < M; ++t) {
    acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    mins[t] = 0;
  }
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    int16_block32<T, M, 0>(j, row + b * T::BYTES, b, m0, acc, mins);
    int16_block32<T, M, 1>(j, row + (b + 1) * T::BYTES, b + 1, m0, acc, mins);
  }
  if (b < nb) int16_block32<T, M, 0>(j, row + b * T::BYTES, b, m0, acc, mins);
  for (int t = 0; t < M; ++t) j.y[(m0 + t) * j.n + n] = hsum256(_mm256_add_ps(acc[t][0], acc[t][1])) + mins[t];
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
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * T::BYTES;
    const Scales<T> s = scales_of<T>(blk);
    alignas(64) float a[16];
    alignas(32) int16_t sc[16];
    if constexpr (SCALE_PER_32<T>) scale_floats(s.sc, s.d, a);
    else _mm256_store_si256(reinterpret_cast<__m256i*>(sc), s.sc);
#pragma GCC unroll 8
    for (int c = 0; c < T::QK / 32; ++c) {
      __m256i lo, hi;
      codes16<T>(blk, c, lo, hi);
      if constexpr (!SCALE_PER_32<T>) {
        lo = _mm256_mullo_epi16(lo, _mm256_set1_epi16(sc[2 * c]));
        hi = _mm256_mullo_epi16(hi, _mm256_set1_epi16(sc[2 * c + 1]));
      }
      const float scale = SCALE_PER_32<T> ? a[2 * c] : s.d;
      for (int t = 0; t < M; ++t) {
        const int64_t r = m0 + t;
        const int16_t* q = j.q16.q + r * j.k + b * T::QK + 32 * c;
        const float dx = j.q16.d[r * (j.k / 32) + b * (T::QK / 32) + c];
        acc[t][c & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16(lo, hi, q)), _mm256_set1_ps(scale * dx),
                                        acc[t][c & 1]);
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
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_BIG);
  for (int64_t b = 0; b < k / Q16_BLOCK; ++b) {
    const float* xb = x + b * Q16_BLOCK;
    __m256 v[4], vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int r = 0; r < 4; ++r) {
      v[r] = _mm256_loadu_ps(xb + 8 * r);
      const __m256 a = _mm256_andnot_ps(sign, v[r]);
      vmax = _mm256_max_ps(vmax, a);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const bool finite = _mm256_movemask_ps(bad) == 0;
    float inv;
    d[b] = code_scale(_mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))), finite, Q16_MAX, &inv);
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
