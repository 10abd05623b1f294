// The service over real loopback gRPC, in process: one request end to end against the float64
// reference, and the stream's ordering, error, cancellation and drain behaviour with executors
// that copy or block.
#include "server/service/attention_service.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_attention.h"
#include "kernels/reference/reference_attention.h"
#include "server/streams/generic_streams.h"
#include "server/testing/run_gate_for_tests.h"

namespace attention::server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using v1::AttendRequest;
using v1::AttendResponse;

// Writes o = q (same shape), after sleeping seqlen_q * delay; when gated, waits for Release()
// first. Lets the tests see which response belongs to which request, and control the order.
class CopyExecutor final : public Executor {
 public:
  explicit CopyExecutor(absl::Duration delay_per_row, bool gated = false)
      : delay_per_row_(delay_per_row), gate_(/*open=*/!gated) {
    device_.name = "copy";
  }
  void SetFastHeadDims(std::vector<int> dims) { device_.fast_head_dims = std::move(dims); }
  const DeviceDescription& device() const override { return device_; }
  absl::StatusOr<StageTimes> Run(const AttentionParams& p) override {
    gate_.Pass();
    absl::SleepFor(delay_per_row_ * p.seqlen_q);
    const int64_t rows = p.is_varlen() ? p.total_q : p.batch * p.seqlen_q;
    std::memcpy(p.o, p.q, rows * p.heads_q * p.head_dim * DTypeSize(p.dtype));
    return StageTimes{.compute_us = 1};
  }
  void Release() { gate_.Open(); }
  void AwaitStarted(int n) { gate_.AwaitStarted(n); }
  int started() { return gate_.started(); }

 private:
  DeviceDescription device_;
  const absl::Duration delay_per_row_;
  RunGate gate_;
};

// How AttendStream is served (generic_streams.h): gRPC's callback API, or the async API polled.
enum class Transport { kCallback, kPolled };

// A server on a free loopback port with the given executor, and a stub to it.
class TestServer {
 public:
  TestServer(std::unique_ptr<Executor> executor, const SchedulerOptions& scheduler_options,
             const ServiceOptions& service_options = {}, Transport transport = Transport::kCallback)
      : metrics_(BuildInfo{.version = "test", .backend = "cpu", .cuda = "none"}) {
    std::vector<std::unique_ptr<Executor>> executors;
    executors.push_back(std::move(executor));
    scheduler_.emplace(std::move(executors), scheduler_options);
    service_.emplace(service_options, &*scheduler_, &gate_);
    stream_methods_.Add(kAttendStreamPath, service_->AttendStreamMethod());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&*service_);
    std::unique_ptr<grpc::ServerCompletionQueue> queue;
    if (transport == Transport::kPolled) {  // AttendStream
      builder.RegisterAsyncGenericService(&async_streams_);
      queue = builder.AddCompletionQueue();
    } else {
      streams_.emplace(&stream_methods_);
      builder.RegisterCallbackGenericService(&*streams_);
    }
    server_ = builder.BuildAndStart();
    if (queue != nullptr) {
      polled_.emplace(&stream_methods_, &async_streams_, std::move(queue));
      polled_->Start();
    }
    stub_ = v1::Attention::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  ~TestServer() {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
    scheduler_->Shutdown();
    if (polled_.has_value()) polled_->Stop();  // as the server does: after every call's end
  }
  v1::Attention::Stub& stub() { return *stub_; }
  DrainGate& drain() { return drain_; }
  // The request log's lines so far.
  std::vector<std::string> log_lines() {
    std::lock_guard<std::mutex> lock(log_mu_);
    return log_lines_;
  }
  Metrics& metrics() { return metrics_; }

