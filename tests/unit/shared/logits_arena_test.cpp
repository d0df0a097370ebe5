// Logits arena: rows published by the writer verify on the reader side; every mismatch is named;
// segments are exclusive and owner-only; another incarnation's segment is refused; an arena
// /dev/shm cannot hold is refused when made.
#include "shared/logits_arena.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cmath>

#include <boost/interprocess/shared_memory_object.hpp>

#include "shared/checksum.h"

namespace bulkhead {
namespace {

class LogitsArenaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    name_ = LogitsArena::arenaName(::getpid(), 0xabc000 + counter_++);
    auto w = LogitsArena::create(name_, 7, 4, 100);
    ASSERT_TRUE(w.ok()) << w.status().toString();
    writer_ = std::move(*w);
    auto r = LogitsArena::open(name_, 7, 100);
    ASSERT_TRUE(r.ok()) << r.status().toString();
    reader_ = std::move(*r);
  }

  uint64_t writeRow(uint32_t slot, uint64_t step, uint64_t seq, uint32_t index) {
    float* row = writer_->beginRow(slot);
    for (int i = 0; i < 100; ++i) row[i] = float(i) * 0.5f + float(step);
    // The producer's checksum, as a backend computes it while writing the row.
    const uint64_t sum = checkRow(row, 100).checksum;
    writer_->publishRow(slot, step, seq, index, sum);
    return sum;
  }

  IntegrityCheck verify(const RowExpectation& e) {
    IntegrityCheck check = IntegrityCheck::kNone;
    auto r = reader_->verifyRow(e, &check);
    if (r.ok()) {
      EXPECT_EQ(r->size(), 100u);
      return IntegrityCheck::kNone;
    }
    EXPECT_EQ(r.status().code(), Code::kDataLoss);
    return check;
  }

  static inline int counter_ = 0;
  std::string name_;
  std::unique_ptr<LogitsArena> writer_, reader_;
};

TEST_F(LogitsArenaTest, PublishedRowVerifies) {
  const uint64_t sum = writeRow(2, 5, 11, 3);
  RowExpectation e{7, 5, 11, 3, 2, sum};
  EXPECT_EQ(verify(e), IntegrityCheck::kNone);
  auto row = reader_->verifyRow(e, nullptr);
  ASSERT_TRUE(row.ok());
  EXPECT_EQ((*row)[4], 2.0f + 5.0f);
}

TEST_F(LogitsArenaTest, EveryMismatchIsNamed) {
  const uint64_t sum = writeRow(1, 5, 11, 3);
  const RowExpectation good{7, 5, 11, 3, 1, sum};
  auto with = [&](auto edit) {
    RowExpectation e = good;
    edit(e);
    return verify(e);
  };
  EXPECT_EQ(with([](auto& e) { e.slot = 4; }), IntegrityCheck::kSlotRange);
  EXPECT_EQ(with([](auto& e) { e.incarnation = 8; }), IntegrityCheck::kIncarnation);
  EXPECT_EQ(with([](auto& e) { e.step_id = 6; }), IntegrityCheck::kStepId);
  EXPECT_EQ(with([](auto& e) { e.sequence_id = 12; }), IntegrityCheck::kSequenceId);
  EXPECT_EQ(with([](auto& e) { e.token_index = 0; }), IntegrityCheck::kTokenIndex);
  EXPECT_EQ(with([](auto& e) { e.reported_checksum ^= 1; }), IntegrityCheck::kReportedChecksum);
  writer_->publishHeader(1, {7, 5, 11, 3, 99, sum});
  EXPECT_EQ(verify(good), IntegrityCheck::kRowLength);
  writer_->publishHeader(1, {7, 5, 11, 3, 100, sum});
  EXPECT_EQ(verify(good), IntegrityCheck::kNone);
  writer_->beginRow(1)[50] += 1.0f;  // payload changes after publication (and unpublishes)
  writer_->publishHeader(1, {7, 5, 11, 3, 100, sum});
  EXPECT_EQ(verify(good), IntegrityCheck::kPayloadChecksum);
  float* row = writer_->beginRow(1);
  row[50] = NAN;
  const RowCheck nan_check = checkRow(row, 100);
  EXPECT_FALSE(nan_check.finite);
  const uint64_t nan_sum = nan_check.checksum;
  writer_->publishRow(1, 5, 11, 3, nan_sum);
  EXPECT_EQ(verify({7, 5, 11, 3, 1, nan_sum}), IntegrityCheck::kNonFinite);
}

