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
  for (size_t i = 0; i < rows.size(); ++i) {
    if (out[i].failed == IntegrityCheck::kNone) continue;
    WorkerFailure f = workerFailure(WorkerFailure::Kind::kIntegrityFailure,
                                    "logits row " + std::to_string(i) + " failed the " +
                                        std::string(integrityCheckName(out[i].failed)) + " check");
    f.check = out[i].failed;
    return f;
  }
  return {};
}

}  // namespace bulkhead
