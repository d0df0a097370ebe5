#include "worker/staging_ring.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <utility>

namespace bulkhead {
namespace {

using Op = StagingRing::Op;

TEST(StagingRing, IssuesTheFirstCopiesThenOneAfterEachUnit) {
  StagingRing ring(3, 2);
  EXPECT_EQ(ring.begin(), (std::vector<Op>{{Op::kCopy, 0, 0},
                                           {Op::kRecordStaged, 0, 0},
                                           {Op::kCopy, 1, 1},
                                           {Op::kRecordStaged, 1, 1}}));
  EXPECT_EQ(*ring.before(0), (std::vector<Op>{{Op::kComputeWaits, 0, 0}}));
  EXPECT_EQ(*ring.after(0), (std::vector<Op>{{Op::kRecordFreed, 0, 0},
                                             {Op::kCopyWaitsFreed, 2, 0},
                                             {Op::kCopy, 2, 0},
                                             {Op::kRecordStaged, 2, 0}}));
  EXPECT_FALSE(ring.end().ok());  // units 1 and 2 not yet read
  EXPECT_EQ(*ring.before(1), (std::vector<Op>{{Op::kComputeWaits, 1, 1}}));
  EXPECT_EQ(*ring.after(1), (std::vector<Op>{{Op::kRecordFreed, 1, 1}}));
  ASSERT_TRUE(ring.before(2).ok());
  ASSERT_TRUE(ring.after(2).ok());
  EXPECT_TRUE(ring.end().ok());
}

TEST(StagingRing, RefusesUnitsOutOfOrder) {
  StagingRing ring(3, 2);
  ring.begin();
  EXPECT_FALSE(ring.before(1).ok());
  EXPECT_FALSE(ring.after(0).ok());  // not read yet
  ASSERT_TRUE(ring.before(0).ok());
  EXPECT_FALSE(ring.before(0).ok());  // twice
  EXPECT_FALSE(ring.after(1).ok());
  ASSERT_TRUE(ring.after(0).ok());
  // A new step starts over.
  ring.begin();
  EXPECT_TRUE(ring.before(0).ok());
}

// A simulated device: a copy stream and a compute stream, each running its operations in order;
// events as CUDA's (a wait is for the event's last record issued before it; a wait for an event
// never recorded passes). Copies and products take random times. It checks what the CUDA backend
// relies on: a product reads its own unit, copied this step, and no copy writes a slot while a
// product reads it; and that the streams never wait for each other in a cycle.
class SimulatedDevice {
 public:
  // `dropped`: operations of that kind are left out (to show the checks see what they guard).
  SimulatedDevice(uint32_t slots, uint32_t seed, std::optional<Op::Kind> dropped = std::nullopt)
      : content_(slots), rng_(seed), dropped_(dropped) {}

  // One step of `units` units through `slots` slots, issued as the backend issues it.
  void runStep(size_t units, uint32_t slots) {
    ++step_;
    StagingRing ring(units, slots);
    issue(ring.begin());
    for (size_t j = 0; j < units; ++j) {
      issue(*ring.before(j));
      compute_.push_back({Item::kProduct, j, uint32_t(j % slots), 0});
      issue(*ring.after(j));
    }
    ASSERT_TRUE(ring.end().ok());
    run();
    EXPECT_EQ(products_run_, units) << "step " << step_;
    products_run_ = 0;
  }

 private:
  struct Item {
    enum Kind { kWait, kRecord, kCopy, kProduct } kind;
    size_t unit;
    uint32_t slot;
    uint64_t version;  // kWait: the record it waits for; kRecord: the one it makes
    std::pair<int, uint32_t> event = {};  // (0 staged / 1 freed, slot)
  };
  struct Stream {
    std::deque<Item> queue;
    double busy_until = -1;  // < 0: idle
    Item running{};
  };

  void issue(const std::vector<Op>& ops) {
    for (const Op& op : ops) {
      if (dropped_ == op.kind) continue;
      switch (op.kind) {
        case Op::kCopyWaitsFreed:
          copy_.push_back(waitFor({1, op.slot}, op));
          break;
        case Op::kCopy:
          copy_.push_back({Item::kCopy, op.unit, op.slot, 0});
          break;
        case Op::kRecordStaged:
          copy_.push_back(record({0, op.slot}, op));
          break;
        case Op::kComputeWaits:
          compute_.push_back(waitFor({0, op.slot}, op));
          break;
        case Op::kRecordFreed:
          compute_.push_back(record({1, op.slot}, op));
          break;
      }
    }
  }
  Item waitFor(std::pair<int, uint32_t> event, const Op& op) {
    return {Item::kWait, op.unit, op.slot, issued_[event], event};
  }
  Item record(std::pair<int, uint32_t> event, const Op& op) {
    return {Item::kRecord, op.unit, op.slot, ++issued_[event], event};
  }

