#include "worker/weight_residency.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

namespace bulkhead {
namespace {

// A model's units as the CUDA backend lists them: per layer q/k/v, o, gate/up, down (sizes in
// MiB, 7B-like proportions), then an untied lm_head.
std::vector<WeightUnit> modelUnits(uint32_t layers, bool lm_head = true) {
  std::vector<WeightUnit> units;
  for (uint32_t l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    units.push_back({p + "qkv", 33u << 20, l});
    units.push_back({p + "o", 25u << 20, l});
    units.push_back({p + "gate_up", 271u << 20, l});
    units.push_back({p + "down", 136u << 20, l});
  }
  if (lm_head) units.push_back({"lm_head", 1090u << 20, layers});
  return units;
}

ResidencyRequest request(uint64_t budget, std::vector<std::string> streamed = {},
                         uint32_t slots = 2) {
  ResidencyRequest r;
  r.budget = budget;
  r.streamed = std::move(streamed);
  r.staging_slots = slots;
  return r;
}

uint64_t total(const std::vector<WeightUnit>& units) {
  uint64_t t = 0;
  for (const WeightUnit& u : units) t += u.bytes;
  return t;
}

TEST(SpreadOrder, VisitsEveryLayerOnceHalvingTheGaps) {
  EXPECT_EQ(spreadOrder(8), (std::vector<uint32_t>{0, 4, 2, 6, 1, 5, 3, 7}));
  for (uint32_t count : {1u, 3u, 24u, 28u, 80u}) {
    const std::vector<uint32_t> order = spreadOrder(count);
    ASSERT_EQ(order.size(), count);
    EXPECT_EQ(std::set<uint32_t>(order.begin(), order.end()).size(), count);
  }
  const std::vector<uint32_t> order = spreadOrder(24);
  EXPECT_EQ(std::vector<uint32_t>(order.begin(), order.begin() + 4),
            (std::vector<uint32_t>{0, 12, 6, 18}));
}

TEST(PlanResidency, NoBudgetKeepsEveryWeightResident) {
  const auto units = modelUnits(4);
  auto plan = planResidency(units, 1000, request(0));
  ASSERT_TRUE(plan.ok()) << plan.status().toString();
  EXPECT_EQ(plan->streamedCount(), 0u);
  EXPECT_EQ(plan->staging_slots, 0u);
  EXPECT_EQ(plan->resident_bytes, 1000 + total(units));
  EXPECT_EQ(plan->streamed_bytes, 0u);
  // A budget the model fits in streams nothing either.
  plan = planResidency(units, 1000, request(1000 + total(units)));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->streamedCount(), 0u);
}

TEST(PlanResidency, ABudgetIsMetStreamingTheFewestBytes) {
  const auto units = modelUnits(28);
  const uint64_t fixed = 1100ull << 20, all = fixed + total(units);
  for (const uint64_t budget : std::vector<uint64_t>{all - (300ull << 20), all / 2, all / 3}) {
    auto plan = planResidency(units, fixed, request(budget));
    ASSERT_TRUE(plan.ok()) << plan.status().toString();
    EXPECT_LE(plan->deviceBytes(), budget);
    EXPECT_EQ(plan->resident_bytes + plan->streamed_bytes, all);
    EXPECT_EQ(plan->staging_slots, 2u);
    // Every plan with other units streamed that fits streams at least as many bytes: check
    // against each single-size plan by brute force over which size class is streamed.
    uint64_t slot = 0;
    for (size_t i = 0; i < units.size(); ++i)
      if (plan->streamed[i]) slot = std::max(slot, units[i].bytes);
    EXPECT_EQ(plan->slot_bytes, slot);
    // lm_head alone costs two slots of its size: never worth it here.
    EXPECT_FALSE(plan->streamed.back()) << "budget " << budget;
  }
  // 600 MiB to shed, with two staging slots of the largest streamed unit's size: 26 of the
  // 25 MiB o units shed 650 MiB for 50 of staging, fewer bytes a step than 21 q/k/v units (693)
  // or 7 down units (952); the two left resident are the last in the spread order.
  auto plan = planResidency(units, fixed, request(all - (600ull << 20)));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->slot_bytes, 25ull << 20);
  EXPECT_EQ(plan->streamed_bytes, 650ull << 20);
  const std::vector<uint32_t> spread = spreadOrder(29);
  std::set<uint32_t> resident_o;
  for (size_t i = 0; i < units.size(); ++i) {
    const bool is_o = units[i].name.ends_with(".o");
    if (plan->streamed[i]) {
      EXPECT_TRUE(is_o) << units[i].name;
    }
    if (is_o && !plan->streamed[i]) resident_o.insert(units[i].layer);
  }
  std::set<uint32_t> last_two;
  for (auto it = spread.rbegin(); last_two.size() < 2; ++it)
    if (*it < 28) last_two.insert(*it);
  EXPECT_EQ(resident_o, last_two);
}

