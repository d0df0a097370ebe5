// Fault injection hooks: the refusing default and the injecting implementation, one fault kind
// at a time as shared/fault.h documents them.
#include "worker/fault_hooks.h"

#include <signal.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "shared/mix.h"

namespace bulkhead {

Status StepFaults::arm(const FaultSpec&) {
  spdlog::warn("refused a fault injection request: fault injection is disabled");
  return Status(Code::kPermissionDenied,
                "fault injection is disabled; start the worker with --enable-fault-injection");
}

namespace {

bool isRowFault(Fault kind) {
  return kind == Fault::kLogitsCorrupt || kind == Fault::kTornWrite ||
         kind == Fault::kStaleIncarnation || kind == Fault::kStaleStep || kind == Fault::kLogitsNan;
}

class InjectedFaults final : public StepFaults {
 public:
  InjectedFaults(Backend& backend, std::shared_mutex& weights_mutex, LogitsArena& arena)
      : backend_(backend), weights_mutex_(weights_mutex), arena_(arena) {}

  Status arm(const FaultSpec& fault) override {
    spdlog::warn("fault armed: {} row {}", faultName(fault.fault), fault.row);
    if (fault.fault == Fault::kWeightBitflip) {
      std::unique_lock weights(weights_mutex_);
      return backend_.flipWeightBit(fault.byte_offset, fault.bit);
    }
    if (fault.fault == Fault::kStaleSlot || fault.fault == Fault::kComputeFault) {
      // Both land in the backend's bindings; the step path never sees the hook.
      std::unique_lock weights(weights_mutex_);
      const bool stale = fault.fault == Fault::kStaleSlot;
      auto tensor =
          stale ? backend_.staleSlot(fault.byte_offset) : backend_.computeFault(fault.byte_offset);
      if (!tensor.ok()) return tensor.status();
      spdlog::warn(
          "fault: {} {}", *tensor,
          stale ? "now served from a stale slot" : "computes one value of its next product wrong");
      return okStatus();
    }
    armed_ = fault;
    return okStatus();
  }

  // Row faults wait for a step that has rows and hit its last row if it has fewer; any other
  // fault is spent on the next step.
  void beginStep(uint32_t rows) override {
    active_.reset();
    if (!armed_ || (isRowFault(armed_->fault) && rows == 0)) return;
    active_ = armed_;
    armed_.reset();
    if (isRowFault(active_->fault)) active_->row = std::min(active_->row, rows - 1);
  }

  // A torn write: the payload is produced where the slot never sees it. The half that will never
  // be written is made stale first: a row that repeats exactly (the canary's continuation) would
  // otherwise find its own previous bytes there, and the tear would change nothing.
  float* rowDestination(uint32_t row, float* slot) override {
    if (!hits(row, Fault::kTornWrite)) return slot;
    scratch_.resize(arena_.rowFloats());
    std::fill(slot + scratch_.size() / 2, slot + scratch_.size(), 1234.5f);
    return scratch_.data();
  }

  void afterCompute() override {
    if (active_ && !active_->between_steps) stopWorker();
  }

  void afterReply() override {
    if (active_ && active_->between_steps) stopWorker();
  }

  // Kill, hang or slow down, when the active fault is one of those.
  void stopWorker() {
    switch (active_->fault) {
      case Fault::kWorkerKill:
        ::raise(SIGKILL);
        break;
      case Fault::kWorkerHang:
        ::raise(SIGSTOP);
        break;
      case Fault::kSlowStep:
        std::this_thread::sleep_for(std::chrono::milliseconds(active_->delay_ms));
        break;
      default:
        return;
    }
    active_.reset();
  }

  void beforePublish(uint32_t row, float* slot, RowCheck& check) override {
    if (hits(row, Fault::kLogitsNan)) {
      // As if the producer had written the NaN: the checksum matches the row, the flag says so.
      constexpr uint32_t kIndex = 7;
      const uint32_t old_word = std::bit_cast<uint32_t>(slot[kIndex]);
      slot[kIndex] = std::nanf("");
      check.checksum += checksumTerm(std::bit_cast<uint32_t>(slot[kIndex]), kIndex);
      check.checksum -= checksumTerm(old_word, kIndex);
      check.finite = false;
    } else if (hits(row, Fault::kTornWrite)) {
      // Half the payload lands; the header will claim all of it.
      std::memcpy(slot, scratch_.data(), sizeof(float) * (scratch_.size() / 2));
    } else if (hits(row, Fault::kLogitsCorrupt)) {
      reinterpret_cast<unsigned char*>(slot)[13] ^= 0x40;  // after the checksum was taken
    }
  }

  void afterPublish(uint32_t row, uint32_t slot, const RowHeaderFields& header) override {
    RowHeaderFields stale = header;
    if (hits(row, Fault::kStaleIncarnation)) {
      stale.incarnation -= 1;
    } else if (hits(row, Fault::kStaleStep)) {
      stale.step_id -= 1;
    } else {
      return;
    }
    arena_.publishHeader(slot, stale);
  }

  ReplyForm replyForm() override {
    if (active_ && active_->fault == Fault::kGarbageReply) return ReplyForm::kGarbage;
    if (active_ && active_->fault == Fault::kTruncatedReply) return ReplyForm::kTruncated;
    return ReplyForm::kMessage;
  }

 private:
  bool hits(uint32_t row, Fault kind) const {
    return active_ && active_->fault == kind && active_->row == row;
  }

  Backend& backend_;
  std::shared_mutex& weights_mutex_;
  LogitsArena& arena_;
  std::optional<FaultSpec> armed_;   // waiting for a step
  std::optional<FaultSpec> active_;  // the step in progress
  std::vector<float> scratch_;
};

}  // namespace

std::unique_ptr<StepFaults> makeInjectedFaults(Backend& backend, std::shared_mutex& weights_mutex,
                                               LogitsArena& arena) {
  return std::make_unique<InjectedFaults>(backend, weights_mutex, arena);
}

}  // namespace bulkhead
