// ChunkCoverage: which bytes of one tensor of an AttendChunked call have come (attend_chunked.cc).
#ifndef ATTENTION_SERVER_SERVICE_CHUNK_COVERAGE_H_
#define ATTENTION_SERVER_SERVICE_CHUNK_COVERAGE_H_

#include <cstdint>
#include <iterator>
#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attention::server {

// The byte ranges of one tensor received so far, none overlapping, none adjacent: ranges that
// touch are merged, so there is one per stretch of received bytes whatever the chunk size.
class ChunkCoverage {
 public:
  // Adds [begin, begin + size); an error naming `name` when it overlaps what came before.
  absl::Status Add(absl::string_view name, int64_t begin, int64_t size) {
    int64_t end = begin + size;
    auto next = ranges_.upper_bound(begin);
    if (next != ranges_.end() && next->first < end) return Overlap(name, begin, end, *next);
    if (next != ranges_.begin()) {
      auto prev = std::prev(next);
      if (prev->second > begin) return Overlap(name, begin, end, *prev);
      if (prev->second == begin) {  // extends prev
        begin = prev->first;
        ranges_.erase(prev);
      }
    }
    if (next != ranges_.end() && next->first == end) {  // runs into next
      end = next->second;
      ranges_.erase(next);
    }
    ranges_.emplace(begin, end);
    received_ += size;
    return absl::OkStatus();
  }
  int64_t received() const { return received_; }
  // Stretches of received bytes kept: one more than the gaps between them at most.
  size_t ranges() const { return ranges_.size(); }

 private:
  static absl::Status Overlap(absl::string_view name, int64_t begin, int64_t end,
                              const std::pair<const int64_t, int64_t>& old) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk of ", name, ": bytes [", begin, ", ", end, ") overlap bytes [", old.first, ", ",
        old.second, ") already received (each byte comes exactly once)"));
  }

  std::map<int64_t, int64_t> ranges_;  // begin -> end
  int64_t received_ = 0;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SERVICE_CHUNK_COVERAGE_H_
