// checkCanaryRecord: the canary's two steps on the backend, their rows checked as any step's.
#include "worker/canary_check.h"

#include <cstdio>
#include <string>
#include <vector>

namespace bulkhead {
namespace {

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

Status checkCanaryRecord(Backend& backend, const Checkpoint& checkpoint,
                         const CanaryRecord& record) {
  if (record.model_identity != checkpoint.identity() || record.backend != backend.name() ||
      record.weight_digest != checkpoint.weightDigest())
    return failedPrecondition("the canary record is for model " + hex(record.model_identity) +
                              " (weights " + hex(record.weight_digest) + ") on " + record.backend +
                              ", this worker serves " + hex(checkpoint.identity()) + " (weights " +
                              hex(checkpoint.weightDigest()) + ") on " +
                              std::string(backend.name()));
  const BackendLimits& limits = backend.limits();
  const std::vector<uint32_t> tokens = canaryTokens(limits.vocab_size);
  std::vector<uint32_t> blocks;
  for (uint32_t b = 0; b * limits.kv_block_size < tokens.size(); ++b) blocks.push_back(b);
  if (blocks.size() > limits.kv_block_count || limits.max_step_tokens < kCanaryPrefix)
    return failedPrecondition("the worker is too small for the canary");
  // The prefix asking for its last row, then the continuation asking for its own: the same two
  // steps the broker runs, so the same rows.
  const uint32_t prefix_row[] = {kCanaryPrefix - 1}, ride_row[] = {0};
  const SequenceStep steps[] = {{.sequence_id = 0,
                                 .start_position = 0,
                                 .tokens = std::span(tokens).first(kCanaryPrefix),
                                 .kv_blocks = blocks,
                                 .logits_rows = prefix_row},
                                {.sequence_id = 0,
                                 .start_position = kCanaryPrefix,
                                 .tokens = std::span(tokens).subspan(kCanaryPrefix, 1),
                                 .kv_blocks = blocks,
                                 .logits_rows = ride_row}};
  std::vector<float> row(limits.vocab_size);
  std::vector<uint64_t> checksums;
  for (const SequenceStep& step : steps) {
    RowCheck check;
    const RowOutput out{row.data(), &check};
    BULKHEAD_RETURN_IF_ERROR(backend.enqueueStep({&step, 1}, {&out, 1}));
    WeightReadVerdict verdict;
    BULKHEAD_RETURN_IF_ERROR(backend.waitStep(verdict));
    if (!verdict.failed_tensor.empty())
      return dataLoss("canary step read " + verdict.failed_tensor + " wrongly: " + verdict.why);
    if (!check.finite) return dataLoss("the canary's logits are not finite");
    checksums.push_back(check.checksum);
  }
  const uint64_t digest = canaryDigest(checksums);
  if (digest != record.logits_digest)
    return dataLoss("the canary's digest is " + hex(digest) + ", the record's " +
                    hex(record.logits_digest));
  return okStatus();
}

}  // namespace bulkhead
