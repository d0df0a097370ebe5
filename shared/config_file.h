// The options of broker and worker from a TOML file too (CLI11's config support): every flag is a
// key of the same name without its dashes, flags on the command line win over the file, and
// --print-config prints the effective options (defaults included) as a file that reads back the
// same. Header-only: used by the executables, which link CLI11.
#pragma once

#include <CLI/CLI.hpp>

#include <iostream>

namespace bulkhead {

class ConfigFile {
 public:
  // Before any option is added: defaults are captured, so --print-config can show them.
  explicit ConfigFile(CLI::App& app) { app.option_defaults()->always_capture_default(); }
  // After every option: --config FILE and --print-config.
  void addOptions(CLI::App& app) {
    app.set_config("--config", "", "TOML file of options, one key per flag");
    app.add_flag("--print-config", print_, "Print the effective options as TOML and exit")
        ->configurable(false);
  }
  // After parsing: prints the options when asked; true then (the program exits).
  bool printed(const CLI::App& app) const {
    if (print_) std::cout << app.config_to_str(/*default_also=*/true, /*write_description=*/true);
    return print_;
  }

 private:
  bool print_ = false;
};

}  // namespace bulkhead
