// A worker's canary at start, before it tells systemd it is ready: the broker's canary (its
// 16-token prefix and one-token continuation, broker/canary.h) computed on the backend, whose
// digest must equal a record `bulkhead qualify` pinned for this model, weights and backend. A
// worker whose canary differs never becomes ready; systemd restarts it, up to its start limit.
#pragma once

#include "broker/canary.h"
#include "shared/checkpoint.h"
#include "shared/status.h"
#include "worker/backend.h"

namespace bulkhead {

// OK when the record is for this checkpoint (identity and weight digest) and backend and the
// canary's digest matches; FAILED_PRECONDITION (another model or backend) or DATA_LOSS (the
// digest) saying what differs.
Status checkCanaryRecord(Backend& backend, const Checkpoint& checkpoint,
                         const CanaryRecord& record);

}  // namespace bulkhead
