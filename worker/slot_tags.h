// The tags of a backend's resident weight slots: (tensor index, generation) for each slot's
// address. A rebind or reuse of a slot would bump its generation; before every step a backend
// checks each binding its kernels will be handed against these tags (WeightCheck::kSlotTag).
#pragma once

#include <cstdint>
#include <string_view>
#include <unordered_map>

namespace bulkhead {

class SlotTags {
 public:
  void tag(const void* slot, uint32_t tensor, uint32_t generation = 1) {
    tags_[slot] = {tensor, generation};
  }
  // The generation of a tagged slot.
  uint32_t generation(const void* slot) const { return tags_.at(slot).generation; }
  // Empty when `binding` is the slot tagged for `tensor` at `generation`; else why it is not.
  std::string_view mismatch(const void* binding, uint32_t tensor, uint32_t generation) const {
    const auto found = tags_.find(binding);
    if (found == tags_.end()) return "bound to memory that is no resident slot";
    if (found->second.tensor != tensor) return "bound to a slot tagged for another tensor";
    if (found->second.generation != generation) return "bound to an older generation of its slot";
    return {};
  }

 private:
  struct Tag {
    uint32_t tensor = 0;
    uint32_t generation = 0;
  };
  std::unordered_map<const void*, Tag> tags_;
};

}  // namespace bulkhead
