// Transport security and caller authentication for the gRPC port.
//
// TLS: the server presents --tls_cert/--tls_key; with --tls_client_ca it also demands a client
// certificate signed by that CA (mutual TLS). Without a certificate the port is plaintext.
// Bearer token: with --auth_token_file every attention.v1.Attention and attention.v1.Sessions call
// must carry the metadata `authorization: Bearer <token>`, else it is answered UNAUTHENTICATED.
// The health service is not checked, so load balancers and orchestrators can probe without a
// secret. The Prometheus port is
// separate, plaintext and unauthenticated: keep it on an internal network.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/string_ref.h"

namespace attention::server {

struct SecurityOptions {
  // PEM files. tls_cert and tls_key come together; tls_client_ca needs them (mTLS over TLS).
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // A file holding the bearer token (surrounding whitespace ignored); empty: no token check.
  std::string auth_token_file;
};

// Plaintext, TLS or mutual-TLS credentials for the listening port. An error names the flag whose
// file is missing, unreadable or empty, or the flag that lacks its partner.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const SecurityOptions& options);

// The token in `path`, without surrounding whitespace. An error when the file cannot be read, the
// token is empty, or it holds characters that cannot travel in gRPC metadata.
absl::StatusOr<std::string> ReadAuthToken(const std::string& path);

// OK when `metadata` holds `authorization: Bearer <expected>` (the scheme in any case), else
// UNAUTHENTICATED. An empty `expected` admits every call. The token comparison takes the same
// time wherever the first difference is, so it leaks no prefix of the token.
absl::Status CheckBearerToken(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                              absl::string_view expected);

}  // namespace attention::server
