// The release ledger of one sequence: its token history, which step produced each generated token
// that has not been sent yet, and how many have been sent. A token is sent only once the steps up
// to the one that produced it are vouched for; until then it can be rolled back, and the sequence
// is replayed from its history on whatever worker computes it next.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "broker/sampler.h"

namespace bulkhead {

class ReleaseLedger {
 public:
  explicit ReleaseLedger(std::vector<uint32_t> prompt);

  // Prompt followed by every generated token, sent or not: what the worker must have computed.
  std::span<const uint32_t> tokens() const { return tokens_; }
  std::span<const uint32_t> prompt() const { return std::span(tokens_).first(prompt_len_); }
  std::span<const uint32_t> generated() const { return std::span(tokens_).subspan(prompt_len_); }
  uint32_t promptLength() const { return prompt_len_; }
  uint32_t generatedCount() const { return uint32_t(tokens_.size()) - prompt_len_; }
  uint32_t released() const { return released_; }
  size_t unreleasedCount() const { return unreleased_.size(); }

  using Clock = std::chrono::steady_clock;
  // A token sampled from a row of step `step`, which completed at `step_done`.
  void append(uint64_t step, TokenChoice choice, Clock::time_point step_done = {});
  // The unsent tokens produced by steps up to `clean_through`, in order; they count as sent once
  // this returns. Empty when the oldest unsent token is from a later step. `produced_at`, when
  // given, receives each one's step completion time.
  std::vector<TokenChoice> takeReleasable(uint64_t clean_through,
                                          std::vector<Clock::time_point>* produced_at = nullptr);
  // Forgets every unsent token produced by step `from_step` or later (they were computed from
  // weights found corrupted). Returns how many were dropped.
  size_t rollBack(uint64_t from_step);
  // Forgets every unsent token (the worker that produced them is gone and cannot vouch for them).
  size_t forgetUnreleased() { return rollBack(0); }

 private:
  struct Unsent {
    uint64_t step;
    TokenChoice choice;
    Clock::time_point step_done;
  };
  std::vector<uint32_t> tokens_;
  uint32_t prompt_len_ = 0;
  uint32_t released_ = 0;
  std::vector<Unsent> unreleased_;  // oldest first; steps never decrease
};

}  // namespace bulkhead
