// configureLogging: the pattern, a flag for the syslog priority of each level, and the journal
// sink with its structured fields (libsystemd's sd_journal_sendv).
#include "shared/logging.h"

#include <sys/stat.h>
#include <sys/uio.h>
#include <systemd/sd-journal.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace bulkhead {
namespace {

std::mutex process_fields_mu;
LogFields process_fields;
thread_local LogFields thread_fields;

void overlay(LogFields& base, const LogFields& top) {
  if (top.request_id) base.request_id = top.request_id;
  if (top.worker) base.worker = top.worker;
  if (top.incarnation) base.incarnation = top.incarnation;
}

int syslogPriority(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace:
    case spdlog::level::debug:
      return 7;
    case spdlog::level::warn:
      return 4;
    case spdlog::level::err:
      return 3;
    case spdlog::level::critical:
      return 2;
    default:
      return 6;  // info
  }
}

// %* : the line's syslog priority, "<N>", as sd-daemon(3) prefixes lines for the journal.
class PriorityFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const int priority = syslogPriority(msg.level);
    const char text[4] = {'<', char('0' + priority), '>', '\0'};
    dest.append(text, text + 3);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<PriorityFlag>();
  }
};

// Entries straight to the journal, with their fields; a line on stdout (with its priority prefix,
// which journald reads from the stream) when the journal's socket takes nothing.
class JournalSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit JournalSink(std::unique_ptr<spdlog::formatter> fallback_format)
      : fallback_(std::make_shared<spdlog::sinks::stdout_sink_mt>()) {
    fallback_->set_formatter(std::move(fallback_format));
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    const std::vector<std::string> entry =
        journalEntry(std::string_view(msg.payload.data(), msg.payload.size()),
                     syslogPriority(msg.level), currentLogFields());
    std::vector<iovec> parts(entry.size());
    for (size_t i = 0; i < entry.size(); ++i)
      parts[i] = {const_cast<char*>(entry[i].data()), entry[i].size()};
    if (sd_journal_sendv(parts.data(), int(parts.size())) < 0) {
      fallback_->log(msg);
      fallback_->flush();  // a line at a time, as the stream journald reads expects
    }
  }
  void flush_() override { fallback_->flush(); }

 private:
  std::shared_ptr<spdlog::sinks::stdout_sink_mt> fallback_;
};

}  // namespace

void setProcessLogFields(const LogFields& fields) {
  std::lock_guard lock(process_fields_mu);
  process_fields = fields;
}

void setThreadLogFields(const LogFields& fields) {
  thread_fields = fields;
}

ScopedLogFields::ScopedLogFields(const LogFields& fields) : saved_(thread_fields) {
  overlay(thread_fields, fields);
}

ScopedLogFields::~ScopedLogFields() {
  thread_fields = saved_;
}

LogFields currentLogFields() {
  LogFields fields;
  {
    std::lock_guard lock(process_fields_mu);
    fields = process_fields;
  }
  overlay(fields, thread_fields);
  return fields;
}

std::vector<std::string> journalEntry(std::string_view message, int priority,
                                      const LogFields& fields) {
  std::vector<std::string> entry = {"MESSAGE=" + std::string(message),
                                    "PRIORITY=" + std::to_string(priority)};
  if (fields.request_id) entry.push_back("BULKHEAD_REQUEST_ID=" + *fields.request_id);
  if (fields.worker) entry.push_back("BULKHEAD_WORKER=" + *fields.worker);
  if (fields.incarnation) {
    char hex[40];
    std::snprintf(hex, sizeof(hex), "BULKHEAD_INCARNATION=%016" PRIx64, *fields.incarnation);
    entry.emplace_back(hex);
  }
  return entry;
}

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
  // The journal stamps each entry itself. Its native socket takes entries with fields; when it
  // is not there (libsystemd then drops entries silently), lines with their priority prefix go
  // to the stream.
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<PriorityFlag>('*').set_pattern("%*[" + component + "] %l: %v");
  if (::access("/run/systemd/journal/socket", W_OK) != 0) {
    spdlog::set_formatter(std::move(formatter));
    return;
  }
  spdlog::default_logger()->sinks() = {std::make_shared<JournalSink>(std::move(formatter))};
}

}  // namespace bulkhead
