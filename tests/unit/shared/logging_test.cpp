// Log fields: the process's, overlaid by the thread's, overlaid by a scope's, restored when the
// scope ends; and the journal entry they make.
#include "shared/logging.h"

#include <gtest/gtest.h>

#include <thread>

namespace bulkhead {
namespace {

TEST(LogFields, ProcessThenThreadThenScopeAndRestored) {
  setProcessLogFields({.worker = "41", .incarnation = 7});
  setThreadLogFields({.incarnation = 9});
  {
    ScopedLogFields scope({.request_id = "req-1"});
    const LogFields f = currentLogFields();
    EXPECT_EQ(f.request_id, "req-1");
    EXPECT_EQ(f.worker, "41");
    EXPECT_EQ(f.incarnation, 9u);
    // Another thread sees the process's fields alone.
    std::thread([] {
      const LogFields other = currentLogFields();
      EXPECT_FALSE(other.request_id.has_value());
      EXPECT_EQ(other.incarnation, 7u);
    }).join();
  }
  EXPECT_FALSE(currentLogFields().request_id.has_value());
  EXPECT_EQ(currentLogFields().incarnation, 9u);
  setThreadLogFields({});
  setProcessLogFields({});
  EXPECT_FALSE(currentLogFields().worker.has_value());
}

TEST(LogFields, JournalEntryCarriesMessagePriorityAndTheFieldsSet) {
  const auto entry =
      journalEntry("step 3 failed", 3, {.request_id = "r\nx", .incarnation = 0xabcULL});
  const std::vector<std::string> want = {"MESSAGE=step 3 failed", "PRIORITY=3",
                                         "BULKHEAD_REQUEST_ID=r\nx",
                                         "BULKHEAD_INCARNATION=0000000000000abc"};
  EXPECT_EQ(entry, want);
  EXPECT_EQ(journalEntry("m", 6, {}).size(), 2u);
}

}  // namespace
}  // namespace bulkhead
