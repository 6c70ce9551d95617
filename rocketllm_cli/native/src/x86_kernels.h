// The x86 exact kernels, written once over the variant's float vector F (FW lanes), and included by avx2.cpp and
// avx512.cpp inside their namespace after x86_codes.h and these ops of theirs:
//   F fzero(), fset(float), fload(const float*), fadd(F, F), ffma(F, F, F); float fsum(F); fstore(float*, F)
//   to_float<SIGNED>(__m256i codes, F out[32 / FW]): the 32 codes as fp32, unsigned or signed bytes
//   scale_floats(__m256i s, float mult, float out[16]): out[g] = mult · s[g] for 16 int16 s (64-byte aligned out)
//   signed_floats(const uint8_t* p, F out[32 / FW]): the 32 int8 at p as fp32
//   codes_as_floats<T>(const uint8_t* blk, int c, F out[32 / FW]): chunk c's 32 codes as fp32
//   constexpr int MT: rows of x per tile
// The int8 kernels differ more between the two (VNNI, 64-byte vectors) and live in each file.
// (No include guard on purpose.)

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
      stream_ahead(row + b * T::BYTES, 2 * T::BYTES);
      exact_block<T, M, 0>(row + b * T::BYTES, x + b * T::QK, j.k, acc);
      exact_block<T, M, 1>(row + (b + 1) * T::BYTES, x + (b + 1) * T::QK, j.k, acc);
    }
  for (; b < nb; ++b) {
    stream_ahead(row + b * T::BYTES, T::BYTES);
    exact_block<T, M, 0>(row + b * T::BYTES, x + b * T::QK, j.k, acc);
  }
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
    stream_ahead(row + b * Q8_0::BYTES, 2 * Q8_0::BYTES);
    exact_q8_block<M, 0>(row + b * Q8_0::BYTES, x + b * 32, j.k, acc);
    exact_q8_block<M, 1>(row + (b + 1) * Q8_0::BYTES, x + (b + 1) * 32, j.k, acc);
  }
  if (b < nb) {
    stream_ahead(row + b * Q8_0::BYTES, Q8_0::BYTES);
    exact_q8_block<M, 0>(row + b * Q8_0::BYTES, x + b * 32, j.k, acc);
  }
  for (int t = 0; t < M; ++t) j.y[(m0 + t) * j.n + n] = fsum(fadd(acc[t][0], acc[t][1]));
}

// W's rows n0..n1 as fp32 into y [N, K], each weight exact_block's a · code + b (Q8_0: d · code, exact either way):
// what a prefill multiplies densely (packed/dense.py), a chunk of rows at a time.
template <class T> RL_TARGET void dequant_rows(const Job& j, int64_t n0, int64_t n1) {
  constexpr int NV = 32 / FW;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    float* out = j.y + n * j.k;
    for (int64_t b = 0; b < j.k / T::QK; ++b) {
      const uint8_t* blk = row + b * T::BYTES;
      const Scales<T> s = scales_of<T>(blk);
      alignas(64) float a[16], off[16];
      if constexpr (T::SCALED) {
        scale_floats(s.sc, s.d, a);
        if (T::MIN) scale_floats(s.mn, -s.dmin, off); else scale_floats(s.sc, -float(T::OFF) * s.d, off);
      } else {
        a[0] = a[1] = s.d;
        off[0] = off[1] = T::MIN ? s.dmin : -float(T::OFF) * s.d;
      }
      for (int c = 0; c < T::QK / 32; ++c) {
        F w[NV];
        codes_as_floats<T>(blk, c, w);
        for (int v = 0; v < NV; ++v) {
          const int g = 2 * c + v * FW / 16;
          fstore(out + b * T::QK + 32 * c + FW * v, ffma(fset(a[g]), w[v], fset(off[g])));
        }
      }
    }
  }
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

