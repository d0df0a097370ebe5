// LogitsArena over Boost.Interprocess shared memory.
#include "shared/logits_arena.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include "shared/checksum.h"

namespace bulkhead {
namespace bip = boost::interprocess;
namespace {

constexpr uint64_t kArenaMagic = 0x414e455241484b42ull;  // "BKHARENA"
constexpr uint32_t kArenaVersion = 1;
constexpr size_t kHeaderBytes = 64;
constexpr std::string_view kPrefix = "bulkhead-arena-";

struct ArenaHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint32_t row_floats;
  uint32_t reserved0;
  uint64_t incarnation;
  uint64_t slot_stride;
  uint64_t reserved[3];
};
static_assert(sizeof(ArenaHeader) == kHeaderBytes);

// Every field atomic: the segment is shared with a process we do not trust to be well behaved.
struct SlotHeader {
  std::atomic<uint64_t> step_id;  // written last (release); 0 while the row is being written
  std::atomic<uint64_t> incarnation;
  std::atomic<uint64_t> sequence_id;
  std::atomic<uint64_t> length_and_index;  // row_length << 32 | token_index
  std::atomic<uint64_t> checksum;
  uint64_t pad[3];
};
static_assert(sizeof(SlotHeader) == kHeaderBytes);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

size_t strideFor(uint32_t row_floats) {
  return kHeaderBytes + ((size_t(row_floats) * 4 + 63) & ~size_t(63));
}

}  // namespace

struct LogitsArena::Impl {
  bip::shared_memory_object shm;
  bip::mapped_region region;
};

std::string_view integrityCheckName(IntegrityCheck check) {
  switch (check) {
    case IntegrityCheck::kNone:
      return "none";
    case IntegrityCheck::kSlotRange:
      return "slot out of range";
    case IntegrityCheck::kIncarnation:
      return "incarnation id";
    case IntegrityCheck::kStepId:
      return "step id";
    case IntegrityCheck::kSequenceId:
      return "sequence id";
    case IntegrityCheck::kTokenIndex:
      return "token index";
    case IntegrityCheck::kRowLength:
      return "row length";
    case IntegrityCheck::kReportedChecksum:
      return "reported checksum";
    case IntegrityCheck::kPayloadChecksum:
      return "payload checksum";
    case IntegrityCheck::kNonFinite:
      return "non-finite value";
    case IntegrityCheck::kWeightReads:
      return "in-step weight reads";
    case IntegrityCheck::kSlotTag:
      return "slot tag";
    case IntegrityCheck::kArithmetic:
      return "arithmetic check";
    case IntegrityCheck::kCanary:
      return "canary";
  }
  return "?";
}

uint64_t LogitsArena::processStart(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return 0;
  // After the command name (in parentheses, which it may itself contain): the state, field 3;
  // the start time is field 22.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i)
    if (!(fields >> field)) return 0;
  return std::strtoull(field.c_str(), nullptr, 10);
}

std::string LogitsArena::arenaName(int pid, uint64_t incarnation) {
  return arenaName(pid, processStart(pid), incarnation);
}

std::string LogitsArena::arenaName(int pid, uint64_t start, uint64_t incarnation) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%.*s%d-%llu-%016llx", int(kPrefix.size()), kPrefix.data(), pid,
                static_cast<unsigned long long>(start),
                static_cast<unsigned long long>(incarnation));
  return buf;
}

size_t LogitsArena::bytes() const {
  return kHeaderBytes + size_t(slots_) * slot_stride_;
}

