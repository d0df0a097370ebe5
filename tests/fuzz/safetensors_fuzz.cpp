// libFuzzer target: the safetensors parser on any bytes. It must reject what is malformed with a
// status, never crash or read outside the image; every tensor it accepts lies inside the image.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "shared/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  auto parsed = bulkhead::parseSafetensors({bytes, size}, "fuzz.safetensors");
  if (!parsed.ok()) return 0;
  for (const auto& [name, tensor] : *parsed) {
    if (tensor.data.data() < bytes || tensor.data.data() + tensor.data.size() > bytes + size)
      std::abort();  // a view outside the image
  }
  return 0;
}
