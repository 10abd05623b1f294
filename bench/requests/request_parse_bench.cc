// Microseconds to parse one decode Step as the service receives it, against protobuf's own parse
// of the same bytes (the anchor, which checks less: no field names in its errors, unknown fields
// and known ones of the wrong wire type kept alike):
//   BM_ParseMessageStep   ParseMessage (server/requests/wire_message.h) of a StepRequest
//   BM_ProtobufStep       StepRequest::ParseFromArray of the same bytes
//   BM_WalkedStep         ParseMessage of the same Step with one unknown field in each entry,
//                         which sends it through the walk as well
// The Step: 8 entries by reference (session id, q, k and v with dtype, shape and a TensorRef each,
// and o_ref), as attn_bench --mode=decode --shm sends for 8 sessions x 32 query heads, D 128.
// Each parse goes into a message on a fresh arena whose first block is on the stack, as a
// StepStream message's (SessionService::StepMessages).
#include <string>
#include <utility>

#include "attention/v1/attention.pb.h"
#include "benchmark/benchmark.h"
#include "google/protobuf/arena.h"
#include "server/requests/wire_message.h"

namespace attention::server {
namespace {

std::string StepBytes(bool with_unknown_fields) {
  v1::StepRequest step;
  step.set_request_id("step-000123");
  step.set_causal(true);
  for (int i = 0; i < 8; ++i) {
    v1::StepEntry* entry = step.add_entries();
    entry->set_session_id("session-" + std::to_string(i) + "-3f2a9c41d07e");
    // q [32, 1, 128], the new K and V rows [8, 1, 128], bfloat16.
    for (auto [t, heads] : {std::pair{entry->mutable_q(), 32}, std::pair{entry->mutable_k(), 8},
                            std::pair{entry->mutable_v(), 8}}) {
      t->set_dtype(v1::DTYPE_BFLOAT16);
      for (int d : {heads, 1, 128}) t->add_shape(d);
      v1::TensorRef* ref = t->mutable_ref();
      ref->set_region("attn-bench-7f3e");
      ref->set_offset(65536 * (3 * i + 1));
      ref->set_byte_size(int64_t{2} * heads * 128);
    }
    v1::TensorRef* o = entry->mutable_o_ref();
    o->set_region("attn-bench-7f3e");
    o->set_offset(65536 * (3 * 8 + i));
    o->set_byte_size(32 * 128 * 2);
    // Field 99 as a varint: unknown to StepEntry.
    if (with_unknown_fields) entry->GetReflection()->MutableUnknownFields(entry)->AddVarint(99, 7);
  }
  return step.SerializeAsString();
}

template <typename Parse>
void RunParses(benchmark::State& state, const std::string& bytes, Parse parse) {
  for (auto _ : state) {
    alignas(8) char first_block[8192];
    google::protobuf::ArenaOptions options;
    options.initial_block = first_block;
    options.initial_block_size = sizeof(first_block);
    google::protobuf::Arena arena(options);
    auto* step = google::protobuf::Arena::CreateMessage<v1::StepRequest>(&arena);
    if (!parse(step)) state.SkipWithError("the Step did not parse");
    benchmark::DoNotOptimize(step);
  }
  state.counters["bytes"] = static_cast<double>(bytes.size());
}

void BM_ParseMessageStep(benchmark::State& state) {
  const std::string bytes = StepBytes(false);
  const WireBytes wire({bytes});
  RunParses(state, bytes, [&](v1::StepRequest* step) { return ParseMessage(wire, step).ok(); });
}
BENCHMARK(BM_ParseMessageStep);

void BM_ProtobufStep(benchmark::State& state) {
  const std::string bytes = StepBytes(false);
  RunParses(state, bytes, [&](v1::StepRequest* step) {
    return step->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
  });
}
BENCHMARK(BM_ProtobufStep);

void BM_WalkedStep(benchmark::State& state) {
  const std::string bytes = StepBytes(true);
  const WireBytes wire({bytes});
  RunParses(state, bytes, [&](v1::StepRequest* step) { return ParseMessage(wire, step).ok(); });
}
BENCHMARK(BM_WalkedStep);

}  // namespace
}  // namespace attention::server

BENCHMARK_MAIN();
