// How broker and worker log (spdlog's default logger): on stdout with a timestamp, on a terminal
// or in a file; straight to the journal when systemd started the process (JOURNAL_STREAM names
// the stream stdout is, and the journal's socket is there), as entries with their priority and
// structured fields: which request
// (BULKHEAD_REQUEST_ID), which worker (BULKHEAD_WORKER, its socket or "spawned") and which
// incarnation of it (BULKHEAD_INCARNATION) a line is about, so `journalctl
// BULKHEAD_REQUEST_ID=...` finds a request's lines across restarts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace bulkhead {

// The fields a log line is about; unset ones are left out.
struct LogFields {
  std::optional<std::string> request_id = {};
  std::optional<std::string> worker = {};
  std::optional<uint64_t> incarnation = {};
};

// Fields every line of this process carries (a worker: its socket and incarnation).
void setProcessLogFields(const LogFields& fields);
// Fields every line of this thread carries, over the process's, until replaced (the scheduler
// thread: the worker it drives).
void setThreadLogFields(const LogFields& fields);
// Fields for the lines of a scope on this thread, over the thread's.
class ScopedLogFields {
 public:
  explicit ScopedLogFields(const LogFields& fields);
  ~ScopedLogFields();
  ScopedLogFields(const ScopedLogFields&) = delete;
  ScopedLogFields& operator=(const ScopedLogFields&) = delete;

 private:
  LogFields saved_;
};
// The fields a line logged now on this thread carries: process, then thread, then scopes.
LogFields currentLogFields();

// `component` names the process in every line ("broker", "worker %P"; spdlog flags allowed).
void configureLogging(const std::string& component, const std::string& level);

// One journal entry's fields, "NAME=value" each: MESSAGE, PRIORITY (syslog, 2 to 7) and the
// BULKHEAD_* fields that are set.
std::vector<std::string> journalEntry(std::string_view message, int priority,
                                      const LogFields& fields);

// Whether stdout is the stream $JOURNAL_STREAM names.
bool stdoutIsJournal();

}  // namespace bulkhead
