// The order of a step's work for streamed weight units (worker/weight_residency.h): copies into
// staging slots on a copy stream, and the waits that keep each product reading its own unit. Pure:
// the CUDA backend turns each operation into a stream call, and the tests run the same operations
// on a simulated device (two in-order streams, events as CUDA's: a wait is for the record of the
// event issued last before it).
//
// Unit j (in step order) goes into slot j % slots. Its copy waits until the products of unit
// j - slots, the slot's last reader, have run; its product waits for its copy. At the start the
// first `slots` copies are issued; after unit j's product, the copy of unit j + slots.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

class StagingRing {
 public:
  struct Op {
    enum Kind {
      kCopyWaitsFreed,  // the copy stream waits for event freed[slot]
      kCopy,            // the copy stream copies `unit` into `slot`
      kRecordStaged,    // the copy stream records staged[slot]
      kComputeWaits,    // the compute stream waits for event staged[slot]
      kRecordFreed,     // the compute stream records freed[slot]
    } kind;
    size_t unit = 0;
    uint32_t slot = 0;
    bool operator==(const Op&) const = default;
  };

  StagingRing(size_t units, uint32_t slots) : units_(units), slots_(slots) {}

  // A step's start: the copies of the first units.
  std::vector<Op> begin();
  // Before the products of unit `unit`: the wait for its copy. Units come in order, each once a
  // step; FailedPrecondition otherwise.
  Result<std::vector<Op>> before(size_t unit);
  // After them: the slot freed, and the next unit's copy into it.
  Result<std::vector<Op>> after(size_t unit);
  // The step's end: every unit's products ran and every copy was issued.
  Status end() const;

 private:
  void copyNext(std::vector<Op>& ops);
  size_t units_;
  uint32_t slots_;
  size_t next_copy_ = 0;  // the next unit to copy
  size_t next_read_ = 0;  // the next unit whose products run
  bool reading_ = false;  // between before() and after()
};

}  // namespace bulkhead
