// The portable variant: the readable reference every SIMD variant is tested against. Per block type, codes()
// unpacks one block into its QK codes in element order; the generic loops below apply blocks.h's w = a·code + b.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace rl {
namespace {

// 32-element types: byte i of qs holds element i (low nibble) and element 16 + i (high nibble)
void nibbles32(const uint8_t* qs, uint8_t* out) {
  for (int i = 0; i < 16; ++i) { out[i] = qs[i] & 15; out[16 + i] = qs[i] >> 4; }
}
void high_bits32(uint32_t qh, uint8_t* out) {  // Q5_0 / Q5_1: bit i of qh is element i's bit 4
  for (int i = 0; i < 32; ++i) out[i] |= ((qh >> i) & 1) << 4;
}

template <class T> void codes(const uint8_t* b, uint8_t* out);

template <> void codes<Q4_0>(const uint8_t* b, uint8_t* out) { nibbles32(b + 2, out); }
template <> void codes<Q4_1>(const uint8_t* b, uint8_t* out) { nibbles32(b + 4, out); }
template <> void codes<Q5_0>(const uint8_t* b, uint8_t* out) { nibbles32(b + 6, out); high_bits32(u32_at(b + 2), out); }
template <> void codes<Q5_1>(const uint8_t* b, uint8_t* out) { nibbles32(b + 8, out); high_bits32(u32_at(b + 4), out); }
template <> void codes<Q8_0>(const uint8_t* b, uint8_t* out) { std::memcpy(out, b + 2, 32); }
template <> void codes<IQ4_NL>(const uint8_t* b, uint8_t* out) {
  nibbles32(b + 2, out);
  for (int i = 0; i < 32; ++i) out[i] = uint8_t(IQ4_VALUES[out[i]]);
}

// Q2_K / Q3_K / Q6_K: element 128h + 32t + i takes its 2-bit field t from byte 32h + i of a 64-byte run
template <> void codes<Q2_K>(const uint8_t* b, uint8_t* out) {
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 32; ++i) out[128 * h + 32 * t + i] = (b[16 + 32 * h + i] >> (2 * t)) & 3;
}
template <> void codes<Q3_K>(const uint8_t* b, uint8_t* out) {  // + bit 2 from hmask: element 32s + i is bit s of i
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 32; ++i) {
        const int low = (b[32 + 32 * h + i] >> (2 * t)) & 3, high = (b[i] >> (4 * h + t)) & 1;
        out[128 * h + 32 * t + i] = uint8_t(low | high << 2);
      }
}
template <> void codes<Q6_K>(const uint8_t* b, uint8_t* out) {  // a nibble of ql, 2 bits of qh
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 32; ++i) {
        const int low = (b[64 * h + 32 * (t & 1) + i] >> (4 * (t >> 1))) & 15;
        const int high = (b[128 + 32 * h + i] >> (2 * t)) & 3;
        out[128 * h + 32 * t + i] = uint8_t(low | high << 4);
      }
}
// Q4_K / Q5_K: sub-block j (32 elements) is the low (j even) or high (j odd) nibbles of qs[32 (j / 2) ...]
template <> void codes<Q4_K>(const uint8_t* b, uint8_t* out) {
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 32; ++i) out[32 * j + i] = (b[16 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
}
template <> void codes<Q5_K>(const uint8_t* b, uint8_t* out) {  // + bit 4: bit j of qh[i]
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 32; ++i)
      out[32 * j + i] = uint8_t(((b[48 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15) | ((b[16 + i] >> j) & 1) << 4);
}
template <> void codes<IQ4_XS>(const uint8_t* b, uint8_t* out) {  // 8 runs of 16 bytes, each as IQ4_NL's
  for (int j = 0; j < 8; ++j) nibbles32(b + 8 + 16 * j, out + 32 * j);
  for (int i = 0; i < QK_K; ++i) out[i] = uint8_t(IQ4_VALUES[out[i]]);
}

template <class T> int code_value(uint8_t c) { return T::SIGNED ? int(int8_t(c)) : int(c); }

// One block's QK weights a_g · code_i + b_g as fp32 into w
template <class T>
void block_weights(const uint8_t* blk, float* w) {
  uint8_t c[T::QK];
  Head h;
  head_of<T>(blk, h);
  codes<T>(blk, c);
  const float d = d_of<T>(blk), dmin = dmin_of<T>(blk);
  for (int g = 0; g < T::QK / 16; ++g) {
    const float a = d * float(scale_of<T>(h, g));
    const float off = T::MIN ? -(dmin * float(min_of<T>(h, g))) : -float(T::OFF) * a;
    for (int i = 16 * g; i < 16 * g + 16; ++i) w[i] = a * float(code_value<T>(c[i])) + off;
  }
}

// exact: y[m, n] = Σ_blocks Σ_i (a_g · code_i + b_g) · x[m, i], each block's sum in fp32, the row's in fp64
template <class T>
void exact_rows(const Job& j, int64_t n0, int64_t n1) {
  const int64_t nb = j.k / T::QK;
  std::vector<double> acc(size_t(j.m));
  float w[T::QK];
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t b = 0; b < nb; ++b) {  // each block decoded once, then used by every row of x
      block_weights<T>(j.w + n * j.row_bytes + b * T::BYTES, w);
      for (int64_t m = 0; m < j.m; ++m) {
        const float* x = j.x + m * j.k + b * T::QK;
        float sum = 0;
        for (int i = 0; i < T::QK; ++i) sum += w[i] * x[i];
        acc[size_t(m)] += sum;
      }
    }
    for (int64_t m = 0; m < j.m; ++m) j.y[m * j.n + n] = float(acc[size_t(m)]);
  }
}

