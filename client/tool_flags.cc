#include "client/tool_flags.h"

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace attention::client {
namespace {

// abseil's own flags that act while it parses (they read files or the environment, or print
// help); checking them here would apply them twice, and the help ones are not in the registry.
bool IsAbseilBuiltin(absl::string_view name) {
  for (absl::string_view builtin :
       {"flagfile", "fromenv", "tryfromenv", "undefok", "help", "helpfull", "helpshort",
        "helppackage", "helpon", "helpmatch", "version", "only_check_args"}) {
    if (name == builtin) return true;
  }
  return false;
}

// The command line's flags must exist and their values parse. absl::ParseCommandLine would exit
// 1 on either, so they are checked first, with the flags' own parsers, in abseil's syntax:
// -name or --name, =value or the next argument (not for bools), --noname for a false bool,
// "--" ends the flags.
absl::Status CheckCommandLine(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "-") || arg.empty()) continue;  // a positional argument
    absl::ConsumePrefix(&arg, "-");
    const std::vector<absl::string_view> parts = absl::StrSplit(arg, absl::MaxSplits('=', 1));
    absl::string_view name = parts[0];
    std::optional<absl::string_view> value;
    if (parts.size() == 2) value = parts[1];
    if (IsAbseilBuiltin(name)) continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && !value && absl::ConsumePrefix(&name, "no")) {
      flag = absl::FindCommandLineFlag(name);
      if (flag != nullptr && flag->IsOfType<bool>()) value = "false";
    }
    if (flag == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", arg));
    if (!value) {
      if (flag->IsOfType<bool>()) continue;
      if (i + 1 == argc) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = argv[++i];
    }
    std::string error;
    if (!flag->ParseFrom(*value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, "=", *value, ": ", error));
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool AbslParseFlag(absl::string_view text, Shape* shape, std::string* error) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ',');
  if (parts.size() != 4) {
    *error = absl::StrCat("expected B,H,N,D (four positive integers), got ", parts.size(),
                          parts.size() == 1 ? " value" : " values");
    return false;
  }
  int64_t* dims[] = {&shape->batch, &shape->heads, &shape->seqlen, &shape->head_dim};
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!absl::SimpleAtoi(parts[i], dims[i]) || *dims[i] < 1) {
      *error = absl::StrCat("'", parts[i], "' is not a positive integer (B,H,N,D)");
      return false;
    }
  }
  return true;
}

std::string AbslUnparseFlag(const Shape& shape) {
  return absl::StrJoin({shape.batch, shape.heads, shape.seqlen, shape.head_dim}, ",");
}

absl::Status CheckKvFlags(const ProblemSpec& spec) {
  if (spec.heads_kv < 1 || spec.seqlen_k < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_heads and --nk must be positive, got ",
                                                   spec.heads_kv, " and ", spec.seqlen_k));
  }
  return absl::OkStatus();
}

void ParseToolFlags(int argc, char** argv, absl::string_view usage, absl::string_view flags_file) {
  absl::SetProgramUsageMessage(usage);
  // With the build's -fmacro-prefix-map, flag file names are paths in the source tree, as
  // `flags_file` is.
  const std::string file(flags_file);
  const auto own_flags = [file](absl::string_view name) { return name == file; };
  absl::SetFlagsUsageConfig(
      {.contains_helpshort_flags = own_flags, .contains_help_flags = own_flags});
  if (absl::Status status = CheckCommandLine(argc, argv); !status.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], std::string(status.message()).c_str());
    std::exit(kExitUsage);
  }
  absl::ParseCommandLine(argc, argv);
}

}  // namespace attention::client
