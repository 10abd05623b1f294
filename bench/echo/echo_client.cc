// attn_echo_client: the bare round trip of one EchoStream message at a time (write one request,
// read its reply, repeat), on gRPC's callback API (as attn_bench: reactions on gRPC's threads,
// the sender woken by them), its synchronous API (the sending thread blocks in Write and Read
// and polls the connection itself) or, with --api=poll, its async API with the sending thread
// polling its own completion queue without sleeping (client/polled_stream.h). With
// attn_echo_server's --sync and --unix_socket this sets the transport's variants side by side
// (bench/colo/latency.sh); prints one JSON line.
//
//   attn_echo_client --target=unix:/tmp/echo.sock --api=sync --q_bytes=131072 --kv_bytes=131072
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/synchronization/mutex.h"
#include "bench/echo/echo.grpc.pb.h"
#include "client/polled_stream.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50061", "The attn_echo_server (host:port or unix:PATH).");
ABSL_FLAG(std::string, api, "callback",
          "callback | sync | poll: the client API of the stream (poll: the async API, the sending "
          "thread polling its completion queue without sleeping; client/polled_stream.h).");
ABSL_FLAG(int64_t, q_bytes, 131072, "Bytes of q in each request (the reply carries as many).");
ABSL_FLAG(int64_t, kv_bytes, 131072, "Bytes of each of k and v in each request.");
ABSL_FLAG(double, warmup_s, 0.5, "Round trips before the measurement, seconds.");
ABSL_FLAG(double, duration_s, 3, "Measured round trips, seconds.");

namespace attention::bench {
namespace {

using Clock = std::chrono::steady_clock;

// One message at a time on a callback stream: the reactions run on gRPC's threads and wake the
// sender, as attn_bench's stream slots do.
class CallbackStream final : public grpc::ClientBidiReactor<EchoRequest, EchoReply> {
 public:
  explicit CallbackStream(Echo::Stub* stub) {
    stub->async()->EchoStream(&context_, this);
    StartCall();
  }
  // One round trip; false when the stream broke.
  bool RoundTrip(const EchoRequest& request) {
    std::unique_lock<std::mutex> lock(mu_);
    pending_ = 2;
    ok_ = true;
    StartRead(&reply_);
    StartWrite(&request);
    done_.wait(lock, [this] { return pending_ == 0; });
    return ok_;
  }
  void Close() {
    StartWritesDone();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return finished_; });
  }

 private:
  void Completed(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    ok_ = ok_ && ok;
    if (--pending_ == 0) done_.notify_one();
  }
  void OnWriteDone(bool ok) override { Completed(ok); }
  void OnReadDone(bool ok) override { Completed(ok); }
  void OnDone(const grpc::Status& /*status*/) override {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    done_.notify_one();
  }

  grpc::ClientContext context_;
  EchoReply reply_;
  std::mutex mu_;
  std::condition_variable done_;
  int pending_ = 0;
  bool ok_ = true;
  bool finished_ = false;
};

int Run() {
  const std::string api = absl::GetFlag(FLAGS_api);
  if (api != "callback" && api != "sync" && api != "poll") {
    std::fprintf(stderr, "attn_echo_client: --api must be callback, sync or poll, got %s\n",
                 api.c_str());
    return 2;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(absl::GetFlag(FLAGS_target),
                                           grpc::InsecureChannelCredentials(), args);
  std::unique_ptr<Echo::Stub> stub = Echo::NewStub(channel);
  EchoRequest request;
  request.set_q(std::string(absl::GetFlag(FLAGS_q_bytes), 'q'));
  request.set_k(std::string(absl::GetFlag(FLAGS_kv_bytes), 'k'));
  request.set_v(std::string(absl::GetFlag(FLAGS_kv_bytes), 'v'));

  std::unique_ptr<CallbackStream> callback;
  grpc::ClientContext sync_context;
  std::unique_ptr<grpc::ClientReaderWriter<EchoRequest, EchoReply>> sync;
  std::unique_ptr<client::PolledStream<EchoRequest, EchoReply>> polled;
  EchoReply reply;
  if (api == "callback") {
    callback = std::make_unique<CallbackStream>(stub.get());
  } else if (api == "poll") {
    polled = client::PolledStream<EchoRequest, EchoReply>::Start(
        [&](grpc::ClientContext* c, grpc::CompletionQueue* cq) {
          return stub->PrepareAsyncEchoStream(c, cq);
        },
        &sync_context);
  } else {
    sync = stub->EchoStream(&sync_context);
  }
  auto round_trip = [&] {
    if (callback) return callback->RoundTrip(request);
    if (polled) return polled->Write(request) && polled->Read(&reply);
    return sync->Write(request) && sync->Read(&reply);
  };
  const auto seconds = [](double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  const Clock::time_point measure_from = Clock::now() + seconds(absl::GetFlag(FLAGS_warmup_s));
  const Clock::time_point end = measure_from + seconds(absl::GetFlag(FLAGS_duration_s));
  std::vector<double> us;
  for (Clock::time_point t = Clock::now(); t < end; t = Clock::now()) {
    if (!round_trip()) {
      std::fprintf(stderr, "attn_echo_client: the stream to %s broke\n",
                   absl::GetFlag(FLAGS_target).c_str());
      return 1;
    }
    if (t >= measure_from) {
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t).count());
    }
  }
  if (callback) {
    callback->Close();
  } else if (polled) {
    polled->WritesDone();
    polled->Finish().ok();
  } else {
    sync->WritesDone();
    sync->Finish().ok();  // the server ends the stream OK once the client half-closes
  }
  if (us.empty()) return 1;
  std::sort(us.begin(), us.end());
  const auto at = [&us](double p) { return us[static_cast<size_t>(p * (us.size() - 1))]; };
  std::printf(
      "{\"target\": \"%s\", \"api\": \"%s\", \"q_bytes\": %lld, \"kv_bytes\": %lld, "
      "\"round_trips\": %zu, \"p50_us\": %.1f, \"p90_us\": %.1f, \"p99_us\": %.1f}\n",
      absl::GetFlag(FLAGS_target).c_str(), api.c_str(),
      static_cast<long long>(absl::GetFlag(FLAGS_q_bytes)),
      static_cast<long long>(absl::GetFlag(FLAGS_kv_bytes)), us.size(), at(0.5), at(0.9), at(0.99));
  return 0;
}

}  // namespace
}  // namespace attention::bench

int main(int argc, char** argv) {
  // Lock-order checks off, as in attention_server (server/main.cc says why).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "Round trips of one EchoStream message at a time (attn_echo_server).");
  const auto own_flags = [](absl::string_view file) { return file == __FILE__; };
  absl::SetFlagsUsageConfig(
      {.contains_helpshort_flags = own_flags, .contains_help_flags = own_flags});
  absl::ParseCommandLine(argc, argv);
  return attention::bench::Run();
}
