// The CPU reference engine run in the caller's own process, for qualifying what another process
// computed (the broker's canary, `bulkhead qualify`): the logits of chosen rows of one prefill,
// from the checkpoint's bytes, with every in-step check on.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

// Rows `rows` (token indices) of a prefill of `tokens` at positions 0.. on the model in
// `model_dir`. `weight_digest`, when not 0, must equal the checkpoint's: the reference is then
// known to be computed from the very weights the worker reported loading.
Result<std::vector<std::vector<float>>> referenceLogits(const std::string& model_dir,
                                                        uint64_t weight_digest,
                                                        std::span<const uint32_t> tokens,
                                                        std::span<const uint32_t> rows);

}  // namespace bulkhead
