#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace tq {

size_t HardwareThreads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : n;
}

namespace {

thread_local bool t_inside_task = false;

class Pool {
 public:
  Pool() {
    const size_t workers = HardwareThreads() > 1 ? HardwareThreads() - 1 : 0;
    for (size_t i = 0; i < workers; ++i) threads_.emplace_back([this] { Worker(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  size_t workers() const { return threads_.size(); }

  // Runs chunk c = 0..chunks-1 on the workers and the caller.
  void Run(size_t chunks, const std::function<void(size_t)>& chunk_fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &chunk_fn;
      chunks_ = chunks;
      next_.store(0);
      done_ = 0;
      ++generation_;
    }
    cv_.notify_all();
    Drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_ == chunks_; });
    fn_ = nullptr;
  }

 private:
  void Drain() {
    const bool was_inside = t_inside_task;
    t_inside_task = true;
    for (;;) {
      const size_t c = next_.fetch_add(1);
      if (c >= chunks_) break;
      (*fn_)(c);
      std::lock_guard<std::mutex> lock(mu_);
      if (++done_ == chunks_) done_cv_.notify_all();
    }
    t_inside_task = was_inside;
  }

  void Worker() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (generation_ != seen && fn_ != nullptr); });
        if (stop_) return;
        seen = generation_;
      }
      Drain();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t chunks_ = 0;
  std::atomic<size_t> next_{0};
  size_t done_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
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
  size_t chunks = std::min(threads, (n + min_chunk - 1) / min_chunk);
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
  pool.Run(chunks, [&](size_t c) {
    const size_t begin = c * per + std::min(c, extra);
    const size_t end = begin + per + (c < extra ? 1 : 0);
    fn(begin, end);
  });
}

}  // namespace tq
