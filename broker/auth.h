// Who may call what on the broker's gRPC port: bearer tokens ("authorization: Bearer TOKEN"),
// one for Generate and a separate one for Admin, read from files at start; and the port's TLS
// credentials, with client certificates required when a client CA is given (mutual TLS). Health
// and reflection stay open, for load balancers' checks.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "shared/status.h"

namespace bulkhead {

class Authorizer {
 public:
  enum class Api { kGenerate, kAdmin };

  // Empty paths: that API needs no token. A Generate token without an Admin token closes Admin
  // (it is never left open beside a protected Generate). Token files must not be readable or
  // writable by group or others.
  static Result<Authorizer> load(const std::string& generate_token_file,
                                 const std::string& admin_token_file);

  // OK, UNAUTHENTICATED (no token, or not one of ours) or PERMISSION_DENIED (a Generate token
  // on Admin, or Admin closed). The Admin token also opens Generate.
  grpc::Status check(const grpc::ServerContextBase& context, Api api) const;

 private:
  std::string generate_token_, admin_token_;
  bool admin_closed_ = false;
};

// The gRPC port's credentials: TLS from PEM files when `cert_file` is set (client certificates
// required and verified against `client_ca_file` when that is set), else insecure.
Result<std::shared_ptr<grpc::ServerCredentials>> serverCredentials(
    const std::string& cert_file, const std::string& key_file, const std::string& client_ca_file);

}  // namespace bulkhead
