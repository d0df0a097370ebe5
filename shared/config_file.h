// The options of broker and worker from a TOML file too (CLI11's config support): every flag is a
// key of the same name without its dashes, flags on the command line win over the file, and
// --print-config prints the effective options (defaults included) as a file that reads back the
// same; a key that is no option is an error. Header-only: used by the executables, which link
// CLI11.
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace bulkhead {

class ConfigFile {
 public:
  // Before any option is added: defaults are captured, so --print-config can show them.
  explicit ConfigFile(CLI::App& app) { app.option_defaults()->always_capture_default(); }
  // After every option: --config FILE and --print-config.
  void addOptions(CLI::App& app) {
    app.set_config("--config", "", "TOML file of options, one key per flag");
    // A key that names no option (a typo) is an error, not a setting silently left out.
    app.allow_config_extras(CLI::config_extras_mode::error);
    app.add_flag("--print-config", print_, "Print the effective options as TOML and exit")
        ->configurable(false);
  }
  // A repeatable option of strings. CLI11 prints an empty list as `KEY="[]"`, which it reads back
  // as the string "[]" (and `KEY=[]` not at all), so printed() writes `KEY=""` instead: one empty
  // string, which parse() drops (as it drops "[]", from files printed before), so a printed file
  // reads back as the empty list it was.
  CLI::Option* addList(CLI::App& app, const std::string& name, std::vector<std::string>& values,
                       const std::string& help) {
    lists_.push_back(&values);
    return app.add_option(name, values, help)->allow_extra_args(false);
  }
  // Parses the command line (and the file it names): the exit code to return with when the
  // program must stop here (a bad flag or key, --help), nothing when it goes on.
  std::optional<int> parse(CLI::App& app, int argc, char** argv) {
    try {
      app.parse(argc, argv);
      for (std::vector<std::string>* list : lists_)
        std::erase_if(*list, [](const std::string& v) { return v.empty() || v == "[]"; });
    } catch (const CLI::ConfigError& e) {
      // CLI11 says "INI was not able to parse KEY" of a key that is no option.
      const std::string what = e.what(), prefix = "INI was not able to parse ";
      if (what.rfind(prefix, 0) != 0) return app.exit(e);
      std::cerr << "--config: \"" << what.substr(prefix.size()) << "\" is no option of "
                << std::filesystem::path(app.get_name()).filename().string()
                << " (see --help; keys are the flags without their dashes)\n";
      return e.get_exit_code();
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    return std::nullopt;
  }
  // After parsing: prints the options when asked; true then (the program exits).
  bool printed(const CLI::App& app) const {
    if (!print_) return false;
    // An empty list as "" (addList).
    std::string text = app.config_to_str(/*default_also=*/true, /*write_description=*/true);
    for (size_t at = 0; (at = text.find("=\"[]\"\n", at)) != std::string::npos; at += 4)
      text.replace(at, 6, "=\"\"\n");
    std::cout << text;
    return true;
  }

 private:
  bool print_ = false;
  std::vector<std::vector<std::string>*> lists_;
};

}  // namespace bulkhead
