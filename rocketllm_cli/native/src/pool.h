// A small thread pool (no OpenMP: torch ships its own runtime, and two of them fight over the cores).
#pragma once
#include <cstdint>

namespace rl {

using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);

// fn(ctx, begin, end) over [0, total) in pieces of `chunk`, on `threads` threads: the caller and threads - 1
// workers, which spin briefly after a call (the next one often follows at once), then sleep on a condition
// variable. One call at a time (the caller serialises); safe after fork (a child starts a pool of its own).
void parallel_for(int threads, int64_t total, int64_t chunk, RangeFn fn, void* ctx);

// While held, the workers spin between calls instead of sleeping after a short spin, until released or until a while
// after the last call (a pass that raised never releases them). Holding wakes sleeping workers, so the first call of
// a pass finds them awake.
void pool_hold(bool on);

}  // namespace rl
