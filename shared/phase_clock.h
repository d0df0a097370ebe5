// PhaseClock: how long each phase of a longer job took (a worker's start, a backend's load), for
// one log line.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace bulkhead {

class PhaseClock {
 public:
  // Ends the phase that began at the last call (or at construction), naming it.
  void phase(std::string name) {
    const auto now = std::chrono::steady_clock::now();
    phases_.emplace_back(std::move(name), now - last_);
    last_ = now;
  }
  // "1234 ms: load 1000 ms, digest 234 ms"
  std::string summary() const {
    std::string parts;
    std::chrono::steady_clock::duration all{};
    for (const auto& [name, took] : phases_) {
      parts +=
          (parts.empty() ? "" : ", ") + name + " " + std::to_string(milliseconds(took)) + " ms";
      all += took;
    }
    return std::to_string(milliseconds(all)) + " ms: " + parts;
  }

 private:
  static long long milliseconds(std::chrono::steady_clock::duration d) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
  }
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
  std::vector<std::pair<std::string, std::chrono::steady_clock::duration>> phases_;
};

}  // namespace bulkhead
