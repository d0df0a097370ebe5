// The broker's gRPC port secured: TLS, mutual TLS, and bearer tokens for Generate and Admin
// (missing, wrong, right; one API's token on the other), against a real broker process, with
// certificates made for the test by the openssl command line.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"
#include "support/broker_process.h"
#include "support/test_support.h"

namespace bulkhead {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA.
void makeCertificates(const std::string& dir) {
  test::writeFile(dir + "/make-certs.sh", R"(set -e
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"; }
key ca.key
openssl req -x509 -new -key ca.key -subj /CN=bulkhead-test-ca -days 3650 -out ca.crt
for who in server client; do
  key $who.key
  openssl req -new -key $who.key -subj /CN=$who -out $who.csr
done
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > san.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
  -extfile san.ext -out server.crt
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
  -out client.crt
)");
  const std::string command = "cd '" + dir + "' && sh make-certs.sh > make-certs.log 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << "openssl could not make the test certificates:\n"
                                             << slurp(dir + "/make-certs.log");
}

void writeSecret(const std::string& path, const std::string& token, mode_t mode = 0600) {
  test::writeFile(path, token + "\n");
  ASSERT_EQ(::chmod(path.c_str(), mode), 0);
}

grpc::Status generateWith(const std::shared_ptr<grpc::Channel>& channel,
                          const std::string& token = "") {
  auto stub = v1::Generator::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  v1::GenerateRequest request;
  for (uint32_t t : {5, 6, 7}) request.add_prompt_token_ids(t);
  request.set_max_tokens(4);
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  uint32_t tokens = 0;
  while (reader->Read(&response)) tokens += uint32_t(response.token_ids_size());
  grpc::Status status = reader->Finish();
  if (status.ok()) EXPECT_EQ(tokens, 4u);
  return status;
}

grpc::Status statsWith(const std::shared_ptr<grpc::Channel>& channel,
                       const std::string& token = "") {
  auto admin = v1::Admin::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  v1::Stats stats;
  return admin->GetStats(&context, {}, &stats);
}

std::shared_ptr<grpc::Channel> tlsChannel(const std::string& address, const std::string& dir,
                                          bool client_certificate) {
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = slurp(dir + "/ca.crt");
  if (client_certificate) {
    tls.pem_cert_chain = slurp(dir + "/client.crt");
    tls.pem_private_key = slurp(dir + "/client.key");
  }
  return grpc::CreateChannel(address, grpc::SslCredentials(tls));
}

TEST(BrokerSecurityTest, TokensGuardGenerateAndAdminSeparately) {
  test::TempDir dir;
  writeSecret(dir.path() + "/generate.token", "generate-secret");
  writeSecret(dir.path() + "/admin.token", "admin-secret");
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                             {"--token-file", dir.path() + "/generate.token", "--admin-token-file",
                              dir.path() + "/admin.token"});
  ASSERT_TRUE(broker.ok());
  auto channel = broker.channel();
  EXPECT_EQ(generateWith(channel).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(generateWith(channel, "wrong").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(generateWith(channel, "generate-secret").ok());
  EXPECT_TRUE(generateWith(channel, "admin-secret").ok());
  EXPECT_EQ(statsWith(channel).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(statsWith(channel, "wrong").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(statsWith(channel, "generate-secret").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(statsWith(channel, "admin-secret").ok());
  // Health stays open for load balancers.
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckResponse serving;
  ASSERT_TRUE(health->Check(&context, {}, &serving).ok());
  EXPECT_EQ(serving.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST(BrokerSecurityTest, AGenerateTokenAloneClosesAdmin) {
  test::TempDir dir;
  writeSecret(dir.path() + "/generate.token", "generate-secret");
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                             {"--token-file", dir.path() + "/generate.token"});
  ASSERT_TRUE(broker.ok());
  EXPECT_TRUE(generateWith(broker.channel(), "generate-secret").ok());
  EXPECT_EQ(statsWith(broker.channel(), "generate-secret").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

TEST(BrokerSecurityTest, ATokenFileOthersCanReadIsRefusedAtStart) {
  test::TempDir dir;
  writeSecret(dir.path() + "/generate.token", "generate-secret", 0644);
  auto child = ChildProcess::spawn(
      {test::binDir() + "/bulkhead-broker", "--model", test::fixtureDir("tiny-qwen2"), "--listen",
       "127.0.0.1:0", "--token-file", dir.path() + "/generate.token", "--state-dir", dir.path()});
  ASSERT_TRUE(child.ok()) << child.status().toString();
  ExitInfo exit;
  ASSERT_TRUE(child->waitExit(std::chrono::steady_clock::now() + std::chrono::seconds(30), &exit))
      << "the broker started with a token file others can read";
  EXPECT_EQ(exit.exit_code, 2) << exit.describe();
}

TEST(BrokerSecurityTest, TlsServesOnlyTlsClients) {
  test::TempDir dir;
  makeCertificates(dir.path());
  test::BrokerProcess broker(
      test::fixtureDir("tiny-qwen2"),
      {"--tls-cert", dir.path() + "/server.crt", "--tls-key", dir.path() + "/server.key"});
  EXPECT_TRUE(generateWith(tlsChannel(broker.address(), dir.path(), false)).ok());
  const grpc::Status plain = generateWith(broker.channel());  // the helper's plain-text channel
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::UNAVAILABLE) << plain.error_message();
}

TEST(BrokerSecurityTest, MutualTlsRequiresAClientCertificateFromTheCa) {
  test::TempDir dir;
  makeCertificates(dir.path());
  test::BrokerProcess broker(
      test::fixtureDir("tiny-qwen2"),
      {"--tls-cert", dir.path() + "/server.crt", "--tls-key", dir.path() + "/server.key",
       "--tls-client-ca", dir.path() + "/ca.crt"});
  EXPECT_TRUE(generateWith(tlsChannel(broker.address(), dir.path(), true)).ok());
  const grpc::Status without = generateWith(tlsChannel(broker.address(), dir.path(), false));
  EXPECT_EQ(without.error_code(), grpc::StatusCode::UNAVAILABLE) << without.error_message();
}

}  // namespace
}  // namespace bulkhead
