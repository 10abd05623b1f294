#include "server/calls/security.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;
using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;

// A file with `contents` in a fresh temporary directory, removed with the fixture.
class TempFiles {
 public:
  TempFiles() {
    std::string dir = (std::filesystem::temp_directory_path() / "security_test.XXXXXX").string();
    dir_ = mkdtemp(dir.data()) != nullptr ? dir : "";
  }
  ~TempFiles() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  std::string Write(const std::string& name, const std::string& contents) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << contents;
    return path;
  }

 private:
  std::string dir_;
};

TEST(ReadAuthTokenTest, StripsSurroundingWhitespace) {
  TempFiles files;
  absl::StatusOr<std::string> token = ReadAuthToken(files.Write("t", "  s3cr3t-T0ken/+=\n"));
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, "s3cr3t-T0ken/+=");
}

TEST(ReadAuthTokenTest, RejectsMissingEmptyAndUnprintableTokens) {
  TempFiles files;
  EXPECT_THAT(ReadAuthToken("/nonexistent/token").status().message(), HasSubstr("cannot read"));
  EXPECT_THAT(ReadAuthToken(files.Write("empty", "")).status().message(), HasSubstr("empty"));
  EXPECT_THAT(ReadAuthToken(files.Write("blank", " \n\t")).status().message(),
              HasSubstr("no token"));
  EXPECT_THAT(ReadAuthToken(files.Write("space", "two words")).status().message(),
              HasSubstr("printable ASCII"));
  EXPECT_THAT(ReadAuthToken(files.Write("ctrl", "a\x01b")).status().message(),
              HasSubstr("printable ASCII"));
}

TEST(CheckBearerTokenTest, NoExpectedTokenAdmitsEveryone) {
  EXPECT_TRUE(CheckBearerToken(Metadata{}, "").ok());
}

TEST(CheckBearerTokenTest, AcceptsTheTokenWithTheSchemeInAnyCase) {
  for (const char* value : {"Bearer abc123", "bearer abc123", "BEARER abc123"}) {
    Metadata metadata = {{"authorization", value}};
    EXPECT_TRUE(CheckBearerToken(metadata, "abc123").ok()) << value;
  }
  // Any one of several authorization entries may carry it.
  Metadata several = {{"authorization", "Basic dXNlcjpwdw=="}, {"authorization", "Bearer abc123"}};
  EXPECT_TRUE(CheckBearerToken(several, "abc123").ok());
}

TEST(CheckBearerTokenTest, RefusesMissingOrWrongCredentials) {
  const std::vector<Metadata> refused = {
      {},
      {{"x-other", "Bearer abc123"}},
      {{"authorization", ""}},
      {{"authorization", "Bearer"}},
      {{"authorization", "Bearer "}},
      {{"authorization", "Bearer abc12"}},    // a prefix
      {{"authorization", "Bearer abc1234"}},  // longer
      {{"authorization", "Bearer abc124"}},   // last character differs
      {{"authorization", "Bearer  abc123"}},  // two spaces
      {{"authorization", "Basic abc123"}},    // another scheme
      {{"authorization", "abc123"}},          // no scheme
  };
  for (const Metadata& metadata : refused) {
    absl::Status status = CheckBearerToken(metadata, "abc123");
    EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated)
        << (metadata.empty()
                ? std::string("(none)")
                : std::string(metadata.begin()->second.data(), metadata.begin()->second.size()));
  }
}

TEST(MakeServerCredentialsTest, PlaintextWithoutCertificate) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = MakeServerCredentials({});
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  EXPECT_NE(*credentials, nullptr);
}

TEST(MakeServerCredentialsTest, RefusesIncompleteFlagSets) {
  TempFiles files;
  const std::string pem = files.Write("x.pem", "-----BEGIN CERTIFICATE-----\n");
  EXPECT_THAT(MakeServerCredentials({.tls_cert = pem}).status().message(),
              HasSubstr("--tls_cert and --tls_key must be given together"));
  EXPECT_THAT(MakeServerCredentials({.tls_key = pem}).status().message(),
              HasSubstr("--tls_cert and --tls_key must be given together"));
  EXPECT_THAT(MakeServerCredentials({.tls_client_ca = pem}).status().message(),
              HasSubstr("--tls_client_ca needs --tls_cert and --tls_key"));
  EXPECT_THAT(MakeServerCredentials({.tls_cert = pem, .tls_key = "/nonexistent/key.pem"})
                  .status()
                  .message(),
              HasSubstr("--tls_key: cannot read /nonexistent/key.pem"));
  EXPECT_THAT(MakeServerCredentials(
                  {.tls_cert = pem, .tls_key = pem, .tls_client_ca = files.Write("empty.pem", "")})
                  .status()
                  .message(),
              HasSubstr("--tls_client_ca: "));
}

}  // namespace
}  // namespace attention::server
