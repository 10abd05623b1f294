#include "server/requests/tensor_refs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

absl::Status SharedMemoryOff(absl::string_view field) {
  return absl::FailedPreconditionError(
      absl::StrCat(field,
                   ": tensors in shared memory are off on this server (start it with "
                   "--allow_shared_memory)"));
}

}  // namespace

absl::StatusOr<const char*> TensorData(absl::string_view name, const v1::Tensor& t,
                                       int64_t alignment, TensorRefResolver* refs) {
  if (!t.has_ref()) return t.data().data();
  const std::string field = absl::StrCat(name, ".ref");
  if (refs == nullptr) return SharedMemoryOff(field);
  absl::StatusOr<char*> data = refs->Resolve(field, t.ref(), alignment);
  if (!data.ok()) return data.status();
  return *data;
}

absl::StatusOr<char*> OutputRef(absl::string_view field, const v1::TensorRef& ref, int64_t bytes,
                                int64_t alignment, TensorRefResolver* refs) {
  if (ref.byte_size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".byte_size: expected ", bytes,
                                                   " bytes (the output's size), got ",
                                                   ref.byte_size()));
  }
  if (refs == nullptr) return SharedMemoryOff(field);
  return refs->Resolve(field, ref, alignment);
}

absl::Status CheckOutputsApart(const std::vector<ByteSpan>& outputs,
                               const std::vector<ByteSpan>& inputs) {
  // Spans by address; of two that overlap, the one visited second begins before the first ends,
  // so it overlaps the span of the furthest end seen so far among the first's kind.
  struct Entry {
    const ByteSpan* span;
    bool output;
    size_t order;  // among outputs: which to name first
  };
  std::vector<Entry> entries;
  entries.reserve(outputs.size() + inputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) entries.push_back({&outputs[i], true, i});
  for (const ByteSpan& in : inputs) entries.push_back({&in, false, 0});
  std::erase_if(entries,
                [](const Entry& e) { return e.span->begin == nullptr || e.span->bytes <= 0; });
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.span->begin < b.span->begin; });
  const Entry* furthest_output = nullptr;
  const Entry* furthest_input = nullptr;
  auto end = [](const Entry* e) { return e->span->begin + e->span->bytes; };
  auto reaches = [&](const Entry* e, const Entry& next) {
    return e != nullptr && end(e) > next.span->begin;
  };
  auto input_overlap = [](const ByteSpan& out, const ByteSpan& in) {
    return absl::InvalidArgumentError(absl::StrCat(
        out.field, ": expected bytes apart from every input's, got bytes that overlap ", in.field,
        "'s"));
  };
  for (const Entry& e : entries) {
    if (reaches(furthest_output, e)) {
      if (!e.output) return input_overlap(*furthest_output->span, *e.span);
      const bool e_later = e.order > furthest_output->order;
      const ByteSpan& later = e_later ? *e.span : *furthest_output->span;
      const ByteSpan& earlier = e_later ? *furthest_output->span : *e.span;
      return absl::InvalidArgumentError(
          absl::StrCat(later.field,
                       ": expected bytes apart from every other output's, got bytes "
                       "that overlap ",
                       earlier.field, "'s"));
    }
    if (e.output && reaches(furthest_input, e))
      return input_overlap(*e.span, *furthest_input->span);
    const Entry*& furthest = e.output ? furthest_output : furthest_input;
    if (furthest == nullptr || end(&e) > end(furthest)) furthest = &e;
  }
  return absl::OkStatus();
}

}  // namespace attention::server
