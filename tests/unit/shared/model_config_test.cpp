// config.json parsing: both styles, rope variants, eos lists, and a clear error per bad field.
#include "shared/model_config.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "support/test_support.h"

namespace bulkhead {
namespace {

using nlohmann::json;

json newerStyle() {
  return {{"architectures", {"Qwen2ForCausalLM"}},
          {"hidden_size", 64},
          {"intermediate_size", 176},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"vocab_size", 512},
          {"max_position_embeddings", 256},
          {"rms_norm_eps", 1e-6},
          {"dtype", "bfloat16"},
          {"rope_parameters", {{"rope_theta", 20000.0}, {"rope_type", "default"}}},
          {"tie_word_embeddings", true},
          {"eos_token_id", 2}};
}

json olderStyle() {
  json c = newerStyle();
  c.erase("dtype");
  c.erase("rope_parameters");
  c["torch_dtype"] = "bfloat16";
  c["rope_theta"] = 20000.0;
  c["rope_scaling"] = nullptr;
  return c;
}

TEST(ModelConfig, BothStylesAgree) {
  auto a = ModelConfig::fromJson(newerStyle(), "new");
  auto b = ModelConfig::fromJson(olderStyle(), "old");
  ASSERT_TRUE(a.ok()) << a.status().toString();
  ASSERT_TRUE(b.ok()) << b.status().toString();
  for (const ModelConfig* c : {&*a, &*b}) {
    EXPECT_EQ(c->architecture, Architecture::kQwen2);
    EXPECT_EQ(c->head_dim, 16);
    EXPECT_EQ(c->num_kv_heads, 2);
    EXPECT_DOUBLE_EQ(c->rope.theta, 20000.0);
    EXPECT_EQ(c->rope.type, "default");
    EXPECT_EQ(c->dtype, DType::kBF16);
    EXPECT_TRUE(c->qkv_bias);
    EXPECT_TRUE(c->tie_word_embeddings);
    EXPECT_EQ(c->max_context, 256);
    EXPECT_EQ(c->eos_token_ids, std::vector<uint32_t>{2});
  }
  EXPECT_EQ(a->ropeInverseFrequencies(), b->ropeInverseFrequencies());
}

TEST(ModelConfig, FixtureLoadsWithGenerationConfig) {
  auto c = ModelConfig::load(test::fixtureDir("tiny-qwen2"));
  ASSERT_TRUE(c.ok()) << c.status().toString();
  EXPECT_EQ(c->vocab_size, 512);
  EXPECT_EQ(c->num_layers, 2);
  EXPECT_EQ(c->eos_token_ids, std::vector<uint32_t>{2});
}

TEST(ModelConfig, LlamaFamilyDetails) {
  json c = olderStyle();
  c["architectures"] = {"LlamaForCausalLM"};
  c["attention_bias"] = false;
  c["head_dim"] = 32;  // explicit head_dim differing from hidden / heads
  c["eos_token_id"] = {128001, 128009};
  c["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 64}};
  auto r = ModelConfig::fromJson(c, "llama");
  ASSERT_TRUE(r.ok()) << r.status().toString();
  EXPECT_EQ(r->head_dim, 32);
  EXPECT_EQ(r->qDim(), 128);
  EXPECT_FALSE(r->qkv_bias);
  EXPECT_EQ(r->eos_token_ids, (std::vector<uint32_t>{128001, 128009}));
  EXPECT_EQ(r->rope.type, "llama3");
  // High frequencies untouched, the lowest divided by the factor.
  auto inv = r->ropeInverseFrequencies();
  json plain = c;
  plain.erase("rope_scaling");
  auto base = ModelConfig::fromJson(plain, "plain")->ropeInverseFrequencies();
  EXPECT_FLOAT_EQ(inv.front(), base.front());
  EXPECT_FLOAT_EQ(inv.back(), base.back() / 8.0f);
}

TEST(ModelConfig, MistralSlidingWindowCapsContext) {
  json c = olderStyle();
  c["architectures"] = {"MistralForCausalLM"};
  c["max_position_embeddings"] = 32768;
  c["sliding_window"] = 4096;
  auto r = ModelConfig::fromJson(c, "mistral");
  ASSERT_TRUE(r.ok()) << r.status().toString();
  EXPECT_EQ(r->max_context, 4096);
  EXPECT_FALSE(r->qkv_bias);
}

struct BadConfig {
  const char* what;
  std::function<void(json&)> mutate;
  const char* message;
};

TEST(ModelConfig, BadFieldsAreNamed) {
  const std::vector<BadConfig> cases = {
      {"architecture", [](json& c) { c["architectures"] = {"GPT2LMHeadModel"}; },
       "unsupported architecture \"GPT2LMHeadModel\""},
      {"no architectures", [](json& c) { c.erase("architectures"); }, "missing \"architectures\""},
      {"missing hidden", [](json& c) { c.erase("hidden_size"); }, "missing field \"hidden_size\""},
      {"negative", [](json& c) { c["num_hidden_layers"] = -2; },
       "\"num_hidden_layers\" must be a positive integer"},
      {"string", [](json& c) { c["vocab_size"] = "512"; }, "\"vocab_size\" must be a positive"},
      {"gqa", [](json& c) { c["num_key_value_heads"] = 3; }, "not a multiple of num_key_value"},
      // 4 x 536,871,040 wraps to 4,096 in 32 bits, and 2 x it to 2,048.
      {"head_dim product", [](json& c) { c["head_dim"] = 536871040; },
       "num_attention_heads 4 x head_dim 536871040 is over 2^30"},
      {"act", [](json& c) { c["hidden_act"] = "gelu"; }, "unsupported hidden_act \"gelu\""},
      {"rope", [](json& c) { c["rope_parameters"]["rope_type"] = "yarn"; },
       "unsupported rope type \"yarn\""},
      {"dtype", [](json& c) { c["dtype"] = "int8"; }, "unsupported dtype \"int8\""},
      {"eps", [](json& c) { c["rms_norm_eps"] = 0; }, "rms_norm_eps must be positive"},
  };
  for (const BadConfig& bad : cases) {
    json c = newerStyle();
    bad.mutate(c);
    auto r = ModelConfig::fromJson(c, "dir/config.json");
    ASSERT_FALSE(r.ok()) << bad.what;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << bad.what;
    EXPECT_NE(r.status().message().find(bad.message), std::string::npos)
        << bad.what << ": " << r.status().message();
    EXPECT_EQ(r.status().message().rfind("dir/config.json", 0), 0u) << r.status().message();
  }
}

TEST(ModelConfig, UnreadableFiles) {
  test::TempDir dir;
  auto missing = ModelConfig::load(dir.path());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("config.json"), std::string::npos);
  test::writeFile(dir.file("config.json"), "{ not json");
  auto bad = ModelConfig::load(dir.path());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("config.json: not valid JSON"), std::string::npos);
}

}  // namespace
}  // namespace bulkhead
