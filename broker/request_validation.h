// Turns a GenerateRequest into a GenerationRequest, or an INVALID_ARGUMENT naming the field.
#pragma once

#include "broker/scheduler.h"
#include "broker/sequence.h"
#include "bulkhead/v1/generator.pb.h"

namespace bulkhead {

constexpr uint32_t kMaxTopLogprobs = 20;
constexpr size_t kMaxRequestIdBytes = 256;
// Each generated token is looked up among them on the scheduler's thread.
constexpr int kMaxStopTokenIds = 256;

Result<GenerationRequest> validateRequest(const v1::GenerateRequest& request,
                                          const ModelLimits& model);

}  // namespace bulkhead
