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

}  // namespace tq

#endif  // TQ_SRC_CORE_THREAD_POOL_H_
