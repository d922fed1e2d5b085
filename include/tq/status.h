// Status and Result<T>: how every user-reachable failure in turboquant is
// reported. The core never throws and never aborts on user input; internal
// invariants use TQ_CHECK, which is always on and aborts with a message.
// Status and Result are plain values: a const one may be read from many
// threads, a mutable one by one thread at a time.
#ifndef TQ_STATUS_H_
#define TQ_STATUS_H_

#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

namespace tq {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // a parameter or input value is outside what is accepted
  kOutOfRange = 2,       // an index/slot/size is outside the valid range
  kFailedPrecondition = 3,  // the object is not in a state for this call
  kDataLoss = 4,         // corrupt or truncated bytes (files, metadata)
  kUnimplemented = 5,    // a combination that is not supported (lists what is)
  kInternal = 6,         // a bug: an invariant did not hold
  kIoError = 7,          // the operating system refused a file operation
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: bits must be in 1..8, got 9"
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

Status InvalidArgumentError(std::string message);
Status OutOfRangeError(std::string message);
Status FailedPreconditionError(std::string message);
Status DataLossError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status IoError(std::string message);

// Result<T> holds either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(const T& value) : status_(), has_value_(true) {  // NOLINT
    new (&storage_) T(value);
  }
  Result(T&& value) : status_(), has_value_(true) {  // NOLINT
    new (&storage_) T(std::move(value));
  }
  Result(Status status) : status_(std::move(status)), has_value_(false) {  // NOLINT
    if (status_.ok()) {
      status_ = InternalError("Result constructed from an OK Status without a value");
    }
  }
  Result(const Result& other) : status_(other.status_), has_value_(other.has_value_) {
    if (has_value_) new (&storage_) T(other.value_ref());
  }
  Result(Result&& other) noexcept
      : status_(std::move(other.status_)), has_value_(other.has_value_) {
    if (has_value_) new (&storage_) T(std::move(other.value_ref()));
  }
  Result& operator=(Result other) {
    Reset();
    status_ = std::move(other.status_);
    has_value_ = other.has_value_;
    if (has_value_) new (&storage_) T(std::move(other.value_ref()));
    return *this;
  }
  ~Result() { Reset(); }

  bool ok() const { return has_value_; }
  const Status& status() const { return status_; }

  T& value() & { Check(); return value_ref(); }
  const T& value() const& { Check(); return value_ref(); }
  T&& value() && { Check(); return std::move(value_ref()); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void Check() const {
    if (!has_value_) {
      std::fprintf(stderr, "tq: Result::value() on error: %s\n",
                   status_.ToString().c_str());
      std::abort();
    }
  }
  T& value_ref() { return *std::launder(reinterpret_cast<T*>(&storage_)); }
  const T& value_ref() const {
    return *std::launder(reinterpret_cast<const T*>(&storage_));
  }
  void Reset() {
    if (has_value_) value_ref().~T();
    has_value_ = false;
  }

  Status status_;
  bool has_value_;
  alignas(T) unsigned char storage_[sizeof(T)];
};

namespace internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* expr);
}  // namespace internal

}  // namespace tq

#define TQ_STATUS_CONCAT_INNER_(a, b) a##b
#define TQ_STATUS_CONCAT_(a, b) TQ_STATUS_CONCAT_INNER_(a, b)

#define TQ_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::tq::Status tq_status_ = (expr);         \
    if (!tq_status_.ok()) return tq_status_;  \
  } while (0)

#define TQ_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

#define TQ_ASSIGN_OR_RETURN(lhs, expr) \
  TQ_ASSIGN_OR_RETURN_IMPL_(TQ_STATUS_CONCAT_(tq_result_, __LINE__), lhs, expr)

// Internal invariant, always checked. Never use for user input.
#define TQ_CHECK(expr)                                         \
  do {                                                         \
    if (!(expr)) ::tq::internal::CheckFailed(__FILE__, __LINE__, #expr); \
  } while (0)

#endif  // TQ_STATUS_H_
