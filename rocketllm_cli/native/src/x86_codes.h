// x86 codes: 32 codes of a block at a time (chunk c covers elements 32c .. 32c + 31), in a __m256i, in element
// order, as scalar.cpp's codes<T>() gives them. Included by avx2.cpp and avx512.cpp inside their own namespace
// with RL_TARGET set to their target attribute, so each variant gets its own copy compiled for its ISA.
// (No include guard on purpose.)

#define RL_INLINE inline __attribute__((always_inline)) RL_TARGET

RL_INLINE __m256i bytes(int v) { return _mm256_set1_epi8(char(v)); }
RL_INLINE __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
RL_INLINE __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
RL_INLINE __m256i shift_right(__m256i v, int bits) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits)); }
RL_INLINE __m256i field(__m256i v, int shift, int mask) { return _mm256_and_si256(shift_right(v, shift), bytes(mask)); }

// 16 bytes -> 32 nibbles: low nibbles (elements 0..15), then high nibbles (16..31)
RL_INLINE __m256i nibbles32(const uint8_t* qs) {
  const __m128i q = load16(qs), low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
}
// uint32 qh -> 0x10 in byte i where bit i is set (Q5_0 / Q5_1)
RL_INLINE __m256i high_bits32(uint32_t qh) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int(qh)),  // byte i <- byte i / 8 of qh
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));  // byte i tests bit i % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), bytes(0x10));
}
RL_INLINE __m256i iq4_lookup(__m256i idx) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
  return _mm256_shuffle_epi8(table, idx);
}

template <class T> RL_INLINE __m256i codes32(const uint8_t* b, int c);

template <> RL_INLINE __m256i codes32<Q4_0>(const uint8_t* b, int) { return nibbles32(b + 2); }
template <> RL_INLINE __m256i codes32<Q4_1>(const uint8_t* b, int) { return nibbles32(b + 4); }
template <> RL_INLINE __m256i codes32<Q5_0>(const uint8_t* b, int) {
  return _mm256_or_si256(nibbles32(b + 6), high_bits32(u32_at(b + 2)));
}
template <> RL_INLINE __m256i codes32<Q5_1>(const uint8_t* b, int) {
  return _mm256_or_si256(nibbles32(b + 8), high_bits32(u32_at(b + 4)));
}
template <> RL_INLINE __m256i codes32<Q8_0>(const uint8_t* b, int) { return load32(b + 2); }
template <> RL_INLINE __m256i codes32<IQ4_NL>(const uint8_t* b, int) { return iq4_lookup(nibbles32(b + 2)); }

// chunk c = 4h + t: field t of the 32 bytes at 32h
template <> RL_INLINE __m256i codes32<Q2_K>(const uint8_t* b, int c) {
  return field(load32(b + 16 + 32 * (c >> 2)), 2 * (c & 3), 3);
}
template <> RL_INLINE __m256i codes32<Q3_K>(const uint8_t* b, int c) {
  const __m256i low = field(load32(b + 32 + 32 * (c >> 2)), 2 * (c & 3), 3);
  const __m256i high = _mm256_slli_epi16(field(load32(b), c, 1), 2);  // bit c of hmask[i]
  return _mm256_or_si256(low, high);
}
template <> RL_INLINE __m256i codes32<Q6_K>(const uint8_t* b, int c) {
  const int h = c >> 2, t = c & 3;
  const __m256i low = field(load32(b + 64 * h + 32 * (t & 1)), 4 * (t >> 1), 15);
  const __m256i high = _mm256_slli_epi16(field(load32(b + 128 + 32 * h), 2 * t, 3), 4);
  return _mm256_or_si256(low, high);
}
template <> RL_INLINE __m256i codes32<Q4_K>(const uint8_t* b, int c) {
  return field(load32(b + 16 + 32 * (c >> 1)), 4 * (c & 1), 15);
}
template <> RL_INLINE __m256i codes32<Q5_K>(const uint8_t* b, int c) {
  const __m256i high = _mm256_slli_epi16(field(load32(b + 16), c, 1), 4);
  return _mm256_or_si256(field(load32(b + 48 + 32 * (c >> 1)), 4 * (c & 1), 15), high);
}
template <> RL_INLINE __m256i codes32<IQ4_XS>(const uint8_t* b, int c) { return iq4_lookup(nibbles32(b + 8 + 16 * c)); }

