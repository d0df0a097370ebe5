// Verification of a step's pending rows on the sampling pool when nothing is to be sampled from
// them (the canary, benchmarks, tests): the same single pass that verifyAndSample makes.
#pragma once

#include <span>

#include "broker/row_sampling.h"
#include "broker/worker_connection.h"

namespace bulkhead {

// OK, or kIntegrityFailure naming the first row that failed and the check.
WorkerFailure verifyRows(RowSampler& sampler, std::span<const PendingRow> rows);

}  // namespace bulkhead
