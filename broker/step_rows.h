// Verification of a step's pending rows on the sampling pool when nothing is to be sampled from
// them (the canary, benchmarks, tests): the same single pass that verifyAndSample makes.
#pragma once

#include <span>
#include <string>

#include "broker/row_sampling.h"
#include "broker/worker_connection.h"

namespace bulkhead {

// OK, or kIntegrityFailure naming the first row that failed and the check.
WorkerFailure verifyRows(RowSampler& sampler, std::span<const PendingRow> rows);
// The same verdict for rows already verified (and sampled): OK, or the first row that failed.
// `where` names the step in the message ("" for none).
WorkerFailure firstFailedRow(std::span<const SampledRow> rows, const std::string& where = "");

}  // namespace bulkhead
