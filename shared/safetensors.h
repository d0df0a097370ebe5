// Reader for the safetensors format: an 8-byte little-endian header length, a JSON header naming
// each tensor's dtype, shape and byte range, then the data. Every field is checked against the
// file before a single tensor byte is handed out, so a damaged file is an error, never a crash.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "shared/dtype.h"
#include "shared/mapped_file.h"
#include "shared/status.h"

namespace bulkhead {

struct TensorView {
  std::string name;
  std::string file;  // the file it came from, for error messages
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;

  int64_t numel() const;
  std::string shapeString() const;  // "[176,64]"
};

class SafetensorsFile {
 public:
  // Maps and validates `path`.
  static Result<SafetensorsFile> open(const std::string& path);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& path() const { return file_.path(); }

 private:
  MappedFile file_;
  std::map<std::string, TensorView> tensors_;
};

// Validates a safetensors image held in memory; `name` labels errors. Views point into `bytes`.
Result<std::map<std::string, TensorView>> parseSafetensors(std::span<const std::byte> bytes,
                                                           const std::string& name);

}  // namespace bulkhead
