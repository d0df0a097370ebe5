// `bulkhead qualify`: runs the canary on a freshly started worker, qualifies it against the CPU
// reference engine in this process, and writes the record an operator pins with the broker's
// --canary-record.
#pragma once

#include <string>
#include <vector>

#include "broker/canary.h"
#include "shared/status.h"

namespace bulkhead {

struct QualifyOptions {
  std::string model_dir;
  std::string backend = "auto";
  std::string out_path;
  std::string worker_path;               // bulkhead-worker
  std::vector<std::string> worker_args;  // extra worker flags
};

// The record written to out_path; FAILED_PRECONDITION when the worker's canary disagrees with
// the reference engine (nothing is written then).
Result<CanaryRecord> runQualify(const QualifyOptions& options);

}  // namespace bulkhead
