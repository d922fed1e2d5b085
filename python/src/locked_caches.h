// KVCache and PagedKVCache as Python holds them: the cache and a lock.
//
// The C++ caches let const calls run concurrently but nothing concurrent
// with a mutating call (tq/kv_cache.h, tq/paged_kv_cache.h), and the
// bindings release the GIL, so two Python threads could race inside one
// cache (an append against an append or a decode). Every bound method goes
// through ReadLocked (decode, prefill, dequantize, length, ledger, ...: may
// run together) or WriteLocked (append, fork, free, write_slots, ...: alone).
// Both release the GIL first and take the lock without it, and the GIL is
// taken back only after the lock is dropped, so a thread waiting for the
// lock never holds the GIL that the lock's holder would need. The function
// run under the lock touches no Python object (array data pointers only;
// the arrays stay alive through the caller's references). Misuse from
// threads is therefore serialized: slow, never a crash.
#pragma once

#include <mutex>
#include <shared_mutex>
#include <utility>

#include <nanobind/nanobind.h>

#include "tq/kv_cache.h"
#include "tq/paged_kv_cache.h"

namespace tq_py {

namespace nb = nanobind;

template <typename Cache>
struct Locked {
  explicit Locked(Cache c) : cache(std::move(c)) {}
  // Only while constructing the Python object (nothing else can hold it).
  Locked(Locked&& other) noexcept : cache(std::move(other.cache)) {}
  Locked(const Locked&) = delete;

  Cache cache;
  mutable std::shared_mutex mu;
};

using PyKVCache = Locked<tq::KVCache>;
using PyPagedKVCache = Locked<tq::PagedKVCache>;

// f(const Cache&) under a shared lock, the GIL released.
template <typename Cache, typename F>
auto ReadLocked(const Locked<Cache>& c, F&& f) {
  nb::gil_scoped_release release;
  std::shared_lock lock(c.mu);
  return f(static_cast<const Cache&>(c.cache));
}

// f(Cache&) under the exclusive lock, the GIL released.
template <typename Cache, typename F>
auto WriteLocked(Locked<Cache>& c, F&& f) {
  nb::gil_scoped_release release;
  std::unique_lock lock(c.mu);
  return f(c.cache);
}

}  // namespace tq_py
