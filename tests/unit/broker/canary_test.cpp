// CanaryStore: a qualified digest is recorded and persisted; later ones must match it, for the
// same weights; each model and backend has its own record; a corrupt record is moved aside, never
// thrown over, and sends the canary back to qualification; a pinned record is the only reference.
// qualifyRows: the comparison with the reference engine.
#include "broker/canary.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "support/test_support.h"

namespace bulkhead {
namespace {

TEST(CanaryStore, RecordsThenChecksAcrossRestarts) {
  test::TempDir dir;
  {
    CanaryStore store(dir.path());
    EXPECT_EQ(store.check(1, "cpu", 100, 555).code(), Code::kNotFound);  // not yet qualified
    store.record(1, "cpu", 100, 555);
    EXPECT_TRUE(store.check(1, "cpu", 100, 555).ok());
  }
  CanaryStore reopened(dir.path());  // a new broker process reads the record
  EXPECT_TRUE(reopened.check(1, "cpu", 100, 555).ok());
  Status wrong_logits = reopened.check(1, "cpu", 100, 556);
  EXPECT_EQ(wrong_logits.code(), Code::kDataLoss);
  EXPECT_NE(wrong_logits.message().find("canary mismatch"), std::string::npos);
  Status wrong_weights = reopened.check(1, "cpu", 101, 555);
  EXPECT_EQ(wrong_weights.code(), Code::kDataLoss);
  EXPECT_NE(wrong_weights.message().find("weights"), std::string::npos);
  // Another backend or model has a record of its own.
  EXPECT_EQ(reopened.check(1, "cuda", 100, 555).code(), Code::kNotFound);
  EXPECT_EQ(reopened.check(2, "cpu", 100, 555).code(), Code::kNotFound);
}

TEST(CanaryStore, WithoutADirectoryItRemembersInMemory) {
  CanaryStore store("");
  EXPECT_EQ(store.check(1, "cpu", 1, 2).code(), Code::kNotFound);
  store.record(1, "cpu", 1, 2);
  EXPECT_TRUE(store.check(1, "cpu", 1, 2).ok());
  EXPECT_EQ(store.check(1, "cpu", 1, 3).code(), Code::kDataLoss);
}

TEST(CanaryStore, APinnedRecordIsTheOnlyReferenceAndNothingIsRecorded) {
  test::TempDir dir;
  const std::filesystem::path pinned_path = std::filesystem::path(dir.path()) / "pinned.json";
  ASSERT_TRUE(writeCanaryRecord(pinned_path, {1, "cpu", 100, 555}).ok());
  auto pinned = readCanaryRecord(pinned_path);
  ASSERT_TRUE(pinned.ok()) << pinned.status().toString();
  test::TempDir state;
  CanaryStore store(state.path(), *pinned);
  EXPECT_TRUE(store.check(1, "cpu", 100, 555).ok());
  EXPECT_EQ(store.check(1, "cpu", 100, 556).code(), Code::kDataLoss);
  Status other = store.check(2, "cpu", 100, 555);
  EXPECT_EQ(other.code(), Code::kFailedPrecondition);
  EXPECT_NE(other.message().find("pinned canary record is for model"), std::string::npos);
  store.record(1, "cpu", 100, 556);
  EXPECT_EQ(store.check(1, "cpu", 100, 556).code(), Code::kDataLoss);
  EXPECT_TRUE(std::filesystem::is_empty(state.path()));
}

TEST(CanaryStore, APinnedRecordThatCannotBeReadIsAnError) {
  test::TempDir dir;
  const std::string path = dir.file("pinned.json");
  EXPECT_EQ(readCanaryRecord(path).status().code(), Code::kFailedPrecondition);
  test::writeFile(path, R"({"model_identity": "1", "backend": "cpu", "weight_digest": "zz",)"
                        R"( "logits_digest": "1"})");
  Result<CanaryRecord> bad = readCanaryRecord(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("weight_digest"), std::string::npos);
}

// The file CanaryStore uses for model 1 on "cpu"; the name is part of the on-disk format.
std::filesystem::path recordPath(const test::TempDir& dir) {
  return std::filesystem::path(dir.path()) / "canary-v3-0000000000000001-cpu.json";
}

// Files in `dir` whose name starts with the record's and carries ".corrupt-".
std::vector<std::filesystem::path> movedAside(const test::TempDir& dir) {
  std::vector<std::filesystem::path> out;
  const std::string prefix = recordPath(dir).filename().string() + ".corrupt-";
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path());
  return out;
}

std::string validRecord(const std::string& weights, const std::string& logits) {
  return R"({"model_identity": "0000000000000001", "backend": "cpu", "weight_digest": ")" +
         weights + R"(", "logits_digest": ")" + logits + "\"}\n";
}

