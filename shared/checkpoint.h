// A Hugging Face checkpoint directory opened for serving: config.json, generation_config.json and
// the weights (model.safetensors, or shards listed in model.safetensors.index.json), memory-mapped,
// with every tensor the architecture needs found and its shape checked against the config.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shared/model_config.h"
#include "shared/safetensors.h"
#include "shared/status.h"

namespace bulkhead {

struct LayerTensors {
  const TensorView* input_norm = nullptr;
  const TensorView* q = nullptr;
  const TensorView* k = nullptr;
  const TensorView* v = nullptr;
  const TensorView* o = nullptr;
  const TensorView* q_bias = nullptr;  // null when the architecture has none
  const TensorView* k_bias = nullptr;
  const TensorView* v_bias = nullptr;
  const TensorView* o_bias = nullptr;
  const TensorView* post_norm = nullptr;
  const TensorView* gate = nullptr;
  const TensorView* up = nullptr;
  const TensorView* down = nullptr;
};

struct ModelTensors {
  const TensorView* embed = nullptr;
  const TensorView* final_norm = nullptr;
  const TensorView* lm_head = nullptr;  // == embed when embeddings are tied
  std::vector<LayerTensors> layers;
};

class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::string& dir);

  Checkpoint(Checkpoint&&) = default;
  Checkpoint& operator=(Checkpoint&&) = default;
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  const ModelTensors& tensors() const { return tensors_; }
  // Every tensor of every file, by name.
  const std::map<std::string, TensorView>& all() const { return all_; }
  // Bytes of the tensors the model uses (tied lm_head counted once).
  uint64_t weightBytes() const;
  // The tensors the model uses, each once, in a fixed order.
  std::vector<const TensorView*> usedTensors() const;
  // Digest of the per-granule checksums (shared/checksum.h) of every used tensor, in order:
  // identifies the exact weights a worker loaded. A pass over every weight byte on every core,
  // the first time it is asked for; remembered after that.
  uint64_t weightDigest() const;
  // Identity of the model apart from weight content: config.json and every used tensor's name,
  // dtype and shape. Two checkpoints with the same identity should compute the same function.
  uint64_t identity() const;

 private:
  Checkpoint() = default;
  Status bindTensors();

  std::string dir_;
  std::string config_text_;
  ModelConfig config_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView> all_;
  ModelTensors tensors_;
  struct Digest {
    std::once_flag once;
    uint64_t value = 0;
  };
  std::unique_ptr<Digest> digest_ = std::make_unique<Digest>();
};

}  // namespace bulkhead
