// Request validation: every field checked against the model and the sampler's domain.
#include "broker/request_validation.h"

#include <sys/random.h>

#include <cmath>

namespace bulkhead {
namespace {

Status bad(const std::string& field, const std::string& why) {
  return invalidArgument(field + ": " + why);
}

}  // namespace

Result<GenerationRequest> validateRequest(const v1::GenerateRequest& r, const ModelLimits& model) {
  GenerationRequest out;
  if (r.prompt_token_ids_size() == 0) return bad("prompt_token_ids", "empty");
  for (int i = 0; i < r.prompt_token_ids_size(); ++i) {
    if (r.prompt_token_ids(i) >= model.vocab_size)
      return bad("prompt_token_ids[" + std::to_string(i) + "]",
                 std::to_string(r.prompt_token_ids(i)) + " >= vocab size " +
                     std::to_string(model.vocab_size));
  }
  if (r.max_tokens() == 0) return bad("max_tokens", "must be at least 1");
  const uint64_t total = uint64_t(r.prompt_token_ids_size()) + r.max_tokens();
  if (total > model.max_context)
    return bad("max_tokens", "prompt (" + std::to_string(r.prompt_token_ids_size()) +
                                 ") + max_tokens (" + std::to_string(r.max_tokens()) +
                                 ") exceeds the context of " + std::to_string(model.max_context));
  if (r.stop_token_ids_size() > kMaxStopTokenIds)
    return bad("stop_token_ids", std::to_string(r.stop_token_ids_size()) + " ids, at most " +
                                     std::to_string(kMaxStopTokenIds));
  for (int i = 0; i < r.stop_token_ids_size(); ++i) {
    if (r.stop_token_ids(i) >= model.vocab_size)
      return bad("stop_token_ids[" + std::to_string(i) + "]", std::to_string(r.stop_token_ids(i)) +
                                                                  " >= vocab size " +
                                                                  std::to_string(model.vocab_size));
  }
  if (r.top_logprobs() > kMaxTopLogprobs)
    return bad("top_logprobs", "at most " + std::to_string(kMaxTopLogprobs));
  if (r.request_id().size() > kMaxRequestIdBytes)
    return bad("request_id", "longer than " + std::to_string(kMaxRequestIdBytes) + " bytes");

  const v1::SamplingParams& s = r.sampling();
  SamplingConfig& c = out.sampling;
  auto finite = [](float v) { return std::isfinite(v); };
  if (!finite(s.temperature()) || s.temperature() < 0)
    return bad("sampling.temperature", "must be >= 0 (0 is greedy)");
  c.temperature = s.temperature();
  c.top_k = s.top_k();
  if (!finite(s.top_p()) || s.top_p() < 0 || s.top_p() > 1)
    return bad("sampling.top_p", "must be in (0, 1] (0 leaves it unset)");
  c.top_p = s.top_p() == 0 ? 1.0f : s.top_p();
  if (!finite(s.min_p()) || s.min_p() < 0 || s.min_p() > 1)
    return bad("sampling.min_p", "must be in [0, 1]");
  c.min_p = s.min_p();
  if (!finite(s.repetition_penalty()) || s.repetition_penalty() < 0)
    return bad("sampling.repetition_penalty", "must be > 0 (0 leaves it unset)");
  c.repetition_penalty = s.repetition_penalty() == 0 ? 1.0f : s.repetition_penalty();
  if (!finite(s.presence_penalty()) || std::fabs(s.presence_penalty()) > 2)
    return bad("sampling.presence_penalty", "must be in [-2, 2]");
  c.presence_penalty = s.presence_penalty();
  if (!finite(s.frequency_penalty()) || std::fabs(s.frequency_penalty()) > 2)
    return bad("sampling.frequency_penalty", "must be in [-2, 2]");
  c.frequency_penalty = s.frequency_penalty();
  if (s.has_seed()) {
    c.seed = s.seed();
  } else if (::getrandom(&c.seed, sizeof(c.seed), 0) != ssize_t(sizeof(c.seed))) {
    return internalError("cannot draw a seed");
  }
  c.top_logprobs = r.top_logprobs();
  c.logprobs = r.logprobs() || r.top_logprobs() > 0;

  out.prompt.assign(r.prompt_token_ids().begin(), r.prompt_token_ids().end());
  out.max_tokens = r.max_tokens();
  out.stop_token_ids.assign(r.stop_token_ids().begin(), r.stop_token_ids().end());
  out.ignore_eos = r.ignore_eos();
  out.request_id = r.request_id();
  return out;
}

}  // namespace bulkhead