TEST(CanaryStore, CorruptRecordIsMovedAsideAndRequalified) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"non-hex weight digest", validRecord("zz", "000000000000022b")},
      {"non-hex logits digest", validRecord("0000000000000064", "0x22b")},
      {"overlong digest", validRecord("10000000000000064", "000000000000022b")},
      {"empty digest", validRecord("", "000000000000022b")},
      {"signed digest", validRecord("-64", "000000000000022b")},
      {"digest with a space", validRecord(" 64", "000000000000022b")},
      {"digest is a number", R"({"model_identity": "1", "backend": "cpu", "weight_digest": 100,)"
                             R"( "logits_digest": "22b"})"},
      {"digest is null", R"({"model_identity": "1", "backend": "cpu", "weight_digest": null,)"
                         R"( "logits_digest": "22b"})"},
      {"missing field", R"({"model_identity": "1", "backend": "cpu", "weight_digest": "64"})"},
      {"missing backend",
       R"({"model_identity": "1", "weight_digest": "64", "logits_digest": "1"})"},
      {"other model", R"({"model_identity": "2", "backend": "cpu", "weight_digest": "64",)"
                      R"( "logits_digest": "22b"})"},
      {"other backend", R"({"model_identity": "1", "backend": "cuda", "weight_digest": "64",)"
                        R"( "logits_digest": "22b"})"},
      {"truncated", validRecord("0000000000000064", "000000000000022b").substr(0, 50)},
      {"array", R"(["0000000000000064", "000000000000022b"])"},
      {"string", R"("0000000000000064")"},
      {"empty file", ""},
      {"binary", std::string("\x00\xff\xfe{\x01", 5)},
      {"huge", std::string(100 << 10, ' ')},
  };
  for (const auto& [what, bytes] : cases) {
    SCOPED_TRACE(what);
    test::TempDir dir;
    test::writeFile(recordPath(dir).string(), bytes);
    CanaryStore store(dir.path());
    Status status;
    // The digests differ from the corrupt record's: had it been believed, this would be DATA_LOSS.
    EXPECT_NO_THROW(status = store.check(1, "cpu", 7, 8));
    EXPECT_EQ(status.code(), Code::kNotFound) << status.toString();
    store.record(1, "cpu", 7, 8);  // qualified afresh
    const auto aside = movedAside(dir);
    ASSERT_EQ(aside.size(), 1u);
    EXPECT_EQ(test::readFile(aside[0].string()), bytes);
    // A fresh, valid record took its place: a new process checks against it.
    CanaryStore reopened(dir.path());
    EXPECT_TRUE(reopened.check(1, "cpu", 7, 8).ok());
    EXPECT_EQ(reopened.check(1, "cpu", 7, 9).code(), Code::kDataLoss);
    EXPECT_EQ(movedAside(dir).size(), 1u);
  }
}

TEST(CanaryStore, DirectoryInPlaceOfTheRecordIsMovedAside) {
  test::TempDir dir;
  std::filesystem::create_directory(recordPath(dir));
  test::writeFile((recordPath(dir) / "inside").string(), "kept");
  CanaryStore store(dir.path());
  Status status;
  EXPECT_NO_THROW(status = store.check(1, "cpu", 7, 8));
  EXPECT_EQ(status.code(), Code::kNotFound) << status.toString();
  store.record(1, "cpu", 7, 8);
  const auto aside = movedAside(dir);
  ASSERT_EQ(aside.size(), 1u);
  EXPECT_TRUE(std::filesystem::is_directory(aside[0]));
  EXPECT_EQ(test::readFile((aside[0] / "inside").string()), "kept");
  EXPECT_TRUE(std::filesystem::is_regular_file(recordPath(dir)));
  CanaryStore reopened(dir.path());
  EXPECT_EQ(reopened.check(1, "cpu", 7, 9).code(), Code::kDataLoss);
}

