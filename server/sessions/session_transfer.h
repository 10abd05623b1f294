// A session moved between servers (Sessions.Export and Import): the order its rows travel in.
// An export sends each layer's rows in order, `chunk_rows` at a time, the layers one after
// another; an import takes chunks only in that order (each continuing the first layer not yet
// whole, at its next row) and is whole once every declared row came. Plain bookkeeping over the
// layers' lengths: the service reads and appends the rows through the store.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"

namespace attention::server {

// Rows [first_row, first_row + rows) of one layer.
struct RowChunk {
  int layer = 0;
  int64_t first_row = 0;
  int64_t rows = 0;
};

// An export's chunks over layers of `lengths` rows, at most `chunk_rows` (> 0) each; empty layers
// have none.
class ExportChunks {
 public:
  ExportChunks(std::vector<int64_t> lengths, int64_t chunk_rows);
  // The next chunk, or none once every row was handed out.
  std::optional<RowChunk> Next();

 private:
  const std::vector<int64_t> lengths_;
  const int64_t chunk_rows_;
  int layer_ = 0;
  int64_t row_ = 0;
};

// An import's progress over layers of the declared `lengths` rows.
class ImportProgress {
 public:
  explicit ImportProgress(std::vector<int64_t> lengths);
  // Takes `chunk` if it continues the stream: INVALID_ARGUMENT naming layer, first_row or the
  // rows (k.shape) with the expected and actual values otherwise (nothing taken).
  absl::Status Take(const RowChunk& chunk);
  // OK once every declared row was taken; else INVALID_ARGUMENT naming the first layer short.
  absl::Status Whole() const;

 private:
  const std::vector<int64_t> lengths_;
  std::vector<int64_t> received_;
  int layer_ = 0;  // the first layer not yet whole
};

}  // namespace attention::server
