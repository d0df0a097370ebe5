// Checkpoint directory loading: single-file and sharded safetensors, tensor binding and shape
// checks.
#include "shared/checkpoint.h"

#include "shared/checksum.h"
#include "shared/work_pool.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace bulkhead {
namespace {

std::string shapeString(const std::vector<int64_t>& shape) {
  TensorView v;
  v.shape = shape;
  return v.shapeString();
}

}  // namespace

Result<Checkpoint> Checkpoint::open(const std::string& dir) {
  Checkpoint ckpt;
  ckpt.dir_ = dir;
  BULKHEAD_ASSIGN_OR_RETURN(ckpt.config_, ModelConfig::load(dir));
  {
    std::ifstream in(dir + "/config.json", std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    ckpt.config_text_ = text.str();
  }

  const std::string index_path = dir + "/model.safetensors.index.json";
  const std::string single_path = dir + "/model.safetensors";
  std::error_code ec;
  if (std::filesystem::exists(index_path, ec)) {
    std::ifstream in(index_path, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    auto index = nlohmann::json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object())
      return invalidArgument(index_path + ": not valid JSON");
    auto map_it = index.find("weight_map");
    if (map_it == index.end() || !map_it->is_object())
      return invalidArgument(index_path + ": missing \"weight_map\" object");
    std::map<std::string, size_t> file_slot;  // shard file name -> files_ index
    for (const auto& [tensor, file_json] : map_it->items()) {
      if (!file_json.is_string())
        return invalidArgument(index_path + ": tensor " + tensor + ": file name is not a string");
      const std::string file = file_json.get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        return invalidArgument(index_path + ": tensor " + tensor + ": shard name \"" + file +
                               "\" is not a plain file name in the checkpoint directory");
      auto [slot, inserted] = file_slot.emplace(file, ckpt.files_.size());
      if (inserted) {
        BULKHEAD_ASSIGN_OR_RETURN(auto shard, SafetensorsFile::open(dir + "/" + file));
        ckpt.files_.push_back(std::make_unique<SafetensorsFile>(std::move(shard)));
      }
      const auto& shard_tensors = ckpt.files_[slot->second]->tensors();
      auto t = shard_tensors.find(tensor);
      if (t == shard_tensors.end())
        return invalidArgument(index_path + ": tensor " + tensor + " is mapped to " + file +
                               ", which does not contain it");
      ckpt.all_.emplace(tensor, t->second);
    }
  } else if (std::filesystem::exists(single_path, ec)) {
    BULKHEAD_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(single_path));
    ckpt.files_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
    ckpt.all_ = ckpt.files_.back()->tensors();
  } else {
    return notFound(dir + ": no model.safetensors or model.safetensors.index.json");
  }
  BULKHEAD_RETURN_IF_ERROR(ckpt.bindTensors());
  return ckpt;
}

