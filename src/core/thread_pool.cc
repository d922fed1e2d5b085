#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tq {

size_t HardwareThreads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : n;
}

namespace {

thread_local bool t_inside_task = false;

// How long an idle worker, or a caller waiting for the workers, polls before
// it blocks on a condition variable. Waking a blocked thread took 50-70 us on
// the 2-vCPU VMs we measure on (a futex wake-up through the hypervisor), and a
// decode step runs three parallel regions; while the pool is busy every
// region then starts at once. TQ_SPIN_US overrides it (0: block at once).
int64_t SpinNanos() {
  if (const char* e = std::getenv("TQ_SPIN_US")) {
    char* end = nullptr;
    const long v = std::strtol(e, &end, 10);
    if (end != e && *end == '\0' && v >= 0 && v <= 1000000) return static_cast<int64_t>(v) * 1000;
  }
  return 500 * 1000;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class Pool {
 public:
  Pool() : spin_ns_(SpinNanos()) {
    const size_t workers = HardwareThreads() > 1 ? HardwareThreads() - 1 : 0;
    for (size_t i = 0; i < workers; ++i) threads_.emplace_back([this] { Worker(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  size_t workers() const { return threads_.size(); }

  // Runs chunk c = 0..chunks-1 on the caller and at most max_workers
  // workers. The caller claims chunks too, so a run completes even if no
  // worker shows up.
  void Run(size_t chunks, size_t max_workers, const std::function<void(size_t)>& chunk_fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    fn_ = &chunk_fn;
    done_.store(0, std::memory_order_relaxed);
    max_workers_.store(max_workers, std::memory_order_relaxed);
    const uint64_t gen = ((state_.load(std::memory_order_relaxed) >> kGenShift) + 1) & kGenMask;
    joined_.store(gen << 32, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_.store(gen << kGenShift | static_cast<uint64_t>(chunks) << kChunkShift,
                   std::memory_order_release);
    }
    cv_.notify_all();
    Drain(gen);
    auto all_done = [&] { return done_.load(std::memory_order_acquire) == chunks; };
    if (!SpinUntil(all_done)) {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, all_done);
    }
  }

 private:
  // state_: generation (bits 40..63), chunks of the run (20..39), next chunk
  // to claim (0..19). A chunk is claimed by a compare-exchange that also
  // checks the generation, so a worker that wakes late cannot claim a chunk
  // of a later run by mistake.
  static constexpr int kGenShift = 40;
  static constexpr int kChunkShift = 20;
  static constexpr uint64_t kGenMask = (uint64_t{1} << 24) - 1;
  static constexpr uint64_t kIdxMask = (uint64_t{1} << 20) - 1;

  template <class Pred>
  bool SpinUntil(const Pred& pred) const {
    if (pred()) return true;
    if (spin_ns_ <= 0) return false;
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        CpuRelax();
        if (pred()) return true;
      }
      if (std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
              .count() > spin_ns_) {
        return pred();
      }
    }
  }

  void Drain(uint64_t gen) {
    const bool was_inside = t_inside_task;
    t_inside_task = true;
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      if ((s >> kGenShift) != gen) break;
      const size_t next = s & kIdxMask;
      const size_t chunks = (s >> kChunkShift) & kIdxMask;
      if (next >= chunks) break;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
        continue;  // s holds the current state
      }
      (*fn_)(next);
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) {
        { std::lock_guard<std::mutex> lock(mu_); }
        done_cv_.notify_all();
      }
      s = state_.load(std::memory_order_acquire);
    }
    t_inside_task = was_inside;
  }

  bool Join(uint64_t gen) {
    uint64_t j = joined_.load(std::memory_order_acquire);
    for (;;) {
      if ((j >> 32) != gen || (j & 0xFFFFFFFFu) >= max_workers_.load(std::memory_order_relaxed)) return false;
      if (joined_.compare_exchange_weak(j, j + 1, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
    }
  }

  void Worker() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = 0;
      auto woken = [&] {
        gen = state_.load(std::memory_order_acquire) >> kGenShift;
        return gen != seen || stop_.load(std::memory_order_relaxed);
      };
      if (!SpinUntil(woken)) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, woken);
      }
      if (stop_.load()) return;
      seen = gen;
      // Workers beyond the run's cap sit it out. The join count carries its
      // run's generation, so a worker that wakes late for a finished run
      // cannot take a place in the next one. (max_workers_ and joined_ were
      // stored before the generation this worker acquired.)
      if (Join(gen)) Drain(gen);
    }
  }

  const int64_t spin_ns_;
  std::vector<std::thread> threads_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  const std::function<void(size_t)>* fn_ = nullptr;
  std::atomic<uint64_t> state_{0};
  std::atomic<size_t> done_{0};
  std::atomic<size_t> max_workers_{0};
  std::atomic<uint64_t> joined_{0};  // generation (bits 32..63), workers joined
  std::atomic<bool> stop_{false};
};

Pool& GlobalPool() {
  static Pool* pool = new Pool();  // never destroyed: workers may outlive statics
  return *pool;
}

}  // namespace

void ParallelFor(size_t n, size_t threads, size_t min_chunk,
                 const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  if (threads == 0) threads = HardwareThreads();
  min_chunk = std::max<size_t>(min_chunk, 1);
  // Whole chunks of min_chunk (n / min_chunk, not rounded up: 7 items at 3
  // a chunk are two chunks of 4 and 3, not three of 3, 2 and 2).
  size_t chunks = std::min(threads, std::max<size_t>(1, n / min_chunk));
  if (chunks <= 1 || t_inside_task) {
    fn(0, n);
    return;
  }
  Pool& pool = GlobalPool();
  chunks = std::min(chunks, pool.workers() + 1);
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  const size_t per = n / chunks;
  const size_t extra = n % chunks;
  pool.Run(chunks, chunks - 1, [&](size_t c) {
    const size_t begin = c * per + std::min(c, extra);
    const size_t end = begin + per + (c < extra ? 1 : 0);
    fn(begin, end);
  });
}

void ParallelForDynamic(size_t n, size_t threads, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  if (threads == 0) threads = HardwareThreads();
  if (threads <= 1 || n == 1 || t_inside_task) {
    fn(0, n);
    return;
  }
  Pool& pool = GlobalPool();
  const size_t workers = std::min(threads - 1, pool.workers());
  if (workers == 0) {
    fn(0, n);
    return;
  }
  // One item a chunk (a few a chunk past the pool's chunk count limit).
  constexpr size_t kMaxChunks = size_t{1} << 19;
  const size_t per = (n + kMaxChunks - 1) / kMaxChunks;
  const size_t chunks = (n + per - 1) / per;
  pool.Run(chunks, workers, [&](size_t c) { fn(c * per, std::min(n, (c + 1) * per)); });
}

}  // namespace tq
