// Which of a model's product weights stay resident on the device and which stream from pinned
// host memory every step (DESIGN.md, "Residency"). A pure function of the units' sizes, the
// budget and the request, so it is tested without a device; the CUDA backend carries it out.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

// A product's weights as one piece, in the order a step reads them: each layer's q/k/v
// ("layers.N.qkv"), o ("layers.N.o"), gate/up ("layers.N.gate_up") and down ("layers.N.down"),
// then an untied lm_head ("lm_head"). `bytes` is the unit's tensors laid out one after another.
struct WeightUnit {
  std::string name;
  uint64_t bytes = 0;
  uint32_t layer = 0;  // lm_head: the number of layers
};

struct ResidencyRequest {
  // Device bytes for the weights: the resident ones plus the staging slots streamed units pass
  // through. 0: no limit.
  uint64_t budget = 0;
  // Units streamed whatever the budget (by name); the budget may stream more.
  std::vector<std::string> streamed;
  // Units larger than this many bytes streamed whatever the budget (0: none by size).
  uint64_t stream_larger_than = 0;
  // Staging slots: while a product reads one, the next streamed units copy into the others.
  uint32_t staging_slots = 2;
};

struct ResidencyPlan {
  std::vector<bool> streamed;   // per unit
  uint32_t staging_slots = 0;   // 0 when nothing streams
  uint64_t slot_bytes = 0;      // the largest streamed unit
  uint64_t resident_bytes = 0;  // the weights outside units and the resident units
  uint64_t streamed_bytes = 0;  // copied in every step
  uint64_t deviceBytes() const { return resident_bytes + uint64_t(staging_slots) * slot_bytes; }
  size_t streamedCount() const;
};

// The plan for `units` (in step order) beside `fixed_bytes` of weights that always stay resident
// (embedding, norms, biases, a tied lm_head). Units named in request.streamed or larger than
// request.stream_larger_than stream whatever the budget. Within the budget it looks for the
// fewest bytes a step: for each unit size as the largest it streams, it streams the largest
// units up to that size first, layers spread over the model (so copies overlap the resident
// layers between them), until the budget holds, and keeps the plan that streams least. Fails,
// saying the least budget that could work, when none fits; fails on an unknown name.
Result<ResidencyPlan> planResidency(std::span<const WeightUnit> units, uint64_t fixed_bytes,
                                    const ResidencyRequest& request);

// Layers 0..count-1 in the order that spreads a prefix of them over the model: 0, count/2,
// count/4, 3count/4, ... (each once).
std::vector<uint32_t> spreadOrder(uint32_t count);

// "1.5GiB", "800MiB", "4096" (bytes), "2G": a size in bytes (binary units, case-insensitive, a
// trailing "B" or "iB" optional).
Result<uint64_t> parseByteSize(const std::string& text);

}  // namespace bulkhead
