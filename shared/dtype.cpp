// DType names and IEEE half conversions (software, so they work on any host).
#include "shared/dtype.h"

#include <cmath>

namespace bulkhead {

std::string_view dtypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

std::string_view dtypeTorchName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
  }
  return "?";
}

std::optional<DType> dtypeFromSafetensors(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  return std::nullopt;
}

std::optional<DType> dtypeFromTorchName(std::string_view name) {
  if (name == "float32" || name == "torch.float32") return DType::kF32;
  if (name == "float16" || name == "torch.float16") return DType::kF16;
  if (name == "bfloat16" || name == "torch.bfloat16") return DType::kBF16;
  return std::nullopt;
}

float f16ToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: value = mant * 2^-24
      float f = std::ldexp(float(mant), -24);
      return sign ? -f : f;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t floatToF16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (absu >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  if (absu < 0x38800000u) {                        // subnormal or zero in half
    float a = std::bit_cast<float>(absu);
    return sign | uint16_t(std::nearbyint(a * 16777216.0f));  // a / 2^-24, ties to even
  }
  uint32_t rounded = absu + 0xfffu + ((absu >> 13) & 1u);
  return sign | uint16_t((rounded - (112u << 23)) >> 13);
}

}  // namespace bulkhead
