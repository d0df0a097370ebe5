// Background verification of the weights a backend computes from. Expected checksums come from
// the checkpoint's host bytes at load; each call verifies the next slice of a rolling pass, repairs
// any granule that no longer matches from the host copy, and says which steps may have used it.
// Corruption persists until repaired, so a granule found clean at time t was clean for every step
// before t: a full pass that started after step S and found nothing proves steps up to S clean.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shared/checkpoint.h"
#include "worker/backend.h"

namespace bulkhead {

struct WeightCorruption {
  std::string tensor;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t suspect_from_step = 0;
};

class WeightScrubber {
 public:
  WeightScrubber(Backend& backend, const Checkpoint& checkpoint,
                 uint64_t granule_bytes = 2ull << 20);

  // Verifies about `budget_bytes` more of the current pass. `last_step` is the id of the last
  // step the backend completed. Corrupted granules are repaired and returned.
  std::vector<WeightCorruption> scrub(uint64_t budget_bytes, uint64_t last_step);
  // A complete pass starting now.
  std::vector<WeightCorruption> fullPass(uint64_t last_step);

  uint64_t cleanThrough() const { return clean_through_; }
  uint64_t totalBytes() const { return total_bytes_; }
  uint64_t passes() const { return passes_; }

 private:
  struct Granule {
    uint32_t tensor;
    uint64_t offset, bytes, checksum;
    uint64_t clean_after_step;  // last_step when it was last found (or made) clean
  };
  Backend& backend_;
  std::vector<std::string> names_;
  std::vector<Granule> granules_;
  uint64_t total_bytes_ = 0;
  size_t cursor_ = 0;
  uint64_t pass_started_after_ = 0;
  bool pass_clean_ = true;
  uint64_t clean_through_ = 0;
  uint64_t passes_ = 0;
};

}  // namespace bulkhead
