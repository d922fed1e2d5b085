// A growable byte buffer whose allocations are counted in a shared counter,
// so that a cache can report the bytes it really holds (byte ledger).
// Internal header.
#ifndef TQ_SRC_KV_TRACKED_BUFFER_H_
#define TQ_SRC_KV_TRACKED_BUFFER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace tq {

class TrackedBuffer {
 public:
  static constexpr size_t kAlign = 64;
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
      o.data_ = nullptr;
      o.size_ = o.capacity_ = 0;
    }
    return *this;
  }
  ~TrackedBuffer() { Release(); }

  void set_counter(size_t* counter) { counter_ = counter; }
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }

  // Grows capacity to at least n bytes (exactly n when `exact`, else with
  // doubling so that appends are amortized O(1)).
  void Reserve(size_t n, bool exact = false) {
    if (n <= capacity_) return;
    // Grow by 1/4: appends stay amortized O(1) while unused capacity (the
    // ledger's "slack") stays under 20% of the buffer.
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
      std::free(data_);
      if (counter_) *counter_ -= capacity_;
    }
    data_ = nullptr;
    size_ = capacity_ = 0;
  }

 private:
  size_t* counter_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

}  // namespace tq

#endif  // TQ_SRC_KV_TRACKED_BUFFER_H_
