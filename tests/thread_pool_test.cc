// The thread pool's two loops: every item runs exactly once, ParallelFor in
// at most `threads` contiguous chunks, ParallelForDynamic one item a call on
// at most `threads` threads, both inline inside a task.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "core/thread_pool.h"

namespace tq {
namespace {

TEST(ThreadPoolTest, ParallelForCoversEachItemOnceInContiguousChunks) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
    for (size_t threads : {size_t{1}, size_t{2}, size_t{4}, size_t{0}}) {
      std::vector<std::atomic<int>> hits(n);
      std::mutex mu;
      std::vector<std::pair<size_t, size_t>> ranges;
      ParallelFor(n, threads, 3, [&](size_t b, size_t e) {
        {
          std::lock_guard<std::mutex> lock(mu);
          ranges.emplace_back(b, e);
        }
        for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " threads " << threads << " item " << i;
      const size_t cap = threads == 0 ? HardwareThreads() : threads;
      EXPECT_LE(ranges.size(), std::max<size_t>(1, cap)) << "n " << n;
      for (const auto& [b, e] : ranges) {
        EXPECT_LT(b, e);
        if (n >= 3 && ranges.size() > 1) {
          EXPECT_GE(e - b, size_t{3}) << "chunks of at least min_chunk";
        }
      }
    }
  }
}

TEST(ThreadPoolTest, ParallelForDynamicRunsEachItemOnceOnAtMostThreads) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{33}, size_t{5000}}) {
    for (size_t threads : {size_t{1}, size_t{2}, size_t{3}, size_t{0}}) {
      std::vector<std::atomic<int>> hits(n);
      std::mutex mu;
      std::set<std::thread::id> ids;
      size_t calls = 0;
      ParallelForDynamic(n, threads, [&](size_t b, size_t e) {
        {
          std::lock_guard<std::mutex> lock(mu);
          ids.insert(std::this_thread::get_id());
          ++calls;
        }
        for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " threads " << threads << " item " << i;
      const size_t cap = threads == 0 ? HardwareThreads() : threads;
      EXPECT_LE(ids.size(), cap) << "n " << n << " threads " << threads;
      // One item a call whenever the work is spread over threads.
      if (n > 1 && cap > 1 && HardwareThreads() > 1) {
        EXPECT_EQ(calls, n) << "n " << n << " threads " << threads;
      }
    }
  }
}

TEST(ThreadPoolTest, LoopsInsideATaskRunInline) {
  std::atomic<int> wrong_thread{0}, items{0};
  ParallelFor(4, 4, 1, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const std::thread::id me = std::this_thread::get_id();
      ParallelForDynamic(16, 4, [&](size_t b2, size_t e2) {
        if (std::this_thread::get_id() != me) wrong_thread.fetch_add(1);
        items.fetch_add(static_cast<int>(e2 - b2));
      });
    }
  });
  EXPECT_EQ(wrong_thread.load(), 0);
  EXPECT_EQ(items.load(), 64);
}

}  // namespace
}  // namespace tq
