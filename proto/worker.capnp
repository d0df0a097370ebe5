# The step protocol between broker and worker, over a Unix stream socket. Each message travels in
# one frame (shared/ipc_frame.h). The worker speaks first with Hello; afterwards every ToWorker
# message gets exactly one FromWorker reply carrying the same requestId.
@0xecb78efd3d70ed8c;

$import "/capnp/c++.capnp".namespace("bulkhead::wire");

const protocolVersion :UInt32 = 2;

struct Hello {
  protocolVersion @0 :UInt32;
  pid @1 :Int32;
  incarnation @2 :UInt64;
  backend @3 :Text;
  architecture @4 :Text;
  modelDir @5 :Text;
  vocabSize @6 :UInt32;
  maxContext @7 :UInt32;
  kvBlockSize @8 :UInt32;
  kvBlockCount @9 :UInt32;
  maxStepTokens @10 :UInt32;
  weightBytes @11 :UInt64;
  # Digest of the per-granule checksums of every weight, as loaded.
  weightDigest @12 :UInt64;
  # The logits arena of this incarnation.
  arenaName @13 :Text;
  arenaSlots @14 :UInt32;
  faultInjection @15 :Bool;
  eosTokenIds @16 :List(UInt32);
  # Identity of the model independent of weight content: config.json and the tensors' names,
  # dtypes and shapes. Keys the broker's canary record.
  modelIdentity @17 :UInt64;
  # Whether the worker scrubs its resident weights (StepDone.scrub is meaningful).
  scrubbing @18 :Bool;
  # Whether every step checks the weight words its kernels read (StepDone.weightReads): a step
  # that passes is vouched for by itself, and its tokens need not wait for the scrubber.
  inStepChecks @19 :Bool;
  # Whether a step's compute time grows with its rows (a CPU), rather than staying near flat up
  # to large batches (a GPU reading its weights once a step): two half steps then cost no more
  # than one whole, and the broker overlaps sampling with compute sooner.
  computeGrowsWithRows @20 :Bool;
  # Of weightBytes, those kept in host memory and copied to the device every step (a CUDA
  # worker's weight budget); the rest are resident.
  streamedWeightBytes @21 :UInt64;
}

struct WeightCorruption {
  tensor @0 :Text;
  offset @1 :UInt64;
  bytes @2 :UInt64;
  # The granule was last verified clean before this step: this step and later ones may have
  # computed with the corrupted weight. The granule has been repaired from the host copy.
  suspectFromStep @3 :UInt64;
}

struct ScrubReport {
  # Every resident weight was verified clean after this step completed, so steps up to and
  # including it computed with clean weights.
  cleanThrough @0 :UInt64;
  corruptions @1 :List(WeightCorruption);
}

struct SequenceStep {
  sequenceId @0 :UInt64;
  startPosition @1 :UInt32;
  tokens @2 :List(UInt32);
  kvBlocks @3 :List(UInt32);
  # Indices into tokens whose logits are wanted, strictly ascending.
  logitsRows @4 :List(UInt32);
}

struct Step {
  stepId @0 :UInt64;
  sequences @1 :List(SequenceStep);
  # The step's logits rows go to arena slots firstSlot onwards: a broker with two steps in flight
  # gives them disjoint slots, so one step's rows are not overwritten while it reads them.
  firstSlot @2 :UInt32;
}

struct RowRef {
  slot @0 :UInt32;
  sequenceId @1 :UInt64;
  tokenIndex @2 :UInt32;
  checksum @3 :UInt64;
}

struct WeightReads {
  # The step's kernels folded every weight word they read; checked against the checkpoint.
  checked @0 :Bool;
  # The first weight whose reads did not match; empty when all did. The step's rows must not be
  # used.
  failedTensor @1 :Text;
  wordsRead @2 :UInt64;
  # Which way the failed weight was wrong, as far as the worker can tell (another slot, bytes).
  why @3 :Text;
  # Which check failed: worker/backend.h WeightCheck, in the same order.
  failedCheck @4 :WeightCheck;
}

enum WeightCheck {
  reads @0;       # the words read differ from the checkpoint's, or were not all read
  slotTag @1;     # a binding is not its tensor's tagged slot
  arithmetic @2;  # a product's output sums fail the column-sum check
}

struct StepDone {
  stepId @0 :UInt64;
  # One per requested row, in request order (sequence by sequence, rows ascending).
  rows @1 :List(RowRef);
  computeMicros @2 :UInt64;
  scrub @3 :ScrubReport;
  weightReads @4 :WeightReads;
  timeline @5 :StepTimeline;
}

# When the worker handled a step, in nanoseconds of the host's monotonic clock (the broker's
# steady clock on the same host): what a step costs beyond its compute, piece by piece.
struct StepTimeline {
  arrived @0 :Int64;       # the step's bytes were readable on the socket
  computeStart @1 :Int64;  # decoded; the backend is given the step
  computeEnd @2 :Int64;    # the backend's rows are in the arena
  replying @3 :Int64;      # the reply is about to be written
}

# The fault classes of shared/fault.h, in the same order after `none`.
enum FaultKind {
  none @0;
  workerKill @1;        # SIGKILL itself in the middle of the next step (or after it)
  workerHang @2;        # SIGSTOP itself in the middle of the next step (or after it)
  slowStep @3;          # delay the next step by delayMillis
  weightBitflip @4;     # flip one bit of one resident weight
  logitsCorrupt @5;     # flip a byte of a row after its checksum is taken
  logitsNan @6;         # write a NaN into a row before its checksum is taken
  tornWrite @7;         # publish a row's header over a half-written payload
  staleIncarnation @8;  # publish a row under an older incarnation id
  staleStep @9;         # publish a row under the previous step id
  garbageReply @10;     # answer the next step with bytes that are not a message
  truncatedReply @11;   # answer the next step with a cut-off frame
  staleSlot @12;        # serve one weight from another slot or a stale copy (byteOffset picks)
  computeFault @13;     # one wrong multiply-add in the next step (byteOffset picks where)
}

struct FaultInject {
  kind @0 :FaultKind;
  # Which requested row of the next step is damaged (row faults).
  row @1 :UInt32;
  delayMillis @2 :UInt32;
  # weightBitflip: byte offset into the resident weights and the bit.
  byteOffset @3 :UInt64;
  bit @4 :UInt8;
  # workerKill, workerHang: right after the next step's reply went out, not in its middle.
  betweenSteps @5 :Bool;
}

struct ToWorker {
  requestId @0 :UInt64;
  union {
    step @1 :Step;
    release @2 :List(UInt64);   # sequence ids the broker has finished with
    ping @3 :Void;
    shutdown @4 :Void;
    faultInject @5 :FaultInject;
    heartbeat @6 :Void;         # answered at once by a Pong carrying no new scrub work
  }
}

struct Error {
  # A canonical status code (shared/status.h) and a message naming the problem.
  code @0 :UInt32;
  message @1 :Text;
}

struct FromWorker {
  requestId @0 :UInt64;
  union {
    hello @1 :Hello;
    stepDone @2 :StepDone;
    error @3 :Error;
    pong @4 :ScrubReport;   # a Ping completes a full scrub pass first
    released @5 :Void;
    shuttingDown @6 :Void;
    faultArmed @7 :Void;
  }
}
