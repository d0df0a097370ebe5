// Safetensors validation: header bounds, JSON, dtypes, shapes, offsets, overlaps.
#include "shared/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

namespace bulkhead {
namespace {

// Headers larger than this are not produced by any real writer; refusing them bounds the JSON
// parser's memory on hostile input.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shapeString() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Result<std::map<std::string, TensorView>> parseSafetensors(std::span<const std::byte> bytes,
                                                           const std::string& name) {
  if (bytes.size() < 8) {
    return invalidArgument(name + ": truncated: " + std::to_string(bytes.size()) +
                           " bytes, a safetensors file starts with an 8-byte header length");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | uint8_t(bytes[size_t(i)]);
  const uint64_t available = bytes.size() - 8;
  if (header_len > available) {
    return invalidArgument(name + ": header length " + std::to_string(header_len) +
                           " runs past the end of the file (" + std::to_string(available) +
                           " bytes after the length)");
  }
  if (header_len > kMaxHeaderBytes) {
    return invalidArgument(name + ": header length " + std::to_string(header_len) +
                           " exceeds the limit of " + std::to_string(kMaxHeaderBytes));
  }
  const char* header_begin = reinterpret_cast<const char*>(bytes.data() + 8);
  nlohmann::json header = nlohmann::json::parse(header_begin, header_begin + header_len, nullptr,
                                                /*allow_exceptions=*/false);
  if (header.is_discarded()) return invalidArgument(name + ": header is not valid JSON");
  if (!header.is_object()) return invalidArgument(name + ": header is not a JSON object");

  const std::span<const std::byte> data = bytes.subspan(8 + header_len);
  std::map<std::string, TensorView> tensors;
  struct Range {
    uint64_t begin, end;
    const std::string* tensor;
  };
  std::vector<Range> ranges;
  for (const auto& [key, entry] : header.items()) {
    if (key == "__metadata__") continue;
    const std::string where = name + ": tensor " + key;
    if (!entry.is_object()) return invalidArgument(where + ": entry is not an object");
    auto dtype_it = entry.find("dtype");
    auto shape_it = entry.find("shape");
    auto offsets_it = entry.find("data_offsets");
    if (dtype_it == entry.end() || !dtype_it->is_string())
      return invalidArgument(where + ": missing or non-string \"dtype\"");
    if (shape_it == entry.end() || !shape_it->is_array())
      return invalidArgument(where + ": missing or non-array \"shape\"");
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2)
      return invalidArgument(where + ": \"data_offsets\" must be [begin, end]");

    TensorView view;
    view.name = key;
    view.file = name;
    const std::string dtype_name = dtype_it->get<std::string>();
    auto dtype = dtypeFromSafetensors(dtype_name);
    if (!dtype)
      return invalidArgument(where + ": unknown or unsupported dtype \"" + dtype_name +
                             "\" (supported: BF16, F16, F32)");
    view.dtype = *dtype;

    uint64_t numel = 1;
    for (const auto& d : *shape_it) {
      if (!d.is_number_unsigned())
        return invalidArgument(where + ": shape has a non-integer or negative dimension");
      uint64_t dim = d.get<uint64_t>();
      if (dim > uint64_t(std::numeric_limits<int64_t>::max()) ||
          (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / dim))
        return invalidArgument(where + ": shape overflows");
      numel *= dim;
      view.shape.push_back(int64_t(dim));
    }
    const auto& b = (*offsets_it)[0];
    const auto& e = (*offsets_it)[1];
    if (!b.is_number_unsigned() || !e.is_number_unsigned())
      return invalidArgument(where + ": data_offsets must be non-negative integers");
    uint64_t begin = b.get<uint64_t>(), end = e.get<uint64_t>();
    if (begin > end)
      return invalidArgument(where + ": data_offsets begin " + std::to_string(begin) +
                             " is after end " + std::to_string(end));
    if (end > data.size())
      return invalidArgument(where + ": data_offsets [" + std::to_string(begin) + "," +
                             std::to_string(end) + "] lie outside the file's " +
                             std::to_string(data.size()) + " data bytes");
    const uint64_t elem = dtypeSize(view.dtype);
    if (numel > std::numeric_limits<uint64_t>::max() / elem || numel * elem != end - begin)
      return invalidArgument(where + ": shape " + view.shapeString() + " of " + dtype_name +
                             " needs " + std::to_string(numel * elem) +
                             " bytes, data_offsets give " + std::to_string(end - begin));
    view.data = data.subspan(begin, end - begin);
    auto [it, inserted] = tensors.emplace(key, std::move(view));
    ranges.push_back({begin, end, &it->first});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  // Sorted by start, a range overlaps an earlier one exactly when it starts before the furthest
  // end seen so far. Empty tensors occupy no bytes and cannot overlap.
  const Range* furthest = nullptr;
  for (const Range& cur : ranges) {
    if (cur.begin == cur.end) continue;
    if (furthest != nullptr && cur.begin < furthest->end) {
      return invalidArgument(name + ": tensors " + *furthest->tensor + " and " + *cur.tensor +
                             " overlap (bytes " + std::to_string(cur.begin) + ".." +
                             std::to_string(std::min(furthest->end, cur.end)) + ")");
    }
    if (furthest == nullptr || cur.end > furthest->end) furthest = &cur;
  }
  return tensors;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  BULKHEAD_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::open(path));
  SafetensorsFile file;
  file.file_ = std::move(mapped);
  BULKHEAD_ASSIGN_OR_RETURN(file.tensors_, parseSafetensors(file.file_.bytes(), path));
  return file;
}

}  // namespace bulkhead
