// Where fault injection enters a step. The step runner calls these hooks at fixed points; the
// base class is the serving worker (every hook does nothing, arming is refused), and
// makeInjectedFaults() builds the one that damages steps as shared/fault.h documents,
// installed only when the worker was started with --enable-fault-injection.
#pragma once

#include <cstdint>
#include <memory>
#include <shared_mutex>

#include "shared/checksum.h"
#include "shared/fault.h"
#include "shared/logits_arena.h"
#include "worker/backend.h"

namespace bulkhead {

// How a step's reply goes out.
enum class ReplyForm { kMessage, kGarbage, kTruncated };

class StepFaults {
 public:
  virtual ~StepFaults() = default;

  // A FaultInject request: arms a fault for the next step, or applies it at once (a weight bit
  // flip). The serving worker refuses with PERMISSION_DENIED.
  virtual Status arm(const FaultSpec& fault);

  // A decoded step asking for `rows` logits rows is about to be enqueued.
  virtual void beginStep(uint32_t rows) {}
  // Where the backend writes requested row `row`: `slot`, unless a fault diverts it.
  virtual float* rowDestination(uint32_t row, float* slot) { return slot; }
  // The backend finished the step; nothing is published yet.
  virtual void afterCompute() {}
  // Row `row` is in `slot` with its producer's check, about to be published under check.checksum.
  virtual void beforePublish(uint32_t row, float* slot, RowCheck& check) {}
  // Row `row` was published in arena slot `slot` with `header`.
  virtual void afterPublish(uint32_t row, uint32_t slot, const RowHeaderFields& header) {}
  // How this step's reply is sent.
  virtual ReplyForm replyForm() { return ReplyForm::kMessage; }
  // A reply (to a step or anything else) went out; the next request has not been read.
  virtual void afterReply() {}
};

// The fault-injecting hooks. Weight bit flips take `weights_mutex` exclusive, so they never
// race a step or a repair.
std::unique_ptr<StepFaults> makeInjectedFaults(Backend& backend, std::shared_mutex& weights_mutex,
                                               LogitsArena& arena);

}  // namespace bulkhead
