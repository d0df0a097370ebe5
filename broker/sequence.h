// A generation request as the scheduler sees it, and the sink its tokens stream into (the gRPC
// stream in production, a collector in tests).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "broker/sampler.h"
#include "shared/status.h"

namespace bulkhead {

enum class FinishReason { kNone, kLength, kStop, kContext };

struct Usage {
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  uint64_t seed = 0;
};

struct GenerationRequest {
  std::vector<uint32_t> prompt;
  uint32_t max_tokens = 0;
  SamplingConfig sampling;
  std::vector<uint32_t> stop_token_ids;
  bool ignore_eos = false;
  std::string request_id;
  std::optional<std::chrono::steady_clock::time_point> deadline;
};

// What a release measured, in milliseconds: per token, from the end of the step that produced
// it; per sequence's first token, from the request's arrival (time to first token); per later
// token, from the previous token's release (the inter-token gap; tokens released together after
// the first of them have a gap of 0).
// Per sequence that moved to another worker, from the loss (or drain) of its worker to its first
// token released on the new one.
struct ReleaseTimes {
  std::vector<double> after_step, first_token, inter_token, migration;
};

class TokenSink {
 public:
  virtual ~TokenSink() = default;
  // New tokens, in order; called on the scheduler thread.
  virtual void onTokens(std::span<const TokenChoice> tokens) = 0;
  // Called exactly once, last. A non-OK status ends the request with that error.
  virtual void onFinish(FinishReason reason, const Usage& usage, const Status& status) = 0;
  // The client went away; the scheduler frees the sequence within one step.
  virtual bool cancelled() const = 0;
};

}  // namespace bulkhead
