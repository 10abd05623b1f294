#include "server/calls/security.h"

#include <fstream>
#include <iterator>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "kernels/status_macros.h"

namespace attention::server {
namespace {

constexpr absl::string_view kBearerPrefix = "bearer ";

// The whole file `path`, named by `flag` in errors.
absl::StatusOr<std::string> ReadFile(absl::string_view flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::string contents((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  if (contents.empty())
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is empty"));
  return contents;
}

// Equality whose time depends on the lengths only, not on where the strings differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i) difference |= static_cast<unsigned char>(a[i] ^ b[i]);
  return difference == 0;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const SecurityOptions& options) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  if (options.tls_cert.empty()) {
    if (!options.tls_client_ca.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
    }
    return grpc::InsecureServerCredentials();
  }
  ASSIGN_OR_RETURN(std::string cert, ReadFile("--tls_cert", options.tls_cert));
  ASSIGN_OR_RETURN(std::string key, ReadFile("--tls_key", options.tls_key));

  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_key_cert_pairs.push_back({.private_key = std::move(key), .cert_chain = std::move(cert)});
  if (!options.tls_client_ca.empty()) {
    ASSIGN_OR_RETURN(std::string ca, ReadFile("--tls_client_ca", options.tls_client_ca));
    ssl.pem_root_certs = std::move(ca);
    // Mutual TLS: a handshake without a client certificate signed by the CA fails.
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

absl::StatusOr<std::string> ReadAuthToken(const std::string& path) {
  ASSIGN_OR_RETURN(std::string contents, ReadFile("--auth_token_file", path));
  const std::string token(absl::StripAsciiWhitespace(contents));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--auth_token_file: ", path, " holds no token"));
  }
  for (char c : token) {
    // gRPC metadata values are printable ASCII; a space would split "Bearer <token>".
    if (c <= 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_token_file: the token in ", path,
                       " must be printable ASCII without spaces (as in RFC 6750's token68)"));
    }
  }
  return token;
}

absl::Status CheckBearerToken(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                              absl::string_view expected) {
  if (expected.empty()) return absl::OkStatus();
  auto [begin, end] = metadata.equal_range("authorization");
  if (begin == end) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  bool matched = false;
  for (auto it = begin; it != end; ++it) {
    absl::string_view value(it->second.data(), it->second.size());
    // RFC 7235: the scheme name is case-insensitive.
    if (value.size() < kBearerPrefix.size() ||
        !absl::EqualsIgnoreCase(value.substr(0, kBearerPrefix.size()), kBearerPrefix)) {
      continue;
    }
    matched |= ConstantTimeEquals(value.substr(kBearerPrefix.size()), expected);
  }
  if (!matched) return absl::UnauthenticatedError("invalid bearer token");
  return absl::OkStatus();
}

}  // namespace attention::server
