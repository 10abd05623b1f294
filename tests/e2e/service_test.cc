// End to end service surface: GetServerInfo, grpc.health.v1, server reflection, the Prometheus
// endpoint, and the attn_client CLI run against a live server.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/npy.h"
#include "client/request_builder.h"
#include "client/tensors.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_attention.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::e2e {
namespace {

using client::HealthStatus;
using client::ProblemSpec;
using grpc::health::v1::HealthCheckResponse;
namespace reflection = grpc::reflection::v1alpha;

class ServiceTest : public SharedServerTest<ServiceTest> {
 public:
  static std::vector<std::string> ServerFlags() {
    return {"--backend=cpu", "--max_message_mb=64", "--max_queue=77", "--max_batch=5"};
  }
};

TEST_F(ServiceTest, ServerInfoDescribesTheCpuServer) {
  absl::StatusOr<v1::ServerInfo> info = client().GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->version().empty());
  EXPECT_EQ(info->backend(), "cpu");
  ASSERT_GE(info->devices_size(), 1);
  EXPECT_EQ(info->devices(0).name(), "cpu");
  EXPECT_GT(info->devices(0).memory_bytes(), 0);
  EXPECT_GT(info->devices(0).multiprocessors(), 0);
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    EXPECT_NE(std::find(info->dtypes().begin(), info->dtypes().end(), dtype), info->dtypes().end())
        << v1::DType_Name(dtype);
  }
  // The fast head dims are the CPU kernel's own specialisations (none: one code path for all).
  EXPECT_EQ(std::vector<int>(info->head_dims().begin(), info->head_dims().end()),
            cpu::SpecialisedHeadDims());
  EXPECT_EQ(info->limits().max_message_bytes(), int64_t{64} << 20);
  EXPECT_EQ(info->limits().max_queue(), 77);
  EXPECT_EQ(info->limits().max_batch(), 5);
  EXPECT_EQ(info->limits().max_head_dim(), 256);
}

TEST_F(ServiceTest, HealthIsServingOverallAndForAttention) {
  for (const std::string service : {"", "attention.v1.Attention"}) {
    absl::StatusOr<HealthStatus> status = client().CheckHealth(service);
    ASSERT_TRUE(status.ok()) << "'" << service << "': " << status.status();
    EXPECT_EQ(*status, HealthCheckResponse::SERVING) << "'" << service << "'";
  }
  absl::StatusOr<HealthStatus> unknown = client().CheckHealth("no.such.Service");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
}