TEST(CanaryStore, UnreadableRecordIsMovedAside) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads files whatever their mode";
  test::TempDir dir;
  test::writeFile(recordPath(dir).string(), validRecord("0000000000000064", "000000000000022b"));
  std::filesystem::permissions(recordPath(dir), std::filesystem::perms::none);
  CanaryStore store(dir.path());
  Status status;
  EXPECT_NO_THROW(status = store.check(1, "cpu", 7, 8));
  EXPECT_EQ(status.code(), Code::kNotFound) << status.toString();
  store.record(1, "cpu", 7, 8);
  ASSERT_EQ(movedAside(dir).size(), 1u);
  CanaryStore reopened(dir.path());
  EXPECT_EQ(reopened.check(1, "cpu", 7, 9).code(), Code::kDataLoss);
}

TEST(CanaryStore, ValidRecordWrittenByHandStillDetectsAMismatch) {
  test::TempDir dir;
  // Upper case and without leading zeros: still the digests 0x64 and 0x22b.
  test::writeFile(recordPath(dir).string(), validRecord("64", "22B"));
  CanaryStore store(dir.path());
  Status status;
  EXPECT_NO_THROW(status = store.check(1, "cpu", 0x64, 0x22c));
  EXPECT_EQ(status.code(), Code::kDataLoss);
  EXPECT_NE(status.message().find("canary mismatch"), std::string::npos);
  EXPECT_TRUE(store.check(1, "cpu", 0x64, 0x22b).ok());
  EXPECT_TRUE(movedAside(dir).empty());
  CanaryStore other_weights(dir.path());
  EXPECT_EQ(other_weights.check(1, "cpu", 0x65, 0x22b).code(), Code::kDataLoss);
}

TEST(Canary, PromptIsFixedAndInVocabulary) {
  const auto a = canaryTokens(512), b = canaryTokens(512);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), kCanaryPrefix + 1);  // the prefix and the continuation token
  for (uint32_t t : canaryTokens(7)) EXPECT_LT(t, 7u);
}

TEST(Canary, QualificationComparesArgmaxAndError) {
  const std::vector<std::vector<float>> reference = {{0.0f, 4.0f, 1.0f}, {2.0f, -3.0f, 1.5f}};
  auto rows = [](const std::vector<std::vector<float>>& v) {
    return std::vector<std::span<const float>>(v.begin(), v.end());
  };
  EXPECT_TRUE(qualifyRows(rows(reference), reference, 0.0f).ok());
  // Within 2% of the largest reference magnitude (4 for row 0, 3 for row 1).
  const std::vector<std::vector<float>> close = {{0.07f, 3.93f, 1.0f}, {2.05f, -3.0f, 1.5f}};
  EXPECT_TRUE(qualifyRows(rows(close), reference, 0.02f).ok());
  EXPECT_EQ(qualifyRows(rows(close), reference, 0.0f).code(), Code::kFailedPrecondition);
  // The same errors, but the argmax of row 1 moves: no tolerance excuses that.
  const std::vector<std::vector<float>> flipped = {{0.0f, 4.0f, 1.0f}, {1.5f, -3.0f, 1.51f}};
  Status argmax = qualifyRows(rows(flipped), reference, 0.5f);
  EXPECT_EQ(argmax.code(), Code::kFailedPrecondition);
  EXPECT_NE(argmax.message().find("canary row 1"), std::string::npos) << argmax.message();
  EXPECT_NE(argmax.message().find("argmax 2"), std::string::npos) << argmax.message();
  const std::vector<std::vector<float>> nan = {{0.0f, 4.0f, NAN}, {2.0f, -3.0f, 1.5f}};
  EXPECT_EQ(qualifyRows(rows(nan), reference, 0.5f).code(), Code::kFailedPrecondition);
  const auto all = rows(reference);
  EXPECT_EQ(qualifyRows(std::span(all).subspan(1), reference, 0.0f).code(),
            Code::kFailedPrecondition);
}

}  // namespace
}  // namespace bulkhead