 private:
  Metrics metrics_;
  DrainGate drain_;
  std::mutex log_mu_;
  std::vector<std::string> log_lines_;  // guarded by log_mu_
  CallLog log_{{.sink = [this](const std::string& line) {
    std::lock_guard<std::mutex> lock(log_mu_);
    log_lines_.push_back(line);
  }}};
  const CallGate gate_{&metrics_, &drain_, "", &log_};
  std::optional<Scheduler> scheduler_;
  std::optional<AttentionService> service_;
  StreamMethods stream_methods_;
  std::optional<CallbackStreams> streams_;
  grpc::AsyncGenericService async_streams_;
  std::unique_ptr<grpc::Server> server_;
  std::optional<PolledStreams> polled_;
  std::unique_ptr<v1::Attention::Stub> stub_;
};

std::mt19937& Generator(unsigned* seed_out = nullptr) {
  static const unsigned seed = std::random_device{}();
  static std::mt19937 gen(seed);
  if (seed_out) *seed_out = seed;
  return gen;
}

std::string SeedTrace() {
  unsigned seed = 0;
  Generator(&seed);
  return absl::StrCat("seed ", seed);
}

void SetRandomTensor(v1::Tensor* t, std::vector<int64_t> shape) {
  t->set_dtype(v1::DTYPE_FLOAT32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  std::vector<float> values(n);
  std::normal_distribution<float> normal;
  {
    // One generator for every test thread (the concurrent-stream tests draw from several).
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    for (float& x : values) x = normal(Generator());
  }
  t->set_data(values.data(), values.size() * sizeof(float));
}

// q [1, 2, nq, 4], k and v [1, 2, 3, 4].
AttendRequest SmallRequest(const std::string& id, int64_t nq) {
  AttendRequest r;
  r.set_request_id(id);
  SetRandomTensor(r.mutable_q(), {1, 2, nq, 4});
  SetRandomTensor(r.mutable_k(), {1, 2, 3, 4});
  SetRandomTensor(r.mutable_v(), {1, 2, 3, 4});
  return r;
}

// Polls `condition` until it holds or 10 s pass; true when it held.
bool Eventually(const std::function<bool()>& condition) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!condition()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

double RelativeError(const float* out, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return std::sqrt(diff / norm);
}

TEST(AttentionServiceTest, AttendMatchesTheReference) {
  SCOPED_TRACE(SeedTrace());
  TestServer server(MakeCpuExecutor(1), {.workers = 1, .max_queue = 4});
  AttendRequest request;
  request.set_request_id("ref-1");
  // GQA, causal, lengths that are no tile multiple.
  SetRandomTensor(request.mutable_q(), {2, 4, 37, 64});
  SetRandomTensor(request.mutable_k(), {2, 2, 53, 64});
  SetRandomTensor(request.mutable_v(), {2, 2, 53, 64});
  request.set_causal(true);
  request.set_return_lse(true);
  AttendResponse response;
  grpc::ClientContext context;
  grpc::Status status = server.stub().Attend(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  EXPECT_EQ(response.request_id(), "ref-1");
  EXPECT_EQ(response.device(), "cpu");
  EXPECT_THAT(response.o().shape(), ::testing::ElementsAre(2, 4, 37, 64));
  EXPECT_THAT(response.lse().shape(), ::testing::ElementsAre(2, 4, 37));
  EXPECT_GT(response.timing().compute_us(), 0);
  EXPECT_GE(response.timing().total_us(), response.timing().compute_us());
  EXPECT_GT(response.timing().parse_us(), 0);
  EXPECT_LE(response.timing().parse_us(), response.timing().decode_us());

  // The reference on the same request, decoded locally.
  AttendResponse local;
  absl::StatusOr<DecodedRequest> decoded = DecodeRequest(request, {}, &local);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  std::vector<double> ref_o, ref_lse;
  ASSERT_TRUE(reference::Forward(decoded->params, &ref_o, &ref_lse).ok());
  ASSERT_EQ(response.o().data().size(), ref_o.size() * sizeof(float));
  ASSERT_EQ(response.lse().data().size(), ref_lse.size() * sizeof(float));
  EXPECT_LT(RelativeError(reinterpret_cast<const float*>(response.o().data().data()), ref_o), 1e-5);
  EXPECT_LT(RelativeError(reinterpret_cast<const float*>(response.lse().data().data()), ref_lse),
            1e-5);
}

TEST(AttentionServiceTest, InvalidRequestsGetInvalidArgument) {
  TestServer server(std::make_unique<CopyExecutor>(absl::ZeroDuration()),
                    {.workers = 1, .max_queue = 4});
  AttendRequest request = SmallRequest("bad", 5);
  request.clear_k();
  AttendResponse response;
  grpc::ClientContext context;
  grpc::Status status = server.stub().Attend(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("k: expected a tensor, got none"));
  EXPECT_THAT(server.metrics().Scrape(),
              HasSubstr("attention_requests_total{code=\"INVALID_ARGUMENT\",rpc=\"Attend\"} 1"));
}

// The stream tests run on both transports of AttendStream.
class AttentionStreamTest : public ::testing::TestWithParam<Transport> {};

INSTANTIATE_TEST_SUITE_P(Transports, AttentionStreamTest,
                         ::testing::Values(Transport::kCallback, Transport::kPolled),
                         [](const ::testing::TestParamInfo<Transport>& info) {
                           return info.param == Transport::kPolled ? "Polled" : "Callback";
                         });

TEST_P(AttentionStreamTest, StreamAnswersEveryRequestOutOfOrder) {
  SCOPED_TRACE(SeedTrace());
  // Request i has 8 - i rows and sleeps that many * 20 ms once all eight run: later ones finish
  // first. (Ungated, a slow machine let s0 finish before the others had even arrived.)
  auto owned = std::make_unique<CopyExecutor>(absl::Milliseconds(20), /*gated=*/true);
  CopyExecutor* executor = owned.get();
  TestServer server(std::move(owned), {.workers = 8, .max_queue = 16}, {}, GetParam());
  grpc::ClientContext context;
  auto stream = server.stub().AttendStream(&context);
  std::map<std::string, std::string> sent;  // request_id -> q bytes
  for (int i = 0; i < 8; ++i) {
    AttendRequest request = SmallRequest(absl::StrCat("s", i), 8 - i);
    sent[request.request_id()] = request.q().data();
    ASSERT_TRUE(stream->Write(request));
  }
  stream->WritesDone();
  executor->AwaitStarted(8);
  executor->Release();
  std::vector<std::string> order;
  AttendResponse response;
  while (stream->Read(&response)) {
    order.push_back(response.request_id());
    ASSERT_TRUE(sent.count(response.request_id())) << response.request_id();
    EXPECT_EQ(response.o().data(), sent[response.request_id()]) << response.request_id();
    EXPECT_EQ(response.device(), "copy");
  }
  grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(order.size(), 8u);
  EXPECT_EQ(std::set<std::string>(order.begin(), order.end()).size(), 8u);
  EXPECT_NE(order.front(), "s0");  // s0 is the slowest
}

TEST_P(AttentionStreamTest, ConcurrentStreamsNeverMixResponses) {
  SCOPED_TRACE(SeedTrace());
  TestServer server(std::make_unique<CopyExecutor>(absl::Microseconds(50)),
                    {.workers = 4, .max_queue = 256}, {.stream_window = 4}, GetParam());
  std::vector<std::thread> clients;
  std::vector<int> received(4, 0);
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&, c] {
      grpc::ClientContext context;
      auto stream = server.stub().AttendStream(&context);
      std::map<std::string, std::string> sent;
      for (int i = 0; i < 25; ++i) {
        AttendRequest request = SmallRequest(absl::StrCat("c", c, "-", i), 1 + i % 7);
        sent[request.request_id()] = request.q().data();
        if (!stream->Write(request)) break;
      }
      stream->WritesDone();
      AttendResponse response;
      while (stream->Read(&response)) {
        EXPECT_EQ(response.o().data(), sent[response.request_id()]) << response.request_id();
        ++received[c];
      }
      grpc::Status status = stream->Finish();
      EXPECT_TRUE(status.ok()) << status.error_message();
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_THAT(received, ::testing::Each(25));
}

TEST_P(AttentionStreamTest, AFailingRequestEndsTheStreamWithItsStatus) {
  TestServer server(std::make_unique<CopyExecutor>(absl::ZeroDuration()),
                    {.workers = 1, .max_queue = 4}, {}, GetParam());
  grpc::ClientContext context;
  auto stream = server.stub().AttendStream(&context);
  AttendResponse response;
  ASSERT_TRUE(stream->Write(SmallRequest("good", 3)));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), "good");
  AttendRequest bad = SmallRequest("bad", 3);
  bad.mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED);
  ASSERT_TRUE(stream->Write(bad));
  // The stream stays open on the client side; the server ends it anyway.
  EXPECT_FALSE(stream->Read(&response));
  grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("request 'bad': q.dtype: expected"));
}

