// The canary: a fixed prompt whose logits a worker must reproduce before it takes traffic, and a
// fixed one-token continuation of it that rides along with client steps every N steps (and runs
// alone now and then while idle). Batch invariance makes both rows' digests exact whatever else
// shares the step.
//
// A digest becomes the reference only after qualification: the first time a model and backend
// serve, the worker's canary rows are checked against the CPU reference engine run in the
// broker's own process (argmax equal, error within the backend's tolerance), or an operator pins
// a record made by `bulkhead qualify`. A worker that fails qualification never serves and records
// nothing. Records live in the broker's state directory, keyed by the model's identity and the
// backend; each also remembers the weight digest it was recorded with.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

struct WorkerHello;

// Version 3: a 16-token prefix and one continuation token, two rows.
constexpr int kCanaryVersion = 3;
constexpr uint32_t kCanaryPrefix = 16;

// The canary's tokens for a vocabulary: kCanaryPrefix fixed, spread-out ids, then the
// continuation token that rides along (position kCanaryPrefix).
std::vector<uint32_t> canaryTokens(uint32_t vocab_size);
// Digest of the canary's rows, from each row's payload checksum (checksumBytes), in order.
uint64_t canaryDigest(std::span<const uint64_t> row_checksums);

// The reference engine: the logits rows `rows` of a prefill of `tokens` for the model a worker
// serves, computed in the caller's process.
using CanaryReference = std::function<Result<std::vector<std::vector<float>>>(
    const WorkerHello& hello, std::span<const uint32_t> tokens, std::span<const uint32_t> rows)>;

// How far a backend's logits may be from the reference engine's, as a share of the largest
// reference logit's magnitude (at least 1): 0 for the CPU engine itself, which must be exact.
float canaryTolerance(const std::string& backend);
// OK when every worker row has the reference row's argmax (the lowest id among the largest) and
// no value further from it than `tolerance`; FAILED_PRECONDITION saying where they disagree.
Status qualifyRows(std::span<const std::span<const float>> worker,
                   std::span<const std::vector<float>> reference, float tolerance);

// One record, as stored and as `bulkhead qualify` writes it.
struct CanaryRecord {
  uint64_t model_identity = 0;
  std::string backend;
  uint64_t weight_digest = 0, logits_digest = 0;
};
// Reads a record file strictly (a pinned record: an operator's, so any fault is an error).
Result<CanaryRecord> readCanaryRecord(const std::filesystem::path& path);
// Writes a record atomically (a temporary file renamed over the target).
Status writeCanaryRecord(const std::filesystem::path& path, const CanaryRecord& record);

// Thread-safe: the schedulers of a broker with several workers share one store.
class CanaryStore {
 public:
  // `pinned`: a record an operator pinned; it is the only reference, and nothing is recorded.
  explicit CanaryStore(std::filesystem::path dir, std::optional<CanaryRecord> pinned = {})
      : dir_(std::move(dir)), pinned_(std::move(pinned)) {}

  // OK if the digest matches the record; DATA_LOSS naming what differs; NOT_FOUND when there is
  // no record (the canary must be qualified, then record()ed); FAILED_PRECONDITION when the
  // pinned record is for another model or backend. Runs on the scheduler thread, so it never
  // throws: a record that cannot be read or parsed is logged, moved aside ("<name>.corrupt-<unix
  // seconds>") and treated as absent.
  Status check(uint64_t model_identity, const std::string& backend, uint64_t weight_digest,
               uint64_t logits_digest) noexcept;
  // Records a qualified canary (in memory, and in the directory unless a corrupt record that
  // could not be moved aside sits where it would go).
  void record(uint64_t model_identity, const std::string& backend, uint64_t weight_digest,
              uint64_t logits_digest) noexcept;
  // Held from check() through qualification to record(), so that workers starting together
  // qualify once: the others wait, then find the record.
  std::unique_lock<std::mutex> qualifying() { return std::unique_lock(qualify_mu_); }

 private:
  struct Record {
    uint64_t weight_digest = 0, logits_digest = 0;
  };
  std::filesystem::path pathFor(uint64_t identity, const std::string& backend) const;
  // The record on disk: nullopt when there is none or it was corrupt (and has been moved aside).
  // `keep_out` is set when a corrupt record could not be moved aside, so that it is not
  // overwritten.
  std::optional<Record> load(const std::filesystem::path& path, uint64_t identity,
                             const std::string& backend, bool& keep_out) noexcept;
  std::mutex qualify_mu_;
  std::mutex mu_;  // check and record, whole
  std::filesystem::path dir_;
  std::optional<CanaryRecord> pinned_;
  std::map<std::pair<uint64_t, std::string>, Record> memory_;
  std::map<std::pair<uint64_t, std::string>, bool> keep_out_;
};

}  // namespace bulkhead
