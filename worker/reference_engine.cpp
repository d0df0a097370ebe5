// referenceLogits: a CpuBackend with a KV cache just large enough for one prefill.
#include "worker/reference_engine.h"

#include <memory>

#include "worker/cpu_backend.h"

namespace bulkhead {

Result<std::vector<std::vector<float>>> referenceLogits(const std::string& model_dir,
                                                        uint64_t weight_digest,
                                                        std::span<const uint32_t> tokens,
                                                        std::span<const uint32_t> rows) {
  BULKHEAD_ASSIGN_OR_RETURN(Checkpoint opened, Checkpoint::open(model_dir));
  auto checkpoint = std::make_shared<const Checkpoint>(std::move(opened));
  if (weight_digest != 0 && checkpoint->weightDigest() != weight_digest)
    return failedPrecondition("the reference engine's checkpoint " + model_dir +
                              " holds other weights than the worker reported loading");
  CpuBackend::Options options;
  options.kv_blocks = uint32_t((tokens.size() + options.kv_block_size - 1) / options.kv_block_size);
  options.max_step_tokens = std::max<uint32_t>(options.max_step_tokens, uint32_t(tokens.size()));
  BULKHEAD_ASSIGN_OR_RETURN(auto backend, CpuBackend::create(checkpoint, options));
  std::vector<uint32_t> blocks(options.kv_blocks);
  for (uint32_t b = 0; b < blocks.size(); ++b) blocks[b] = b;
  const SequenceStep step{.sequence_id = 1,
                          .start_position = 0,
                          .tokens = tokens,
                          .kv_blocks = blocks,
                          .logits_rows = rows};
  std::vector<std::vector<float>> out(rows.size(),
                                      std::vector<float>(backend->limits().vocab_size));
  std::vector<float*> payloads;
  for (auto& row : out) payloads.push_back(row.data());
  BULKHEAD_RETURN_IF_ERROR(runStep(*backend, {&step, 1}, payloads));
  return out;
}

}  // namespace bulkhead
