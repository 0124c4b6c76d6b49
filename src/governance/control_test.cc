// The control protocol: typed messages round-trip over a socketpair, the listener fd crosses
// with SCM_RIGHTS, malformed input is an error, not a crash.
#include "governance/control.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <condition_variable>
#include <mutex>

#include "common/protocol.h"
#include "gtest/gtest.h"

namespace esb::governance::control {
namespace {

struct Pair {
  Pair() {
    int sv[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    esbd = std::make_unique<ControlChannel>(UniqueFd(sv[0]));
    proxy = std::make_unique<ControlChannel>(UniqueFd(sv[1]));
  }
  std::unique_ptr<ControlChannel> esbd, proxy;
};

EgressPolicy Policy(const char* json) { return *ParseEgressPolicy(boost::json::parse(json)); }

ino_t Inode(int fd) {
  struct stat st {};
  fstat(fd, &st);
  return st.st_ino;
}

TEST(ControlChannelTest, AttachPassesTheListenerFdAndEveryField) {
  Pair p;
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  Attach a;
  a.env_id = "env-1";
  a.tenant = "acme";
  a.policy = Policy(R"({"mode":"allowlist","allow":["*.weather.test:443"],"deny":["x.test"]})");
  ActiveIntent intent;
  intent.name = "check-weather";
  intent.allow.push_back(*ParseHostRule("weather.example"));
  intent.expires_ms = 1234567;
  a.intents.push_back(intent);
  a.ca_cert_pem = "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n";
  a.ca_key_pem = "key";
  a.listener_fd = listener;
  uint32_t seq = 0;
  ASSERT_TRUE(p.esbd->Send(ToProxy(std::move(a)), &seq).ok());
  EXPECT_EQ(seq, 1u);
  uint32_t got_seq = 0;
  absl::StatusOr<ToProxy> m = p.proxy->ReceiveToProxy(&got_seq);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(got_seq, seq);
  Attach* got = std::get_if<Attach>(&*m);
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->env_id, "env-1");
  EXPECT_EQ(got->tenant, "acme");
  EXPECT_TRUE(got->policy ==
              Policy(R"({"mode":"allowlist","allow":["*.weather.test:443"],"deny":["x.test"]})"));
  ASSERT_EQ(got->intents.size(), 1u);
  EXPECT_EQ(got->intents[0], intent);
  EXPECT_EQ(got->ca_key_pem, "key");
  ASSERT_TRUE(got->received_listener);
  EXPECT_NE(got->listener_fd, listener);
  EXPECT_EQ(Inode(got->listener_fd), Inode(listener));  // the same socket
  close(listener);
}

TEST(ControlChannelTest, UpdateDetachPingAndRepliesRoundTrip) {
  Pair p;
  ASSERT_TRUE(p.esbd->Send(ToProxy(Update{"e", Policy(R"({"mode":"open"})"), {}})).ok());
  ASSERT_TRUE(p.esbd->Send(ToProxy(Detach{"e"})).ok());
  ASSERT_TRUE(p.esbd->Send(ToProxy(Ping{})).ok());
  auto u = p.proxy->ReceiveToProxy();
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(std::get<Update>(*u).policy.mode, EgressMode::kOpen);
  EXPECT_EQ(std::get<Detach>(*p.proxy->ReceiveToProxy()).env_id, "e");
  EXPECT_TRUE(std::holds_alternative<Ping>(*p.proxy->ReceiveToProxy()));

  AuditEvent e;
  e.time_ms = 42;
  e.env_id = "e";
  e.tenant = "t";
  e.intents = {"i1"};
  e.method = "POST";
  e.scheme = "https";
  e.host = "api.test";
  e.port = 443;
  e.path = "/v1?x=[masked]";
  e.status = 403;
  e.decision = "blocked";
  e.rule_ids = {"allow:api.test", "dlp:aws_access_key"};
  e.reason = "r";
  e.bytes_up = 1;
  e.bytes_down = 2;
  e.duration_ms = 3;
  e.request_headers = "Authorization: Bearer [masked]\n";
  e.request_body = "[REDACTED:dlp:aws_access_key]";
  e.request_body_truncated = true;
  e.request_body_sha256 = std::string(64, 'a');
  e.findings.push_back({"dlp:aws_access_key", "block", "body", 2});
  ASSERT_TRUE(p.proxy->Send(ToEsbd(e)).ok());
  ASSERT_TRUE(p.proxy->Send(ToEsbd(Health{7, 8, 1, 2, 3, 4})).ok());
  ASSERT_TRUE(p.proxy->Send(ToEsbd(Result{5, false, "bad"})).ok());
  auto ge = p.esbd->ReceiveToEsbd();
  ASSERT_TRUE(ge.ok()) << ge.status();
  const AuditEvent& g = std::get<AuditEvent>(*ge);
  EXPECT_EQ(boost::json::serialize(ToJson(g)), boost::json::serialize(ToJson(e)));
  auto gh = p.esbd->ReceiveToEsbd();
  ASSERT_TRUE(gh.ok());
  EXPECT_EQ(std::get<Health>(*gh).blocked_total, 4);
  auto gr = p.esbd->ReceiveToEsbd();
  ASSERT_TRUE(gr.ok());
  EXPECT_EQ(std::get<Result>(*gr).seq, 5u);
  EXPECT_FALSE(std::get<Result>(*gr).ok);
  EXPECT_EQ(std::get<Result>(*gr).error, "bad");
}

TEST(ControlChannelTest, AttachWithoutAPassedFdIsAnError) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ControlChannel proxy{UniqueFd(sv[1])};
  proto::Frame f;
  f.type = proto::FrameType::kRequest;
  f.stream = 1;
  f.header = boost::json::object{{"op", "attach"}};
  f.payload = R"({"env_id":"e","policy":{}})";
  std::string err;
  ASSERT_TRUE(proto::WriteFrame(sv[0], f, &err));
  auto m = proxy.ReceiveToProxy();
  EXPECT_FALSE(m.ok());
  EXPECT_NE(std::string(m.status().message()).find("without a passed fd"), std::string::npos);
  close(sv[0]);
}

TEST(ControlChannelTest, MalformedMessagesAreErrors) {
  for (std::string payload :
       {std::string("not json"), std::string(R"({"env_id":3})"),
        std::string(R"({"env_id":"e","policy":{"mode":"sideways"}})"), std::string(R"([1,2])")}) {
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    ControlChannel proxy{UniqueFd(sv[1])};
    proto::Frame f;
    f.type = proto::FrameType::kRequest;
    f.stream = 1;
    f.header = boost::json::object{{"op", "update"}};
    f.payload = payload;
    std::string err;
    ASSERT_TRUE(proto::WriteFrame(sv[0], f, &err));
    EXPECT_FALSE(proxy.ReceiveToProxy().ok()) << payload;
    close(sv[0]);
  }
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ControlChannel esbd{UniqueFd(sv[0])};
  ASSERT_EQ(write(sv[1], "\x00\x00\x00\x05garbage", 12), 12);
  EXPECT_FALSE(esbd.ReceiveToEsbd().ok());
  close(sv[1]);
}

// Attack: sandbox traffic with bytes that are not UTF-8 (a 0xFF in the target, a binary body)
// ends up in an audit event. Before, esbd's parser refused the event, closed the control
// channel and the proxy restarted for every tenant; now the event arrives, made valid.
TEST(ControlChannelTest, AuditEventWithInvalidUtf8ArrivesValid) {
  Pair p;
  AuditEvent e;
  e.env_id = "e1";
  e.method = "GET";
  e.host = "x.test";
  e.path = std::string("/\xff\xfe", 3);
  e.request_headers = "X-Bin: \x80\xc3\n";
  e.request_body = std::string("\x00\xff\x01", 3);
  e.decision = "blocked";
  ASSERT_TRUE(p.proxy->Send(ToEsbd(e)).ok());
  absl::StatusOr<ToEsbd> m = p.esbd->ReceiveToEsbd();
  ASSERT_TRUE(m.ok()) << m.status();
  const AuditEvent* got = std::get_if<AuditEvent>(&*m);
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->host, "x.test");
  EXPECT_EQ(got->path, "/\xEF\xBF\xBD\xEF\xBF\xBD");  // each bad byte is U+FFFD
  EXPECT_NE(got->request_headers.find("X-Bin: "), std::string::npos);
  EXPECT_EQ(got->request_body.size(), 1u + 3u + 1u);  // NUL, U+FFFD, 0x01
}

