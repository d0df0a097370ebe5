// Status and Result<T>: how expected failures travel through bulkhead.
// Codes are gRPC's canonical ones so a failure maps 1:1 onto an RPC reply; exceptions never
// cross a library or process boundary.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace bulkhead {

enum class Code : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

std::string_view codeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message"
  std::string toString() const;

  // Prefixes the message with context ("config.json: ..."), keeping the code.
  Status withContext(std::string_view context) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status okStatus() {
  return Status();
}
inline Status invalidArgument(std::string m) {
  return {Code::kInvalidArgument, std::move(m)};
}
inline Status notFound(std::string m) {
  return {Code::kNotFound, std::move(m)};
}
inline Status dataLoss(std::string m) {
  return {Code::kDataLoss, std::move(m)};
}
inline Status internalError(std::string m) {
  return {Code::kInternal, std::move(m)};
}
inline Status outOfRange(std::string m) {
  return {Code::kOutOfRange, std::move(m)};
}
inline Status unimplemented(std::string m) {
  return {Code::kUnimplemented, std::move(m)};
}
inline Status resourceExhausted(std::string m) {
  return {Code::kResourceExhausted, std::move(m)};
}
inline Status unavailable(std::string m) {
  return {Code::kUnavailable, std::move(m)};
}
inline Status failedPrecondition(std::string m) {
  return {Code::kFailedPrecondition, std::move(m)};
}

// A value, or the error (a Status unless said otherwise) saying why there is none.
template <typename T, typename E = Status>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(E error) : error_(std::move(error)) {   // NOLINT(google-explicit-constructor)
    assert(!error_.ok() && "Result built from a non-error carries no value");
  }

  bool ok() const { return value_.has_value(); }
  const E& status() const { return error_; }
  const E& error() const { return error_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  E error_;
};

}  // namespace bulkhead

// Early return of a failed Status (or the Status of a failed Result).
#define BULKHEAD_RETURN_IF_ERROR(expr)                   \
  do {                                                   \
    ::bulkhead::Status bulkhead_status_ = (expr);        \
    if (!bulkhead_status_.ok()) return bulkhead_status_; \
  } while (0)

#define BULKHEAD_CONCAT_INNER(a, b) a##b
#define BULKHEAD_CONCAT(a, b) BULKHEAD_CONCAT_INNER(a, b)
#define BULKHEAD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
// BULKHEAD_ASSIGN_OR_RETURN(auto x, computeX());
#define BULKHEAD_ASSIGN_OR_RETURN(lhs, expr) \
  BULKHEAD_ASSIGN_OR_RETURN_IMPL(BULKHEAD_CONCAT(bulkhead_result_, __LINE__), lhs, expr)
