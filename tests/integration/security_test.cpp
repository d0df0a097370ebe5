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
#include <thread>

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
  if (status.ok()) {
    EXPECT_EQ(tokens, 4u);
  }
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

// With --admin-socket, Admin answers only on that Unix socket (owner-only): on the gRPC port it
// does not exist. A symlink at the path is refused, not followed.
TEST(BrokerSecurityTest, AdminOnAUnixSocketOnly) {
  test::TempDir dir;
  const std::string path = dir.file("admin.sock");
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--admin-socket", path});
  ASSERT_TRUE(broker.ok());
  const grpc::Status on_port = statsWith(broker.channel());
  EXPECT_EQ(on_port.error_code(), grpc::StatusCode::UNIMPLEMENTED) << on_port.error_message();
  auto local = grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials());
  EXPECT_TRUE(statsWith(local).ok());
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_TRUE(generateWith(broker.channel()).ok());

  ASSERT_EQ(::symlink(dir.file("elsewhere").c_str(), dir.file("link.sock").c_str()), 0);
  auto child = ChildProcess::spawn(
      {test::binDir() + "/bulkhead-broker", "--model", test::fixtureDir("tiny-qwen2"), "--listen",
       "127.0.0.1:0", "--admin-socket", dir.file("link.sock"), "--state-dir", dir.path()});
  ASSERT_TRUE(child.ok()) << child.status().toString();
  ExitInfo exit;
  ASSERT_TRUE(child->waitExit(std::chrono::steady_clock::now() + std::chrono::seconds(60), &exit))
      << "the broker started with a symlink for its Admin socket";
  EXPECT_EQ(exit.exit_code, 1) << exit.describe();
}

// A request larger than --max-message-bytes is refused by gRPC with RESOURCE_EXHAUSTED; one
// within it is served.
TEST(BrokerLimitsTest, AMessageOverTheLimitIsRefused) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--max-message-bytes", "2048"});
  ASSERT_TRUE(broker.ok());
  v1::GenerateRequest big;
  for (int i = 0; i < 1500; ++i) big.add_prompt_token_ids(300 + uint32_t(i % 200));
  big.set_max_tokens(1);
  ASSERT_GT(big.ByteSizeLong(), 2048u);
  const test::Generation refused = test::generate(*broker.channel(), big);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.status.error_message();
  EXPECT_TRUE(generateWith(broker.channel()).ok());
}

// With --max-streams-per-connection 1, two generations started together on one connection do not
// overlap: the second stream waits until the first has finished. Each client thread times what it
// reads, and the first stream's last tokens and the second's first arrive on one connection but
// are read in two threads, so the later stream's first token is only asserted to come after the
// earlier one has read most of its tokens (without the limit both run from the start).
TEST(BrokerLimitsTest, StreamsBeyondTheLimitOfAConnectionWaitTheirTurn) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--max-streams-per-connection", "1"});
  ASSERT_TRUE(broker.ok());
  using Clock = std::chrono::steady_clock;
  struct Timed {
    std::vector<Clock::time_point> read;  // when each token was read
    grpc::Status status;
  };
  auto stream = [&](Timed& t, uint32_t seed_token) {
    auto stub = v1::Generator::NewStub(broker.channel());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::GenerateRequest request;
    for (uint32_t v : {seed_token, 6u, 7u}) request.add_prompt_token_ids(v);
    request.set_max_tokens(200);
    request.set_ignore_eos(true);
    auto reader = stub->Generate(&context, request);
    v1::GenerateResponse response;
    while (reader->Read(&response))
      t.read.insert(t.read.end(), size_t(response.token_ids_size()), Clock::now());
    t.status = reader->Finish();
  };
  Timed a, b;
  std::thread ta([&] { stream(a, 5); }), tb([&] { stream(b, 9); });
  ta.join();
  tb.join();
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  ASSERT_EQ(a.read.size(), 200u);
  ASSERT_EQ(b.read.size(), 200u);
  const Timed& earlier = a.read[0] <= b.read[0] ? a : b;
  const Timed& later = &earlier == &a ? b : a;
  EXPECT_GT(later.read[0], earlier.read[150])
      << "two streams of one connection were open at once: the later one's first token came "
      << std::chrono::duration_cast<std::chrono::microseconds>(earlier.read.back() - later.read[0])
             .count()
      << " us before the earlier one's last";
}

}  // namespace
}  // namespace bulkhead