// A well-framed message esbd cannot parse is dropped; the channel keeps working (only framing
// or socket errors end it).
TEST(ControlClientTest, UnusableMessageIsDroppedAndTheChannelStaysUp) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::mutex mu;
  std::condition_variable cv;
  int healths = 0;
  bool closed = false;
  ControlClient::Callbacks cb;
  cb.on_health = [&](const Health&) {
    std::lock_guard<std::mutex> lock(mu);
    ++healths;
    cv.notify_all();
  };
  cb.on_closed = [&](const absl::Status&) {
    std::lock_guard<std::mutex> lock(mu);
    closed = true;
    cv.notify_all();
  };
  ControlClient client(UniqueFd(sv[0]), cb);
  proto::Frame bad;
  bad.type = proto::FrameType::kRequest;
  bad.stream = 1;
  bad.header = boost::json::object{{"op", "audit"}};
  bad.payload = "{\"host\":\"\xff\"}";  // invalid UTF-8: the parser refuses it
  std::string err;
  ASSERT_TRUE(proto::WriteFrame(sv[1], bad, &err)) << err;
  ControlChannel proxy{UniqueFd(sv[1])};
  ASSERT_TRUE(proxy.Send(ToEsbd(Health{})).ok());
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(5), [&] { return healths > 0 || closed; }));
  EXPECT_EQ(healths, 1);
  EXPECT_FALSE(closed);
}

TEST(ControlChannelTest, PeerCloseIsUnavailable) {
  Pair p;
  p.esbd.reset();
  auto m = p.proxy->ReceiveToProxy();
  EXPECT_TRUE(absl::IsUnavailable(m.status())) << m.status();
  EXPECT_EQ(m.status().message(), "control socket closed");
}

}  // namespace
}  // namespace esb::governance::control
