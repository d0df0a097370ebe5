// Conversions between shared/fault.h's Fault and the worker protocol's FaultKind, which lists the
// same classes in the same order after `none`.
#pragma once

#include <optional>

#include "proto/worker.capnp.h"
#include "shared/fault.h"

namespace bulkhead {

inline wire::FaultKind toWire(Fault fault) {
  return static_cast<wire::FaultKind>(uint16_t(fault) + 1);
}

// nullopt for `none` and for values this build does not know.
inline std::optional<Fault> fromWire(wire::FaultKind kind) {
  const auto v = uint16_t(kind);
  if (v == 0 || v > allFaults().size()) return std::nullopt;
  return static_cast<Fault>(v - 1);
}

static_assert(uint16_t(wire::FaultKind::STALE_SLOT) == uint16_t(Fault::kStaleSlot) + 1);
static_assert(uint16_t(wire::FaultKind::COMPUTE_FAULT) == uint16_t(Fault::kComputeFault) + 1);
static_assert(uint16_t(wire::FaultKind::WORKER_KILL) == uint16_t(Fault::kWorkerKill) + 1);

}  // namespace bulkhead
