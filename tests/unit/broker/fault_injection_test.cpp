// Fault-injection bookkeeping: the concrete fault for a class, and the injector's handling of
// a refusal and of shutdown, against the in-process fake worker.
#include "broker/fault_injection.h"

#include <gtest/gtest.h>

#include <future>

#include "support/fake_worker.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;

TEST(FaultSpecFor, PicksRowsBitsAndRolesFromTheRandomValue) {
  WorkerHello hello;
  hello.weight_bytes = 1000;
  const uint64_t r = (uint64_t(5) << 56) | 1234567;
  const FaultSpec flip = faultSpecFor(Fault::kWeightBitflip, r, hello, 300ms);
  EXPECT_EQ(flip.byte_offset, r % 1000);
  EXPECT_EQ(flip.bit, 5);
  EXPECT_EQ(faultSpecFor(Fault::kSlowStep, r, hello, 300ms).delay_ms, 900u)
      << "a slow step outlasts the deadline";
  EXPECT_EQ(faultSpecFor(Fault::kLogitsNan, 70, hello, 300ms).row, 6u);
  EXPECT_EQ(faultSpecFor(Fault::kStaleSlot, 12345, hello, 300ms).byte_offset, 12345u);
}

TEST(FaultInjector, ReportsAWorkerThatRefusesToArm) {
  auto control = std::make_shared<test::FakeWorkerControl>();
  auto worker = control->factory(control)(1);
  ASSERT_TRUE(worker.ok());
  FaultInjector injector;
  std::promise<void> woken;
  auto outcome = std::async(std::launch::async, [&] {
    return injector.inject(Fault::kLogitsCorrupt, 7, 10s, [&] { woken.set_value(); });
  });
  woken.get_future().wait();
  ASSERT_TRUE(injector.pending());
  // The fake refuses to arm: the outcome says so and names the refusal.
  injector.arm(**worker, 300ms);
  auto refused = outcome.get();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("injection refused"), std::string::npos);
  EXPECT_FALSE(injector.pending());
}

TEST(FaultInjector, StopEndsAWaitAndRefusesNewInjections) {
  FaultInjector injector;
  std::promise<void> woken;
  auto outcome = std::async(std::launch::async, [&] {
    return injector.inject(Fault::kWorkerKill, 1, 60s, [&] { woken.set_value(); });
  });
  woken.get_future().wait();
  injector.stop();
  auto r = outcome.get();
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->detected);
  EXPECT_EQ(injector.inject(Fault::kWorkerKill, 1, 1s, [] {}).status().code(), Code::kUnavailable);
}

}  // namespace
}  // namespace bulkhead
