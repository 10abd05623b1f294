#include "server/sessions/session_transfer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attention::server {

ExportChunks::ExportChunks(std::vector<int64_t> lengths, int64_t chunk_rows)
    : lengths_(std::move(lengths)), chunk_rows_(chunk_rows) {}

std::optional<RowChunk> ExportChunks::Next() {
  while (layer_ < static_cast<int>(lengths_.size()) && row_ >= lengths_[layer_]) {
    ++layer_;
    row_ = 0;
  }
  if (layer_ == static_cast<int>(lengths_.size())) return std::nullopt;
  const RowChunk chunk{
      .layer = layer_, .first_row = row_, .rows = std::min(chunk_rows_, lengths_[layer_] - row_)};
  row_ += chunk.rows;
  return chunk;
}

ImportProgress::ImportProgress(std::vector<int64_t> lengths)
    : lengths_(std::move(lengths)), received_(lengths_.size(), 0) {
  while (layer_ < static_cast<int>(lengths_.size()) && lengths_[layer_] == 0) ++layer_;
}

absl::Status ImportProgress::Take(const RowChunk& chunk) {
  const int layers = static_cast<int>(lengths_.size());
  if (chunk.layer < 0 || chunk.layer >= layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer: expected 0..", layers - 1,
                                                   " (the header's layers), got ", chunk.layer));
  }
  if (chunk.layer != layer_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer: expected ",
        layer_ == layers ? std::string("none (every declared row came)") : absl::StrCat(layer_),
        " (layers in order, each whole before the next), got ", chunk.layer));
  }
  if (chunk.first_row != received_[layer_]) {
    return absl::InvalidArgumentError(absl::StrCat("first_row: expected ", received_[layer_],
                                                   " (layer ", layer_, "'s rows in order), got ",
                                                   chunk.first_row));
  }
  const int64_t left = lengths_[layer_] - received_[layer_];
  if (chunk.rows < 1 || chunk.rows > left) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k.shape: expected 1..", left, " rows (layer ", layer_, " declares ", lengths_[layer_],
        " in header.layer_lengths, ", received_[layer_], " came), got ", chunk.rows));
  }
  received_[layer_] += chunk.rows;
  while (layer_ < layers && received_[layer_] == lengths_[layer_]) ++layer_;
  return absl::OkStatus();
}

absl::Status ImportProgress::Whole() const {
  if (layer_ == static_cast<int>(lengths_.size())) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("stream: expected every declared row before the end, got ", received_[layer_],
                   " of layer ", layer_, "'s ", lengths_[layer_], " rows (header.layer_lengths)"));
}

}  // namespace attention::server
