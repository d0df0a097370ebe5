// RowPool: every index runs exactly once, from repeated bursts, with more threads than cores.
#include "broker/row_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

namespace bulkhead {
namespace {

void expectEachIndexOnce(RowPool& pool, size_t n) {
  std::vector<std::atomic<int>> hits(n);
  pool.parallelFor(n, [&](size_t i) { hits[i].fetch_add(1, std::memory_order_relaxed); });
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "index " << i << " of " << n;
}

TEST(RowPool, EveryIndexExactlyOnceUnderContention) {
  // Eight threads on however few cores this machine has: helpers are preempted mid-burst.
  RowPool pool(8);
  EXPECT_EQ(pool.threads(), 8u);
  for (int round = 0; round < 300; ++round)
    expectEachIndexOnce(pool, size_t(round % 7 == 0 ? 1 : (round * 37) % 513));
}

TEST(RowPool, ReturnsOnlyWhenAllWorkIsDone) {
  RowPool pool(4);
  for (int round = 0; round < 50; ++round) {
    std::atomic<int> done{0};
    pool.parallelFor(64, [&](size_t i) {
      if (i % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      done.fetch_add(1);
    });
    ASSERT_EQ(done.load(), 64);
  }
}

TEST(RowPool, WakesAfterIdleHelpersHaveGoneToSleep) {
  RowPool pool(3);
  expectEachIndexOnce(pool, 100);
  // Long enough for every helper to stop spinning and wait on the condition variable.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  expectEachIndexOnce(pool, 100);
}

TEST(RowPool, SingleThreadRunsInlineAndZeroMeansHardwareConcurrency) {
  RowPool one(1);
  EXPECT_EQ(one.threads(), 1u);
  const std::thread::id caller = std::this_thread::get_id();
  one.parallelFor(10, [&](size_t) { EXPECT_EQ(std::this_thread::get_id(), caller); });
  RowPool all(0);
  EXPECT_EQ(all.threads(), std::max(1u, std::thread::hardware_concurrency()));
  expectEachIndexOnce(all, 1000);
}

TEST(RowPool, ManyPoolsComeAndGo) {
  for (int i = 0; i < 20; ++i) {
    auto pool = std::make_unique<RowPool>(unsigned(1 + i % 5));
    expectEachIndexOnce(*pool, size_t(i * 3));
  }
}

}  // namespace
}  // namespace bulkhead
