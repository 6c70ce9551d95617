// transformers' RMS norm in one call, in the bits torch's ops give: y = (x · rsqrt(mean(x²) + eps)) · w.
//
// The one step whose bits depend on an order is the sum of x² that mean() takes; torch's CPU sum of a contiguous row
// (ATen's SumKernel.cpp, cascade_sum) adds the row as vectors of `lanes` floats (16 where it dispatches AVX-512, 8
// otherwise), four vectors side by side, in a cascade of up to four levels of 16 or more steps each, then the four
// vectors into the first, then the scalars past the last whole vector, then the vector's lanes in order. This is that
// order written out; the Python side probes it against the module's own forward and keeps it only where the bits
// agree. Each product and sum is rounded on its own (the library is built with -ffp-contract=off: no FMA).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace rl {

inline int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = uint64_t(x) - 1; v != 0; v >>= 1) ++bits;
  return bits;
}

// acc[r] (each of `width` floats) += the sum over i < size of item(i, r), in the cascade of ATen's multi_row_sum for
// four rows; item(i, r) is the element at (i * 4 + r) of `sq`, an element a run of `width` floats.
inline void cascade_rows(const float* sq, int64_t size, int width, float acc_out[4][16]) {
  constexpr int LEVELS = 4, ROWS = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / LEVELS), step = int64_t(1) << power, mask = step - 1;
  float acc[LEVELS][ROWS][16] = {};
  auto add_items = [&](int64_t i) {
    for (int r = 0; r < ROWS; ++r)
      for (int l = 0; l < width; ++l) acc[0][r][l] += sq[(i * ROWS + r) * width + l];
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) add_items(i);
    for (int level = 1; level < LEVELS; ++level) {
      for (int r = 0; r < ROWS; ++r)
        for (int l = 0; l < width; ++l) {
          acc[level][r][l] += acc[level - 1][r][l];
          acc[level - 1][r][l] = 0.0f;
        }
      if ((i & (mask << (level * power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_items(i);
  for (int level = 1; level < LEVELS; ++level)
    for (int r = 0; r < ROWS; ++r)
      for (int l = 0; l < width; ++l) acc[0][r][l] += acc[level][r][l];
  for (int r = 0; r < ROWS; ++r)
    for (int l = 0; l < width; ++l) acc_out[r][l] = acc[0][r][l];
}

// ATen's row_sum: `count` elements (runs of `width` floats) of sq, four at a time in the cascade, the rest into the
// first, then the four into the first.
inline void row_sum(const float* sq, int64_t count, int width, float out[16]) {
  float part[4][16];
  const int64_t size = count / 4;
  cascade_rows(sq, size, width, part);
  for (int64_t i = size * 4; i < count; ++i)
    for (int l = 0; l < width; ++l) part[0][l] += sq[i * width + l];
  for (int r = 1; r < 4; ++r)
    for (int l = 0; l < width; ++l) part[0][l] += part[r][l];
  for (int l = 0; l < width; ++l) out[l] = part[0][l];
}

// The sum of sq[0, n) as torch's CPU sum of a contiguous row with `lanes`-float vectors adds it.
inline float torch_row_sum(const float* sq, int64_t n, int lanes) {
  float total;
  if (n >= lanes) {  // vectorized_inner_sum
    float lane_sums[16];
    const int64_t vectors = n / lanes;
    row_sum(sq, vectors, lanes, lane_sums);
    total = 0.0f;
    for (int64_t i = vectors * lanes; i < n; ++i) total += sq[i];
    for (int l = 0; l < lanes; ++l) total += lane_sums[l];
  } else {  // scalar_inner_sum
    float one[16];
    row_sum(sq, n, 1, one);
    total = one[0];
  }
  return 0.0f + total;  // the reduction's output starts at zero and takes the sum added
}

// y [rows, n] = x · r · w per row, r = 1 / sqrt(sum(x²) / n + eps), w = weight (or 1 + weight where one_plus, as
// Gemma's norms weigh; no weight where it is null). scratch: n floats.
inline void rms_norm_rows(const float* x, int64_t rows, int64_t n, const float* weight, int one_plus, float eps,
                          int lanes, float* y, float* scratch) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* a = x + row * n;
    float* out = y + row * n;
    for (int64_t i = 0; i < n; ++i) scratch[i] = a[i] * a[i];
    const float mean = torch_row_sum(scratch, n, lanes) / float(n);
    const float r = 1.0f / std::sqrt(mean + eps);
    if (weight == nullptr) {
      for (int64_t i = 0; i < n; ++i) out[i] = a[i] * r;
    } else if (one_plus) {
      for (int64_t i = 0; i < n; ++i) {
        const float scaled = a[i] * r, w = 1.0f + weight[i];
        out[i] = scaled * w;
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const float scaled = a[i] * r;
        out[i] = scaled * weight[i];
      }
    }
  }
}

}  // namespace rl
