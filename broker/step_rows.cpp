// verifyRows over the sampling pool.
#include "broker/step_rows.h"

#include <vector>

namespace bulkhead {

WorkerFailure verifyRows(RowSampler& sampler, std::span<const PendingRow> rows) {
  std::vector<RowToSample> jobs(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    jobs[i].logits = rows[i].payload;
    jobs[i].expected_checksum = rows[i].checksum;
  }
  std::vector<SampledRow> out(rows.size());
  sampler.verifyAndSample(jobs, out);
  return firstFailedRow(out);
}

WorkerFailure firstFailedRow(std::span<const SampledRow> rows, const std::string& where) {
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].failed == IntegrityCheck::kNone) continue;
    WorkerFailure f = workerFailure(WorkerFailure::Kind::kIntegrityFailure,
                                    "logits row " + std::to_string(i) + where + " failed the " +
                                        std::string(integrityCheckName(rows[i].failed)) + " check");
    f.check = rows[i].failed;
    return f;
  }
  return {};
}

}  // namespace bulkhead
