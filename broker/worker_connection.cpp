// WorkerFailure: names and the status a client sees.
#include "broker/worker_connection.h"

namespace bulkhead {

using Kind = WorkerFailure::Kind;

WorkerFailure workerFailure(WorkerFailure::Kind kind, std::string message) {
  WorkerFailure f;
  f.kind = kind;
  f.message = std::move(message);
  return f;
}

std::string_view workerFailureKindName(WorkerFailure::Kind kind) {
  switch (kind) {
    case Kind::kNone:
      return "none";
    case Kind::kExited:
      return "worker exited";
    case Kind::kTimedOut:
      return "timed out";
    case Kind::kProtocolViolation:
      return "protocol violation";
    case Kind::kIntegrityFailure:
      return "integrity failure";
    case Kind::kRejected:
      return "rejected";
    case Kind::kStartFailed:
      return "start failed";
  }
  return "?";
}

std::string WorkerFailure::toString() const {
  if (ok()) return "OK";
  std::string s(workerFailureKindName(kind));
  if (kind == Kind::kExited) {
    s += signal != 0 ? " (signal " + std::to_string(signal) + ")"
                     : " (status " + std::to_string(exit_code) + ")";
  }
  if (kind == Kind::kIntegrityFailure) s += " (" + std::string(integrityCheckName(check)) + ")";
  return s + ": " + message;
}

Status WorkerFailure::toStatus() const {
  switch (kind) {
    case Kind::kNone:
      return okStatus();
    case Kind::kRejected:
      return Status(code, message);
    case Kind::kIntegrityFailure:
      return dataLoss(toString());
    case Kind::kTimedOut:
      return Status(Code::kDeadlineExceeded, toString());
    default:
      return unavailable(toString());
  }
}

}  // namespace bulkhead
