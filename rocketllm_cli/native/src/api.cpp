// The C entry points the Python side loads with ctypes, and the choice of variant by the CPU's capabilities.
#include <cmath>
#include <mutex>
#include <new>
#include <vector>

#include "kernels.h"
#include "pool.h"
#include "rmsnorm.h"

#if defined(__x86_64__) && !defined(RL_SCALAR_ONLY)
#include <cpuid.h>
#endif

namespace rl {
namespace {

enum Isa { SCALAR = 0, AVX2 = 1, AVX512 = 2, NUM_ISAS };

// Variants this CPU runs, as a bit mask of 1 << Isa: read from cpuid, with the OS's register-saving checked
// (xgetbv), so a kernel never hits an illegal instruction.
int runnable_isas() {
  int mask = 1 << SCALAR;
#if defined(__x86_64__) && !defined(RL_SCALAR_ONLY)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return mask;
  const bool fma = c >> 12 & 1, osxsave = c >> 27 & 1, avx = c >> 28 & 1, f16c = c >> 29 & 1;
  if (!(osxsave && avx)) return mask;
  unsigned xlo, xhi;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool ymm_saved = (xlo & 0x6) == 0x6, zmm_saved = (xlo & 0xE6) == 0xE6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return mask;
  const bool avx2 = b >> 5 & 1, avx512f = b >> 16 & 1, avx512bw = b >> 30 & 1, avx512vl = b >> 31 & 1;
  const bool avx512vnni = c >> 11 & 1;
  if (ymm_saved && avx2 && fma && f16c) {
    mask |= 1 << AVX2;
    if (zmm_saved && avx512f && avx512bw && avx512vl && avx512vnni) mask |= 1 << AVX512;
  }
#endif
  return mask;
}

const Variant* variant(int isa) {
  static const int runnable = runnable_isas();
  if (isa < 0 || isa >= NUM_ISAS || !(runnable >> isa & 1)) return nullptr;
  const Variant* (*built)() = isa == AVX512 ? avx512_variant : isa == AVX2 ? avx2_variant : scalar_variant;
  return built != nullptr ? built() : nullptr;  // null: that variant's file was not compiled in
}

struct Layout { int index, qk, bytes; };

bool layout(int ggml_type, Layout& out) {
  switch (ggml_type) {
#define RL_CASE(name, id) case id: out = {T_##name, name::QK, name::BYTES}; return true;
    RL_FOR_EACH_TYPE(RL_CASE)
#undef RL_CASE
    default: return false;
  }
}

struct QuantizeJob {
  const Variant* v; const float* x; int64_t k; int qx; int8_t* q; float* d; int16_t* bs;
  float* ds;  // or null
};

void quantize_range(void* ctx, int64_t m0, int64_t m1) {
  const auto& j = *static_cast<QuantizeJob*>(ctx);
  for (int64_t m = m0; m < m1; ++m) {
    float* d = j.d + m * (j.k / j.qx);
    int16_t* bs = j.bs + m * (j.k / 16);
    j.v->quantize(j.x + m * j.k, j.k, j.qx, j.q + m * j.k, d, bs);
    if (j.ds != nullptr) block_sums(d, bs, j.k / 32, j.ds + m * (2 * j.k / 32));
  }
}

struct Quantize16Job { const Variant* v; const float* x; int64_t k; int16_t* q; float* d; float* xs; };

void quantize16_range(void* ctx, int64_t m0, int64_t m1) {
  const auto& j = *static_cast<Quantize16Job*>(ctx);
  for (int64_t m = m0; m < m1; ++m)
    j.v->quantize16(j.x + m * j.k, j.k, j.q + m * j.k, j.d + m * (j.k / Q16_BLOCK), j.xs + m * (j.k / 16));
}

struct RowsJob { RowsFn fn; const Job* job; };

void rows_range(void* ctx, int64_t n0, int64_t n1) {
  const auto& j = *static_cast<RowsJob*>(ctx);
  j.fn(*j.job, n0, n1);
}

std::mutex call_mutex;  // one call at a time: the pool and the scratch buffers are shared
std::vector<int8_t> scratch_q;
std::vector<float> scratch_d;
std::vector<int16_t> scratch_bs;
std::vector<float> scratch_ds;
std::vector<int16_t> scratch_q16;
std::vector<float> scratch_xs;
std::vector<float> scratch_part;

struct AttendRun { const Variant* v; const AttendJob* job; };

void attend_range(void* ctx, int64_t i0, int64_t i1) {
  const auto& r = *static_cast<AttendRun*>(ctx);
  r.v->attend(*r.job, i0, i1);
}

// out for query head h = Σ_c e^(m_c − M) · acc_c / Σ_c e^(m_c − M) · l_c over the chunks c of its key/value head
void attend_merge(const AttendJob& j, int64_t chunks, float* out, int64_t out_head) {
  const int64_t group = j.heads / j.kv_heads, dim = j.dim, stride = group * (dim + 2);
  for (int64_t h = 0; h < j.kv_heads; ++h)
    for (int64_t g = 0; g < group; ++g) {
      const float* first = j.part + h * chunks * stride + g * (dim + 2);
      float most = first[0];
      for (int64_t c = 1; c < chunks; ++c) most = std::fmax(most, first[c * stride]);
      float* o = out + (h * group + g) * out_head;
      float total = 0;
      for (int64_t d = 0; d < dim; ++d) o[d] = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* p = first + c * stride;
        const float w = chunks == 1 ? 1.0f : std::exp(p[0] - most);
        total += w * p[1];
        for (int64_t d = 0; d < dim; ++d) o[d] += w * p[2 + d];
      }
      for (int64_t d = 0; d < dim; ++d) o[d] /= total;
    }
}

constexpr int64_t SMALL = 1 << 16;  // multiply-adds (or values to quantize) under which one thread does it all

}  // namespace
}  // namespace rl