// W's rows n0..n1 as fp32 into y [N, K], each weight as exact_rows computes it
template <class T>
void dequant_rows(const Job& j, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < j.k / T::QK; ++b)
      block_weights<T>(j.w + n * j.row_bytes + b * T::BYTES, j.y + n * j.k + b * T::QK);
}

// The integer modes' loop: each block of W's rows n0..n1 decoded once (codes, scales, d, dmin), then for every row
// m of x `part(m, b, codes, head, d, dmin)` gives the block's share of y[m, n], summed in fp32
template <class T, class Part>
void integer_rows(const Job& j, int64_t n0, int64_t n1, Part part) {
  const int64_t nb = j.k / T::QK;
  std::vector<float> acc(size_t(j.m));
  uint8_t c[T::QK];
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = j.w + n * j.row_bytes + b * T::BYTES;
      Head h;
      head_of<T>(blk, h);
      codes<T>(blk, c);
      const float d = d_of<T>(blk), dmin = dmin_of<T>(blk);
      for (int64_t m = 0; m < j.m; ++m) acc[size_t(m)] += part(m, b, c, h, d, dmin);
    }
    for (int64_t m = 0; m < j.m; ++m) j.y[m * j.n + n] = acc[size_t(m)];
  }
}

// Σ_i (code_i − OFF) · q_i over group g of a block's codes, exactly
template <class T, class Q> int32_t group_dot(const uint8_t* c, const Q* q, int g) {
  int32_t dot = 0;
  for (int i = 16 * g; i < 16 * g + 16; ++i) dot += (code_value<T>(c[i]) - T::OFF) * q[i];
  return dot;
}

// int8: per block, integer dot products of the weights' integer parts with x's q8 codes, then
//   y += d·dx · Σ_g sc_g · Σ_i (code_i − OFF)·q_i  −  dmin·dx · Σ_g mn_g · bs_g
template <class T>
void int8_rows(const Job& j, int64_t n0, int64_t n1) {
  const int64_t nb = j.k / T::QK;
  integer_rows<T>(j, n0, n1, [&](int64_t m, int64_t b, const uint8_t* c, const Head& h, float d, float dmin) {
    const int8_t* q = j.q8.q + m * j.k + b * T::QK;
    const int16_t* bs = j.q8.bs + m * (j.k / 16) + b * (T::QK / 16);
    int32_t isum = 0, msum = 0;
    for (int g = 0; g < T::QK / 16; ++g) {
      isum += scale_of<T>(h, g) * group_dot<T>(c, q, g);
      if (T::MIN) msum += min_of<T>(h, g) * bs[g];
    }
    const float dx = j.q8.d[m * nb + b];
    return d * dx * float(isum) - (T::MIN ? dmin * dx * float(msum) : 0.0f);
  });
}

