// config.json parsing with a clear error for every missing or out-of-range field.
#include "shared/model_config.h"

#include <cmath>
#include <fstream>
#include <numbers>
#include <sstream>

#include <nlohmann/json.hpp>

namespace bulkhead {
namespace {

using nlohmann::json;

Result<json> readJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return notFound(path + ": cannot open");
  std::stringstream buffer;
  buffer << in.rdbuf();
  json parsed = json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return invalidArgument(path + ": not valid JSON");
  if (!parsed.is_object()) return invalidArgument(path + ": not a JSON object");
  return parsed;
}

// Reads a positive integer field; `fallback` used when absent or null.
Status readInt(const json& j, const char* key, const std::string& name, int& out,
               std::optional<int> fallback = std::nullopt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback) {
      out = *fallback;
      return okStatus();
    }
    return invalidArgument(name + ": missing field \"" + key + "\"");
  }
  if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > (1 << 30))
    return invalidArgument(name + ": field \"" + key + "\" must be a positive integer");
  out = int(it->get<int64_t>());
  return okStatus();
}

Status readNumber(const json& j, const char* key, const std::string& name, double& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return okStatus();  // keep default
  if (!it->is_number()) return invalidArgument(name + ": field \"" + key + "\" must be a number");
  out = it->get<double>();
  if (!std::isfinite(out)) return invalidArgument(name + ": field \"" + key + "\" is not finite");
  return okStatus();
}

bool readBool(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return (it != j.end() && it->is_boolean()) ? it->get<bool>() : fallback;
}

// eos_token_id may be an integer or a list of them.
Result<std::vector<uint32_t>> readTokenIds(const json& j, const char* key,
                                           const std::string& name) {
  std::vector<uint32_t> ids;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return ids;
  auto one = [&](const json& v) -> Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > UINT32_MAX)
      return invalidArgument(name + ": \"" + key + "\" must hold token ids");
    ids.push_back(uint32_t(v.get<int64_t>()));
    return okStatus();
  };
  if (it->is_array()) {
    for (const auto& v : *it) BULKHEAD_RETURN_IF_ERROR(one(v));
  } else {
    BULKHEAD_RETURN_IF_ERROR(one(*it));
  }
  return ids;
}

Status readRope(const json& config, const std::string& name, RopeConfig& rope) {
  // Newer style nests everything in rope_parameters; older has rope_theta + rope_scaling.
  BULKHEAD_RETURN_IF_ERROR(readNumber(config, "rope_theta", name, rope.theta));
  const json* params = nullptr;
  if (auto it = config.find("rope_parameters"); it != config.end() && it->is_object()) {
    params = &*it;
    BULKHEAD_RETURN_IF_ERROR(readNumber(*params, "rope_theta", name, rope.theta));
  }
  if (params == nullptr) {
    if (auto it = config.find("rope_scaling"); it != config.end() && it->is_object()) params = &*it;
  }
  if (rope.theta <= 0) return invalidArgument(name + ": rope_theta must be positive");
  if (params == nullptr) return okStatus();
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (auto it = params->find(key); it != params->end() && it->is_string()) {
      type = it->get<std::string>();
      break;
    }
  }
  rope.type = type;
  BULKHEAD_RETURN_IF_ERROR(readNumber(*params, "factor", name, rope.factor));
  BULKHEAD_RETURN_IF_ERROR(readNumber(*params, "low_freq_factor", name, rope.low_freq_factor));
  BULKHEAD_RETURN_IF_ERROR(readNumber(*params, "high_freq_factor", name, rope.high_freq_factor));
  BULKHEAD_RETURN_IF_ERROR(
      readNumber(*params, "original_max_position_embeddings", name, rope.original_max_position));
  if (type != "default" && type != "linear" && type != "llama3")
    return invalidArgument(name + ": unsupported rope type \"" + type +
                           "\" (supported: default, linear, llama3)");
  if (rope.factor <= 0) return invalidArgument(name + ": rope factor must be positive");
  if (type == "llama3" && rope.high_freq_factor <= rope.low_freq_factor)
    return invalidArgument(name + ": llama3 rope needs high_freq_factor > low_freq_factor");
  return okStatus();
}

}  // namespace

