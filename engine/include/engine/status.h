// Errors cross library boundaries as values, never as exceptions: Status for "did it work",
// Result<T> for "the value, or why not". A Status carries a code, so a worker can say "this
// request is bad" (kInvalidArgument), "it can never fit" (kResourceExhausted), "stopped on
// request" (kCancelled) or "a peer is gone" (kUnavailable) and the server maps the code to an
// HTTP status / gRPC code instead of guessing from the text. Status::error(msg) is kInternal.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace burst {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,
  kResourceExhausted,
  kCancelled,
  kUnavailable,
  kInternal,
};

const char* status_code_name(StatusCode code);

class Status {
 public:
  Status() = default;
  static Status error(std::string message) {
    return Status(StatusCode::kInternal, std::move(message));
  }
  static Status error(StatusCode code, std::string message) {
    return Status(code == StatusCode::kOk ? StatusCode::kInternal : code, std::move(message));
  }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kInternal: return "INTERNAL";
  }
  return "INTERNAL";
}

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
  StatusCode code() const { return ok() ? StatusCode::kOk : std::get<Status>(v_).code(); }
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
