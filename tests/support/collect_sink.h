// A TokenSink that collects a request's tokens and end for in-process scheduler tests, and the
// greedy continuation the fake worker's model gives (what any correct schedule must produce).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "broker/sequence.h"
#include "support/fake_worker.h"

namespace bulkhead::test {

class CollectSink final : public TokenSink {
 public:
  void onTokens(std::span<const TokenChoice> tokens) override {
    std::lock_guard lock(mu_);
    for (const auto& t : tokens) tokens_.push_back(t.token);
  }
  void onFinish(FinishReason reason, const Usage&, const Status& status) override {
    if (on_finish) on_finish();
    std::lock_guard lock(mu_);
    reason_ = reason;
    status_ = status;
    done_ = true;
    cv_.notify_all();
  }
  bool cancelled() const override { return cancel.load(); }
  std::function<void()> on_finish;  // runs on the scheduler thread as the request ends
  std::atomic<bool> cancel{false};  // the client has cancelled

  // Waits (bounded) for the request to end.
  bool done() const {
    std::lock_guard lock(mu_);
    return done_;
  }
  bool wait() {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(20), [&] { return done_; });
  }
  std::vector<uint32_t> tokens() const {
    std::lock_guard lock(mu_);
    return tokens_;
  }
  Status status() const {
    std::lock_guard lock(mu_);
    return status_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint32_t> tokens_;
  FinishReason reason_ = FinishReason::kNone;
  Status status_;
  bool done_ = false;
};

// Greedy continuation straight from the fake's logits function: what any correct schedule gives.
inline std::vector<uint32_t> expectedGreedy(std::vector<uint32_t> history, uint32_t n,
                                            uint32_t vocab) {
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < n; ++i) {
    const auto row = test::fakeLogits(history, vocab);
    const uint32_t t = uint32_t(std::max_element(row.begin(), row.end()) - row.begin());
    out.push_back(t);
    history.push_back(t);
  }
  return out;
}

}  // namespace bulkhead::test
