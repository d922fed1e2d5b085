// A growable byte buffer whose allocations are counted in a shared counter,
// so that a cache can report the bytes it really holds (byte ledger).
// Internal header.
//
// Two allocation regimes:
// - heap blocks (aligned_alloc): small buffers, growing by 1/4 (copying),
//   and exact reservations (pools sized once keep their byte-exact size);
// - page mappings (Linux), once a buffer grows past kMapBytes: grown in
//   place or moved by mremap, which relinks the pages instead of copying
//   them, so a growing history reserves at most 1/64 of its size (+ one
//   page) ahead: a 32K-token cache's unused capacity stays under 2% of its
//   rows.
// The counter holds capacity() bytes (whole pages for a mapping).
#ifndef TQ_SRC_KV_TRACKED_BUFFER_H_
#define TQ_SRC_KV_TRACKED_BUFFER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace tq {

class TrackedBuffer {
 public:
  static constexpr size_t kAlign = 64;
  // Capacities of at least this many bytes are page mappings (Linux).
  static constexpr size_t kMapBytes = size_t{64} << 10;

  TrackedBuffer() = default;
  explicit TrackedBuffer(size_t* counter) : counter_(counter) {}
  TrackedBuffer(const TrackedBuffer&) = delete;
  TrackedBuffer& operator=(const TrackedBuffer&) = delete;
  TrackedBuffer(TrackedBuffer&& o) noexcept { *this = std::move(o); }
  TrackedBuffer& operator=(TrackedBuffer&& o) noexcept {
    if (this != &o) {
      Release();
      counter_ = o.counter_;
      data_ = o.data_;
      size_ = o.size_;
      capacity_ = o.capacity_;
      mapped_ = o.mapped_;
      o.data_ = nullptr;
      o.size_ = o.capacity_ = 0;
      o.mapped_ = false;
    }
    return *this;
  }
  ~TrackedBuffer() { Release(); }

  void set_counter(size_t* counter) { counter_ = counter; }
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }

  // Grows capacity to at least n bytes: exactly n (whole pages for a
  // mapping) when `exact`, else with headroom so that appends are amortized
  // O(1) (1/4 below kMapBytes, 1/64 above). Contents [0, size()) are kept;
  // data() may move. Throws std::bad_alloc when memory is exhausted.
  void Reserve(size_t n, bool exact = false) {
    if (n <= capacity_) return;
#if defined(__linux__)
    // Growing past kMapBytes (or a buffer that is a mapping already): pages.
    // An exact reservation of a heap buffer stays a heap block of n bytes
    // (pools sized once keep their byte-exact size).
    if (mapped_ || (n >= kMapBytes && !exact)) {
      GrowMapping(exact ? n : std::max(n, capacity_ + capacity_ / 64));
      return;
    }
#endif
    const size_t cap = exact ? n : std::max(n, capacity_ + capacity_ / 4 + 64);
    // Cache-line aligned: rows whose stride is a multiple of 64 bytes (fp16
    // and int8 rows at d >= 32) then never straddle two lines (malloc gives
    // 16 mod 64 for large blocks: every 64-byte load of such a row split).
    uint8_t* p = static_cast<uint8_t*>(std::aligned_alloc(kAlign, (cap + kAlign - 1) / kAlign * kAlign));
    if (p == nullptr) throw std::bad_alloc();
    if (size_) std::memcpy(p, data_, size_);
    std::free(data_);
    if (counter_) *counter_ += cap - capacity_;
    data_ = p;
    capacity_ = cap;
  }
  void Resize(size_t n, bool exact = false) {
    Reserve(n, exact);
    size_ = n;
  }
  void Append(const uint8_t* p, size_t n) {
    Reserve(size_ + n);
    if (n) std::memcpy(data_ + size_, p, n);
    size_ += n;
  }
  void CopyFrom(const TrackedBuffer& o) {
    size_ = 0;
    Reserve(o.size_, true);
    if (o.size_) std::memcpy(data_, o.data_, o.size_);
    size_ = o.size_;
  }
  void Release() {
    if (data_ != nullptr) {
#if defined(__linux__)
      if (mapped_) {
        munmap(data_, capacity_);
      } else {
        std::free(data_);
      }
#else
      std::free(data_);
#endif
      if (counter_) *counter_ -= capacity_;
    }
    data_ = nullptr;
    size_ = capacity_ = 0;
    mapped_ = false;
  }

 private:
#if defined(__linux__)
  // Capacity becomes `want` rounded up to whole pages; a heap block becomes a
  // mapping (one copy), a mapping grows by mremap (no copy).
  void GrowMapping(size_t want) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t cap = (want + page - 1) / page * page;
    void* p;
    if (mapped_) {
      p = mremap(data_, capacity_, cap, MREMAP_MAYMOVE);
      if (p == MAP_FAILED) throw std::bad_alloc();
    } else {
      p = mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      if (size_) std::memcpy(p, data_, size_);
      std::free(data_);
    }
    if (counter_) *counter_ += cap - capacity_;
    data_ = static_cast<uint8_t*>(p);
    capacity_ = cap;
    mapped_ = true;
  }
#endif

  size_t* counter_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
  bool mapped_ = false;  // data_ is a page mapping (munmap), else aligned_alloc (free)
};

}  // namespace tq

#endif  // TQ_SRC_KV_TRACKED_BUFFER_H_
