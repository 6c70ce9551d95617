// A decode step's attention in fp32, one query position per head: out_h = softmax(scale · q_h · Kᵀ) · V over the
// cache's L positions, query head h reading key/value head h / (heads / kv_heads) (grouped-query attention).
//
// Each variant's file includes this inside its namespace, after defining RL_ATTEND_TARGET (its target attribute,
// empty for the portable one) and its float vector F of FW lanes with fzero, fset, fload, fstore, fadd, ffma and fsum
// (the portable variant's F is one float). A work item is one key/value head and ATTEND_CHUNK positions of the cache:
// its keys and values are read from memory once (each query head of the group reads them again from L1), and it
// leaves per query head its scores' max m, the sum l of e^(s − m) and Σ e^(s − m) · v, which api.cpp's rl_attend
// merges across chunks (flash-decoding's split of the cache, so that two cores share one head).
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>

#define RL_ATTEND_INLINE inline __attribute__((always_inline)) RL_ATTEND_TARGET

// a · b over n floats: two vector accumulators, one horizontal sum
RL_ATTEND_INLINE float attend_dot(const float* a, const float* b, int64_t n) {
  F acc0 = fzero(), acc1 = fzero();
  int64_t i = 0;
  for (; i + 2 * FW <= n; i += 2 * FW) {
    acc0 = ffma(fload(a + i), fload(b + i), acc0);
    acc1 = ffma(fload(a + i + FW), fload(b + i + FW), acc1);
  }
  for (; i + FW <= n; i += FW) acc0 = ffma(fload(a + i), fload(b + i), acc0);
  float s = fsum(fadd(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc += p0 · v0 + p1 · v1 + p2 · v2 + p3 · v3 over n floats
RL_ATTEND_INLINE void attend_axpy4(float* acc, const float* p, const float* v0, int64_t row, int64_t n) {
  const F f0 = fset(p[0]), f1 = fset(p[1]), f2 = fset(p[2]), f3 = fset(p[3]);
  const float *v1 = v0 + row, *v2 = v1 + row, *v3 = v2 + row;
  int64_t d = 0;
  for (; d + FW <= n; d += FW)
    fstore(acc + d, ffma(f3, fload(v3 + d), ffma(f2, fload(v2 + d), ffma(f1, fload(v1 + d), ffma(f0, fload(v0 + d),
                                                                                                 fload(acc + d))))));
  for (; d < n; ++d) acc[d] += p[0] * v0[d] + p[1] * v1[d] + p[2] * v2[d] + p[3] * v3[d];
}

// e^x for x <= 0 (a score less its row's max), 0 below -87 (e^-87 is near fp32's least normal), NaN for NaN:
// x = n · ln 2 + r with |r| <= ln 2 / 2, e^r by Cephes' degree-6 polynomial (~1 ulp), 2^n put into the exponent.
// n is rounded by adding and taking away 1.5 · 2^23, so the loop over a row vectorises on every target.
RL_ATTEND_INLINE float attend_exp(float x) {
  const float c = x < -87.0f ? -87.0f : x;
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.0f ? 0.0f : p * two_n;
}

RL_ATTEND_TARGET void attend_items(const AttendJob& j, int64_t i0, int64_t i1) {
  const int64_t group = j.heads / j.kv_heads, chunks = (j.length + ATTEND_CHUNK - 1) / ATTEND_CHUNK, dim = j.dim;
  alignas(64) float s[ATTEND_CHUNK];
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t h = item / chunks, l0 = item % chunks * ATTEND_CHUNK;
    const int64_t rows = j.length - l0 < ATTEND_CHUNK ? j.length - l0 : ATTEND_CHUNK;
    const float* k = j.k + h * j.k_head + l0 * j.k_row;
    const float* v = j.v + h * j.v_head + l0 * j.v_row;
    float* part = j.part + item * group * (dim + 2);
    for (int64_t g = 0; g < group; ++g) {
      const float* q = j.q + (h * group + g) * j.q_head;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < rows; ++l) {
        s[l] = j.scale * attend_dot(q, k + l * j.k_row, dim);
        m = s[l] > m ? s[l] : m;  // a NaN score is left out here and gives NaN below
      }
      for (int64_t l = 0; l < rows; ++l) s[l] = attend_exp(s[l] - m);
      float sum = 0;
      for (int64_t l = 0; l < rows; ++l) sum += s[l];
      float* acc = part + g * (dim + 2) + 2;
      for (int64_t d = 0; d < dim; ++d) acc[d] = 0;
      int64_t l = 0;
      for (; l + 4 <= rows; l += 4) attend_axpy4(acc, s + l, v + l * j.v_row, j.v_row, dim);  // 4 rows a trip
      for (; l < rows; ++l) {
        const float p = s[l], *vl = v + l * j.v_row;
        for (int64_t d = 0; d < dim; ++d) acc[d] += p * vl[d];
      }
      part[g * (dim + 2)] = m;
      part[g * (dim + 2) + 1] = sum;
    }
  }
}
