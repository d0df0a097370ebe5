// Random-weight checkpoints in Hugging Face layout at real model shapes: the embedded default
// model, test models, and what GPU benchmarks run at full size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shared/dtype.h"
#include "shared/status.h"

namespace bulkhead {

struct ModelShape {
  std::string name;
  std::string architecture;  // LlamaForCausalLM | Qwen2ForCausalLM | MistralForCausalLM
  int hidden = 0, layers = 0, heads = 0, kv_heads = 0, intermediate = 0, vocab = 0;
  int max_position = 0;
  double rope_theta = 10000.0;
  double rms_eps = 1e-6;
  bool tied = false;
  bool llama3_rope = false;  // Llama 3.1 style frequency scaling
  uint32_t bos = 1, eos = 2;
};

// Known shapes: tiny, tiny-v152k, tiny-llama, qwen2.5-0.5b, qwen2.5-7b, qwen2.5-14b.
const std::vector<ModelShape>& modelShapes();

struct MakeModelOptions {
  std::string shape = "tiny";
  std::string out_dir;
  uint64_t seed = 0;
  DType dtype = DType::kBF16;
  uint64_t max_shard_bytes = 5'000'000'000;  // larger checkpoints are split into shards
  int layers = 0;                            // 0: the shape's; else this many layers
};

struct MakeModelReport {
  uint64_t parameters = 0;
  uint64_t bytes = 0;
  int shards = 0;
};

Result<MakeModelReport> makeModel(const MakeModelOptions& options);

}  // namespace bulkhead