Result<ModelConfig> ModelConfig::fromJson(const json& config, const std::string& name) {
  ModelConfig c;
  auto arch_it = config.find("architectures");
  if (arch_it == config.end() || !arch_it->is_array() || arch_it->empty() ||
      !(*arch_it)[0].is_string())
    return invalidArgument(name + ": missing \"architectures\"");
  c.architecture_name = (*arch_it)[0].get<std::string>();
  if (c.architecture_name == "LlamaForCausalLM") {
    c.architecture = Architecture::kLlama;
  } else if (c.architecture_name == "Qwen2ForCausalLM") {
    c.architecture = Architecture::kQwen2;
  } else if (c.architecture_name == "MistralForCausalLM") {
    c.architecture = Architecture::kMistral;
  } else {
    return invalidArgument(
        name + ": unsupported architecture \"" + c.architecture_name +
        "\" (supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)");
  }
  BULKHEAD_RETURN_IF_ERROR(readInt(config, "hidden_size", name, c.hidden_size));
  BULKHEAD_RETURN_IF_ERROR(readInt(config, "intermediate_size", name, c.intermediate_size));
  BULKHEAD_RETURN_IF_ERROR(readInt(config, "num_hidden_layers", name, c.num_layers));
  BULKHEAD_RETURN_IF_ERROR(readInt(config, "num_attention_heads", name, c.num_heads));
  BULKHEAD_RETURN_IF_ERROR(
      readInt(config, "num_key_value_heads", name, c.num_kv_heads, c.num_heads));
  BULKHEAD_RETURN_IF_ERROR(readInt(config, "vocab_size", name, c.vocab_size));
  BULKHEAD_RETURN_IF_ERROR(
      readInt(config, "max_position_embeddings", name, c.max_position_embeddings, 2048));
  if (c.hidden_size % c.num_heads != 0 && !config.contains("head_dim"))
    return invalidArgument(name + ": hidden_size " + std::to_string(c.hidden_size) +
                           " is not a multiple of num_attention_heads " +
                           std::to_string(c.num_heads));
  BULKHEAD_RETURN_IF_ERROR(
      readInt(config, "head_dim", name, c.head_dim, c.hidden_size / c.num_heads));
  if (c.head_dim % 2 != 0) return invalidArgument(name + ": head_dim must be even for RoPE");
  // qDim() and kvDim() stay ints (kvDim <= qDim, the heads being a multiple of the KV heads): a
  // product that wrapped could match a real checkpoint's shapes and index far past its buffers.
  if (int64_t(c.num_heads) * c.head_dim > (1 << 30))
    return invalidArgument(name + ": num_attention_heads " + std::to_string(c.num_heads) +
                           " x head_dim " + std::to_string(c.head_dim) + " is over 2^30");
  if (c.num_heads % c.num_kv_heads != 0)
    return invalidArgument(name + ": num_attention_heads " + std::to_string(c.num_heads) +
                           " is not a multiple of num_key_value_heads " +
                           std::to_string(c.num_kv_heads));

  double eps = 1e-6;
  BULKHEAD_RETURN_IF_ERROR(readNumber(config, "rms_norm_eps", name, eps));
  if (eps <= 0) return invalidArgument(name + ": rms_norm_eps must be positive");
  c.rms_norm_eps = float(eps);
  BULKHEAD_RETURN_IF_ERROR(readRope(config, name, c.rope));

  if (auto it = config.find("hidden_act");
      it != config.end() && it->is_string() && it->get<std::string>() != "silu") {
    return invalidArgument(name + ": unsupported hidden_act \"" + it->get<std::string>() +
                           "\" (supported: silu)");
  }
  if (readBool(config, "mlp_bias", false))
    return invalidArgument(name + ": mlp_bias=true is not supported");

  c.tie_word_embeddings = readBool(config, "tie_word_embeddings", false);
  if (c.architecture == Architecture::kQwen2) {
    c.qkv_bias = true;  // Qwen2 always carries q/k/v biases
  } else if (c.architecture == Architecture::kLlama) {
    c.qkv_bias = c.o_bias = readBool(config, "attention_bias", false);
  }

  for (const char* key : {"dtype", "torch_dtype"}) {
    if (auto it = config.find(key); it != config.end() && it->is_string()) {
      c.dtype = dtypeFromTorchName(it->get<std::string>());
      if (!c.dtype)
        return invalidArgument(name + ": unsupported " + key + " \"" + it->get<std::string>() +
                               "\" (supported: bfloat16, float16, float32)");
      break;
    }
  }

  c.max_context = c.max_position_embeddings;
  bool window_active =
      c.architecture == Architecture::kMistral || readBool(config, "use_sliding_window", false);
  if (auto it = config.find("sliding_window");
      window_active && it != config.end() && it->is_number_integer() && it->get<int64_t>() > 0) {
    c.max_context = int(std::min<int64_t>(c.max_context, it->get<int64_t>()));
  }

  BULKHEAD_ASSIGN_OR_RETURN(auto bos, readTokenIds(config, "bos_token_id", name));
  if (!bos.empty()) c.bos_token_id = bos.front();
  BULKHEAD_ASSIGN_OR_RETURN(c.eos_token_ids, readTokenIds(config, "eos_token_id", name));
  return c;
}

Result<ModelConfig> ModelConfig::load(const std::string& dir) {
  const std::string path = dir + "/config.json";
  BULKHEAD_ASSIGN_OR_RETURN(json config, readJsonFile(path));
  BULKHEAD_ASSIGN_OR_RETURN(ModelConfig c, fromJson(config, path));
  const std::string gen_path = dir + "/generation_config.json";
  if (std::ifstream(gen_path).good()) {
    BULKHEAD_ASSIGN_OR_RETURN(json gen, readJsonFile(gen_path));
    BULKHEAD_ASSIGN_OR_RETURN(auto eos, readTokenIds(gen, "eos_token_id", gen_path));
    if (!eos.empty()) c.eos_token_ids = std::move(eos);
  }
  return c;
}

std::vector<float> ModelConfig::ropeInverseFrequencies() const {
  const int pairs = head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(pairs));
  for (int i = 0; i < pairs; ++i) {
    // float32 like the reference implementation: 1 / theta^(2i/d)
    float exponent = float(2 * i) / float(head_dim);
    float f = 1.0f / std::pow(float(rope.theta), exponent);
    if (rope.type == "linear") {
      f = float(f / rope.factor);
    } else if (rope.type == "llama3") {
      const double low_wavelen = rope.original_max_position / rope.low_freq_factor;
      const double high_wavelen = rope.original_max_position / rope.high_freq_factor;
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen > low_wavelen) {
        f = float(f / rope.factor);
      } else if (wavelen >= high_wavelen) {
        double smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) /
                        (rope.high_freq_factor - rope.low_freq_factor);
        f = float((1.0 - smooth) * f / rope.factor + smooth * f);
      }
    }
    inv[size_t(i)] = f;
  }
  return inv;
}

}  // namespace bulkhead
