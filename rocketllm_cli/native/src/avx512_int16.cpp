// The AVX-512 (F, BW, VL, VNNI) variant's int16 kernels (x86_int16.h), compiled beside avx512.cpp: its table
// takes them through avx512_int16_fill (a weak symbol: null where this file is not built).
#define RL_INT16_NS avx512
#define RL_INT16_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define RL_INT16_MT 4
#define RL_INT16_MASKS 1
#define RL_INT16_VNNI 1
#define RL_INT16_FILL avx512_int16_fill
#include "x86_int16.h"
