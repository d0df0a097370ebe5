// readOptionFile, and readSecretFile: the mode check, then the one line.
#include "shared/secret_file.h"

#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <sstream>

namespace bulkhead {

Result<std::string> readOptionFile(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return invalidArgument(flag + " " + path + ": cannot read");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

Result<std::string> readSecretFile(const std::string& path, const std::string& flag) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return invalidArgument(flag + " " + path + ": cannot stat");
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", unsigned(st.st_mode & 07777));
    return invalidArgument(flag + " " + path + ": readable or writable by others (mode " + mode +
                           "); chmod 600 it");
  }
  BULKHEAD_ASSIGN_OR_RETURN(std::string token, readOptionFile(path, flag));
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  if (token.empty()) return invalidArgument(flag + " " + path + ": empty");
  if (token.find_first_of(" \t\r\n") != std::string::npos)
    return invalidArgument(flag + " " + path + ": a token is one line without spaces");
  return token;
}

}  // namespace bulkhead
