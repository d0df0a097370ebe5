// The canary: a fixed prompt whose logits digest is recorded the first time a model and backend
// serve, and checked on every new worker before it takes traffic (and now and then between
// generations). Records live in the broker's state directory, keyed by the model's identity and
// the backend; each also remembers the weight digest it was recorded with.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

constexpr int kCanaryVersion = 2;

// The canary prompt for a vocabulary: 16 fixed, spread-out token ids.
std::vector<uint32_t> canaryTokens(uint32_t vocab_size);
// Digest of the canary's logits rows.
uint64_t canaryDigest(std::span<const std::span<const float>> rows);

class CanaryStore {
 public:
  explicit CanaryStore(std::filesystem::path dir) : dir_(std::move(dir)) {}

  // OK if the digest matches the record (or there was none and it is now recorded);
  // DATA_LOSS naming what differs otherwise. Runs on the scheduler thread, so it never throws: a
  // record that cannot be read or parsed is logged, moved aside ("<name>.corrupt-<unix seconds>")
  // and treated as absent, so this worker's canary is recorded afresh.
  Status check(uint64_t model_identity, const std::string& backend, uint64_t weight_digest,
               uint64_t logits_digest) noexcept;

 private:
  struct Record {
    uint64_t weight_digest = 0, logits_digest = 0;
  };
  std::filesystem::path pathFor(uint64_t identity, const std::string& backend) const;
  // The record on disk: nullopt when there is none or it was corrupt (and has been moved aside).
  // `keep_out` is set when a corrupt record could not be moved aside, so that it is not
  // overwritten.
  std::optional<Record> load(const std::filesystem::path& path, uint64_t identity,
                             const std::string& backend, bool& keep_out) const noexcept;
  void store(const std::filesystem::path& path, uint64_t identity, const std::string& backend,
             const Record& record) const noexcept;
  std::filesystem::path dir_;
  std::map<std::pair<uint64_t, std::string>, Record> memory_;
};

}  // namespace bulkhead
