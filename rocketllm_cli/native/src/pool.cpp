// The thread pool behind parallel_for (pool.h).
#include "pool.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace rl {
namespace {

// A worker's wait for the next call before it sleeps. A decode step calls hundreds of products with torch's small ops
// between them (~0.1 ms); a worker asleep by then is woken by an interrupt each call (SmolLM2 Q4_1 on 2 cores: 20.7
// ms/token at 50 us, 15.9 at 500 us, torch on one thread meanwhile; threads.py native_pass).
constexpr auto SPIN = std::chrono::microseconds(500);
// How long held workers spin after the last call before they sleep anyway. Held, they spin through a pass whose
// every product runs here (torch on one thread meanwhile): a worker asleep while torch ran a prompt's attention (~0.5
// ms) was woken on a halted vCPU, 1.6-3.5 ms for the next product, ~14 times a SmolLM2 prompt of 16 tokens.
constexpr auto HOLD = std::chrono::milliseconds(50);

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  void hold(bool on) {
    last_call_.store(now_ns(), std::memory_order_relaxed);
    held_.store(on, std::memory_order_release);
    if (!on) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      hold_epoch_ += 1;
    }
    wake_.notify_all();
  }

  void run(int threads, int64_t total, int64_t chunk, RangeFn fn, void* ctx) {
    spawn(threads - 1);
    last_call_.store(now_ns(), std::memory_order_relaxed);
    total_ = total; chunk_ = chunk; fn_ = fn; ctx_ = ctx;
    next_.store(0, std::memory_order_relaxed);
    pending_.store(threads - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);  // a worker about to sleep checks the word under this lock
      generation_ += 1;
      word_.store(generation_ << 16 | uint64_t(threads), std::memory_order_release);
    }
    wake_.notify_all();
    work();
    for (int i = 1; pending_.load(std::memory_order_acquire) > 0; ++i)
      if (i % 4096 == 0) std::this_thread::yield(); else relax();  // a worker may have lost its core
  }

 private:
  void spawn(int wanted) {
    for (; workers_ < wanted; ++workers_) {
      const uint64_t seen = word_.load(std::memory_order_relaxed);
      std::thread([this, index = workers_, seen] { loop(index, seen); }).detach();  // the pool is never freed
    }
  }
  void work() {
    for (;;) {
      const int64_t begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
      if (begin >= total_) return;
      fn_(ctx_, begin, begin + chunk_ < total_ ? begin + chunk_ : total_);
    }
  }
  void loop(int index, uint64_t seen) {
    for (;;) {
      seen = wait(seen);
      if (index < int(seen & 0xFFFF) - 1) {  // word: generation << 16 | threads of this call
        work();
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }
  uint64_t wait(uint64_t seen) {
    for (;;) {
      const int64_t start = now_ns(), spin = std::chrono::nanoseconds(SPIN).count();
      const int64_t hold = std::chrono::nanoseconds(HOLD).count();
      for (int i = 1;; ++i) {
        const uint64_t word = word_.load(std::memory_order_acquire);
        if (word != seen) return word;
        relax();
        if (i % 256) continue;
        const int64_t t = now_ns();
        if (!held_.load(std::memory_order_acquire)) {
          if (t - start > spin) break;
        } else if (t - last_call_.load(std::memory_order_relaxed) > hold) {
          break;
        } else if (i % 1024 == 0) {
          std::this_thread::yield();  // a thread that needs this core gets it
        }
      }
      std::unique_lock<std::mutex> lock(mutex_);
      const uint64_t epoch = hold_epoch_;
      wake_.wait(lock, [&] { return word_.load(std::memory_order_acquire) != seen || hold_epoch_ != epoch; });
      if (word_.load(std::memory_order_acquire) != seen) return word_.load(std::memory_order_acquire);
    }  // held again: spin
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> word_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> held_{false};
  std::atomic<int64_t> last_call_{0};  // steady clock ns of the last call or hold
  uint64_t generation_ = 0;
  uint64_t hold_epoch_ = 0;  // under mutex_: bumped by each hold, which wakes the sleepers
  int workers_ = 0;
  int64_t total_ = 0, chunk_ = 1;
  RangeFn fn_ = nullptr;
  void* ctx_ = nullptr;
};

Pool* this_process_pool() {
  static Pool* pool = nullptr;  // leaked on purpose: detached workers wait on it until the process ends
  static pid_t owner = 0;
  if (pool == nullptr || owner != getpid()) {  // a forked child has the memory but not the threads
    pool = new Pool;
    owner = getpid();
  }
  return pool;
}

}  // namespace

void parallel_for(int threads, int64_t total, int64_t chunk, RangeFn fn, void* ctx) {
  if (threads <= 1 || total <= chunk) {
    fn(ctx, 0, total);
    return;
  }
  this_process_pool()->run(threads, total, chunk, fn, ctx);
}

void pool_hold(bool on) { this_process_pool()->hold(on); }

}  // namespace rl
