// CanaryStore: the first digest is recorded and persisted; later ones must match it, for the same
// weights; each model and backend has its own record.
#include "broker/canary.h"

#include <gtest/gtest.h>

#include "support/test_support.h"

namespace bulkhead {
namespace {

TEST(CanaryStore, RecordsThenChecksAcrossRestarts) {
  test::TempDir dir;
  {
    CanaryStore store(dir.path());
    EXPECT_TRUE(store.check(1, "cpu", 100, 555).ok());  // recorded
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
  EXPECT_TRUE(reopened.check(1, "cuda", 100, 777).ok());
  EXPECT_TRUE(reopened.check(2, "cpu", 100, 888).ok());
}

TEST(CanaryStore, WithoutADirectoryItRemembersInMemory) {
  CanaryStore store("");
  EXPECT_TRUE(store.check(1, "cpu", 1, 2).ok());
  EXPECT_FALSE(store.check(1, "cpu", 1, 3).ok());
}

TEST(Canary, PromptIsFixedAndInVocabulary) {
  const auto a = canaryTokens(512), b = canaryTokens(512);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 16u);
  for (uint32_t t : canaryTokens(7)) EXPECT_LT(t, 7u);
}

}  // namespace
}  // namespace bulkhead