Result<std::unique_ptr<LogitsArena>> LogitsArena::create(const std::string& name,
                                                         uint64_t incarnation, uint32_t slots,
                                                         uint32_t row_floats) {
  if (slots == 0 || row_floats == 0) return invalidArgument("arena needs slots and row length");
  std::unique_ptr<LogitsArena> arena(new LogitsArena());
  arena->name_ = name;
  arena->incarnation_ = incarnation;
  arena->slots_ = slots;
  arena->row_floats_ = row_floats;
  arena->slot_stride_ = strideFor(row_floats);
  try {
    bip::permissions owner_only(0600);
    arena->impl_ = std::make_unique<Impl>();
    arena->impl_->shm =
        bip::shared_memory_object(bip::create_only, name.c_str(), bip::read_write, owner_only);
    arena->owner_ = true;
    arena->impl_->shm.truncate(bip::offset_t(arena->bytes()));
    // Pages of shared memory are taken when first written: without reserving them now, a full
    // /dev/shm would end a step with SIGBUS mid-row instead of refusing the arena here.
    if (const int error = ::posix_fallocate(arena->impl_->shm.get_mapping_handle().handle, 0,
                                            off_t(arena->bytes()));
        error != 0) {
      bip::shared_memory_object::remove(name.c_str());
      arena->owner_ = false;
      return resourceExhausted("logits arena " + name + " (" + std::to_string(arena->bytes()) +
                               " bytes) does not fit in /dev/shm: " + std::strerror(error));
    }
    arena->impl_->region = bip::mapped_region(arena->impl_->shm, bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    if (arena->owner_) bip::shared_memory_object::remove(name.c_str());
    arena->owner_ = false;
    return Status(
        e.get_error_code() == bip::already_exists_error ? Code::kAlreadyExists
                                                        : Code::kResourceExhausted,
        "logits arena " + name + " (" + std::to_string(arena->bytes()) + " bytes): " + e.what());
  }
  arena->base_ = static_cast<std::byte*>(arena->impl_->region.get_address());
  auto* header = reinterpret_cast<ArenaHeader*>(arena->base_);
  *header = ArenaHeader{kArenaMagic, kArenaVersion,       slots,    row_floats, 0,
                        incarnation, arena->slot_stride_, {0, 0, 0}};
  return arena;
}

Result<std::unique_ptr<LogitsArena>> LogitsArena::open(const std::string& name,
                                                       uint64_t incarnation, uint32_t row_floats) {
  if (name.rfind(kPrefix, 0) != 0 || name.find('/') != std::string::npos)
    return invalidArgument("arena name \"" + name + "\" is not a bulkhead arena");
  std::unique_ptr<LogitsArena> arena(new LogitsArena());
  arena->name_ = name;
  try {
    arena->impl_ = std::make_unique<Impl>();
    arena->impl_->shm = bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_only);
    arena->impl_->region = bip::mapped_region(arena->impl_->shm, bip::read_only);
  } catch (const bip::interprocess_exception& e) {
    return unavailable("logits arena " + name + ": " + e.what());
  }
  const size_t size = arena->impl_->region.get_size();
  if (size < kHeaderBytes) return dataLoss("logits arena " + name + " is smaller than its header");
  arena->base_ = static_cast<std::byte*>(arena->impl_->region.get_address());
  ArenaHeader h;
  std::memcpy(&h, arena->base_, sizeof(h));
  if (h.magic != kArenaMagic || h.version != kArenaVersion)
    return dataLoss("logits arena " + name + ": bad magic or version");
  if (h.incarnation != incarnation)
    return dataLoss("logits arena " + name + " belongs to incarnation " +
                    std::to_string(h.incarnation) + ", expected " + std::to_string(incarnation));
  if (h.row_floats != row_floats || h.slot_stride != strideFor(row_floats) || h.slots == 0)
    return dataLoss("logits arena " + name + ": layout does not match a vocabulary of " +
                    std::to_string(row_floats));
  arena->incarnation_ = incarnation;
  arena->slots_ = h.slots;
  arena->row_floats_ = row_floats;
  arena->slot_stride_ = strideFor(row_floats);
  if (arena->bytes() > size)
    return dataLoss("logits arena " + name + ": " + std::to_string(h.slots) + " slots need " +
                    std::to_string(arena->bytes()) + " bytes, the segment has " +
                    std::to_string(size));
  return arena;
}

int LogitsArena::collectStale() {
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind(kPrefix, 0) != 0) continue;
    // "<pid>-<start>-<incarnation>": a process of that pid that started at another time is not
    // the creator (the pid was reused). An earlier release's "<pid>-<incarnation>" has no start.
    char* end = nullptr;
    const long pid = std::strtol(file.c_str() + kPrefix.size(), &end, 10);
    if (pid <= 0 || pid > INT_MAX || *end != '-') continue;
    const bool has_start = std::count(file.begin(), file.end(), '-') == 4;
    const uint64_t start = has_start ? std::strtoull(end + 1, nullptr, 10) : 0;
    struct stat st {};
    if (::stat(entry.path().c_str(), &st) != 0 || st.st_uid != ::getuid()) continue;
    const bool running = ::kill(pid_t(pid), 0) == 0 || errno != ESRCH;
    if (running && (!has_start || processStart(int(pid)) == start)) continue;  // creator alive
    if (bip::shared_memory_object::remove(file.c_str())) ++removed;
  }
  return removed;
}

LogitsArena::~LogitsArena() {
  if (owner_) bip::shared_memory_object::remove(name_.c_str());
}

void LogitsArena::unlink() {
  bip::shared_memory_object::remove(name_.c_str());
  owner_ = false;
}

