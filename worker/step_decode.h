// A Step message into the backend's terms: every sequence's lists copied out of the message into
// one buffer, sizes checked against the worker's limits before anything is copied. Cap'n Proto
// reads lazily, so a malformed message can throw kj::Exception from here: callers catch it (the
// serving loop answers Error).
#pragma once

#include <cstdint>
#include <vector>

#include "proto/worker.capnp.h"
#include "shared/status.h"
#include "worker/backend.h"

namespace bulkhead {

// Most sequences one Step may carry.
constexpr uint32_t kMaxSequencesPerStep = 4096;

// `batch` gets one SequenceStep per sequence, its spans into `lists`; `rows` the logits rows
// asked for. INVALID_ARGUMENT or RESOURCE_EXHAUSTED (rows past the last of `arena_slots` from the
// step's first slot) otherwise.
Status decodeStep(wire::Step::Reader step, const BackendLimits& limits, uint32_t arena_slots,
                  std::vector<uint32_t>& lists, std::vector<SequenceStep>& batch, uint32_t& rows);

}  // namespace bulkhead
