// Element types of checkpoint tensors and their scalar conversions to and from float32.
#pragma once

#include <bit>
#include <cstdint>
#include <optional>
#include <string_view>

namespace bulkhead {

enum class DType : uint8_t { kF32, kF16, kBF16 };

constexpr size_t dtypeSize(DType t) {
  return t == DType::kF32 ? 4 : 2;
}
// Safetensors spelling: "F32", "F16", "BF16".
std::string_view dtypeName(DType t);
std::optional<DType> dtypeFromSafetensors(std::string_view name);
// Hugging Face config spelling: "float32", "float16", "bfloat16".
std::optional<DType> dtypeFromTorchName(std::string_view name);
std::string_view dtypeTorchName(DType t);

inline float bf16ToFloat(uint16_t v) {
  return std::bit_cast<float>(uint32_t(v) << 16);
}

// Round to nearest even; NaN stays NaN.
inline uint16_t floatToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16ToFloat(uint16_t h);
uint16_t floatToF16(float f);

}  // namespace bulkhead
