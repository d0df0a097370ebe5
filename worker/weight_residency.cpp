// The residency plan: see weight_residency.h.
#include "worker/weight_residency.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>

namespace bulkhead {

size_t ResidencyPlan::streamedCount() const {
  return size_t(std::count(streamed.begin(), streamed.end(), true));
}

std::vector<uint32_t> spreadOrder(uint32_t count) {
  std::vector<uint32_t> order;
  if (count == 0) return order;
  uint32_t bits = 0;
  while ((uint64_t(1) << bits) < count) ++bits;
  std::vector<bool> seen(count, false);
  // i in bit-reversed order is a fraction 0, 1/2, 1/4, 3/4, ... of the way through; every layer
  // is the floor of some i * count / 2^bits, since 2^bits >= count.
  for (uint64_t i = 0; i < (uint64_t(1) << bits); ++i) {
    uint64_t reversed = 0;
    for (uint32_t b = 0; b < bits; ++b) reversed |= ((i >> b) & 1) << (bits - 1 - b);
    const auto layer = uint32_t(reversed * count >> bits);
    if (seen[layer]) continue;
    seen[layer] = true;
    order.push_back(layer);
  }
  return order;
}

namespace {

std::string mib(uint64_t bytes) {
  return std::to_string((bytes + (uint64_t(1) << 20) - 1) >> 20) + " MiB";
}

// The plan streaming exactly `streamed`.
ResidencyPlan planOf(std::span<const WeightUnit> units, uint64_t fixed_bytes,
                     std::vector<bool> streamed, uint32_t staging_slots) {
  ResidencyPlan plan;
  plan.resident_bytes = fixed_bytes;
  for (size_t i = 0; i < units.size(); ++i) {
    if (!streamed[i]) {
      plan.resident_bytes += units[i].bytes;
      continue;
    }
    plan.streamed_bytes += units[i].bytes;
    plan.slot_bytes = std::max(plan.slot_bytes, units[i].bytes);
  }
  plan.streamed = std::move(streamed);
  plan.staging_slots = plan.streamedCount() > 0 ? staging_slots : 0;
  return plan;
}

}  // namespace

Result<ResidencyPlan> planResidency(std::span<const WeightUnit> units, uint64_t fixed_bytes,
                                    const ResidencyRequest& request) {
  if (request.staging_slots == 0) return invalidArgument("streaming needs a staging slot or more");
  std::vector<bool> forced(units.size(), false);
  uint64_t forced_slot = 0;
  for (const std::string& name : request.streamed) {
    const auto at = std::find_if(units.begin(), units.end(),
                                 [&](const WeightUnit& u) { return u.name == name; });
    if (at == units.end())
      return invalidArgument("no weight unit \"" + name +
                             "\" to stream (units: layers.N.qkv, layers.N.o, layers.N.gate_up, "
                             "layers.N.down, and lm_head where it is not tied to the embedding)");
    forced[size_t(at - units.begin())] = true;
    forced_slot = std::max(forced_slot, at->bytes);
  }
  for (size_t i = 0; i < units.size(); ++i)
    if (request.stream_larger_than > 0 && units[i].bytes > request.stream_larger_than) {
      forced[i] = true;
      forced_slot = std::max(forced_slot, units[i].bytes);
    }
  const uint32_t slots = request.staging_slots;
  ResidencyPlan least = planOf(units, fixed_bytes, forced, slots);
  if (request.budget == 0 || least.deviceBytes() <= request.budget) return least;

  // Candidates for the largest unit the budget streams: each unit size (the staging slots then
  // hold that or the forced units' largest, whichever is larger).
  std::vector<uint64_t> sizes;
  for (const WeightUnit& u : units)
    if (u.bytes > 0) sizes.push_back(u.bytes);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  uint32_t layers = 0;
  for (const WeightUnit& u : units) layers = std::max(layers, u.layer + 1);
  std::vector<uint32_t> rank(layers);
  const std::vector<uint32_t> spread = spreadOrder(layers);
  for (uint32_t i = 0; i < spread.size(); ++i) rank[spread[i]] = i;

  std::optional<ResidencyPlan> best;
  uint64_t needed = std::numeric_limits<uint64_t>::max();  // the least budget any size allows
  for (const uint64_t size : sizes) {
    std::vector<size_t> order;
    uint64_t all_streamed = fixed_bytes + uint64_t(slots) * std::max(size, forced_slot);
    for (size_t i = 0; i < units.size(); ++i) {
      if (forced[i]) continue;
      if (units[i].bytes <= size)
        order.push_back(i);
      else
        all_streamed += units[i].bytes;
    }
    needed = std::min(needed, all_streamed);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      if (units[a].bytes != units[b].bytes) return units[a].bytes > units[b].bytes;
      return rank[units[a].layer] < rank[units[b].layer];
    });
    std::vector<bool> streamed = forced;
    ResidencyPlan plan = planOf(units, fixed_bytes, streamed, slots);
    for (const size_t i : order) {
      if (plan.deviceBytes() <= request.budget) break;
      streamed[i] = true;
      plan = planOf(units, fixed_bytes, streamed, slots);
    }
    if (plan.deviceBytes() > request.budget) continue;
    if (!best || plan.streamed_bytes < best->streamed_bytes) best = std::move(plan);
  }
  if (!best)
    return resourceExhausted("a weight budget of " + mib(request.budget) +
                             " is too small for this model: it needs at least " + mib(needed) +
                             " (" + mib(fixed_bytes) + " of weights that always stay resident, " +
                             std::to_string(slots) + " staging slots of a streamed unit each, " +
                             "and every unit larger than those slots)");
  return std::move(*best);
}

Result<uint64_t> parseByteSize(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) != 0 || text[digits] == '.'))
    ++digits;
  std::string unit = text.substr(digits);
  for (char& ch : unit) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  const std::pair<const char*, int> units[] = {
      {"", 0},     {"b", 0},  {"k", 10},  {"kb", 10},  {"kib", 10}, {"m", 20},  {"mb", 20},
      {"mib", 20}, {"g", 30}, {"gb", 30}, {"gib", 30}, {"t", 40},   {"tb", 40}, {"tib", 40}};
  const auto found = std::find_if(std::begin(units), std::end(units),
                                  [&](const auto& u) { return unit == u.first; });
  double value = 0;
  size_t used = 0;
  try {
    value = std::stod(text.substr(0, digits), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (digits == 0 || used != digits || found == std::end(units) || value < 0 ||
      value * std::ldexp(1.0, found->second) >= std::ldexp(1.0, 63))
    return invalidArgument("\"" + text + "\" is not a size (examples: 8GiB, 800MiB, 4096)");
  return uint64_t(value * std::ldexp(1.0, found->second));
}

}  // namespace bulkhead
