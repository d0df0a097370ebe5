// Files that options name: their whole bytes (PEM certificates and keys), and secrets (bearer
// tokens): one line, no spaces, in a file that group and others can neither read nor write, so a
// token is never taken from a file anyone could have seen.
#pragma once

#include <string>

#include "shared/status.h"

namespace bulkhead {

// The bytes of `path`; `flag` names the option in errors.
Result<std::string> readOptionFile(const std::string& path, const std::string& flag);

// The token in `path`, trailing newline removed; `flag` names the option in errors.
Result<std::string> readSecretFile(const std::string& path, const std::string& flag);

}  // namespace bulkhead
