// make-model: writes config.json, generation_config.json and safetensors (sharded past a size)
// filled from a counter-based generator, so the same seed gives the same bytes on any machine and
// large models fill in parallel.
#include "tools/make_model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "shared/mix.h"

namespace bulkhead {
namespace {

using nlohmann::json;

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  enum Kind { kMatrix, kNorm, kBias } kind;
  uint64_t numel() const {
    uint64_t n = 1;
    for (int64_t d : shape) n *= uint64_t(d);
    return n;
  }
};

// Uniform in [-1, 1) from (seed, tensor, element).
float uniform(uint64_t key, uint64_t index) {
  uint64_t bits = splitmix64(key ^ splitmix64(index));
  return float(int64_t(bits >> 11) - (int64_t(1) << 52)) / float(int64_t(1) << 52);
}

std::vector<TensorSpec> tensorSpecs(const ModelShape& s) {
  const int64_t h = s.hidden, head_dim = s.hidden / s.heads;
  const int64_t q = s.heads * head_dim, kv = s.kv_heads * head_dim, inter = s.intermediate;
  const bool qkv_bias = s.architecture == "Qwen2ForCausalLM";
  std::vector<TensorSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {s.vocab, h}, TensorSpec::kMatrix});
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    specs.push_back({p + "input_layernorm.weight", {h}, TensorSpec::kNorm});
    specs.push_back({p + "self_attn.q_proj.weight", {q, h}, TensorSpec::kMatrix});
    specs.push_back({p + "self_attn.k_proj.weight", {kv, h}, TensorSpec::kMatrix});
    specs.push_back({p + "self_attn.v_proj.weight", {kv, h}, TensorSpec::kMatrix});
    if (qkv_bias) {
      specs.push_back({p + "self_attn.q_proj.bias", {q}, TensorSpec::kBias});
      specs.push_back({p + "self_attn.k_proj.bias", {kv}, TensorSpec::kBias});
      specs.push_back({p + "self_attn.v_proj.bias", {kv}, TensorSpec::kBias});
    }
    specs.push_back({p + "self_attn.o_proj.weight", {h, q}, TensorSpec::kMatrix});
    specs.push_back({p + "post_attention_layernorm.weight", {h}, TensorSpec::kNorm});
    specs.push_back({p + "mlp.gate_proj.weight", {inter, h}, TensorSpec::kMatrix});
    specs.push_back({p + "mlp.up_proj.weight", {inter, h}, TensorSpec::kMatrix});
    specs.push_back({p + "mlp.down_proj.weight", {h, inter}, TensorSpec::kMatrix});
  }
  specs.push_back({"model.norm.weight", {h}, TensorSpec::kNorm});
  if (!s.tied) specs.push_back({"lm_head.weight", {s.vocab, h}, TensorSpec::kMatrix});
  return specs;
}

json configJson(const ModelShape& s, DType dtype) {
  // Written in the older style that released Qwen2.5/Llama checkpoints use.
  json c = {{"architectures", {s.architecture}},
            {"model_type", s.architecture == "Qwen2ForCausalLM"     ? "qwen2"
                           : s.architecture == "MistralForCausalLM" ? "mistral"
                                                                    : "llama"},
            {"hidden_size", s.hidden},
            {"intermediate_size", s.intermediate},
            {"num_hidden_layers", s.layers},
            {"num_attention_heads", s.heads},
            {"num_key_value_heads", s.kv_heads},
            {"vocab_size", s.vocab},
            {"max_position_embeddings", s.max_position},
            {"rms_norm_eps", s.rms_eps},
            {"rope_theta", s.rope_theta},
            {"hidden_act", "silu"},
            {"tie_word_embeddings", s.tied},
            {"torch_dtype", std::string(dtypeTorchName(dtype))},
            {"bos_token_id", s.bos},
            {"eos_token_id", s.eos}};
  if (s.architecture == "Qwen2ForCausalLM") {
    c["use_sliding_window"] = false;
    c["sliding_window"] = s.max_position;
  }
  if (s.llama3_rope) {
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 256}};
  }
  return c;
}

Status writeText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return internalError(path + ": write failed");
  return okStatus();
}

