// AdminExecutor: tasks run on threads of their own, so a long one holds up no other; stop()
// joins what runs and refuses what comes after; a cap bounds how many run at once.
#include "broker/admin_executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>

namespace bulkhead {
namespace {

using namespace std::chrono_literals;

// Generous: only a broken executor comes near it.
constexpr auto kBound = 30s;

TEST(AdminExecutor, RunsTasks) {
  AdminExecutor executor;
  std::vector<std::promise<int>> done(8);
  for (int i = 0; i < 8; ++i)
    ASSERT_TRUE(executor.submit([&done, i] { done[i].set_value(i); }).ok());
  for (int i = 0; i < 8; ++i) {
    auto f = done[i].get_future();
    ASSERT_EQ(f.wait_for(kBound), std::future_status::ready) << "task " << i;
    EXPECT_EQ(f.get(), i);
  }
}

TEST(AdminExecutor, ABlockedTaskDoesNotHoldUpAnother) {
  AdminExecutor executor;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  ASSERT_TRUE(executor.submit([released] { released.wait(); }).ok());  // a long Drain, say
  std::promise<void> second;
  ASSERT_TRUE(executor.submit([&second] { second.set_value(); }).ok());
  EXPECT_EQ(second.get_future().wait_for(kBound), std::future_status::ready);
  release.set_value();
}

TEST(AdminExecutor, StopJoinsRunningTasks) {
  AdminExecutor executor;
  std::promise<void> started, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> finished{false};
  ASSERT_TRUE(executor
                  .submit([&] {
                    started.set_value();
                    released.wait();
                    finished = true;
                  })
                  .ok());
  ASSERT_EQ(started.get_future().wait_for(kBound), std::future_status::ready);
  auto stopping = std::async(std::launch::async, [&] { executor.stop(); });
  // stop() cannot return while the task waits; once released, it returns after the task did.
  EXPECT_EQ(stopping.wait_for(50ms), std::future_status::timeout);
  release.set_value();
  ASSERT_EQ(stopping.wait_for(kBound), std::future_status::ready);
  EXPECT_TRUE(finished);
  EXPECT_EQ(executor.inFlight(), 0u);
}

TEST(AdminExecutor, TasksSubmittedAfterStopAreRefused) {
  AdminExecutor executor;
  executor.stop();
  bool ran = false;
  Status s = executor.submit([&] { ran = true; });
  EXPECT_EQ(s.code(), Code::kUnavailable);
  EXPECT_EQ(s.message(), "shutting down");
  executor.stop();  // idempotent
  EXPECT_FALSE(ran);
}

TEST(AdminExecutor, TooManyInFlightAreRefusedUntilOneEnds) {
  AdminExecutor executor(2);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  ASSERT_TRUE(executor.submit([released] { released.wait(); }).ok());
  ASSERT_TRUE(executor.submit([released] { released.wait(); }).ok());
  EXPECT_EQ(executor.submit([] {}).code(), Code::kResourceExhausted);
  release.set_value();
  // Finished tasks are reaped on the next submit; they end without further help from the test.
  const auto deadline = std::chrono::steady_clock::now() + kBound;
  Status s;
  do {
    s = executor.submit([] {});
    if (!s.ok()) std::this_thread::yield();
  } while (!s.ok() && std::chrono::steady_clock::now() < deadline);
  EXPECT_TRUE(s.ok()) << s.toString();
}

}  // namespace
}  // namespace bulkhead
