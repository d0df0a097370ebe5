// Checkpoint directories: single-file and sharded weights, and errors that name the tensor.
#include "shared/checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "support/test_support.h"
#include "tools/make_model.h"

namespace bulkhead {
namespace {

using nlohmann::json;
using test::TempDir;

void expectFailure(const std::string& dir, Code code, const std::string& needle) {
  auto r = Checkpoint::open(dir);
  ASSERT_FALSE(r.ok()) << "expected failure containing \"" << needle << "\"";
  EXPECT_EQ(r.status().code(), code) << r.status().toString();
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
}

void editConfig(const std::string& dir, const std::function<void(json&)>& edit) {
  json c = json::parse(test::readFile(dir + "/config.json"));
  edit(c);
  test::writeFile(dir + "/config.json", c.dump());
}

TEST(Checkpoint, OpensFixture) {
  auto r = Checkpoint::open(test::fixtureDir("tiny-qwen2"));
  ASSERT_TRUE(r.ok()) << r.status().toString();
  EXPECT_EQ(r->tensors().layers.size(), 2u);
  EXPECT_EQ(r->tensors().lm_head, r->tensors().embed);  // tied
  ASSERT_NE(r->tensors().layers[0].q_bias, nullptr);
  EXPECT_EQ(r->tensors().embed->dtype, DType::kBF16);
}

TEST(Checkpoint, ShardedMatchesSingleFile) {
  TempDir single, sharded;
  ASSERT_TRUE(makeModel({.shape = "tiny-llama", .out_dir = single.path(), .seed = 7}).ok());
  auto report = makeModel(
      {.shape = "tiny-llama", .out_dir = sharded.path(), .seed = 7, .max_shard_bytes = 40000});
  ASSERT_TRUE(report.ok()) << report.status().toString();
  EXPECT_GT(report->shards, 2);
  EXPECT_TRUE(std::filesystem::exists(sharded.file("model.safetensors.index.json")));
  auto a = Checkpoint::open(single.path());
  auto b = Checkpoint::open(sharded.path());
  ASSERT_TRUE(a.ok()) << a.status().toString();
  ASSERT_TRUE(b.ok()) << b.status().toString();
  ASSERT_EQ(a->all().size(), b->all().size());
  for (const auto& [name, view] : a->all()) {
    const TensorView& other = b->all().at(name);
    ASSERT_EQ(view.shape, other.shape) << name;
    ASSERT_TRUE(
        std::equal(view.data.begin(), view.data.end(), other.data.begin(), other.data.end()))
        << name;
  }
  EXPECT_EQ(a->tensors().layers[0].q_bias, nullptr);    // Llama: no biases
  EXPECT_NE(a->tensors().lm_head, a->tensors().embed);  // untied
}

TEST(Checkpoint, MakeModelWritesTheLayersAskedFor) {
  TempDir dir;
  auto report = makeModel({.shape = "tiny", .out_dir = dir.path(), .seed = 7, .layers = 3});
  ASSERT_TRUE(report.ok()) << report.status().toString();
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().toString();
  EXPECT_EQ(ckpt->config().num_layers, 3);
  EXPECT_EQ(ckpt->tensors().layers.size(), 3u);
  EXPECT_FALSE(makeModel({.shape = "tiny", .out_dir = dir.path(), .layers = -1}).ok());
}

TEST(Checkpoint, ShapeDisagreesWithConfig) {
  TempDir dir;
  test::copyDir(test::fixtureDir("tiny-qwen2"), dir.path());
  editConfig(dir.path(), [](json& c) { c["intermediate_size"] = 192; });
  expectFailure(dir.path(), Code::kInvalidArgument,
                "model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape "
                "[176,64], config expects [192,64]");
}

TEST(Checkpoint, MissingTensor) {
  TempDir dir;
  test::copyDir(test::fixtureDir("tiny-qwen2"), dir.path());
  editConfig(dir.path(), [](json& c) { c["num_hidden_layers"] = 3; });
  expectFailure(dir.path(), Code::kNotFound,
                "missing tensor model.layers.2.input_layernorm.weight");
  editConfig(dir.path(), [](json& c) {
    c["num_hidden_layers"] = 2;
    c["tie_word_embeddings"] = false;
  });
  expectFailure(dir.path(), Code::kNotFound, "missing tensor lm_head.weight");
}

TEST(Checkpoint, UnsupportedArchitecture) {
  TempDir dir;
  test::copyDir(test::fixtureDir("tiny-qwen2"), dir.path());
  editConfig(dir.path(), [](json& c) { c["architectures"] = {"MixtralForCausalLM"}; });
  expectFailure(dir.path(), Code::kInvalidArgument,
                "config.json: unsupported architecture \"MixtralForCausalLM\"");
}

TEST(Checkpoint, NoWeights) {
  TempDir dir;
  test::copyDir(test::fixtureDir("tiny-qwen2"), dir.path());
  std::filesystem::remove(dir.file("model.safetensors"));
  expectFailure(dir.path(), Code::kNotFound, "no model.safetensors");
}

TEST(Checkpoint, CorruptWeightsFileNamesIt) {
  TempDir dir;
  test::copyDir(test::fixtureDir("tiny-qwen2"), dir.path());
  std::string bytes = test::readFile(dir.file("model.safetensors"));
  test::writeFile(dir.file("model.safetensors"), bytes.substr(0, bytes.size() - 100));
  expectFailure(dir.path(), Code::kInvalidArgument, "model.safetensors: tensor");
}

TEST(Checkpoint, BadShardIndex) {
  TempDir dir;
  ASSERT_TRUE(makeModel({.shape = "tiny", .out_dir = dir.path(), .max_shard_bytes = 40000}).ok());
  const std::string index_path = dir.file("model.safetensors.index.json");
  const json index = json::parse(test::readFile(index_path));

  json traversal = index;
  traversal["weight_map"]["model.norm.weight"] = "../model.safetensors";
  test::writeFile(index_path, traversal.dump());
  expectFailure(dir.path(), Code::kInvalidArgument, "is not a plain file name");

  json missing_file = index;
  missing_file["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors";
  test::writeFile(index_path, missing_file.dump());
  expectFailure(dir.path(), Code::kNotFound, "model-00009-of-00009.safetensors: cannot open");

  json wrong_file = index;
  wrong_file["weight_map"]["model.norm.weight"] = index["weight_map"]["model.embed_tokens.weight"];
  ASSERT_NE(wrong_file["weight_map"]["model.norm.weight"],
            index["weight_map"]["model.norm.weight"]);
  test::writeFile(index_path, wrong_file.dump());
  auto r = Checkpoint::open(dir.path());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor model.norm.weight is mapped to"), std::string::npos)
      << r.status().message();

  test::writeFile(index_path, "{\"weight_map\": 3}");
  expectFailure(dir.path(), Code::kInvalidArgument, "missing \"weight_map\"");
}

}  // namespace
}  // namespace bulkhead