float* LogitsArena::beginRow(uint32_t slot) {
  std::byte* s = base_ + kHeaderBytes + size_t(slot) * slot_stride_;
  reinterpret_cast<SlotHeader*>(s)->step_id.store(0, std::memory_order_release);
  return reinterpret_cast<float*>(s + kHeaderBytes);
}

void LogitsArena::publishRow(uint32_t slot, uint64_t step_id, uint64_t sequence_id,
                             uint32_t token_index, uint64_t checksum) {
  publishHeader(slot, {incarnation_, step_id, sequence_id, token_index, row_floats_, checksum});
}

void LogitsArena::publishHeader(uint32_t slot, const RowHeaderFields& f) {
  auto* h = reinterpret_cast<SlotHeader*>(base_ + kHeaderBytes + size_t(slot) * slot_stride_);
  h->incarnation.store(f.incarnation, std::memory_order_relaxed);
  h->sequence_id.store(f.sequence_id, std::memory_order_relaxed);
  h->length_and_index.store((uint64_t(f.row_length) << 32) | f.token_index,
                            std::memory_order_relaxed);
  h->checksum.store(f.checksum, std::memory_order_relaxed);
  h->step_id.store(f.step_id, std::memory_order_release);
}

Result<std::span<const float>> LogitsArena::checkHeader(const RowExpectation& e,
                                                        IntegrityCheck* failed) const {
  auto fail = [&](IntegrityCheck check, const std::string& detail) -> Status {
    if (failed != nullptr) *failed = check;
    return dataLoss("logits row in slot " + std::to_string(e.slot) + " failed the " +
                    std::string(integrityCheckName(check)) + " check: " + detail);
  };
  if (e.slot >= slots_)
    return fail(IntegrityCheck::kSlotRange,
                "slot " + std::to_string(e.slot) + " of " + std::to_string(slots_));
  const std::byte* s = base_ + kHeaderBytes + size_t(e.slot) * slot_stride_;
  const auto* h = reinterpret_cast<const SlotHeader*>(s);
  // Each field read once into a local: the writer may still be scribbling.
  const uint64_t step_id = h->step_id.load(std::memory_order_acquire);
  const uint64_t incarnation = h->incarnation.load(std::memory_order_relaxed);
  const uint64_t sequence_id = h->sequence_id.load(std::memory_order_relaxed);
  const uint64_t length_and_index = h->length_and_index.load(std::memory_order_relaxed);
  const uint64_t checksum = h->checksum.load(std::memory_order_relaxed);
  auto got = [](uint64_t g, uint64_t w) {
    return "got " + std::to_string(g) + ", expected " + std::to_string(w);
  };
  if (incarnation != e.incarnation)
    return fail(IntegrityCheck::kIncarnation, got(incarnation, e.incarnation));
  if (step_id != e.step_id) return fail(IntegrityCheck::kStepId, got(step_id, e.step_id));
  if (sequence_id != e.sequence_id)
    return fail(IntegrityCheck::kSequenceId, got(sequence_id, e.sequence_id));
  if (uint32_t(length_and_index) != e.token_index)
    return fail(IntegrityCheck::kTokenIndex, got(uint32_t(length_and_index), e.token_index));
  if ((length_and_index >> 32) != row_floats_)
    return fail(IntegrityCheck::kRowLength, got(length_and_index >> 32, row_floats_));
  if (checksum != e.reported_checksum)
    return fail(IntegrityCheck::kReportedChecksum, got(checksum, e.reported_checksum));
  return std::span<const float>(reinterpret_cast<const float*>(s + kHeaderBytes), row_floats_);
}

Result<std::span<const float>> LogitsArena::verifyRow(const RowExpectation& e,
                                                      IntegrityCheck* failed) const {
  auto row = checkHeader(e, failed);
  if (!row.ok()) return row;
  const RowCheck check = checkRow(row->data(), row->size());
  IntegrityCheck bad = IntegrityCheck::kNone;
  if (check.checksum != e.reported_checksum) {
    bad = IntegrityCheck::kPayloadChecksum;
  } else if (!check.finite) {
    bad = IntegrityCheck::kNonFinite;
  }
  if (bad == IntegrityCheck::kNone) return row;
  if (failed != nullptr) *failed = bad;
  return dataLoss("logits row in slot " + std::to_string(e.slot) + " failed the " +
                  std::string(integrityCheckName(bad)) + " check: " +
                  (bad == IntegrityCheck::kNonFinite ? "row holds NaN or infinity"
                                                     : "payload does not match its header"));
}

}  // namespace bulkhead