void fill(const TensorSpec& spec, uint64_t key, DType dtype, std::byte* dst) {
  const uint64_t n = spec.numel();
  // Uniform with standard deviation 0.02 for matrices (a common initialiser), 1 +/- 0.1 for norm
  // weights (so a norm that ignores its weight shows), small biases.
  const float scale = spec.kind == TensorSpec::kNorm   ? 0.1f
                      : spec.kind == TensorSpec::kBias ? 0.05f
                                                       : 0.02f * std::sqrt(3.0f);
  const float offset = spec.kind == TensorSpec::kNorm ? 1.0f : 0.0f;
#pragma omp parallel for schedule(static, 1 << 16)
  for (uint64_t i = 0; i < n; ++i) {
    const float v = offset + scale * uniform(key, i);
    switch (dtype) {
      case DType::kF32:
        std::memcpy(dst + i * 4, &v, 4);
        break;
      case DType::kBF16: {
        uint16_t b = floatToBf16(v);
        std::memcpy(dst + i * 2, &b, 2);
        break;
      }
      case DType::kF16: {
        uint16_t b = floatToF16(v);
        std::memcpy(dst + i * 2, &b, 2);
        break;
      }
    }
  }
}

// Writes one safetensors file holding specs[begin, end).
Status writeShard(const std::string& path, const std::vector<TensorSpec>& specs, size_t begin,
                  size_t end, uint64_t seed, DType dtype) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (size_t i = begin; i < end; ++i) {
    const uint64_t bytes = specs[i].numel() * dtypeSize(dtype);
    header[specs[i].name] = {{"dtype", std::string(dtypeName(dtype))},
                             {"shape", specs[i].shape},
                             {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const uint64_t total = 8 + header_text.size() + offset;

  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return internalError(path + ": cannot create: " + std::strerror(errno));
  if (::ftruncate(fd, off_t(total)) != 0) {
    ::close(fd);
    return internalError(path + ": cannot size to " + std::to_string(total) + " bytes");
  }
  void* map = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return internalError(path + ": cannot map for writing");
  auto* bytes = static_cast<std::byte*>(map);
  const uint64_t header_len = header_text.size();
  for (int i = 0; i < 8; ++i) bytes[i] = std::byte((header_len >> (8 * i)) & 0xff);
  std::memcpy(bytes + 8, header_text.data(), header_text.size());
  std::byte* data = bytes + 8 + header_text.size();
  for (size_t i = begin; i < end; ++i) {
    fill(specs[i], splitmix64(seed * 1000003ull + i), dtype, data);
    data += specs[i].numel() * dtypeSize(dtype);
  }
  const bool synced = ::msync(map, total, MS_SYNC) == 0;
  ::munmap(map, total);
  if (!synced) return internalError(path + ": flush failed");
  return okStatus();
}

// One layer of `shape` with a small vocabulary: its products and head size at the cost of a test.
ModelShape oneLayerOf(const ModelShape& shape, const char* name) {
  ModelShape layer = shape;
  layer.name = name;
  layer.layers = 1;
  layer.vocab = 1024;
  layer.bos = 1000;
  layer.eos = 1001;
  return layer;
}

}  // namespace

const std::vector<ModelShape>& modelShapes() {
  static const std::vector<ModelShape> shapes = [] {
    std::vector<ModelShape> v;
    ModelShape tiny{.name = "tiny",
                    .architecture = "Qwen2ForCausalLM",
                    .hidden = 64,
                    .layers = 2,
                    .heads = 4,
                    .kv_heads = 2,
                    .intermediate = 176,
                    .vocab = 512,
                    .max_position = 1024,
                    .rope_theta = 10000.0,
                    .rms_eps = 1e-6,
                    .tied = true};
    v.push_back(tiny);
    // The tiny model with a real-size vocabulary: IPC and sampling costs at full row width.
    ModelShape tiny_wide = tiny;
    tiny_wide.name = "tiny-v152k";
    tiny_wide.vocab = 152064;
    v.push_back(tiny_wide);
    ModelShape tiny_llama{.name = "tiny-llama",
                          .architecture = "LlamaForCausalLM",
                          .hidden = 64,
                          .layers = 3,
                          .heads = 4,
                          .kv_heads = 1,
                          .intermediate = 160,
                          .vocab = 384,
                          .max_position = 1024,
                          .rope_theta = 500000.0,
                          .rms_eps = 1e-5,
                          .tied = false,
                          .llama3_rope = true};
    v.push_back(tiny_llama);
    ModelShape q05{.name = "qwen2.5-0.5b",
                   .architecture = "Qwen2ForCausalLM",
                   .hidden = 896,
                   .layers = 24,
                   .heads = 14,
                   .kv_heads = 2,
                   .intermediate = 4864,
                   .vocab = 151936,
                   .max_position = 32768,
                   .rope_theta = 1000000.0,
                   .rms_eps = 1e-6,
                   .tied = true,
                   .bos = 151643,
                   .eos = 151645};
    v.push_back(q05);
    // Its head size of 64.
    v.push_back(oneLayerOf(q05, "qwen2.5-0.5b-layer"));
    ModelShape q7{.name = "qwen2.5-7b",
                  .architecture = "Qwen2ForCausalLM",
                  .hidden = 3584,
                  .layers = 28,
                  .heads = 28,
                  .kv_heads = 4,
                  .intermediate = 18944,
                  .vocab = 152064,
                  .max_position = 32768,
                  .rope_theta = 1000000.0,
                  .rms_eps = 1e-6,
                  .tied = false,
                  .bos = 151643,
                  .eos = 151645};
    v.push_back(q7);
    // Its widest products (k up to 18,944).
    v.push_back(oneLayerOf(q7, "qwen2.5-7b-layer"));
    ModelShape q14{.name = "qwen2.5-14b",
                   .architecture = "Qwen2ForCausalLM",
                   .hidden = 5120,
                   .layers = 48,
                   .heads = 40,
                   .kv_heads = 8,
                   .intermediate = 13824,
                   .vocab = 152064,
                   .max_position = 32768,
                   .rope_theta = 1000000.0,
                   .rms_eps = 1e-5,
                   .tied = false,
                   .bos = 151643,
                   .eos = 151645};
    v.push_back(q14);
    return v;
  }();
  return shapes;
}

Result<MakeModelReport> makeModel(const MakeModelOptions& options) {
  const ModelShape* shape = nullptr;
  std::string known;
  for (const ModelShape& s : modelShapes()) {
    if (s.name == options.shape) shape = &s;
    known += (known.empty() ? "" : ", ") + s.name;
  }
  if (shape == nullptr)
    return invalidArgument("unknown shape \"" + options.shape + "\" (known: " + known + ")");
  if (options.out_dir.empty()) return invalidArgument("--out is required");
  if (options.layers < 0 || options.layers > 1024)
    return invalidArgument("--layers " + std::to_string(options.layers) + " (0 to 1024)");
  ModelShape layered = *shape;
  if (options.layers > 0) {
    layered.layers = options.layers;
    shape = &layered;
  }
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) return internalError(options.out_dir + ": cannot create: " + ec.message());

  const std::vector<TensorSpec> specs = tensorSpecs(*shape);
  MakeModelReport report;
  // Split into shards of at most max_shard_bytes (a tensor is never split).
  std::vector<std::pair<size_t, size_t>> shards;
  uint64_t shard_bytes = 0;
  size_t shard_begin = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const uint64_t bytes = specs[i].numel() * dtypeSize(options.dtype);
    report.parameters += specs[i].numel();
    report.bytes += bytes;
    if (i > shard_begin && shard_bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back(shard_begin, i);
      shard_begin = i;
      shard_bytes = 0;
    }
    shard_bytes += bytes;
  }
  shards.emplace_back(shard_begin, specs.size());
  report.shards = int(shards.size());

  const std::string dir = options.out_dir;
  std::filesystem::remove(dir + "/model.safetensors", ec);
  std::filesystem::remove(dir + "/model.safetensors.index.json", ec);
  if (shards.size() == 1) {
    BULKHEAD_RETURN_IF_ERROR(writeShard(dir + "/model.safetensors", specs, 0, specs.size(),
                                        options.seed, options.dtype));
  } else {
    json weight_map = json::object();
    for (size_t k = 0; k < shards.size(); ++k) {
      char name[64];
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
      BULKHEAD_RETURN_IF_ERROR(writeShard(dir + "/" + name, specs, shards[k].first,
                                          shards[k].second, options.seed, options.dtype));
      for (size_t i = shards[k].first; i < shards[k].second; ++i) weight_map[specs[i].name] = name;
    }
    json index = {{"metadata", {{"total_size", report.bytes}}}, {"weight_map", weight_map}};
    BULKHEAD_RETURN_IF_ERROR(writeText(dir + "/model.safetensors.index.json", index.dump(2)));
  }
  BULKHEAD_RETURN_IF_ERROR(
      writeText(dir + "/config.json", configJson(*shape, options.dtype).dump(2) + "\n"));
  json gen = {{"bos_token_id", shape->bos}, {"eos_token_id", shape->eos}};
  BULKHEAD_RETURN_IF_ERROR(writeText(dir + "/generation_config.json", gen.dump(2) + "\n"));
  return report;
}

}  // namespace bulkhead
