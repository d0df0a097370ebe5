// Safetensors reader: valid files parse; every kind of damage is a clear error, never a crash.
#include "shared/safetensors.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "support/test_support.h"

namespace bulkhead {
namespace {

using nlohmann::json;
using test::TempDir;

// header JSON + data, with the real header length unless `declared_len` overrides it.
std::string image(const json& header, const std::string& data,
                  std::optional<uint64_t> declared_len = std::nullopt) {
  const std::string text = header.dump();
  const uint64_t len = declared_len.value_or(text.size());
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((len >> (8 * i)) & 0xff);
  return out + text + data;
}

Result<SafetensorsFile> openImage(const TempDir& dir, const std::string& bytes) {
  const std::string path = dir.file("model.safetensors");
  test::writeFile(path, bytes);
  return SafetensorsFile::open(path);
}

void expectError(const Result<SafetensorsFile>& r, const std::string& needle) {
  ASSERT_FALSE(r.ok()) << "expected an error containing \"" << needle << "\"";
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("model.safetensors"), std::string::npos)
      << "error does not name the file: " << r.status().message();
}

TEST(Safetensors, ParsesValidFile) {
  TempDir dir;
  std::string data(4 * 6 + 2 * 4, '\0');
  data[0] = 1;
  json h = {{"__metadata__", {{"format", "pt"}}},
            {"a", {{"dtype", "F32"}, {"shape", {2, 3}}, {"data_offsets", {0, 24}}}},
            {"b", {{"dtype", "BF16"}, {"shape", {4}}, {"data_offsets", {24, 32}}}}};
  auto r = openImage(dir, image(h, data));
  ASSERT_TRUE(r.ok()) << r.status().toString();
  ASSERT_EQ(r->tensors().size(), 2u);
  const TensorView& a = r->tensors().at("a");
  EXPECT_EQ(a.dtype, DType::kF32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data.size(), 24u);
  EXPECT_EQ(uint8_t(a.data[0]), 1);
  EXPECT_EQ(r->tensors().at("b").dtype, DType::kBF16);
}

TEST(Safetensors, TruncatedFile) {
  TempDir dir;
  expectError(openImage(dir, std::string(5, '\0')), "truncated");
}

TEST(Safetensors, HeaderLengthPastEnd) {
  TempDir dir;
  json h = {{"a", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}}}};
  expectError(openImage(dir, image(h, "abcd", 1u << 20)), "runs past the end");
  expectError(openImage(dir, image(h, "abcd", ~0ull)), "runs past the end");
}

TEST(Safetensors, BadJson) {
  TempDir dir;
  std::string text = "{\"a\": {\"dtype\": ";
  std::string bytes(8, '\0');
  bytes[0] = char(text.size());
  expectError(openImage(dir, bytes + text), "not valid JSON");
  expectError(openImage(dir, image(json::array({1, 2}), "")), "not a JSON object");
  expectError(openImage(dir, image(json{{"a", 5}}, "")), "tensor a: entry is not an object");
  expectError(openImage(dir, image(json{{"a", {{"dtype", "F32"}, {"shape", {1}}}}}, "abcd")),
              "tensor a: \"data_offsets\"");
}

TEST(Safetensors, DataOffsetsOutsideFile) {
  TempDir dir;
  json h = {{"w", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}}};
  expectError(openImage(dir, image(h, std::string(8, '\0'))), "tensor w: data_offsets [0,16]");
  json reversed = {{"w", {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {8, 4}}}}};
  expectError(openImage(dir, image(reversed, std::string(8, '\0'))), "is after end");
  json negative = {{"w", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {-4, 0}}}}};
  expectError(openImage(dir, image(negative, std::string(8, '\0'))), "non-negative");
}

TEST(Safetensors, OverlappingTensors) {
  TempDir dir;
  json h = {{"x", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}},
            {"y", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {20, 28}}}},
            {"z", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {8, 24}}}}};
  expectError(openImage(dir, image(h, std::string(32, '\0'))), "overlap");
  // A range inside an earlier, longer one is caught too.
  json nested = {{"big", {{"dtype", "F32"}, {"shape", {8}}, {"data_offsets", {0, 32}}}},
                 {"mid", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {4, 8}}}},
                 {"tail", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {24, 28}}}}};
  expectError(openImage(dir, image(nested, std::string(32, '\0'))), "tensors big and");
}

TEST(Safetensors, UnknownDtype) {
  TempDir dir;
  json h = {{"q", {{"dtype", "Q4_K"}, {"shape", {4}}, {"data_offsets", {0, 4}}}}};
  expectError(openImage(dir, image(h, "abcd")), "tensor q: unknown or unsupported dtype \"Q4_K\"");
  json i64 = {{"ids", {{"dtype", "I64"}, {"shape", {1}}, {"data_offsets", {0, 8}}}}};
  expectError(openImage(dir, image(i64, std::string(8, '\0'))), "dtype \"I64\"");
}

TEST(Safetensors, ShapeDisagreesWithByteRange) {
  TempDir dir;
  json h = {{"w", {{"dtype", "BF16"}, {"shape", {3, 3}}, {"data_offsets", {0, 16}}}}};
  expectError(openImage(dir, image(h, std::string(16, '\0'))), "needs 18 bytes");
  json overflow = {
      {"w", {{"dtype", "F32"}, {"shape", {1ull << 40, 1ull << 40}}, {"data_offsets", {0, 0}}}}};
  expectError(openImage(dir, image(overflow, "")), "overflows");
  json bad_dim = {{"w", {{"dtype", "F32"}, {"shape", {-1}}, {"data_offsets", {0, 0}}}}};
  expectError(openImage(dir, image(bad_dim, "")), "non-integer or negative");
}

TEST(Safetensors, MissingFileIsNotFound) {
  TempDir dir;
  auto r = SafetensorsFile::open(dir.file("absent.safetensors"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_NE(r.status().message().find("absent.safetensors"), std::string::npos);
}

// Every prefix of a valid file is rejected cleanly (or parsed, if complete): no crash, no
// out-of-bounds read under the sanitizers.
TEST(Safetensors, EveryTruncationIsHandled) {
  TempDir dir;
  json h = {{"a", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
            {"b", {{"dtype", "F16"}, {"shape", {2}}, {"data_offsets", {8, 12}}}}};
  const std::string full = image(h, std::string(12, 'x'));
  for (size_t len = 0; len < full.size(); ++len) {
    auto r = parseSafetensors(std::as_bytes(std::span(full.data(), len)), "cut");
    EXPECT_FALSE(r.ok()) << "prefix of " << len << " bytes parsed";
  }
  EXPECT_TRUE(parseSafetensors(std::as_bytes(std::span(full.data(), full.size())), "full").ok());
}

}  // namespace
}  // namespace bulkhead