TEST(PlanResidency, NamedUnitsStreamWhateverTheBudget) {
  const auto units = modelUnits(2);
  auto plan = planResidency(units, 0, request(0, {"layers.1.o", "lm_head"}));
  ASSERT_TRUE(plan.ok()) << plan.status().toString();
  EXPECT_EQ(plan->streamedCount(), 2u);
  EXPECT_TRUE(plan->streamed[5]);
  EXPECT_TRUE(plan->streamed[8]);
  EXPECT_EQ(plan->slot_bytes, 1090ull << 20);
  EXPECT_EQ(plan->streamed_bytes, (1090ull + 25) << 20);
  plan = planResidency(units, 0, request(0, {"layers.0.gate_up"}, 1));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->staging_slots, 1u);
  EXPECT_EQ(plan->deviceBytes(), total(units));  // one slot of the one streamed unit's size

  const auto unknown = planResidency(units, 0, request(0, {"layers.9.o"}));
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("layers.9.o"), std::string::npos);
  EXPECT_FALSE(planResidency(units, 0, request(0, {"lm_head"}, 0)).ok());
}

TEST(PlanResidency, UnitsLargerThanAThresholdStreamWhateverTheBudget) {
  const auto units = modelUnits(3);
  ResidencyRequest r = request(0);
  r.stream_larger_than = 100ull << 20;  // gate/up (271 MiB), down (136) and lm_head (1,090)
  auto plan = planResidency(units, 0, r);
  ASSERT_TRUE(plan.ok()) << plan.status().toString();
  for (size_t i = 0; i < units.size(); ++i)
    EXPECT_EQ(plan->streamed[i], units[i].bytes > (100ull << 20)) << units[i].name;
  EXPECT_EQ(plan->slot_bytes, 1090ull << 20);
  // A budget then streams more, from the units the threshold left (the forced slots hold any of
  // them): 40 MiB to shed, two 25 MiB o units (50) rather than two 33 MiB q/k/v ones (66).
  r.budget = plan->deviceBytes() - (40ull << 20);
  plan = planResidency(units, 0, r);
  ASSERT_TRUE(plan.ok()) << plan.status().toString();
  EXPECT_LE(plan->deviceBytes(), r.budget);
  EXPECT_EQ(plan->streamedCount(), 3u * 2 + 1 + 2);
  EXPECT_EQ(plan->streamed_bytes, (3ull * (271 + 136) + 1090 + 2 * 25) << 20);
}

TEST(PlanResidency, ABudgetTooSmallSaysTheLeastThatWorks) {
  const auto units = modelUnits(4, /*lm_head=*/false);
  const uint64_t fixed = 500ull << 20;
  // Everything streamed through two slots of the largest unit: fixed + 2 x 271 MiB. With slots
  // of a smaller size the larger units stay resident, which costs more.
  const uint64_t least = fixed + 2 * (271ull << 20);
  auto plan = planResidency(units, fixed, request(least));
  ASSERT_TRUE(plan.ok()) << plan.status().toString();
  EXPECT_EQ(plan->streamedCount(), units.size());
  const auto small = planResidency(units, fixed, request(least - 1));
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("at least 1042 MiB"), std::string::npos)
      << small.status().message();
}

TEST(ParseByteSize, ReadsBinaryUnits) {
  EXPECT_EQ(*parseByteSize("4096"), 4096u);
  EXPECT_EQ(*parseByteSize("800MiB"), 800ull << 20);
  EXPECT_EQ(*parseByteSize("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*parseByteSize("2g"), 2ull << 30);
  EXPECT_EQ(*parseByteSize("64KB"), 64ull << 10);
  for (const char* bad : {"", "GiB", "12 apples", "1.2.3G", "-5M", "99999999999T"})
    EXPECT_FALSE(parseByteSize(bad).ok()) << bad;
}

}  // namespace
}  // namespace bulkhead