Status Checkpoint::bindTensors() {
  const ModelConfig& c = config_;
  auto bind = [&](const std::string& name, std::vector<int64_t> expected,
                  const TensorView*& out) -> Status {
    auto it = all_.find(name);
    if (it == all_.end())
      return notFound(dir_ + ": missing tensor " + name + " (expected shape " +
                      shapeString(expected) + ")");
    if (it->second.shape != expected)
      return invalidArgument(it->second.file + ": tensor " + name + " has shape " +
                             it->second.shapeString() + ", config expects " +
                             shapeString(expected));
    out = &it->second;
    return okStatus();
  };
  const int64_t h = c.hidden_size, q = c.qDim(), kv = c.kvDim(), inter = c.intermediate_size;
  const int64_t vocab = c.vocab_size;
  BULKHEAD_RETURN_IF_ERROR(bind("model.embed_tokens.weight", {vocab, h}, tensors_.embed));
  BULKHEAD_RETURN_IF_ERROR(bind("model.norm.weight", {h}, tensors_.final_norm));
  if (c.tie_word_embeddings) {
    tensors_.lm_head = tensors_.embed;
  } else {
    BULKHEAD_RETURN_IF_ERROR(bind("lm_head.weight", {vocab, h}, tensors_.lm_head));
  }
  tensors_.layers.resize(size_t(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerTensors& t = tensors_.layers[size_t(l)];
    BULKHEAD_RETURN_IF_ERROR(bind(p + "input_layernorm.weight", {h}, t.input_norm));
    BULKHEAD_RETURN_IF_ERROR(bind(p + "self_attn.q_proj.weight", {q, h}, t.q));
    BULKHEAD_RETURN_IF_ERROR(bind(p + "self_attn.k_proj.weight", {kv, h}, t.k));
    BULKHEAD_RETURN_IF_ERROR(bind(p + "self_attn.v_proj.weight", {kv, h}, t.v));
    BULKHEAD_RETURN_IF_ERROR(bind(p + "self_attn.o_proj.weight", {h, q}, t.o));
    if (c.qkv_bias) {
      BULKHEAD_RETURN_IF_ERROR(bind(p + "self_attn.q_proj.bias", {q}, t.q_bias));
      BULKHEAD_RETURN_IF_ERROR(bind(p + "self_attn.k_proj.bias", {kv}, t.k_bias));
      BULKHEAD_RETURN_IF_ERROR(bind(p + "self_attn.v_proj.bias", {kv}, t.v_bias));
    }
    if (c.o_bias) BULKHEAD_RETURN_IF_ERROR(bind(p + "self_attn.o_proj.bias", {h}, t.o_bias));
    BULKHEAD_RETURN_IF_ERROR(bind(p + "post_attention_layernorm.weight", {h}, t.post_norm));
    BULKHEAD_RETURN_IF_ERROR(bind(p + "mlp.gate_proj.weight", {inter, h}, t.gate));
    BULKHEAD_RETURN_IF_ERROR(bind(p + "mlp.up_proj.weight", {inter, h}, t.up));
    BULKHEAD_RETURN_IF_ERROR(bind(p + "mlp.down_proj.weight", {h, inter}, t.down));
  }
  return okStatus();
}

std::vector<const TensorView*> Checkpoint::usedTensors() const {
  std::vector<const TensorView*> used;
  auto add = [&](const TensorView* v) {
    if (v != nullptr && std::find(used.begin(), used.end(), v) == used.end()) used.push_back(v);
  };
  add(tensors_.embed);
  for (const LayerTensors& t : tensors_.layers) {
    for (const TensorView* v : {t.input_norm, t.q, t.k, t.v, t.o, t.q_bias, t.k_bias, t.v_bias,
                                t.o_bias, t.post_norm, t.gate, t.up, t.down}) {
      add(v);
    }
  }
  add(tensors_.final_norm);
  add(tensors_.lm_head);
  return used;
}

uint64_t Checkpoint::weightBytes() const {
  uint64_t bytes = 0;
  for (const TensorView* v : usedTensors()) bytes += v->data.size();
  return bytes;
}

uint64_t Checkpoint::identity() const {
  std::string description = config_text_;
  for (const TensorView* v : usedTensors()) {
    description += "\n" + v->name + " " + std::string(dtypeName(v->dtype)) + " " + v->shapeString();
  }
  return checksumBytes(std::as_bytes(std::span(description.data(), description.size())));
}

uint64_t Checkpoint::weightDigest() const {
  std::call_once(digest_->once, [this] {
    std::vector<std::span<const std::byte>> ranges;
    for (const TensorView* v : usedTensors()) ranges.push_back(v->data);
    WorkPool pool;
    const std::vector<uint64_t> sums = granuleChecksums(ranges, kChecksumGranuleBytes, pool);
    digest_->value = checksumBytes(std::as_bytes(std::span(sums)));
  });
  return digest_->value;
}

}  // namespace bulkhead
