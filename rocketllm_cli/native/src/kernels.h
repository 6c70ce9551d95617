// What one matmul call hands the kernels, and the table of kernels each variant (scalar, AVX2, AVX-512) fills.
#pragma once
#include <cstdint>
#include <limits>

#include "blocks.h"

namespace rl {

enum Mode { EXACT = 0, INT8 = 1, INT16 = 2, NUM_MODES };

// x quantized for int8 mode, each row on its own: per QX = the weight type's block size (32 or 256) elements one
// scale d = max|x| / 127 and codes q = round-half-even(x / d); per 16 elements the sum of the codes.
struct Q8Rows {
  const int8_t* q;    // [M, K]
  const float* d;     // [M, K / QX]
  const int16_t* bs;  // [M, K / 16]
  const float* ds;    // [M, 2 · K / 32], 32-element types only: per block d and d · Σq side by side
};

// ds of one row from its d and bs (QX = 32): what a block's scales multiply, in the order they are loaded
inline void block_sums(const float* d, const int16_t* bs, int64_t blocks, float* ds) {
  for (int64_t b = 0; b < blocks; ++b) {
    ds[2 * b] = d[b];
    ds[2 * b + 1] = d[b] * float(bs[2 * b] + bs[2 * b + 1]);  // |Σq| <= 32 · 127: exact in fp32
  }
}

// x quantized for int16 mode, each row on its own: per 32 elements one scale d = max|x| / 32767 and codes
// q = round-half-even(x / d); per 16 elements the fp32 sum of x itself (what a block's min or offset multiplies).
// A weight's code times q needs no more than int32 over a group: |code| <= 127, so 16 products stay under 2^26.
constexpr int Q16_BLOCK = 32;
constexpr float Q16_MAX = 32767.0f;
struct Q16Rows {
  const int16_t* q;  // [M, K]
  const float* d;    // [M, K / 32]
  const float* xs;   // [M, K / 16]
};

struct Job {                           // y = x · Wᵀ
  const uint8_t* w; int64_t row_bytes;  // W: [N, row_bytes], row n = output feature n, K / QK blocks
  const float* x; int64_t m, k;         // x: [M, K] fp32, contiguous
  Q8Rows q8;                            // int8 mode only
  Q16Rows q16;                          // int16 mode only
  float* y; int64_t n;                  // y: [M, N] fp32, contiguous
};

// A quantizer's scale of one block of x from its max |x|: d = amax / max_code (127 for int8 mode, 32767 for int16),
// codes round(x · inv) with inv = 1 / d.
// A block whose max is under 1e-30 gets d = 0 (all codes 0, and 1 / d stays finite); one holding inf or NaN gets
// all codes 0 and d = NaN, so that every output it reaches is NaN, as in exact mode. Shared by every quantizer.
inline float code_scale(float amax, bool finite, float max_code, float* inv) {
  if (!finite) {
    *inv = 0;
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (!(amax >= 1e-30f)) {
    *inv = 0;
    return 0;
  }
  const float d = amax / max_code;
  *inv = 1.0f / d;
  return d;
}
inline float q8_scale(float amax, bool finite, float* inv) { return code_scale(amax, finite, 127.0f, inv); }
constexpr float FLT_BIG = std::numeric_limits<float>::max();  // |x| > this, or unordered: inf or NaN

using RowsFn = void (*)(const Job&, int64_t n0, int64_t n1);  // y[:, n0:n1]
// one row of x [K] -> q [K], d [K / qx], bs [K / 16]
using QuantizeFn = void (*)(const float* x, int64_t k, int qx, int8_t* q, float* d, int16_t* bs);
// one row of x [K] -> int16 codes q [K], scales d [K / 32], sums xs [K / 16]
using Quantize16Fn = void (*)(const float* x, int64_t k, int16_t* q, float* d, float* xs);

// A decode step's attention (attend.h): q [heads, dim], K and V [kv_heads, length, dim], each row's dim values
// contiguous at the given strides (in floats); per work item (a key/value head and ATTEND_CHUNK positions) part holds,
// per query head of its group, its scores' max, the sum of their exponentials and the dim weighted values.
constexpr int64_t ATTEND_CHUNK = 64;
struct AttendJob {
  const float* q; int64_t q_head;
  const float* k; int64_t k_head, k_row;
  const float* v; int64_t v_head, v_row;
  int64_t heads, kv_heads, length, dim;
  float scale;
  float* part;  // [kv_heads · chunks, heads / kv_heads, dim + 2]
};
using AttendFn = void (*)(const AttendJob&, int64_t i0, int64_t i1);  // work items i0..i1

struct Variant {
  RowsFn rows[NUM_MODES][NUM_TYPES];  // [mode][type]
  RowsFn dequant[NUM_TYPES];          // W's rows n0..n1 as fp32 into y [N, K]: the weights exact mode multiplies by
  QuantizeFn quantize;
  Quantize16Fn quantize16;
  AttendFn attend;
};

// The variants built into this library; avx2 / avx512 return null where the platform has no x86 code. Each lives in
// a file of its own, which the build compiles only where asked (native/build.py: the best this CPU runs, by
// default): a variant left out is a weak symbol that links to null.
__attribute__((weak)) const Variant* scalar_variant();
__attribute__((weak)) const Variant* avx2_variant();
__attribute__((weak)) const Variant* avx512_variant();
// Each x86 variant's int16 kernels, in files of their own (avx2_int16.cpp, avx512_int16.cpp): fill t's int16 entries
__attribute__((weak)) void avx2_int16_fill(Variant& t);
__attribute__((weak)) void avx512_int16_fill(Variant& t);

constexpr int N_TILE = 8;  // rows of W per pass over x's m-tiles (their blocks stay in L1 while x's rows cycle)

using TileFn = void (*)(const Job&, int64_t n, int64_t m0);  // y[m0 : m0 + MT, n]

// Rows of W are read once per call, straight from memory, and the cores' own prefetchers stop at every 4 KiB page. So
// each kernel asks for the bytes STREAM_BYTES ahead of the blocks it is about to multiply, as it goes (stream_ahead:
// a prefetch never faults, past the end included), into L2 (a T1 hint: more misses in flight than L1 takes, and L1
// keeps the interpreter's and x's lines). Each row's bytes 1.5 KiB ahead asked for at once as the row started, into
// L1, had served compute and memory one after the other: [1, 4096] x [4096, 4096] products cycling through 512 MiB
// on a 2-core Xeon, int16, 2 threads: Q4_0 11.6 -> 17.9 GB/s, Q4_1 12.5 -> 17.5, Q8_0 18.0 -> 21.7, Q4_K 12.5 ->
// 18.9, Q6_K 11.4 -> 17.1. 3-8 KiB ahead measured alike; T0 (L1) 5-12% slower; 1 KiB ahead 10-20% slower.
constexpr int64_t STREAM_BYTES = 4096;
inline void stream_ahead(const uint8_t* at, int64_t bytes) {
  const char* from = reinterpret_cast<const char*>(at) + STREAM_BYTES;
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(from + i, 0, 2);
}

// Visit y[:, n0:n1] by tiles: MT rows of x at a time (a block's decoded weights serve them all), the rest one by one
template <int MT>
inline void for_each_tile(const Job& j, int64_t n0, int64_t n1, TileFn tile, TileFn tile1) {
  for (int64_t nt = n0; nt < n1; nt += N_TILE) {
    const int64_t ne = nt + N_TILE < n1 ? nt + N_TILE : n1;
    int64_t m0 = 0;
    for (; m0 + MT <= j.m; m0 += MT)
      for (int64_t n = nt; n < ne; ++n) tile(j, n, m0);
    for (; m0 < j.m; ++m0)
      for (int64_t n = nt; n < ne; ++n) tile1(j, n, m0);
  }
}

}  // namespace rl
