// libFuzzer target: logits-arena row verification against any header and payload a sick worker
// could leave in shared memory. A row the broker accepts must be exactly what it asked for: every
// header field as expected and the payload hashing to the checksum reported in StepDone.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "shared/checksum.h"
#include "shared/logits_arena.h"

namespace {

constexpr uint32_t kRowFloats = 16;

struct Arenas {
  std::unique_ptr<bulkhead::LogitsArena> worker, broker;
};

Arenas& arenas() {
  static Arenas a = [] {
    Arenas made;
    const std::string name = bulkhead::LogitsArena::arenaName(int(::getpid()), 77);
    auto w = bulkhead::LogitsArena::create(name, 77, 2, kRowFloats);
    if (!w.ok()) std::abort();
    auto b = bulkhead::LogitsArena::open(name, 77, kRowFloats);
    if (!b.ok()) std::abort();
    made.worker = std::move(*w);
    made.broker = std::move(*b);
    made.worker->unlink();  // nothing left in /dev/shm when the fuzzer stops
    return made;
  }();
  return a;
}

template <typename T>
T take(const uint8_t*& data, size_t& size) {
  T v{};
  const size_t n = size < sizeof(T) ? size : sizeof(T);
  std::memcpy(&v, data, n);
  data += n;
  size -= n;
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Arenas& a = arenas();
  bulkhead::RowHeaderFields fields;
  fields.incarnation = take<uint8_t>(data, size) % 2 ? 77 : take<uint64_t>(data, size);
  fields.step_id = take<uint8_t>(data, size) % 4;
  fields.sequence_id = take<uint8_t>(data, size) % 4;
  fields.token_index = take<uint8_t>(data, size) % 4;
  fields.row_length = take<uint8_t>(data, size) % 2 ? kRowFloats : take<uint32_t>(data, size);
  const bool honest = take<uint8_t>(data, size) % 2;
  float* payload = a.worker->beginRow(0);
  float written[kRowFloats] = {};
  std::memcpy(written, data, size < sizeof(written) ? size : sizeof(written));
  std::memcpy(payload, written, sizeof(written));
  fields.checksum =
      honest ? bulkhead::checkRow(written, kRowFloats).checksum : take<uint64_t>(data, size);
  a.worker->publishHeader(0, fields);

  bulkhead::RowExpectation expect{
      77, 1, 1, 1, 0, take<uint8_t>(data, size) % 2 ? fields.checksum : take<uint64_t>(data, size)};
  bulkhead::IntegrityCheck failed = bulkhead::IntegrityCheck::kNone;
  auto row = a.broker->verifyRow(expect, &failed);
  if (!row.ok()) return 0;
  const bulkhead::RowCheck check = bulkhead::checkRow(row->data(), row->size());
  if (fields.incarnation != 77 || fields.step_id != 1 || fields.sequence_id != 1 ||
      fields.token_index != 1 || fields.row_length != kRowFloats || row->size() != kRowFloats ||
      check.checksum != expect.reported_checksum || !check.finite)
    std::abort();  // accepted a row that is not the one asked for
  return 0;
}
