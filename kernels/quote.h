// Quoting a string a client sent (a session id, a request id) inside a Status message. A client
// may send megabytes of arbitrary bytes; echoed whole, the message would exceed the client's
// metadata limit (it would see RESOURCE_EXHAUSTED instead of the real error), and non-UTF-8 bytes
// would make it unreadable. So at most kQuotedPrefixBytes are quoted, escaped, with the length:
//   Quote("abc")              -> 'abc'
//   Quote(1 MiB of "x")       -> 'xx...x...' (1048576 bytes), 64 x quoted
//   Quote("a\xff\n")          -> 'a\xff\n'
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attention {

inline constexpr size_t kQuotedPrefixBytes = 64;

inline std::string Quote(absl::string_view s) {
  if (s.size() <= kQuotedPrefixBytes) return absl::StrCat("'", absl::CHexEscape(s), "'");
  return absl::StrCat("'", absl::CHexEscape(s.substr(0, kQuotedPrefixBytes)), "...' (", s.size(),
                      " bytes)");
}

}  // namespace attention
