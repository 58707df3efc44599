// Errors cross library boundaries as values, never as exceptions: Status for "did it work",
// Result<T> for "the value, or why not".
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace burst {

class Status {
 public:
  Status() = default;
  static Status error(std::string message) { return Status(std::move(message)); }
  bool ok() const { return !failed_; }
  const std::string& message() const { return message_; }

 private:
  explicit Status(std::string message) : failed_(true), message_(std::move(message)) {}
  bool failed_ = false;
  std::string message_;
};

template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: must be an error status
  bool ok() const { return std::holds_alternative<T>(v_); }
  T& value() { return std::get<T>(v_); }
  const T& value() const { return std::get<T>(v_); }
  T&& take() { return std::move(std::get<T>(v_)); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }
  const std::string& message() const {
    static const std::string kNone;
    return ok() ? kNone : std::get<Status>(v_).message();
  }

 private:
  std::variant<T, Status> v_;
};

}  // namespace burst

// Returns the error of an expression yielding Status, or assigns the value of a Result.
#define BURST_RETURN_IF_ERROR(expr)       \
  do {                                    \
    ::burst::Status _st = (expr);         \
    if (!_st.ok()) return _st;            \
  } while (0)
