// The command line of the client tools (attn_client, attn_bench): one parser for it and one for
// their --shape flag.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/request_builder.h"

namespace attention::client {

// The tools' exit status for bad flags or inputs (client/README.md).
inline constexpr int kExitUsage = 2;

// --shape=B,H,N,D: four positive integers (batch, query heads, query length, head dim; attn_bench
// --mode=decode reads them as sessions per Step, query heads, new tokens, head dim).
struct Shape {
  int64_t batch = 1;
  int64_t heads = 1;
  int64_t seqlen = 1;
  int64_t head_dim = 1;
};

// absl flag marshalling: "1,8,512,64". A non-integer, a dim < 1 or another count of dims is an
// error naming the offending part.
bool AbslParseFlag(absl::string_view text, Shape* shape, std::string* error);
std::string AbslUnparseFlag(const Shape& shape);

// --kv_heads and --nk, once in `spec` (heads_kv, seqlen_k), must be positive like --shape's dims:
// a negative size would reach the tensors' allocation.
absl::Status CheckKvFlags(const ProblemSpec& spec);

// Parses the command line like absl::ParseCommandLine, with two differences: --help lists the
// flags defined in `flags_file` (the tool's __FILE__; abseil's default looks for a file named
// like the program), and an unknown flag or a bad value exits kExitUsage with the reason, where
// abseil would exit 1 (the tools' code for a failed call).
void ParseToolFlags(int argc, char** argv, absl::string_view usage, absl::string_view flags_file);

}  // namespace attention::client
