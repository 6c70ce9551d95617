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

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  void run(int threads, int64_t total, int64_t chunk, RangeFn fn, void* ctx) {
    spawn(threads - 1);
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
    const auto start = std::chrono::steady_clock::now();
    for (int i = 1;; ++i) {
      const uint64_t word = word_.load(std::memory_order_acquire);
      if (word != seen) return word;
      relax();
      if (i % 256 == 0 && std::chrono::steady_clock::now() - start > SPIN) break;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return word_.load(std::memory_order_acquire) != seen; });
    return word_.load(std::memory_order_acquire);
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> word_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> pending_{0};
  uint64_t generation_ = 0;
  int workers_ = 0;
  int64_t total_ = 0, chunk_ = 1;
  RangeFn fn_ = nullptr;
  void* ctx_ = nullptr;
};

}  // namespace

void parallel_for(int threads, int64_t total, int64_t chunk, RangeFn fn, void* ctx) {
  if (threads <= 1 || total <= chunk) {
    fn(ctx, 0, total);
    return;
  }
  static Pool* pool = nullptr;  // leaked on purpose: detached workers wait on it until the process ends
  static pid_t owner = 0;
  if (pool == nullptr || owner != getpid()) {  // a forked child has the memory but not the threads
    pool = new Pool;
    owner = getpid();
  }
  pool->run(threads, total, chunk, fn, ctx);
}

}  // namespace rl
