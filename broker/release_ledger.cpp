// ReleaseLedger: append, release through a vouched step, roll back.
#include "broker/release_ledger.h"

#include <algorithm>
#include <cassert>

namespace bulkhead {

ReleaseLedger::ReleaseLedger(std::vector<uint32_t> prompt)
    : tokens_(std::move(prompt)), prompt_len_(uint32_t(tokens_.size())) {}

void ReleaseLedger::append(uint64_t step, TokenChoice choice, Clock::time_point step_done) {
  assert(unreleased_.empty() || unreleased_.back().step <= step);
  tokens_.push_back(choice.token);
  unreleased_.push_back({step, std::move(choice), step_done});
}

std::vector<TokenChoice> ReleaseLedger::takeReleasable(
    uint64_t clean_through, std::vector<Clock::time_point>* produced_at) {
  size_t n = 0;
  while (n < unreleased_.size() && unreleased_[n].step <= clean_through) ++n;
  std::vector<TokenChoice> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(std::move(unreleased_[i].choice));
    if (produced_at != nullptr) produced_at->push_back(unreleased_[i].step_done);
  }
  unreleased_.erase(unreleased_.begin(), unreleased_.begin() + long(n));
  released_ += uint32_t(n);
  return out;
}

size_t ReleaseLedger::rollBack(uint64_t from_step) {
  // Steps never decrease along the list, so the dropped tokens are a suffix.
  const auto first = std::find_if(unreleased_.begin(), unreleased_.end(),
                                  [&](const Unsent& u) { return u.step >= from_step; });
  const size_t drop = size_t(unreleased_.end() - first);
  unreleased_.erase(first, unreleased_.end());
  tokens_.resize(tokens_.size() - drop);
  return drop;
}

}  // namespace bulkhead