using namespace rl;

#define RL_EXPORT __attribute__((visibility("default")))  // the library builds with -fvisibility=hidden

extern "C" {

// Bumped whenever a signature below changes, so that Python never calls a stale library wrongly.
RL_EXPORT int rl_abi_version() { return 7; }

// Bit mask of the variants compiled in and runnable here: 1 scalar, 2 AVX2, 4 AVX-512.
RL_EXPORT int rl_isas() {
  int mask = 0;
  for (int isa = 0; isa < NUM_ISAS; ++isa)
    if (variant(isa) != nullptr) mask |= 1 << isa;
  return mask;
}

// 0 and the block's elements and bytes when `ggml_type` (GGML's type number) has kernels, else -1.
RL_EXPORT int rl_type_layout(int ggml_type, int* qk, int* bytes) {
  Layout l;
  if (!layout(ggml_type, l)) return -1;
  *qk = l.qk;
  *bytes = l.bytes;
  return 0;
}

// x [m, k] fp32 -> q8 codes q [m, k], scales d [m, k / qx], sums of 16 bs [m, k / 16] (int8 mode's first step;
// exposed for the tests). 0, or -1 for a bad argument.
RL_EXPORT int rl_quantize(int isa, const float* x, int64_t m, int64_t k, int qx, int8_t* q, float* d, int16_t* bs) {
  const Variant* v = variant(isa);
  if (v == nullptr || (qx != 32 && qx != QK_K) || k % qx != 0 || m < 0) return -1;
  QuantizeJob job{v, x, k, qx, q, d, bs, nullptr};
  quantize_range(&job, 0, m);
  return 0;
}

// x [m, k] fp32 -> int16 codes q [m, k], scales d [m, k / 32], sums of 16 xs [m, k / 16] (int16 mode's first
// step; exposed for the tests). 0, or -1 for a bad argument.
RL_EXPORT int rl_quantize16(int isa, const float* x, int64_t m, int64_t k, int16_t* q, float* d, float* xs) {
  const Variant* v = variant(isa);
  if (v == nullptr || v->quantize16 == nullptr || k % Q16_BLOCK != 0 || m < 0) return -1;
  Quantize16Job job{v, x, k, q, d, xs};
  quantize16_range(&job, 0, m);
  return 0;
}

// y [m, n] = x [m, k] · Wᵀ, W the raw blocks [n, row_bytes] of GGML type `ggml_type`; mode 0 exact, 1 int8,
// 2 int16.
// 0, or -1 bad type, -2 variant not runnable here, -3 shapes, -4 mode, -5 out of memory.
RL_EXPORT int rl_matmul(int isa, int ggml_type, int mode, const uint8_t* w, int64_t n, int64_t row_bytes,
                        const float* x, int64_t m, int64_t k, float* y, int threads) {
  Layout l;
  if (!layout(ggml_type, l)) return -1;
  const Variant* v = variant(isa);
  if (v == nullptr) return -2;
  if (n < 0 || m < 0 || k < 0 || k % l.qk != 0 || row_bytes != k / l.qk * l.bytes) return -3;
  if (mode < 0 || mode >= NUM_MODES || v->rows[mode][l.index] == nullptr) return -4;
  if (mode == INT16 && v->quantize16 == nullptr) return -4;
  if (n == 0 || m == 0) return 0;
  threads = threads < 1 ? 1 : threads > 1024 ? 1024 : threads;
  std::lock_guard<std::mutex> lock(call_mutex);
  Job job{w, row_bytes, x, m, k, {}, {}, y, n};
  if (mode == INT8) {
    try {
      scratch_q.resize(size_t(m * k));
      scratch_d.resize(size_t(m * (k / l.qk)));
      scratch_bs.resize(size_t(m * (k / 16)));
      if (l.qk == 32) scratch_ds.resize(size_t(m * (2 * k / 32)));
    } catch (const std::bad_alloc&) {
      return -5;
    }
    float* ds = l.qk == 32 ? scratch_ds.data() : nullptr;
    QuantizeJob qj{v, x, k, l.qk, scratch_q.data(), scratch_d.data(), scratch_bs.data(), ds};
    parallel_for(m * k < SMALL ? 1 : threads, m, 1, quantize_range, &qj);
    job.q8 = {scratch_q.data(), scratch_d.data(), scratch_bs.data(), ds};
  } else if (mode == INT16) {
    try {
      scratch_q16.resize(size_t(m * k));
      scratch_d.resize(size_t(m * (k / Q16_BLOCK)));
      scratch_xs.resize(size_t(m * (k / 16)));
    } catch (const std::bad_alloc&) {
      return -5;
    }
    Quantize16Job qj{v, x, k, scratch_q16.data(), scratch_d.data(), scratch_xs.data()};
    parallel_for(m * k < SMALL ? 1 : threads, m, 1, quantize16_range, &qj);
    job.q16 = {scratch_q16.data(), scratch_d.data(), scratch_xs.data()};
  }
  if (m * n * k < SMALL) threads = 1;
  // pieces of whole n-tiles, about four per thread so that a slow core does not hold the others up
  int64_t chunk = (n + 4 * threads - 1) / (4 * threads);
  chunk = (chunk + N_TILE - 1) / N_TILE * N_TILE;
  RowsJob rj{v->rows[mode][l.index], &job};
  parallel_for(threads, n, chunk, rows_range, &rj);
  return 0;
}

// out [n, k] = W's weights in fp32, W the raw blocks [n, row_bytes] of GGML type `ggml_type`: exact mode's weights,
// for a prefill's dense multiply. 0, or -1 bad type, -2 variant not runnable here, -3 shapes.
RL_EXPORT int rl_dequantize(int isa, int ggml_type, const uint8_t* w, int64_t n, int64_t row_bytes, int64_t k,
                            float* out, int threads) {
  Layout l;
  if (!layout(ggml_type, l)) return -1;
  const Variant* v = variant(isa);
  if (v == nullptr || v->dequant[l.index] == nullptr) return -2;
  if (n < 0 || k < 0 || k % l.qk != 0 || row_bytes != k / l.qk * l.bytes) return -3;
  if (n == 0 || k == 0) return 0;
  threads = threads < 1 ? 1 : threads > 1024 ? 1024 : threads;
  if (n * k < SMALL) threads = 1;
  std::lock_guard<std::mutex> lock(call_mutex);
  Job job{w, row_bytes, nullptr, 0, k, {}, {}, out, n};
  RowsJob rj{v->dequant[l.index], &job};
  parallel_for(threads, n, (n + 4 * threads - 1) / (4 * threads), rows_range, &rj);
  return 0;
}

// A decode step's attention (attend.h): out [heads, dim] = softmax(scale · q Kᵀ) V, one query position per head,
// query head h on key/value head h / (heads / kv_heads); q, K, V and out fp32 with each row's dim values contiguous,
// at the given strides in floats. 0, or -2 variant not runnable here, -3 shapes, -5 out of memory.
RL_EXPORT int rl_attend(int isa, const float* q, int64_t heads, int64_t q_head, const float* k, int64_t kv_heads,
                        int64_t length, int64_t k_head, int64_t k_row, const float* v, int64_t v_head, int64_t v_row,
                        int64_t dim, float scale, float* out, int64_t out_head, int threads) {
  const Variant* var = variant(isa);
  if (var == nullptr || var->attend == nullptr) return -2;
  if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0 || length < 1 || dim < 1) return -3;
  const int64_t chunks = (length + ATTEND_CHUNK - 1) / ATTEND_CHUNK, items = kv_heads * chunks;
  threads = threads < 1 ? 1 : threads > 1024 ? 1024 : threads;
  if (2 * heads * length * dim < SMALL) threads = 1;
  std::lock_guard<std::mutex> lock(call_mutex);
  try {
    scratch_part.resize(size_t(items * (heads / kv_heads) * (dim + 2)));
  } catch (const std::bad_alloc&) {
    return -5;
  }
  const AttendJob job{q, q_head, k, k_head, k_row, v, v_head, v_row, heads, kv_heads, length, dim, scale,
                      scratch_part.data()};
  AttendRun run{var, &job};
  parallel_for(threads, items, 1, attend_range, &run);
  attend_merge(job, chunks, out, out_head);
  return 0;
}

