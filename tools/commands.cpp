// logits and local generate: a checkpoint, a backend, and a loop of steps.
#include "tools/commands.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "shared/checkpoint.h"
#include "worker/backend_factory.h"

namespace bulkhead {
namespace {

using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

Result<std::unique_ptr<Backend>> openModel(const std::string& dir, const std::string& backend) {
  BULKHEAD_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(dir));
  auto shared = std::make_shared<const Checkpoint>(std::move(ckpt));
  return createBackend(backend, shared, BackendOptions{});
}

// Blocks 0..n-1 for a single sequence that may grow to `positions`.
std::vector<uint32_t> linearBlocks(const BackendLimits& limits, uint32_t positions) {
  std::vector<uint32_t> blocks((positions + limits.kv_block_size - 1) / limits.kv_block_size);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = uint32_t(i);
  return blocks;
}

Status checkFits(const BackendLimits& limits, uint64_t positions) {
  if (positions > limits.max_context)
    return invalidArgument(std::to_string(positions) + " positions exceed the model's context of " +
                           std::to_string(limits.max_context));
  const uint64_t blocks = (positions + limits.kv_block_size - 1) / limits.kv_block_size;
  if (blocks > limits.kv_block_count)
    return resourceExhausted(std::to_string(positions) + " positions need " +
                             std::to_string(blocks) + " KV blocks, the backend has " +
                             std::to_string(limits.kv_block_count));
  return okStatus();
}

}  // namespace

Result<std::vector<uint32_t>> parseTokenList(const std::string& text) {
  std::vector<uint32_t> tokens;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    const char* begin = text.data() + pos;
    const char* end = text.data() + comma;
    while (begin < end && *begin == ' ') ++begin;
    while (end > begin && end[-1] == ' ') --end;
    uint32_t value = 0;
    auto [ptr, ec] = std::from_chars(begin, end, value);
    if (begin == end || ec != std::errc() || ptr != end)
      return invalidArgument("--tokens: \"" + std::string(text.data() + pos, comma - pos) +
                             "\" is not a token id (expected e.g. 1,5,9)");
    tokens.push_back(value);
    pos = comma + 1;
  }
  if (tokens.empty()) return invalidArgument("--tokens: empty");
  return tokens;
}

Result<std::string> runLogits(const LogitsCommand& command) {
  if (command.tokens.empty()) return invalidArgument("--tokens: empty");
  BULKHEAD_ASSIGN_OR_RETURN(auto backend, openModel(command.model_dir, command.backend));
  const BackendLimits limits = backend->limits();
  const uint32_t n = uint32_t(command.tokens.size());
  BULKHEAD_RETURN_IF_ERROR(checkFits(limits, n));
  const uint32_t vocab = limits.vocab_size;
  std::vector<float> logits(size_t(n) * vocab);
  const std::vector<uint32_t> blocks = linearBlocks(limits, n);

  const auto start = Clock::now();
  // Chunks of at most max_step_tokens; chunking does not change the numbers.
  for (uint32_t begin = 0; begin < n; begin += limits.max_step_tokens) {
    const uint32_t len = std::min(limits.max_step_tokens, n - begin);
    std::vector<uint32_t> rows(len);
    std::vector<float*> dst(len);
    for (uint32_t i = 0; i < len; ++i) {
      rows[i] = i;
      dst[i] = logits.data() + size_t(begin + i) * vocab;
    }
    SequenceStep seq{.sequence_id = 0,
                     .start_position = begin,
                     .tokens = std::span(command.tokens).subspan(begin, len),
                     .kv_blocks = blocks,
                     .logits_rows = rows};
    BULKHEAD_RETURN_IF_ERROR(runStep(*backend, {&seq, 1}, dst));
  }
  const double ms = msSince(start);

  std::ofstream out(command.out_path, std::ios::binary | std::ios::trunc);
  if (!out) return invalidArgument(command.out_path + ": cannot open for writing");
  out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * 4));
  out.close();
  if (!out) return internalError(command.out_path + ": write failed");

  const float* last = logits.data() + size_t(n - 1) * vocab;
  const uint32_t argmax = uint32_t(std::max_element(last, last + vocab) - last);
  char line[256];
  std::snprintf(line, sizeof(line),
                "wrote %u positions x %u vocab float32 logits to %s (backend %s, %.1f ms, "
                "next-token argmax %u)",
                n, vocab, command.out_path.c_str(), std::string(backend->name()).c_str(), ms,
                argmax);
  return std::string(line);
}

Result<LocalGeneration> runLocalGenerate(const LocalGenerateCommand& command) {
  if (command.tokens.empty()) return invalidArgument("--tokens: empty");
  BULKHEAD_ASSIGN_OR_RETURN(auto backend, openModel(command.model_dir, command.backend));
  const BackendLimits limits = backend->limits();
  const uint32_t prompt = uint32_t(command.tokens.size());
  BULKHEAD_RETURN_IF_ERROR(checkFits(limits, prompt));
  if (prompt > limits.max_step_tokens)
    return invalidArgument("prompt of " + std::to_string(prompt) + " tokens exceeds one step");
  const uint32_t total = std::min<uint64_t>(
      uint64_t(prompt) + command.max_tokens,
      std::min(limits.max_context, limits.kv_block_count * limits.kv_block_size));
  const std::vector<uint32_t> blocks = linearBlocks(limits, total);
  const std::vector<uint32_t>& eos = backend->config().eos_token_ids;
  std::vector<float> row(limits.vocab_size);
  float* dst[1] = {row.data()};

  LocalGeneration gen;
  gen.finish_reason = "length";
  std::vector<uint32_t> input = command.tokens;
  uint32_t position = 0;
  auto start = Clock::now();
  while (gen.tokens.size() < command.max_tokens) {
    if (position + input.size() > total) {
      gen.finish_reason = "context";
      break;
    }
    const uint32_t last_row[1] = {uint32_t(input.size() - 1)};
    SequenceStep seq{.sequence_id = 0,
                     .start_position = position,
                     .tokens = input,
                     .kv_blocks = blocks,
                     .logits_rows = last_row};
    BULKHEAD_RETURN_IF_ERROR(runStep(*backend, {&seq, 1}, dst));
    if (position == 0) {
      gen.prefill_ms = msSince(start);
      start = Clock::now();
    }
    position += uint32_t(input.size());
    const uint32_t next = uint32_t(std::max_element(row.begin(), row.end()) - row.begin());
    gen.tokens.push_back(next);
    if (std::find(eos.begin(), eos.end(), next) != eos.end()) {
      gen.finish_reason = "stop";
      break;
    }
    input.assign(1, next);
  }
  if (gen.tokens.size() > 1)
    gen.decode_ms_per_token = msSince(start) / double(gen.tokens.size() - 1);
  return gen;
}

}  // namespace bulkhead
