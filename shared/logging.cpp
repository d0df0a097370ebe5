// configureLogging: the pattern, and a flag for the syslog priority of each level.
#include "shared/logging.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include <spdlog/pattern_formatter.h>
#include <spdlog/spdlog.h>

namespace bulkhead {
namespace {

// %* : the line's syslog priority, "<N>", as sd-daemon(3) prefixes lines for the journal.
class PriorityFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    int priority = 6;  // info
    switch (msg.level) {
      case spdlog::level::trace:
      case spdlog::level::debug:
        priority = 7;
        break;
      case spdlog::level::info:
        priority = 6;
        break;
      case spdlog::level::warn:
        priority = 4;
        break;
      case spdlog::level::err:
        priority = 3;
        break;
      case spdlog::level::critical:
        priority = 2;
        break;
      default:
        break;
    }
    const char text[4] = {'<', char('0' + priority), '>', '\0'};
    dest.append(text, text + 3);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<PriorityFlag>();
  }
};

}  // namespace

bool stdoutIsJournal() {
  const char* stream = std::getenv("JOURNAL_STREAM");
  if (stream == nullptr) return false;
  unsigned long long dev = 0, ino = 0;
  if (std::sscanf(stream, "%llu:%llu", &dev, &ino) != 2) return false;
  struct stat st {};
  return ::fstat(1, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

void configureLogging(const std::string& component, const std::string& level) {
  spdlog::set_level(spdlog::level::from_str(level));
  if (!stdoutIsJournal()) {
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e [" + component + "] %l: %v");
    return;
  }
  // The journal stamps each line itself.
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<PriorityFlag>('*').set_pattern("%*[" + component + "] %l: %v");
  spdlog::set_formatter(std::move(formatter));
}

}  // namespace bulkhead