TEST_P(AttentionStreamTest, CancellingAStreamDropsItsQueuedRequests) {
  auto owned = std::make_unique<CopyExecutor>(absl::ZeroDuration(), /*gated=*/true);
  CopyExecutor* executor = owned.get();
  TestServer server(std::move(owned), {.workers = 1, .max_queue = 16}, {}, GetParam());
  grpc::ClientContext context;
  auto stream = server.stub().AttendStream(&context);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(stream->Write(SmallRequest(absl::StrCat("x", i), 2)));
  // One runs (blocked), the rest wait in the queue.
  executor->AwaitStarted(1);
  ASSERT_TRUE(Eventually([&] {
    return absl::StrContains(server.metrics().Scrape(), "attention_inflight_requests 5");
  }));
  context.TryCancel();
  AttendResponse response;
  while (stream->Read(&response)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  absl::SleepFor(absl::Milliseconds(200));  // let the cancellation reach the server
  executor->Release();
  // The four queued requests are answered CANCELLED without running; ~TestServer then shuts
  // the server and scheduler down cleanly.
  EXPECT_TRUE(Eventually([&] {
    return absl::StrContains(server.metrics().Scrape(),
                             "attention_requests_total{code=\"CANCELLED\",rpc=\"AttendStream\"} 4");
  }));
  EXPECT_EQ(executor->started(), 1);
}

// Messages over 1 MiB are processed off the polling thread (generic_streams.h); the small ones
// after them on the same stream still reach the queue after them. One worker takes the queue in
// order and the executor answers at once, so the answers come in the order requests were queued.
TEST_P(AttentionStreamTest, LargeAndSmallMessagesAreQueuedInTheOrderSent) {
  SCOPED_TRACE(SeedTrace());
  TestServer server(std::make_unique<CopyExecutor>(absl::ZeroDuration()),
                    {.workers = 1, .max_queue = 64}, {.stream_window = 16}, GetParam());
  grpc::ClientContext context;
  auto stream = server.stub().AttendStream(&context);
  std::vector<std::string> sent;
  std::map<std::string, std::string> q;
  for (int i = 0; i < 12; ++i) {
    // Every third one has q of 2 x 40000 x 4 floats (1.28 MB).
    AttendRequest request = SmallRequest(absl::StrCat("m", i), i % 3 == 0 ? 40000 : 1 + i);
    sent.push_back(request.request_id());
    q[request.request_id()] = request.q().data();
    ASSERT_TRUE(stream->Write(request));
  }
  stream->WritesDone();
  std::vector<std::string> order;
  AttendResponse response;
  while (stream->Read(&response)) {
    order.push_back(response.request_id());
    EXPECT_EQ(response.o().data(), q[response.request_id()]) << response.request_id();
  }
  grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(order, sent);
}

TEST(AttentionServiceTest, DeadlinePassedInTheQueueNeverRuns) {
  auto owned = std::make_unique<CopyExecutor>(absl::ZeroDuration(), /*gated=*/true);
  CopyExecutor* executor = owned.get();
  TestServer server(std::move(owned), {.workers = 1, .max_queue = 4});
  std::thread first([&] {
    grpc::ClientContext context;
    AttendResponse response;
    EXPECT_TRUE(server.stub().Attend(&context, SmallRequest("first", 2), &response).ok());
  });
  executor->AwaitStarted(1);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  AttendResponse response;
  grpc::Status status = server.stub().Attend(&context, SmallRequest("late", 2), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server's copy of the deadline comes from the grpc-timeout header, rounded up and counted
  // from arrival: it may trail the client's by a little. Let it pass too before the worker frees.
  absl::SleepFor(absl::Milliseconds(200));
  executor->Release();
  first.join();
  // The worker drops "late" once "first" is done.
  EXPECT_TRUE(Eventually([&] {
    return absl::StrContains(
        server.metrics().Scrape(),
        "attention_requests_total{code=\"DEADLINE_EXCEEDED\",rpc=\"Attend\"} 1");
  }));
  EXPECT_EQ(executor->started(), 1);
}

TEST(AttentionServiceTest, DrainingRefusesNewRequests) {
  TestServer server(std::make_unique<CopyExecutor>(absl::ZeroDuration()),
                    {.workers = 1, .max_queue = 4});
  server.drain().StartDraining();
  grpc::ClientContext context;
  AttendResponse response;
  grpc::Status status = server.stub().Attend(&context, SmallRequest("d", 2), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("server is shutting down"));

  grpc::ClientContext stream_context;
  auto stream = server.stub().AttendStream(&stream_context);
  ASSERT_TRUE(stream->Write(SmallRequest("ds", 2)));
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);

  // Each refusal is one line of the request log (its default level), and counted by its rpc.
  EXPECT_THAT(
      server.log_lines(),
      ::testing::ElementsAre(
          AllOf(HasSubstr("Attend from ipv4:127.0.0.1:"), HasSubstr("UNAVAILABLE after"),
                HasSubstr("server is shutting down")),
          AllOf(HasSubstr("AttendStream from ipv4:127.0.0.1:"), HasSubstr("UNAVAILABLE after"))));
  EXPECT_THAT(server.metrics().Scrape(),
              HasSubstr("attention_requests_total{code=\"UNAVAILABLE\",rpc=\"AttendStream\"} 1"));
}

TEST(AttentionServiceTest, ServerInfoDescribesDevicesAndLimits) {
  TestServer server(MakeCpuExecutor(1), {.workers = 1, .max_queue = 7},
                    {.version = "9.9.9", .max_message_bytes = 1 << 20, .max_queue = 7});
  grpc::ClientContext context;
  v1::ServerInfo info;
  ASSERT_TRUE(server.stub().GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.version(), "9.9.9");
  EXPECT_EQ(info.backend(), "cpu");
  ASSERT_EQ(info.devices_size(), 1);
  EXPECT_EQ(info.devices(0).name(), "cpu");
  EXPECT_GT(info.devices(0).memory_bytes(), 0);
  EXPECT_GT(info.devices(0).multiprocessors(), 0);
  EXPECT_FALSE(info.devices(0).description().empty());
  EXPECT_THAT(info.dtypes(), ::testing::ElementsAre(v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16,
                                                    v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT8_E4M3));
  EXPECT_EQ(info.limits().max_message_bytes(), 1 << 20);
  EXPECT_EQ(info.limits().max_queue(), 7);
  EXPECT_EQ(info.limits().max_batch(), 1);
  EXPECT_EQ(info.limits().max_head_dim(), 256);
  // The CPU kernel's own list (one code path for every head dim: none listed as faster).
  EXPECT_EQ(std::vector<int>(info.head_dims().begin(), info.head_dims().end()),
            cpu::SpecialisedHeadDims());
}

TEST(AttentionServiceTest, ServerInfoListsTheHeadDimsTheDevicesSpecialise) {
  auto executor = std::make_unique<CopyExecutor>(absl::ZeroDuration());
  executor->SetFastHeadDims({128, 64, 256});
  TestServer server(std::move(executor), {.workers = 1});
  grpc::ClientContext context;
  v1::ServerInfo info;
  ASSERT_TRUE(server.stub().GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_THAT(info.head_dims(), ::testing::ElementsAre(64, 128, 256));
}

}  // namespace
}  // namespace attention::server
