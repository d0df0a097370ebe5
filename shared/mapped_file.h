// A read-only memory mapping of a whole file (RAII). Checkpoint weights are read through it so
// a multi-gigabyte model costs page cache, not a copy.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "shared/status.h"

namespace bulkhead {

class MappedFile {
 public:
  static Result<MappedFile> open(const std::string& path);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void reset();

  const std::byte* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

}  // namespace bulkhead
