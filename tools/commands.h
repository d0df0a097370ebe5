// The `bulkhead` subcommands that run a model in-process: logits (teacher-forced forward pass)
// and local greedy generation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

// "1,5,9" -> {1, 5, 9}; rejects anything that is not a comma-separated list of token ids.
Result<std::vector<uint32_t>> parseTokenList(const std::string& text);

struct LogitsCommand {
  std::string model_dir;
  std::vector<uint32_t> tokens;
  std::string out_path;
  std::string backend = "cpu";
};
// Writes float32 little-endian logits [positions][vocab]; returns the one-line summary.
Result<std::string> runLogits(const LogitsCommand& command);

struct LocalGenerateCommand {
  std::string model_dir;
  std::vector<uint32_t> tokens;
  uint32_t max_tokens = 16;
  std::string backend = "cpu";
};
struct LocalGeneration {
  std::vector<uint32_t> tokens;
  std::string finish_reason;  // "length", "stop" or "context"
  double prefill_ms = 0;
  double decode_ms_per_token = 0;
};
// Greedy decoding in this process, stopping at the model's EOS.
Result<LocalGeneration> runLocalGenerate(const LocalGenerateCommand& command);

}  // namespace bulkhead
