// The AVX2 + FMA + F16C variant's int16 kernels (x86_int16.h), compiled beside avx2.cpp: its table
// takes them through avx2_int16_fill (a weak symbol: null where this file is not built).
#define RL_INT16_NS avx2
#define RL_INT16_TARGET "avx2,fma,f16c"
#define RL_INT16_MT 2
#define RL_INT16_MASKS 0
#define RL_INT16_VNNI 0
#define RL_INT16_FILL avx2_int16_fill
#include "x86_int16.h"
