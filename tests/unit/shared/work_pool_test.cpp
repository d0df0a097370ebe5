// WorkPool: every index runs exactly once, from repeated bursts, with more threads than cores,
// from several calling threads, and whether the pool is kept warm or not.
#include "shared/work_pool.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace bulkhead {
namespace {

void expectEachIndexOnce(WorkPool& pool, size_t n) {
  std::vector<std::atomic<int>> hits(n);
  pool.parallelFor(n, [&](size_t i) { hits[i].fetch_add(1, std::memory_order_relaxed); });
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "index " << i << " of " << n;
}

TEST(WorkPool, EveryIndexExactlyOnceUnderContention) {
  // Eight threads on however few cores this machine has: helpers are preempted mid-burst.
  WorkPool pool(8);
  EXPECT_EQ(pool.threads(), 8u);
  for (int round = 0; round < 300; ++round)
    expectEachIndexOnce(pool, size_t(round % 7 == 0 ? 1 : (round * 37) % 513));
}

TEST(WorkPool, ReturnsOnlyWhenAllWorkIsDone) {
  WorkPool pool(4);
  for (int round = 0; round < 50; ++round) {
    std::atomic<int> done{0};
    pool.parallelFor(64, [&](size_t i) {
      if (i % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      done.fetch_add(1);
    });
    ASSERT_EQ(done.load(), 64);
  }
}

TEST(WorkPool, WakesAfterIdleHelpersHaveGoneToSleep) {
  WorkPool pool(3);
  expectEachIndexOnce(pool, 100);
  // Long enough for every helper to stop spinning and wait on the condition variable.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  expectEachIndexOnce(pool, 100);
}

TEST(WorkPool, SingleThreadRunsInlineAndZeroMeansHardwareConcurrency) {
  WorkPool one(1);
  EXPECT_EQ(one.threads(), 1u);
  const std::thread::id caller = std::this_thread::get_id();
  one.parallelFor(10, [&](size_t) { EXPECT_EQ(std::this_thread::get_id(), caller); });
  WorkPool all(0);
  EXPECT_EQ(all.threads(), std::max(1u, std::thread::hardware_concurrency()));
  expectEachIndexOnce(all, 1000);
}

TEST(WorkPool, ManyPoolsComeAndGo) {
  for (int i = 0; i < 20; ++i) {
    auto pool = std::make_unique<WorkPool>(unsigned(1 + i % 5));
    expectEachIndexOnce(*pool, size_t(i * 3));
  }
}

TEST(WorkPool, CallersOnSeveralThreadsTakeTurns) {
  WorkPool pool(3);
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c)
    callers.emplace_back([&pool, c] {
      for (int round = 0; round < 100; ++round) expectEachIndexOnce(pool, size_t(50 + c + round));
    });
  for (std::thread& t : callers) t.join();
}

TEST(WorkPool, WarmPoolRunsBurstsAndCoolsAgain) {
  WorkPool pool(4);
  for (int run = 0; run < 20; ++run) {
    pool.keepWarm(true);
    for (int burst = 0; burst < 10; ++burst) expectEachIndexOnce(pool, size_t(1 + burst * 13));
    pool.keepWarm(false);
    if (run % 5 == 0) {
      // Cold: helpers go to sleep; warming again must wake them for the next run.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  pool.keepWarm(true);  // destroyed while warm: the destructor still joins every helper
}

// A pool limited to some of its threads runs bursts on no more than that many, and on all of
// them again once the limit is lifted.
TEST(WorkPool, ALimitOnParticipantsHoldsAndLifts) {
  WorkPool pool(4);
  auto threadsUsed = [&] {
    std::mutex mu;
    std::set<std::thread::id> ids;
    pool.parallelFor(4000, [&](size_t) {
      // Long enough per index that every participant gets some.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
      while (std::chrono::steady_clock::now() < until) {
      }
      std::lock_guard lock(mu);
      ids.insert(std::this_thread::get_id());
    });
    return ids.size();
  };
  pool.setParticipants(2);
  EXPECT_EQ(pool.threads(), 2u);
  for (int burst = 0; burst < 5; ++burst) {
    EXPECT_LE(threadsUsed(), 2u);
    expectEachIndexOnce(pool, 1000);
  }
  pool.setParticipants(1);
  EXPECT_EQ(threadsUsed(), 1u) << "one participant: the caller alone";
  pool.setParticipants(0);
  EXPECT_EQ(pool.threads(), 4u);
  expectEachIndexOnce(pool, 1000);
  size_t most = 0;
  for (int burst = 0; burst < 20 && most < 3; ++burst) most = std::max(most, threadsUsed());
  EXPECT_GE(most, 3u) << "helpers left out before take part again";
  pool.setParticipants(99);
  EXPECT_EQ(pool.threads(), 4u) << "at most the pool's threads";
}

// A warm pool keeps only its spinners busy: measured as the process's CPU time over a while.
TEST(WorkPool, AWarmPoolSpinsOnlyItsSpinners) {
  auto cpuMillis = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 +
           double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
  };
  WorkPool pool(3);
  expectEachIndexOnce(pool, 100);
  auto warmFor = [&](std::chrono::milliseconds wall) {
    const double before = cpuMillis();
    pool.keepWarm(true);
    std::this_thread::sleep_for(wall);  // a measurement window, not synchronisation
    pool.keepWarm(false);
    const double used = cpuMillis() - before;
    expectEachIndexOnce(pool, 100);  // and it still runs bursts
    return used;
  };
  // Two helpers spinning for 300 ms use up to 600 ms of CPU; on a busy host (the tests run
  // side by side) they get less, but far more than helpers asleep.
  pool.setSpinners(1);  // the caller alone: no helper spins
  const double asleep = warmFor(std::chrono::milliseconds(300));
  EXPECT_LT(asleep, 45.0);
  pool.setSpinners(0);  // every helper spins while warm
  const double spinning = warmFor(std::chrono::milliseconds(300));
  EXPECT_GT(spinning, 45.0);
  EXPECT_GT(spinning, 3 * asleep);
}

}  // namespace
}  // namespace bulkhead
