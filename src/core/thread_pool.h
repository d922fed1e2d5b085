// A small persistent std::thread pool (Highway 1.0.3 has none). ParallelFor
// splits [0, n) into contiguous chunks and runs them on up to `threads`
// threads, the calling thread included. Calls from several threads are
// serialized; a ParallelFor inside a task runs inline. Internal header.
#ifndef TQ_SRC_CORE_THREAD_POOL_H_
#define TQ_SRC_CORE_THREAD_POOL_H_

#include <cstddef>
#include <functional>

namespace tq {

// Number of hardware threads (at least 1).
size_t HardwareThreads();

// Runs fn(begin, end) over a partition of [0, n) into at most `threads`
// chunks of at least min_chunk items. threads == 0 means HardwareThreads().
void ParallelFor(size_t n, size_t threads, size_t min_chunk,
                 const std::function<void(size_t, size_t)>& fn);

// Runs fn(i, i + 1) for every i in [0, n) on up to `threads` threads, the
// calling thread included, each thread taking the next item when it is
// done (for items of uneven cost, where ParallelFor's equal contiguous
// chunks leave one thread waiting on another). threads == 0 means
// HardwareThreads(). (Past 2^19 items a call covers a few items.)
void ParallelForDynamic(size_t n, size_t threads, const std::function<void(size_t, size_t)>& fn);

}  // namespace tq

#endif  // TQ_SRC_CORE_THREAD_POOL_H_
