// WeightScrubber: rolling passes over the backend's resident weights.
#include "worker/weight_scrubber.h"

#include <spdlog/spdlog.h>

#include "shared/checksum.h"

namespace bulkhead {

WeightScrubber::WeightScrubber(Backend& backend, const Checkpoint& checkpoint,
                               uint64_t granule_bytes)
    : backend_(backend) {
  const auto used = checkpoint.usedTensors();
  for (uint32_t t = 0; t < used.size(); ++t) {
    names_.push_back(used[t]->name);
    const auto bytes = used[t]->data;
    for (uint64_t off = 0; off < bytes.size(); off += granule_bytes) {
      const uint64_t len = std::min<uint64_t>(granule_bytes, bytes.size() - off);
      granules_.push_back({t, off, len, checksumBytes(bytes.subspan(off, len)), 0});
      total_bytes_ += len;
    }
  }
}

std::vector<WeightCorruption> WeightScrubber::scrub(uint64_t budget_bytes, uint64_t last_step) {
  std::vector<WeightCorruption> found;
  budget_bytes = std::min(budget_bytes, total_bytes_);  // at most one pass per call
  uint64_t done = 0;
  while (done < budget_bytes && !granules_.empty()) {
    if (cursor_ == 0) {
      pass_started_after_ = last_step;
      pass_clean_ = true;
    }
    Granule& g = granules_[cursor_];
    auto sum = backend_.residentChecksum(g.tensor, g.offset, g.bytes);
    if (!sum.ok() || *sum != g.checksum) {
      found.push_back({names_[g.tensor], g.offset, g.bytes, g.clean_after_step + 1});
      spdlog::error("weight corruption in {} bytes {}..{}; repairing from the host copy",
                    names_[g.tensor], g.offset, g.offset + g.bytes);
      Status repaired = backend_.repairResident(g.tensor, g.offset, g.bytes);
      auto again = backend_.residentChecksum(g.tensor, g.offset, g.bytes);
      if (!repaired.ok() || !again.ok() || *again != g.checksum) {
        // Crash-only: memory that cannot be repaired cannot be served from.
        spdlog::critical("cannot repair {}: {}", names_[g.tensor], repaired.toString());
        std::abort();
      }
      pass_clean_ = false;
    }
    g.clean_after_step = last_step;
    done += g.bytes;
    if (++cursor_ == granules_.size()) {
      cursor_ = 0;
      ++passes_;
      if (pass_clean_) clean_through_ = std::max(clean_through_, pass_started_after_);
    }
  }
  return found;
}

std::vector<WeightCorruption> WeightScrubber::fullPass(uint64_t last_step) {
  cursor_ = 0;
  return scrub(total_bytes_, last_step);
}

}  // namespace bulkhead
