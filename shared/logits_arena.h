// The logits arena: one shared-memory segment per worker incarnation, holding fixed-size row
// slots. The worker writes a row's payload, then its header, the step id last with release
// ordering; the broker accepts a row only if every header field matches what it asked for and the
// payload's checksum and finiteness hold. Segments are per incarnation, so a replaced worker's
// writes land where no one reads them. No locks: a writer that dies mid-row leaves a row that
// fails verification, never a wedged reader.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "shared/status.h"

namespace bulkhead {

// What verification rejected; names the check.
enum class IntegrityCheck {
  kNone,
  kSlotRange,
  kIncarnation,
  kStepId,
  kSequenceId,
  kTokenIndex,
  kRowLength,
  kReportedChecksum,  // header checksum differs from the one in StepDone
  kPayloadChecksum,   // payload does not hash to the header checksum
  kNonFinite,
  kWeightReads,  // the step's own check of the weight words it read failed (worker-reported)
  kSlotTag,      // a weight binding was not its tensor's tagged slot (worker-reported)
  kArithmetic,   // a product failed the column-sum check (worker-reported)
  kCanary,       // the canary row riding along differs from its qualified digest
};
std::string_view integrityCheckName(IntegrityCheck check);

struct RowExpectation {
  uint64_t incarnation = 0;
  uint64_t step_id = 0;
  uint64_t sequence_id = 0;
  uint32_t token_index = 0;
  uint32_t slot = 0;
  uint64_t reported_checksum = 0;
};

struct RowHeaderFields {
  uint64_t incarnation = 0;
  uint64_t step_id = 0;
  uint64_t sequence_id = 0;
  uint32_t token_index = 0;
  uint32_t row_length = 0;
  uint64_t checksum = 0;
};

class LogitsArena {
 public:
  // Worker side: creates `name` exclusively (owner-only), sized for `slots` rows of `row_floats`.
  static Result<std::unique_ptr<LogitsArena>> create(const std::string& name, uint64_t incarnation,
                                                     uint32_t slots, uint32_t row_floats);
  // Broker side: maps an existing arena read-only and checks its layout against expectations.
  static Result<std::unique_ptr<LogitsArena>> open(const std::string& name, uint64_t incarnation,
                                                   uint32_t row_floats);
  // Removes arenas named by arenaName() whose creating process no longer exists (no process of
  // that pid, or one that started at another time). Returns how many were removed.
  static int collectStale();
  // "bulkhead-arena-<pid>-<start>-<incarnation>": the start is the process's start time
  // (processStart), so that a later process given the same pid is not taken for the creator.
  static std::string arenaName(int pid, uint64_t incarnation);
  static std::string arenaName(int pid, uint64_t start, uint64_t incarnation);
  // When process `pid` started, in clock ticks after boot (/proc/<pid>/stat); 0 when it cannot
  // be read (no such process).
  static uint64_t processStart(int pid);

  ~LogitsArena();
  LogitsArena(const LogitsArena&) = delete;
  LogitsArena& operator=(const LogitsArena&) = delete;

  const std::string& name() const { return name_; }
  uint32_t slots() const { return slots_; }
  uint32_t rowFloats() const { return row_floats_; }
  uint64_t incarnation() const { return incarnation_; }
  size_t bytes() const;
  // The whole mapping, for a producer that registers it with a device (worker side).
  std::span<std::byte> memory() const { return {base_, bytes()}; }

  // Worker: where slot's payload goes. Marks the slot unpublished first.
  float* beginRow(uint32_t slot);
  // Worker: publishes the header of a payload already in place, with the checksum its producer
  // computed while writing it (Backend's RowCheck); the payload is not read again.
  void publishRow(uint32_t slot, uint64_t step_id, uint64_t sequence_id, uint32_t token_index,
                  uint64_t checksum);
  // Worker (fault injection): publishes arbitrary header fields.
  void publishHeader(uint32_t slot, const RowHeaderFields& fields);

  // Broker: the row's payload if its header matches `expect` (every field but the payload's own
  // checksum and finiteness, which the sampling pass checks as it reads the row).
  Result<std::span<const float>> checkHeader(const RowExpectation& expect,
                                             IntegrityCheck* failed) const;
  // Broker: the row, if it passes every check, header and payload. On failure `failed` names the
  // check.
  Result<std::span<const float>> verifyRow(const RowExpectation& expect,
                                           IntegrityCheck* failed) const;

  // Removes the segment name now (the mapping stays valid until destruction).
  void unlink();

 private:
  LogitsArena() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string name_;
  bool owner_ = false;
  uint64_t incarnation_ = 0;
  uint32_t slots_ = 0;
  uint32_t row_floats_ = 0;
  size_t slot_stride_ = 0;
  std::byte* base_ = nullptr;
};

}  // namespace bulkhead
