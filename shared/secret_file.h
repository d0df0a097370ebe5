// Secrets kept in files (bearer tokens): one line, no spaces, and a file that group and others
// can neither read nor write, so a token is never taken from a file anyone could have seen.
#pragma once

#include <string>

#include "shared/status.h"

namespace bulkhead {

// The token in `path`, trailing newline removed; `flag` names the option in errors.
Result<std::string> readSecretFile(const std::string& path, const std::string& flag);

}  // namespace bulkhead
