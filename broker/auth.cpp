// Token checks (constant-time comparison) and the port's TLS credentials.
#include "broker/auth.h"

#include "shared/secret_file.h"

namespace bulkhead {
namespace {

// Equal strings, in time that does not depend on where they differ.
bool sameToken(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i) diff |= (i < a.size() ? a[i] : 0) ^ b[i];
  return diff == 0;
}

}  // namespace

Result<Authorizer> Authorizer::load(const std::string& generate_token_file,
                                    const std::string& admin_token_file) {
  Authorizer a;
  if (!generate_token_file.empty()) {
    BULKHEAD_ASSIGN_OR_RETURN(a.generate_token_,
                              readSecretFile(generate_token_file, "--token-file"));
  }
  if (!admin_token_file.empty()) {
    BULKHEAD_ASSIGN_OR_RETURN(a.admin_token_,
                              readSecretFile(admin_token_file, "--admin-token-file"));
  }
  if (!a.generate_token_.empty() && a.generate_token_ == a.admin_token_)
    return invalidArgument("--token-file and --admin-token-file hold the same token");
  a.admin_closed_ = !a.generate_token_.empty() && a.admin_token_.empty();
  return a;
}

grpc::Status Authorizer::check(const grpc::ServerContextBase& context, Api api) const {
  const bool needs_token =
      api == Api::kGenerate ? !generate_token_.empty() : !admin_token_.empty() || admin_closed_;
  if (!needs_token) return grpc::Status::OK;
  if (api == Api::kAdmin && admin_closed_)
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "Admin is closed: the broker has a Generate token but no "
                        "--admin-token-file");
  const auto& metadata = context.client_metadata();
  const auto found = metadata.find("authorization");
  const std::string prefix = "Bearer ";
  if (found == metadata.end())
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing \"authorization: Bearer TOKEN\" metadata");
  const std::string value(found->second.data(), found->second.size());
  if (value.rfind(prefix, 0) != 0)
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "authorization metadata is not \"Bearer TOKEN\"");
  const std::string token = value.substr(prefix.size());
  const bool admin = !admin_token_.empty() && sameToken(token, admin_token_);
  const bool generate = !generate_token_.empty() && sameToken(token, generate_token_);
  if (api == Api::kAdmin) {
    if (admin) return grpc::Status::OK;
    if (generate)
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          "this token may call Generate, not Admin");
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid token");
  }
  if (admin || generate) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid token");
}

Result<std::shared_ptr<grpc::ServerCredentials>> serverCredentials(
    const std::string& cert_file, const std::string& key_file, const std::string& client_ca_file) {
  if (cert_file.empty()) {
    if (!key_file.empty() || !client_ca_file.empty())
      return invalidArgument("--tls-key and --tls-client-ca need --tls-cert");
    return grpc::InsecureServerCredentials();
  }
  if (key_file.empty()) return invalidArgument("--tls-cert needs --tls-key");
  grpc::SslServerCredentialsOptions options(
      client_ca_file.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                             : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  BULKHEAD_ASSIGN_OR_RETURN(pair.cert_chain, readOptionFile(cert_file, "--tls-cert"));
  BULKHEAD_ASSIGN_OR_RETURN(pair.private_key, readOptionFile(key_file, "--tls-key"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!client_ca_file.empty()) {
    BULKHEAD_ASSIGN_OR_RETURN(options.pem_root_certs,
                              readOptionFile(client_ca_file, "--tls-client-ca"));
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace bulkhead
