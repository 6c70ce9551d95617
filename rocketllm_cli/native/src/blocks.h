// GGUF block layouts as every kernel variant reads them: per block type, its scales and its 8-bit codes.
//
// Each weight is  w = a_g * code + b_g  for the 16-element group g it lies in, with
//   a_g = d * sc_g                                  (an exact fp32 product: 11-bit d times a small integer)
//   b_g = -(dmin * mn_g)  for types with a min, else  -OFF * a_g
// which is gguf's dequantization bit for bit: its only rounding is the one addition of a min, and a fused
// a_g * code + b_g rounds that same exact sum once. `code` is unsigned (0 .. 2^bits - 1) or, for SIGNED types,
// the int8 weight value itself (Q8_0's bytes, the IQ4 codebook entries; OFF = 0 there).
//
// This header holds what all variants share: the traits, and the reference decoding of the scales and of fp16.
// The codes are decoded per variant: scalar.cpp has the readable reference, x86_codes.h the AVX2 one.
#pragma once
#include <cstdint>
#include <cstring>

namespace rl {

constexpr int QK_K = 256;

struct Head {                  // a SCALED type's integer scales and mins, one per 16 elements
  alignas(32) int16_t sc[16];
  alignas(32) int16_t mn[16];  // types with a min only
};

inline uint16_t u16_at(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t u32_at(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// fp16 bits -> fp32, exactly (subnormals, inf and NaN too): the portable path; x86 variants use F16C.
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {
    float sub = float(man) * 5.9604644775390625e-8f;  // man * 2^-24: exact
    std::memcpy(&bits, &sub, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- the block types. QK elements in BYTES bytes; OFF: the code's offset; SIGNED: codes are int8 weights;
// ---- SCALED: per-group integer scales (else 1, and a min's mn is -1); MIN: has a min term; D_AT, DMIN_AT:
// ---- the bytes of the fp16 d and dmin (-1: none) ----

#define RL_TRAITS(qk, bytes, off, is_signed, scaled, min, d_at, dmin_at)      \
  static constexpr int QK = qk, BYTES = bytes, OFF = off, D_AT = d_at, DMIN_AT = dmin_at; \
  static constexpr bool SIGNED = is_signed, SCALED = scaled, MIN = min;

struct Q4_0 {  // d, qs[16]: element i < 16 is qs[i] & 15, element 16 + i is qs[i] >> 4; w = d * (q - 8)
  RL_TRAITS(32, 18, 8, false, false, false, 0, -1)
};
struct Q4_1 {  // d, m, qs[16]; w = d * q + m
  RL_TRAITS(32, 20, 0, false, false, true, 0, 2)
};
struct Q5_0 {  // d, qh (uint32: bit i is element i's bit 4), qs[16] as Q4_0; w = d * (q - 16)
  RL_TRAITS(32, 22, 16, false, false, false, 0, -1)
};
struct Q5_1 {  // d, m, qh, qs[16]; w = d * q + m
  RL_TRAITS(32, 24, 0, false, false, true, 0, 2)
};
struct Q8_0 {  // d, qs int8[32]; w = d * q
  RL_TRAITS(32, 34, 0, true, false, false, 0, -1)
};
struct IQ4_NL {  // d, qs[16] 4-bit indices (Q4_0's order) into the codebook; w = d * value
  RL_TRAITS(32, 18, 0, true, false, false, 0, -1)
};

struct Q2_K {  // scales[16] (low nibble sc, high nibble mn), qs[64], d, dmin; w = d * sc * q - dmin * mn
  RL_TRAITS(QK_K, 84, 0, false, true, true, 80, 82)
  static void head(const uint8_t* b, Head& h) {
    for (int g = 0; g < 16; ++g) { h.sc[g] = b[g] & 15; h.mn[g] = b[g] >> 4; }
  }
};
struct Q3_K {  // hmask[32], qs[64], scales[12] (16 6-bit values, offset 32), d; w = d * (sc - 32) * (q - 4)
  RL_TRAITS(QK_K, 110, 4, false, true, false, 108, -1)
  static void head(const uint8_t* b, Head& h) {
    const uint8_t* s = b + 96;
    for (int g = 0; g < 16; ++g) {
      const int low = g < 8 ? s[g] & 15 : s[g - 8] >> 4, high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
      h.sc[g] = int16_t((low | high << 4) - 32);
    }
  }
};
// Q4_K / Q5_K: 8 6-bit scales and mins, one per 32 elements, packed in 12 bytes from byte 4
inline void k4_scales(const uint8_t* b, Head& h) {
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    h.sc[2 * j] = h.sc[2 * j + 1] = int16_t(sc);
    h.mn[2 * j] = h.mn[2 * j + 1] = int16_t(mn);
  }
}
struct Q4_K {  // d, dmin, scales[12], qs[128]; w = d * sc * q - dmin * mn
  RL_TRAITS(QK_K, 144, 0, false, true, true, 0, 2)
  static void head(const uint8_t* b, Head& h) { k4_scales(b, h); }
};
struct Q5_K {  // d, dmin, scales[12], qh[32], qs[128]
  RL_TRAITS(QK_K, 176, 0, false, true, true, 0, 2)
  static void head(const uint8_t* b, Head& h) { k4_scales(b, h); }
};
struct Q6_K {  // ql[128], qh[64], scales int8[16], d; w = d * sc * (q - 32)
  RL_TRAITS(QK_K, 210, 32, false, true, false, 208, -1)
  static void head(const uint8_t* b, Head& h) {
    for (int g = 0; g < 16; ++g) h.sc[g] = int8_t(b[192 + g]);
  }
};
struct IQ4_XS {  // d, scales_h (uint16), scales_l[4], qs[128]; 8 6-bit scales (offset 32); w = d * (ls - 32) * value
  RL_TRAITS(QK_K, 136, 0, true, true, false, 0, -1)
  static void head(const uint8_t* b, Head& h) {
    const int high = u16_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 15;
      h.sc[2 * j] = h.sc[2 * j + 1] = int16_t((low | ((high >> (2 * j)) & 3) << 4) - 32);
    }
  }
};
#undef RL_TRAITS

// IQ4_NL / IQ4_XS codebook
alignas(16) constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1, 13, 25, 38, 53, 69, 89, 113};

// The type list, in the order of the kernel tables; the number is GGML's type id.
#define RL_FOR_EACH_TYPE(X) \
  X(Q4_0, 2) X(Q4_1, 3) X(Q5_0, 6) X(Q5_1, 7) X(Q8_0, 8) X(Q2_K, 10) X(Q3_K, 11) X(Q4_K, 12) X(Q5_K, 13) \
  X(Q6_K, 14) X(IQ4_NL, 20) X(IQ4_XS, 23)

enum TypeIndex {
#define RL_ENUM(name, id) T_##name,
  RL_FOR_EACH_TYPE(RL_ENUM)
#undef RL_ENUM
  NUM_TYPES
};

// A block's fp16 d and dmin (0 where the type has none), and its scales (SCALED types).
template <class T> inline float d_of(const uint8_t* b) { return fp16_to_fp32(u16_at(b + T::D_AT)); }
template <class T> inline float dmin_of(const uint8_t* b) { return T::MIN ? fp16_to_fp32(u16_at(b + T::DMIN_AT)) : 0; }
template <class T> inline void head_of(const uint8_t* b, Head& h) { if constexpr (T::SCALED) T::head(b, h); }

// Per-group integer scale and min as the generic loops see them: 1 and -1 for the 32-element types (Q4_1 and
// Q5_1 keep their m in dmin, so that b = -(dmin * -1) = +m).
template <class T> inline int scale_of(const Head& h, int g) { if constexpr (T::SCALED) return h.sc[g]; return 1; }
template <class T> inline int min_of(const Head& h, int g) { if constexpr (T::SCALED) return h.mn[g]; return -1; }

}  // namespace rl