// int16: per 32 elements one dx; per group, the integer dot product of the codes less their offset with x's int16
// codes, times the group's fp32 a_g · dx, plus the min's b_g times the group's fp32 sum of x itself
//   y += Σ_g a_g · dx · Σ_i (code_i − OFF)·q_i  −  dmin · Σ_g mn_g · xs_g
template <class T>
void int16_rows(const Job& j, int64_t n0, int64_t n1) {
  integer_rows<T>(j, n0, n1, [&](int64_t m, int64_t b, const uint8_t* c, const Head& h, float d, float dmin) {
    const int16_t* q = j.q16.q + m * j.k + b * T::QK;
    const float* dx = j.q16.d + m * (j.k / Q16_BLOCK) + b * (T::QK / Q16_BLOCK);
    const float* xs = j.q16.xs + m * (j.k / 16) + b * (T::QK / 16);
    float sum = 0, msum = 0;
    for (int g = 0; g < T::QK / 16; ++g) {
      sum += d * float(scale_of<T>(h, g)) * dx[g / 2] * float(group_dot<T>(c, q, g));
      if (T::MIN) msum += float(min_of<T>(h, g)) * xs[g];
    }
    return sum - dmin * msum;
  });
}

// Per qx elements of x: d = code_scale(max|x|, max_code) and codes round-half-even(x · (1 / d)), all 0 in a block
// holding inf or NaN (kernels.h code_scale). Both quantizers' first step.
template <class Code>
void quantize_codes(const float* x, int64_t k, int qx, float max_code, Code* q, float* d) {
  for (int64_t b = 0; b < k / qx; ++b) {
    const float* xb = x + b * qx;
    float amax = 0, inv;
    bool finite = true;
    for (int i = 0; i < qx; ++i) {
      amax = std::fmax(amax, std::fabs(xb[i]));
      finite = finite && std::fabs(xb[i]) <= FLT_BIG;
    }
    d[b] = code_scale(amax, finite, max_code, &inv);
    for (int i = 0; i < qx; ++i) q[b * qx + i] = finite ? Code(std::nearbyint(xb[i] * inv)) : 0;
  }
}

// One row of x -> int16 codes (kernels.h's Q16Rows): per 32 elements d and codes; per 16 the fp32 sum of x
void quantize16_row(const float* x, int64_t k, int16_t* q, float* d, float* xs) {
  quantize_codes(x, k, Q16_BLOCK, Q16_MAX, q, d);
  for (int64_t g = 0; g < k / 16; ++g) {
    float sum = 0;
    for (int i = 0; i < 16; ++i) sum += x[16 * g + i];
    xs[g] = sum;
  }
}

// One row of x -> q8 (kernels.h's q8_scale): per qx elements d and codes; per 16 elements the sum of the codes
void quantize_row(const float* x, int64_t k, int qx, int8_t* q, float* d, int16_t* bs) {
  quantize_codes(x, k, qx, 127.0f, q, d);
  for (int64_t g = 0; g < k / 16; ++g) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += q[16 * g + i];
    bs[g] = int16_t(sum);
  }
}

#define RL_ATTEND_TARGET
using F = float;  // attend.h's vector: one lane
constexpr int FW = 1;
inline F fzero() { return 0; }
inline F fset(float v) { return v; }
inline F fload(const float* p) { return *p; }
inline void fstore(float* p, F v) { *p = v; }
inline F fadd(F a, F b) { return a + b; }
inline F ffma(F a, F b, F c) { return a * b + c; }
inline float fsum(F v) { return v; }
#include "attend.h"

}  // namespace

const Variant* scalar_variant() {
  static const Variant v = [] {
    Variant t{};
#define RL_FILL(name, id) t.rows[EXACT][T_##name] = exact_rows<name>; t.rows[INT8][T_##name] = int8_rows<name>; \
    t.rows[INT16][T_##name] = int16_rows<name>; \
    t.dequant[T_##name] = dequant_rows<name>;
    RL_FOR_EACH_TYPE(RL_FILL)
#undef RL_FILL
    t.quantize = quantize_row;
    t.quantize16 = quantize16_row;
    t.attend = attend_items;
    return t;
  }();
  return &v;
}

}  // namespace rl