TEST_F(ServiceTest, ReflectionListsAndDescribesTheService) {
  auto stub = reflection::ServerReflection::NewStub(client().channel());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->ServerReflectionInfo(&context);

  reflection::ServerReflectionRequest list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  reflection::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_TRUE(response.has_list_services_response()) << response.DebugString();
  std::vector<std::string> services;
  for (const auto& s : response.list_services_response().service()) services.push_back(s.name());
  EXPECT_NE(std::find(services.begin(), services.end(), "attention.v1.Attention"), services.end());
  EXPECT_NE(std::find(services.begin(), services.end(), "grpc.health.v1.Health"), services.end());

  reflection::ServerReflectionRequest describe;
  describe.set_file_containing_symbol("attention.v1.Attention");
  ASSERT_TRUE(stream->Write(describe));
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_TRUE(response.has_file_descriptor_response()) << response.DebugString();
  bool found = false;
  for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
    google::protobuf::FileDescriptorProto file;
    ASSERT_TRUE(file.ParseFromString(bytes));
    for (const auto& service : file.service()) {
      if (file.package() != "attention.v1" || service.name() != "Attention") continue;
      found = true;
      std::vector<std::string> methods;
      for (const auto& m : service.method()) methods.push_back(m.name());
      EXPECT_EQ(methods, (std::vector<std::string>{"Attend", "AttendStream", "GetServerInfo",
                                                   "AttendChunked"}));
    }
  }
  EXPECT_TRUE(found) << "no descriptor for attention.v1.Attention";
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// grpc.health.v1.Health is listed, so a reflection client (grpcurl describe) must also find its
// descriptor: the server links the health .proto's generated code into its descriptor pool.
// The methods of grpc.health.v1.Health as a reflection service describes them, and the services
// it lists; `Stub`, `Request` and `Response` are those of v1alpha or v1 (the same messages).
template <typename Stub, typename Request, typename Response>
void ExpectReflectionDescribesHealth(std::unique_ptr<Stub> stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->ServerReflectionInfo(&context);
  Request list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  Response listed;
  ASSERT_TRUE(stream->Read(&listed));
  std::set<std::string> services;
  for (const auto& service : listed.list_services_response().service()) {
    services.insert(service.name());
  }
  for (const char* name : {"attention.v1.Attention", "attention.v1.Sessions",
                           "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}) {
    EXPECT_TRUE(services.contains(name)) << name << " not listed: " << listed.DebugString();
  }
  Request describe;
  describe.set_file_containing_symbol("grpc.health.v1.Health");
  ASSERT_TRUE(stream->Write(describe));
  Response response;
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_TRUE(response.has_file_descriptor_response()) << response.DebugString();
  std::map<std::string, std::string> methods;  // name -> input type
  for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
    google::protobuf::FileDescriptorProto file;
    ASSERT_TRUE(file.ParseFromString(bytes));
    if (file.package() != "grpc.health.v1") continue;
    for (const auto& service : file.service()) {
      if (service.name() != "Health") continue;
      for (const auto& m : service.method()) methods[m.name()] = m.input_type();
    }
  }
  EXPECT_EQ(methods,
            (std::map<std::string, std::string>{{"Check", ".grpc.health.v1.HealthCheckRequest"},
                                                {"Watch", ".grpc.health.v1.HealthCheckRequest"}}));
  // An unknown symbol is an error response on the stream, which stays open.
  Request unknown;
  unknown.set_file_containing_symbol("no.such.Symbol");
  ASSERT_TRUE(stream->Write(unknown));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.error_response().error_code(), grpc::StatusCode::NOT_FOUND);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServiceTest, ReflectionDescribesTheHealthService) {
  ExpectReflectionDescribesHealth<reflection::ServerReflection::Stub,
                                  reflection::ServerReflectionRequest,
                                  reflection::ServerReflectionResponse>(
      reflection::ServerReflection::NewStub(client().channel()));
}

// Reflection v1 (which grpcurl and other clients try first) answers the same.
TEST_F(ServiceTest, ReflectionV1DescribesTheHealthService) {
  namespace v1r = grpc::reflection::v1;
  ExpectReflectionDescribesHealth<v1r::ServerReflection::Stub, v1r::ServerReflectionRequest,
                                  v1r::ServerReflectionResponse>(
      v1r::ServerReflection::NewStub(client().channel()));
}

// The metrics server (civetweb) gives each connection a worker thread until its request is read:
// connections that stay idle, or stall halfway through a request line, must not keep a scraper
// waiting.
TEST_F(ServiceTest, MetricsAnswerBesideIdleAndStalledConnections) {
  const int port = process().metrics_port();
  const auto connect_loopback = [port] {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
    return fd;
  };
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) held.push_back(connect_loopback());
  held.push_back(connect_loopback());
  const std::string half_request = "GET /metrics HTTP/1.1\r\nHo";
  ASSERT_EQ(write(held.back(), half_request.data(), half_request.size()),
            static_cast<ssize_t>(half_request.size()));
  // Let the server take them onto its workers before the scrape arrives.
  absl::SleepFor(absl::Milliseconds(200));

  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> text = HttpGet(port, "/metrics");
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_TRUE(absl::StrContains(*text, "attention_build_info"));
  EXPECT_LT(took, absl::Seconds(2)) << "the scrape waited " << took;
  for (int fd : held) close(fd);
}