RL_INLINE float fp16(uint16_t h) { return _cvtsh_ss(h); }
RL_INLINE float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// max |x| over N values (a multiple of 8), and whether all of them are finite (|x| <= FLT_MAX, not NaN): what a
// quantizer's scale of one block comes from (kernels.h code_scale)
RL_INLINE float abs_max(const float* x, int n, bool* finite) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_BIG);
  __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    vmax = _mm256_max_ps(vmax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  *finite = _mm256_movemask_ps(bad) == 0;
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// SCALED types' integer scales (sc) and mins (mn), one int16 per 16 elements, straight into registers (scalar
// stores read back as a vector would stall on store forwarding). blocks.h's head() is the reference.
template <class T> RL_INLINE void scales16(const uint8_t* b, __m256i& sc, __m256i& mn);

template <> RL_INLINE void scales16<Q2_K>(const uint8_t* b, __m256i& sc, __m256i& mn) {
  const __m128i s = load16(b), low = _mm_set1_epi8(15);
  sc = _mm256_cvtepu8_epi16(_mm_and_si128(s, low));
  mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), low));
}
template <> RL_INLINE void scales16<Q3_K>(const uint8_t* b, __m256i& sc, __m256i&) {
  // 4 bytes at a time: groups 0..3 and 4..7 take low nibbles of bytes 0..7, 8..15 their high nibbles; bits 4..5
  // come from bytes 8..11, two bits per group of four
  const uint32_t w0 = u32_at(b + 96), w1 = u32_at(b + 100), w2 = u32_at(b + 104), nib = 0x0F0F0F0F, top = 0x30303030;
  const __m128i v = _mm_setr_epi32(int((w0 & nib) | ((w2 << 4) & top)), int((w1 & nib) | ((w2 << 2) & top)),
                                   int(((w0 >> 4) & nib) | (w2 & top)), int(((w1 >> 4) & nib) | ((w2 >> 2) & top)));
  sc = _mm256_cvtepi8_epi16(_mm_sub_epi8(v, _mm_set1_epi8(32)));
}
RL_INLINE void k4_scales16(const uint8_t* b, __m256i& sc, __m256i& mn) {  // Q4_K / Q5_K: 8 of each, per 32
  const uint32_t w0 = u32_at(b + 4), w1 = u32_at(b + 8), w2 = u32_at(b + 12), six = 0x3F3F3F3F, top = 0x30303030;
  const uint32_t sc_high = (w2 & 0x0F0F0F0F) | ((w0 >> 2) & top);
  const uint32_t mn_high = ((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 2) & top);
  const __m128i v = _mm_setr_epi32(int(w0 & six), int(sc_high), int(w1 & six), int(mn_high));
  sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));  // each value twice: once per 16 elements
  mn = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
}
template <> RL_INLINE void scales16<Q4_K>(const uint8_t* b, __m256i& sc, __m256i& mn) { k4_scales16(b, sc, mn); }
template <> RL_INLINE void scales16<Q5_K>(const uint8_t* b, __m256i& sc, __m256i& mn) { k4_scales16(b, sc, mn); }
template <> RL_INLINE void scales16<Q6_K>(const uint8_t* b, __m256i& sc, __m256i&) {
  sc = _mm256_cvtepi8_epi16(load16(b + 192));
}
template <> RL_INLINE void scales16<IQ4_XS>(const uint8_t* b, __m256i& sc, __m256i&) {
  const uint32_t low = u32_at(b + 4);  // nibbles: scale j's low 4 bits in byte j / 2
  const __m128i lows = _mm_unpacklo_epi8(_mm_cvtsi32_si128(int(low & 0x0F0F0F0F)),
                                         _mm_cvtsi32_si128(int((low >> 4) & 0x0F0F0F0F)));
  const __m128i high = _mm_set1_epi32(u16_at(b + 2));  // scale j's bits 4..5 at bit 2j
  const __m128i h03 = _mm_and_si128(_mm_srlv_epi32(high, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi32(3));
  const __m128i h47 = _mm_and_si128(_mm_srlv_epi32(high, _mm_setr_epi32(8, 10, 12, 14)), _mm_set1_epi32(3));
  const __m128i highs = _mm_packus_epi16(_mm_packus_epi32(h03, h47), _mm_setzero_si128());
  const __m128i v = _mm_sub_epi8(_mm_or_si128(lows, _mm_slli_epi16(highs, 4)), _mm_set1_epi8(32));
  sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
}

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