// transformers' rotary embedding of q and k at once: y = (x · cos) + (rotate_half(x) · sin), rotate_half(x) = (−x2, x1)
// of x's halves. x [heads, positions, dim] at the given strides in floats (dim contiguous), cos and sin [positions,
// dim] at row stride cs_row, y like x at its own strides. Each product and the sum rounded apart, as torch's ops round
// them (the library is built with -ffp-contract=off: no FMA). 0, or -3 shapes.
static void rope_heads(const float* x, int64_t heads, int64_t x_head, int64_t x_pos, float* y, int64_t y_head,
                       int64_t y_pos, int64_t positions, int64_t dim, const float* cos, const float* sin,
                       int64_t cs_row) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t p = 0; p < positions; ++p) {
      const float* a = x + h * x_head + p * x_pos;
      const float *c = cos + p * cs_row, *s = sin + p * cs_row;
      float* out = y + h * y_head + p * y_pos;
      for (int64_t i = 0; i < half; ++i) {
        const float u = a[i] * c[i], v = -a[i + half] * s[i];
        out[i] = u + v;
      }
      for (int64_t i = half; i < dim; ++i) {
        const float u = a[i] * c[i], v = a[i - half] * s[i];
        out[i] = u + v;
      }
    }
}

RL_EXPORT int rl_rope(const float* q, int64_t q_heads, int64_t q_head, int64_t q_pos, float* q_out, int64_t qo_head,
                      int64_t qo_pos, const float* k, int64_t k_heads, int64_t k_head, int64_t k_pos, float* k_out,
                      int64_t ko_head, int64_t ko_pos, int64_t positions, int64_t dim, const float* cos,
                      const float* sin, int64_t cs_row) {
  if (q_heads < 0 || k_heads < 0 || positions < 0 || dim < 0 || dim % 2 != 0) return -3;
  rope_heads(q, q_heads, q_head, q_pos, q_out, qo_head, qo_pos, positions, dim, cos, sin, cs_row);
  rope_heads(k, k_heads, k_head, k_pos, k_out, ko_head, ko_pos, positions, dim, cos, sin, cs_row);
  return 0;
}

// Hold the pool's workers awake between calls (1) or let them sleep after a short spin (0): pool.h.
RL_EXPORT void rl_pool_hold(int on) { pool_hold(on != 0); }

// transformers' RMS norm (rmsnorm.h): y [rows, n] = x · rsqrt(mean(x²) + eps) · w, fp32, contiguous; weight may be
// null (none) or taken as 1 + weight (one_plus); lanes: the float vector width torch's sum adds rows in (8 or 16).
// 0, or -3 shapes, -5 out of memory.
RL_EXPORT int rl_rms_norm(const float* x, int64_t rows, int64_t n, const float* weight, int one_plus, float eps,
                          int lanes, float* y) {
  if (rows < 0 || n < 1 || (lanes != 8 && lanes != 16)) return -3;
  thread_local std::vector<float> scratch;
  try {
    if (scratch.size() < size_t(n)) scratch.resize(size_t(n));
  } catch (const std::bad_alloc&) {
    return -5;
  }
  rms_norm_rows(x, rows, n, weight, one_plus, eps, lanes, y, scratch.data());
  return 0;
}

}  // extern "C"
