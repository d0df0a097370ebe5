// The model shape and hyper-parameters bulkhead needs from a Hugging Face config.json (and
// generation_config.json), for the Llama family: Llama, Qwen2, Mistral. Both config styles seen in
// the wild load: older (`torch_dtype`, top-level `rope_theta`/`rope_scaling`) and newer (`dtype`,
// `rope_parameters`).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "shared/dtype.h"
#include "shared/status.h"

namespace bulkhead {

enum class Architecture { kLlama, kQwen2, kMistral };

struct RopeConfig {
  std::string type = "default";  // default | linear | llama3
  double theta = 10000.0;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192.0;
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  std::string architecture_name;  // as written in config.json
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  int max_position_embeddings = 0;
  // Longest sequence served: max_position_embeddings, or the sliding window when one is active
  // (attention within the window is then exact without implementing the window).
  int max_context = 0;
  float rms_norm_eps = 1e-6f;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;
  bool o_bias = false;
  std::optional<DType> dtype;  // declared checkpoint dtype, if any
  std::optional<uint32_t> bos_token_id;
  std::vector<uint32_t> eos_token_ids;

  // config.json content; `name` labels errors.
  static Result<ModelConfig> fromJson(const nlohmann::json& config, const std::string& name);
  // Reads DIR/config.json, and DIR/generation_config.json when present (its eos ids win).
  static Result<ModelConfig> load(const std::string& dir);

  // Per rotary pair i (head_dim / 2 of them) the angle per position, after any scaling.
  std::vector<float> ropeInverseFrequencies() const;
  int qDim() const { return num_heads * head_dim; }
  int kvDim() const { return num_kv_heads * head_dim; }
};

}  // namespace bulkhead
