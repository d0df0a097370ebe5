// qualify implementation.
#include "tools/qualify.h"

#include "broker/canary_run.h"
#include "broker/worker_client.h"
#include "shared/work_pool.h"
#include "worker/reference_engine.h"

namespace bulkhead {

Result<CanaryRecord> runQualify(const QualifyOptions& o) {
  if (o.out_path.empty()) return invalidArgument("--out is required");
  WorkerClient::SpawnOptions spawn;
  spawn.worker_path = o.worker_path;
  spawn.model_dir = o.model_dir;
  spawn.backend = o.backend;
  spawn.arena_slots = 1;
  spawn.extra_args = {"--log-level", "warn", "--scrub-share", "0"};
  spawn.extra_args.insert(spawn.extra_args.end(), o.worker_args.begin(), o.worker_args.end());
  auto client = WorkerClient::spawn(spawn);
  if (!client.ok()) return client.error().toStatus();
  WorkerConnection& worker = **client;
  const WorkerHello& hello = worker.hello();
  auto plan = CanaryPlan::forWorker(hello);
  if (!plan) return failedPrecondition("the worker is too small for the canary");
  WorkPool pool(0);
  RowSampler sampler(pool);
  uint64_t step_id = 1;
  BULKHEAD_ASSIGN_OR_RETURN(CanaryRun run, runCanary(
                                               worker, sampler, *plan, [&] { return step_id++; },
                                               std::chrono::seconds(600)));
  const std::string model_dir = o.model_dir;
  const CanaryReference reference = [model_dir](const WorkerHello& h,
                                                std::span<const uint32_t> tokens,
                                                std::span<const uint32_t> rows) {
    return referenceLogits(model_dir, h.weight_digest, tokens, rows);
  };
  BULKHEAD_RETURN_IF_ERROR(qualifyCanary(hello, *plan, run, reference));
  (void)worker.shutdown(std::chrono::seconds(10));
  const CanaryRecord record{hello.model_identity, hello.backend, hello.weight_digest, run.digest};
  BULKHEAD_RETURN_IF_ERROR(writeCanaryRecord(o.out_path, record));
  return record;
}

}  // namespace bulkhead