  void run() {
    std::uniform_real_distribution<double> duration(0.1, 3.0);
    double now = 0;
    Stream* streams[2] = {&copy_stream_, &compute_stream_};
    copy_stream_.queue = std::move(copy_);
    compute_stream_.queue = std::move(compute_);
    copy_.clear();
    compute_.clear();
    for (;;) {
      bool started = false;
      for (Stream* s : streams) {
        while (s->busy_until < 0 && !s->queue.empty()) {
          const Item item = s->queue.front();
          if (item.kind == Item::kWait) {
            if (done_[item.event] < item.version) break;  // not yet
            s->queue.pop_front();
            started = true;
          } else if (item.kind == Item::kRecord) {
            done_[item.event] = item.version;  // in order on its stream
            s->queue.pop_front();
            started = true;
          } else {
            start(item);
            s->queue.pop_front();
            s->running = item;
            s->busy_until = now + duration(rng_);
            started = true;
          }
        }
      }
      Stream* next = nullptr;
      for (Stream* s : streams)
        if (s->busy_until >= 0 && (next == nullptr || s->busy_until < next->busy_until)) next = s;
      if (next == nullptr) {
        if (started) continue;
        ASSERT_TRUE(copy_stream_.queue.empty() && compute_stream_.queue.empty())
            << "the streams wait for each other (step " << step_ << ")";
        return;
      }
      now = next->busy_until;
      next->busy_until = -1;
      finish(next->running);
    }
  }

  void start(const Item& item) {
    auto& [unit_step, unit, readers, writing] = content_[item.slot];
    if (item.kind == Item::kCopy) {
      EXPECT_EQ(readers, 0) << "unit " << item.unit << " copied into slot " << item.slot
                            << " while a product reads it";
      writing = true;
      return;
    }
    EXPECT_FALSE(writing) << "the product of unit " << item.unit << " reads a slot being copied";
    EXPECT_TRUE(unit_step == step_ && unit == item.unit)
        << "the product of unit " << item.unit << " reads slot " << item.slot << " holding unit "
        << unit << " of step " << unit_step << " (step " << step_ << ")";
    ++readers;
  }
  void finish(const Item& item) {
    auto& [unit_step, unit, readers, writing] = content_[item.slot];
    if (item.kind == Item::kCopy) {
      writing = false;
      unit_step = step_;
      unit = item.unit;
      return;
    }
    --readers;
    ++products_run_;
  }

  struct Slot {
    uint64_t step = 0;
    size_t unit = 0;
    int readers = 0;
    bool writing = false;
  };
  std::vector<Slot> content_;
  std::deque<Item> copy_, compute_;
  Stream copy_stream_, compute_stream_;
  std::map<std::pair<int, uint32_t>, uint64_t> issued_, done_;
  std::mt19937 rng_;
  uint64_t step_ = 0;
  size_t products_run_ = 0;
  std::optional<Op::Kind> dropped_;
};

TEST(StagingRing, EveryProductReadsItsOwnUnitOnASimulatedDevice) {
  for (uint32_t slots = 1; slots <= 4; ++slots)
    for (size_t units : {1, 2, 3, 5, 8, 13})
      for (uint32_t seed = 0; seed < 40; ++seed) {
        SimulatedDevice device(slots, seed);
        for (int step = 0; step < 3; ++step) {
          device.runStep(units, slots);
          if (testing::Test::HasFailure()) {
            ADD_FAILURE() << slots << " slots, " << units << " units, seed " << seed;
            return;
          }
        }
      }
}

// The simulated device is not blind: without the copy's wait for the slot's reader, or the
// product's wait for its copy, it sees products read the wrong bytes.
TEST(StagingRing, TheSimulatedDeviceSeesAMissingWait) {
  for (const Op::Kind dropped : {Op::kCopyWaitsFreed, Op::kComputeWaits}) {
    testing::TestPartResultArray failures;
    {
      testing::ScopedFakeTestPartResultReporter reporter(
          testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
      for (uint32_t seed = 0; seed < 20; ++seed) {
        SimulatedDevice device(2, seed, dropped);
        device.runStep(8, 2);
      }
    }
    EXPECT_GT(failures.size(), 0) << "dropping operation kind " << int(dropped);
  }
}

}  // namespace
}  // namespace bulkhead
