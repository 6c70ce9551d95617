// The AVX2 + FMA + F16C variant's int16 kernels (x86_int16.h) in a translation unit of their own, compiled beside
// avx2.cpp; its table takes them through avx2_int16_fill (a weak symbol: null where this file is not built).
#include "kernels.h"

#if defined(__x86_64__) && !defined(RL_SCALAR_ONLY)
#include <immintrin.h>

#include <type_traits>

namespace rl {
namespace avx2 {

#define RL_TARGET __attribute__((target("avx2,fma,f16c")))
#include "x86_codes.h"

constexpr int MT = 2;  // rows of x per tile, as avx2.cpp's kernels take them

#include "x86_int16.h"

}  // namespace avx2

void avx2_int16_fill(Variant& t) {
#define RL_FILL(name, id) t.rows[INT16][T_##name] = avx2::int16_rows<name>;
  RL_FOR_EACH_TYPE(RL_FILL)
#undef RL_FILL
  t.quantize16 = avx2::quantize16_row;
}

}  // namespace rl
#endif