// The counters count exactly the calls made, by rpc and code; a fresh server so nothing else
// has been counted.
TEST(MetricsTest, CountsRequestsByRpcAndCode) {
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu"});
  ASSERT_TRUE(server.ok()) << server.status();
  std::mt19937_64 rng(FreshSeed());
  const ProblemSpec spec{
      .batch = 1, .heads_q = 2, .heads_kv = 1, .seqlen_q = 20, .seqlen_k = 30, .head_dim = 32};
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
  ASSERT_TRUE(request.ok()) << request.status();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(server->client->Attend(*request).ok());
  v1::AttendRequest bad = *request;
  bad.set_window_left(-3);
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(server->client->Attend(bad).ok());
  ASSERT_TRUE(server->client->AttendStream(std::vector<v1::AttendRequest>(4, *request)).ok());
  ASSERT_TRUE(server->client->GetServerInfo().ok());

  absl::StatusOr<std::string> text = HttpGet(server->process->metrics_port(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::vector<MetricSample> samples = ParseMetrics(*text);
  EXPECT_EQ(SumSamples(samples, "attention_requests_total", {{"rpc", "Attend"}, {"code", "OK"}}), 3)
      << *text;
  EXPECT_EQ(SumSamples(samples, "attention_requests_total",
                       {{"rpc", "Attend"}, {"code", "INVALID_ARGUMENT"}}),
            2);
  EXPECT_EQ(
      SumSamples(samples, "attention_requests_total", {{"rpc", "AttendStream"}, {"code", "OK"}}),
      4);
  EXPECT_EQ(
      SumSamples(samples, "attention_requests_total", {{"rpc", "GetServerInfo"}, {"code", "OK"}}),
      1);
  // The latency histogram: every Attend observed, cumulative buckets ending in +Inf.
  EXPECT_EQ(SumSamples(samples, "attention_request_duration_seconds_count", {{"rpc", "Attend"}}),
            5);
  EXPECT_EQ(SumSamples(samples, "attention_request_duration_seconds_bucket",
                       {{"rpc", "Attend"}, {"le", "+Inf"}}),
            5);
  EXPECT_TRUE(HasSample(samples, "attention_request_duration_seconds_sum", {{"rpc", "Attend"}}));
  EXPECT_TRUE(HasSample(samples, "attention_build_info", {{"backend", "cpu"}}));
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

// A Client may be dropped as soon as an AttendAsync answer arrives, even as the process's last
// gRPC object: the answer comes only after the call has let go of the channel, so the channel's
// last reference never goes on gRPC's callback thread (gRPC 1.51 would then shut its library down
// under that thread, and the process crash). Each round's client is the process's only one.
TEST(ClientTest, DroppedRightAfterAnAsyncAnswer) {
  constexpr int kRounds = 5;
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu"});
  ASSERT_TRUE(server.ok()) << server.status();
  server->client.reset();
  std::mt19937_64 rng(FreshSeed());
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
      {.batch = 512, .heads_q = 16, .heads_kv = 16, .seqlen_q = 8, .seqlen_k = 8, .head_dim = 64},
      rng);
  ASSERT_TRUE(request.ok()) << request.status();
  for (int i = 0; i < kRounds; ++i) {
    auto client = std::make_unique<client::Client>(
        client::ClientOptions{.target = server->process->target()});
    absl::StatusOr<v1::AttendResponse> response = client->AttendAsync(*request).get();
    client.reset();
    ExpectCorrect(*request, response);
  }
  EXPECT_TRUE(server->process->Stop().ok());
}

// Runs a command line, returning its exit code and what it printed.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
CommandResult RunCommand(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

TEST_F(ServiceTest, CliCheckPassesAgainstTheServer) {
  const std::string base = absl::StrCat(ATTN_CLIENT_BINARY, " --target=", process().target());
  for (const std::string args : {
           " --shape=2,4,100,64 --kv_heads=2 --nk=77 --dtype=float32 --causal --lse --check",
           " --shape=1,8,1,128 --kv_heads=1 --nk=300 --dtype=bfloat16 --layout=bshd --check",
           " --shape=1,4,1,32 --varlen=37,1,128 --varlen_k=50,20,128 --dtype=float16 --causal "
           "--lse --repeat=3 --check",
           " --shape=1,2,64,32 --window_left=8 --window_right=4 --scale=0.2 --check",
       }) {
    const CommandResult run = RunCommand(base + args);
    EXPECT_EQ(run.exit_code, 0) << args << "\n" << run.output;
    EXPECT_TRUE(absl::StrContains(run.output, "PASS")) << run.output;
    EXPECT_TRUE(absl::StrContains(run.output, "device: cpu")) << run.output;
  }
}

TEST_F(ServiceTest, CliHealthAndInfo) {
  const std::string base = absl::StrCat(ATTN_CLIENT_BINARY, " --target=", process().target());
  CommandResult run = RunCommand(base + " --health");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  run = RunCommand(base + " --health --health_service=attention.v1.Attention");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  run = RunCommand(base + " --info");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "backend: \"cpu\"")) << run.output;
  // Nothing listens on port 1: the probe must fail, not hang.
  run = RunCommand(absl::StrCat(ATTN_CLIENT_BINARY, " --target=127.0.0.1:1 --health"));
  EXPECT_EQ(run.exit_code, 1) << run.output;
}

// --q/--k/--v inputs and --out output go through .npy files: o.npy holds the answer to exactly
// the given inputs (the float16 output file is checked against a run without files).
TEST_F(ServiceTest, CliReadsAndWritesNpy) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("attn_client_npy_", FreshSeed());
  std::filesystem::create_directories(dir);
  std::mt19937_64 rng(FreshSeed());
  const std::vector<int64_t> q_shape = {1, 2, 10, 16}, kv_shape = {1, 1, 12, 16};
  const std::vector<float> q = client::RandomNormal(2 * 10 * 16, rng);
  const std::vector<float> k = client::RandomNormal(12 * 16, rng);
  const std::vector<float> v = client::RandomNormal(12 * 16, rng);
  ASSERT_TRUE(client::WriteNpy((dir / "q.npy").string(), q_shape, q).ok());
  ASSERT_TRUE(
      client::WriteNpy((dir / "k.npy").string(), kv_shape, k, client::NpyType::kFloat16).ok());
  ASSERT_TRUE(client::WriteNpy((dir / "v.npy").string(), kv_shape, v).ok());
  const std::string command =
      absl::StrCat(ATTN_CLIENT_BINARY, " --target=", process().target(),
                   " --shape=1,2,10,16 --kv_heads=1 --nk=12 --dtype=float16 --check --q=",
                   (dir / "q.npy").string(), " --k=", (dir / "k.npy").string(),
                   " --v=", (dir / "v.npy").string(), " --out=", (dir / "o.npy").string());
  const CommandResult run = RunCommand(command);
  EXPECT_EQ(run.exit_code, 0) << run.output;

  absl::StatusOr<client::NpyArray> o = client::ReadNpy((dir / "o.npy").string());
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->shape, q_shape);
  // The same inputs through the library must give the same float16 output bit for bit.
  const ProblemSpec spec{.batch = 1,
                         .heads_q = 2,
                         .heads_kv = 1,
                         .seqlen_q = 10,
                         .seqlen_k = 12,
                         .head_dim = 16,
                         .dtype = v1::DTYPE_FLOAT16};
  absl::StatusOr<v1::AttendRequest> request = client::MakeRequest(spec, q, k, v);
  ASSERT_TRUE(request.ok()) << request.status();
  absl::StatusOr<v1::AttendResponse> response = client().Attend(*request);
  ASSERT_TRUE(response.ok()) << response.status();
  absl::StatusOr<std::vector<float>> expected = client::TensorToFloat(response->o());
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(o->values, *expected);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace attention::e2e