TEST_F(LogitsArenaTest, UnpublishedRowIsRejected) {
  const uint64_t sum = writeRow(0, 5, 11, 3);
  writer_->beginRow(0);  // the writer starts the next step's row and dies
  EXPECT_EQ(verify({7, 5, 11, 3, 0, sum}), IntegrityCheck::kStepId);
}

TEST_F(LogitsArenaTest, ExclusiveOwnerOnlyAndFenced) {
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm/" + name_).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto again = LogitsArena::create(name_, 7, 4, 100);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kAlreadyExists);
  auto other_incarnation = LogitsArena::open(name_, 8, 100);
  ASSERT_FALSE(other_incarnation.ok());
  EXPECT_NE(other_incarnation.status().message().find("belongs to incarnation 7"),
            std::string::npos);
  auto other_vocab = LogitsArena::open(name_, 7, 101);
  EXPECT_FALSE(other_vocab.ok());
  EXPECT_FALSE(LogitsArena::open("not-ours", 7, 100).ok());
}

TEST_F(LogitsArenaTest, OwnerRemovesTheSegment) {
  const std::string path = "/dev/shm/" + name_;
  ASSERT_EQ(::access(path.c_str(), F_OK), 0);
  writer_.reset();
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

// An arena larger than /dev/shm is refused when it is made, with nothing left behind; before,
// its pages were only sized, and the first write past the free space ended the worker with
// SIGBUS mid-step. (Larger than the whole file system: refused before any page is taken, so the
// test never fills /dev/shm under other tests.)
TEST(LogitsArena, AnArenaLargerThanSharedMemoryIsRefusedWhenMade) {
  struct statvfs fs {};
  ASSERT_EQ(::statvfs("/dev/shm", &fs), 0);
  const uint64_t total = uint64_t(fs.f_blocks) * fs.f_frsize;
  const uint32_t row_floats = 1u << 28;  // 1 GiB a slot
  const uint64_t slots = total / (uint64_t(row_floats) * 4) + 2;
  ASSERT_LT(slots, uint64_t(1) << 32) << "a /dev/shm of " << total << " bytes";
  const std::string name = LogitsArena::arenaName(::getpid(), 0xf00d);
  auto arena = LogitsArena::create(name, 7, uint32_t(slots), row_floats);
  ASSERT_FALSE(arena.ok()) << "an arena of " << slots << " GiB in a /dev/shm of " << total
                           << " bytes";
  EXPECT_EQ(arena.status().code(), Code::kResourceExhausted) << arena.status().toString();
  EXPECT_NE(arena.status().message().find("does not fit in /dev/shm"), std::string::npos)
      << arena.status().message();
  EXPECT_NE(::access(("/dev/shm/" + name).c_str(), F_OK), 0) << "the segment was left behind";
}

// An arena whose name carries this process's pid but another start time was left by an earlier
// process that had the pid (a pid reused): collected. This process's own arena stays.
TEST(LogitsArena, AnArenaOfAReusedPidIsCollectedAndALiveOnesIsNot) {
  const uint64_t start = LogitsArena::processStart(::getpid());
  ASSERT_GT(start, 0u) << "no start time in /proc/self/stat";
  const std::string mine = LogitsArena::arenaName(::getpid(), 0xfeed01);
  const std::string earlier = LogitsArena::arenaName(::getpid(), start - 1, 0xfeed02);
  auto live = LogitsArena::create(mine, 1, 1, 16);
  ASSERT_TRUE(live.ok()) << live.status().toString();
  {  // as a process that died would leave it: mapped by nobody, not removed
    boost::interprocess::shared_memory_object shm(boost::interprocess::create_only, earlier.c_str(),
                                                  boost::interprocess::read_write);
    shm.truncate(4096);
  }
  EXPECT_GE(LogitsArena::collectStale(), 1);
  EXPECT_NE(::access(("/dev/shm/" + earlier).c_str(), F_OK), 0) << "the reused pid's arena stayed";
  EXPECT_EQ(::access(("/dev/shm/" + mine).c_str(), F_OK), 0) << "the live process's arena went";
}

}  // namespace
}  // namespace bulkhead
