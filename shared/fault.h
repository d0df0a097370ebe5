// The fault vocabulary: one list of injectable fault classes, with one name each, used alike by
// `bulkhead chaos`, the Admin API (by name) and the worker protocol (proto/worker.capnp's
// FaultKind lists the same classes in the same order). Faults land on the worker, mid-step.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace bulkhead {

enum class Fault : uint8_t {
  kWorkerKill,        // the worker SIGKILLs itself in the middle of the next step, or after it
  kWorkerHang,        // the worker SIGSTOPs itself in the middle of the next step, or after it
  kSlowStep,          // the next step takes longer than its deadline
  kWeightBitflip,     // one bit of one resident weight flips
  kLogitsCorrupt,     // a byte of a row changes after its checksum was taken
  kLogitsNan,         // a NaN lands in a row before its checksum is taken
  kTornWrite,         // a row's header is published over a half-written payload
  kStaleIncarnation,  // a row is published under an older incarnation id
  kStaleStep,         // a row is published under the previous step id
  kGarbageReply,      // the next step is answered with bytes that are not a message
  kTruncatedReply,    // the next step is answered with a cut-off frame
  kStaleSlot,         // one weight is served from another slot or a stale copy, bytes intact
  kComputeFault,      // one multiply-add result of the next step is wrong, weights intact
};

// "worker_kill", "worker_hang", ...
std::string_view faultName(Fault fault);
std::optional<Fault> faultFromName(std::string_view name);
std::span<const Fault> allFaults();

// One fault as armed on a worker.
struct FaultSpec {
  Fault fault = Fault::kWorkerKill;
  uint32_t row = 0;          // row faults: which requested row of the next step that has rows
  uint32_t delay_ms = 0;     // kSlowStep
  uint64_t byte_offset = 0;  // kWeightBitflip: offset into the resident weights; kStaleSlot: role;
                             // kComputeFault: layer, row and output
  uint8_t bit = 0;           // kWeightBitflip
  bool between_steps = false;  // kWorkerKill, kWorkerHang: right after the next step's reply
};

}  // namespace bulkhead
