// libFuzzer target: a GenerateRequest as any client could send it, through the broker's
// validation. A request that passes must be one the scheduler can serve: token ids inside the
// vocabulary, at least one token to generate, and prompt plus tokens inside the context.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "broker/request_validation.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bulkhead::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, int(size))) return 0;
  const bulkhead::ModelLimits model{512, 256, {2}};
  auto valid = bulkhead::validateRequest(request, model);
  if (!valid.ok()) return 0;
  if (valid->prompt.empty() || valid->max_tokens == 0) std::abort();
  if (valid->prompt.size() + valid->max_tokens > model.max_context) std::abort();
  for (uint32_t t : valid->prompt)
    if (t >= model.vocab_size) std::abort();
  return 0;
}
