// Names of the fault classes (shared/fault.h).
#include "shared/fault.h"

#include <array>

namespace bulkhead {
namespace {

struct Named {
  Fault fault;
  std::string_view name;
};

constexpr std::array<Named, 13> kFaults = {{
    {Fault::kWorkerKill, "worker_kill"},
    {Fault::kWorkerHang, "worker_hang"},
    {Fault::kSlowStep, "slow_step"},
    {Fault::kWeightBitflip, "weight_bitflip"},
    {Fault::kLogitsCorrupt, "logits_corrupt"},
    {Fault::kLogitsNan, "logits_nan"},
    {Fault::kTornWrite, "torn_write"},
    {Fault::kStaleIncarnation, "stale_incarnation"},
    {Fault::kStaleStep, "stale_step"},
    {Fault::kGarbageReply, "garbage_reply"},
    {Fault::kTruncatedReply, "truncated_reply"},
    {Fault::kStaleSlot, "stale_slot"},
    {Fault::kComputeFault, "compute_fault"},
}};

constexpr std::array<Fault, kFaults.size()> allOf() {
  std::array<Fault, kFaults.size()> out{};
  for (size_t i = 0; i < kFaults.size(); ++i) out[i] = kFaults[i].fault;
  return out;
}
constexpr std::array<Fault, kFaults.size()> kAll = allOf();

}  // namespace

std::string_view faultName(Fault fault) {
  for (const Named& n : kFaults)
    if (n.fault == fault) return n.name;
  return "?";
}

std::optional<Fault> faultFromName(std::string_view name) {
  for (const Named& n : kFaults)
    if (n.name == name) return n.fault;
  return std::nullopt;
}

std::span<const Fault> allFaults() {
  return kAll;
}

}  // namespace bulkhead
