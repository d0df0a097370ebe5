// How broker and worker format their logs (spdlog's default logger, on stdout): with a timestamp
// on a terminal or in a file; for the journal (systemd's JOURNAL_STREAM names the stream stdout
// is), without one and with the syslog priority prefix ("<3>") journald reads each line's level
// from.
#pragma once

#include <string>

namespace bulkhead {

// `component` names the process in every line ("broker", "worker %P"; spdlog flags allowed).
void configureLogging(const std::string& component, const std::string& level);

// Whether stdout is the stream $JOURNAL_STREAM names.
bool stdoutIsJournal();

}  // namespace bulkhead
