// libFuzzer target: the worker's decoding of a Step message (Cap'n Proto, as the broker or
// anything else on the socket could send it), then the step validation every backend relies on.
// Malformed messages may throw kj::Exception (the serving loop answers Error); nothing may crash,
// and a step both accept stays inside the worker's limits.
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "worker/step_decode.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The message's words, aligned as the socket reader leaves them.
  kj::Array<capnp::word> words = kj::heapArray<capnp::word>(size / sizeof(capnp::word));
  std::memcpy(words.begin(), data, words.size() * sizeof(capnp::word));
  const bulkhead::BackendLimits limits{.vocab_size = 512,
                                       .max_context = 256,
                                       .kv_block_size = 16,
                                       .kv_block_count = 64,
                                       .max_step_tokens = 128};
  try {
    capnp::ReaderOptions options;
    options.traversalLimitInWords = words.size() * 4 + 1024;  // as the worker reads
    options.nestingLimit = 16;
    capnp::FlatArrayMessageReader reader(words, options);
    auto step = reader.getRoot<bulkhead::wire::Step>();
    std::vector<uint32_t> lists;
    std::vector<bulkhead::SequenceStep> batch;
    uint32_t rows = 0;
    if (!bulkhead::decodeStep(step, limits, 8, lists, batch, rows).ok()) return 0;
    static float payload[512];
    std::vector<bulkhead::RowCheck> checks(rows);
    std::vector<bulkhead::RowOutput> outputs(rows);
    for (uint32_t r = 0; r < rows; ++r) outputs[r] = {payload, &checks[r]};
    if (!bulkhead::validateStep(batch, outputs, limits).ok()) return 0;
    for (const bulkhead::SequenceStep& s : batch) {
      const uint64_t end = uint64_t(s.start_position) + s.tokens.size();
      if (end > limits.max_context) std::abort();
      for (uint32_t t : s.tokens)
        if (t >= limits.vocab_size) std::abort();
      // The blocks its positions use (a table may run longer; the rest is never read).
      for (uint64_t p = 0; p < end; p += limits.kv_block_size)
        if (s.kv_blocks[p / limits.kv_block_size] >= limits.kv_block_count) std::abort();
    }
  } catch (const kj::Exception&) {
    // Rejected by Cap'n Proto's own validation: the worker answers Error.
  }
  return 0;
}
