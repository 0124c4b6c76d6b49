// The request-head logic, the resolver overrides and the address refusal, without I/O.
#include "governance/proxy/request.h"

#include <boost/json.hpp>
#include <string>

#include "governance/proxy/resolver.h"
#include "gtest/gtest.h"

namespace esb::governance::proxy {
namespace {

http::request_header<> Head(const std::string& raw) {
  http::request_parser<http::empty_body> p;
  ConfigureRequestParser(p);
  boost::system::error_code ec;
  p.put(asio::buffer(raw), ec);
  EXPECT_FALSE(ec) << ec.message() << " in " << raw;
  return p.release().base();
}

RequestTarget Target(const std::string& raw, const TunnelTarget* tunnel = nullptr) {
  auto r = InterpretHead(Head(raw), tunnel);
  if (auto* refusal = std::get_if<Refusal>(&r)) {
    ADD_FAILURE() << "refused (" << refusal->status << " " << refusal->reason << "): " << raw;
    return {};
  }
  return std::get<RequestTarget>(r);
}

Refusal Refused(const std::string& raw, const TunnelTarget* tunnel = nullptr) {
  auto r = InterpretHead(Head(raw), tunnel);
  if (auto* refusal = std::get_if<Refusal>(&r)) return *refusal;
  ADD_FAILURE() << "accepted: " << raw;
  return {};
}

TEST(InterpretHeadTest, AbsoluteFormOnTheProxyPort) {
  RequestTarget t = Target("GET http://Weather.Test./a/b?c=d HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_FALSE(t.connect);
  EXPECT_EQ(t.host, "weather.test");
  EXPECT_EQ(t.port, 80);
  EXPECT_EQ(t.path, "/a/b?c=d");
  EXPECT_FALSE(t.host_is_ip);
  t = Target("GET http://weather.test:8080 HTTP/1.1\r\nHost: weather.test\r\n\r\n");
  EXPECT_EQ(t.port, 8080);
  EXPECT_EQ(t.path, "/");
  t = Target("GET http://weather.test?q=1 HTTP/1.1\r\nHost: weather.test\r\n\r\n");
  EXPECT_EQ(t.path, "/?q=1");
  t = Target("GET http://[2001:db8::1]:81/ HTTP/1.1\r\nHost: h\r\n\r\n");
  EXPECT_EQ(t.host, "2001:db8::1");
  EXPECT_TRUE(t.host_is_ip);
  EXPECT_EQ(t.port, 81);
  t = Target("GET http://203.0.113.7/ HTTP/1.1\r\nHost: h\r\n\r\n");
  EXPECT_TRUE(t.host_is_ip);
}

TEST(InterpretHeadTest, ConnectNeedsHostAndPort) {
  RequestTarget t = Target("CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com\r\n\r\n");
  EXPECT_TRUE(t.connect);
  EXPECT_EQ(t.host, "api.example.com");
  EXPECT_EQ(t.port, 443);
  EXPECT_EQ(Refused("CONNECT api.example.com HTTP/1.1\r\nHost: a\r\n\r\n").status, 400);
  EXPECT_EQ(Refused("CONNECT api.example.com:0 HTTP/1.1\r\nHost: a\r\n\r\n").status, 400);
  EXPECT_EQ(Refused("CONNECT api.example.com:99999 HTTP/1.1\r\nHost: a\r\n\r\n").status, 400);
  EXPECT_EQ(Refused("CONNECT bad_host!:443 HTTP/1.1\r\nHost: a\r\n\r\n").status, 400);
  TunnelTarget tunnel{"api.example.com", 443};
  EXPECT_EQ(Refused("CONNECT other.com:443 HTTP/1.1\r\nHost: a\r\n\r\n", &tunnel).status, 400);
}

TEST(InterpretHeadTest, RefusesAmbiguousFramingAndOtherSchemes) {
  EXPECT_EQ(Refused("GET /x HTTP/1.1\r\nHost: a\r\n\r\n").status, 400);
  EXPECT_EQ(Refused("GET https://a.test/ HTTP/1.1\r\nHost: a\r\n\r\n").status, 400);
  EXPECT_EQ(Refused("GET ftp://a.test/ HTTP/1.1\r\nHost: a\r\n\r\n").status, 400);
  EXPECT_EQ(Refused("GET http://u:p@a.test/ HTTP/1.1\r\nHost: a\r\n\r\n").status, 400);
  EXPECT_EQ(Refused("GET http://a.test:x/ HTTP/1.1\r\nHost: a\r\n\r\n").status, 400);
  EXPECT_EQ(Refused("GET http://a.test/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n").status, 400);
  EXPECT_EQ(Refused("POST http://a.test/ HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, "
                    "chunked\r\n\r\n")
                .status,
            501);
  EXPECT_EQ(Refused("GET http://a.test/ HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\n\r\n").status, 501);
}

TEST(InterpretHeadTest, InsideATunnelHostMustMatchTheConnectTarget) {
  TunnelTarget tunnel{"api.example.com", 443};
  RequestTarget t = Target("GET /v1 HTTP/1.1\r\nHost: api.example.com\r\n\r\n", &tunnel);
  EXPECT_EQ(t.host, "api.example.com");
  EXPECT_EQ(t.port, 443);
  EXPECT_EQ(t.path, "/v1");
  Target("GET /v1 HTTP/1.1\r\nHost: API.example.com:443\r\n\r\n", &tunnel);
  // Domain fronting: Host names another host than the tunnel → 421.
  Refusal r = Refused("GET /v1 HTTP/1.1\r\nHost: evil.test\r\n\r\n", &tunnel);
  EXPECT_EQ(r.status, 421);
  EXPECT_EQ(r.rule, "tls:host_mismatch");
  EXPECT_EQ(Refused("GET /v1 HTTP/1.1\r\nHost: api.example.com:8443\r\n\r\n", &tunnel).status, 421);
  EXPECT_EQ(
      Refused("GET https://evil.test/v1 HTTP/1.1\r\nHost: api.example.com\r\n\r\n", &tunnel).status,
      421);
  EXPECT_EQ(Refused("GET /v1 HTTP/1.1\r\n\r\n", &tunnel).status, 400);  // 1.1 without Host
}

TEST(PrepareUpstreamHeadTest, OriginFormHostAndNoHopByHopHeaders) {
  http::request_header<> h = Head(
      "POST http://a.test:8080/p?q HTTP/1.0\r\nHost: wrong\r\nConnection: keep-alive, X-Hop\r\n"
      "X-Hop: 1\r\nKeep-Alive: 5\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: Basic "
      "eA==\r\nTE: trailers\r\nExpect: 100-continue\r\nX-Keep: yes\r\n\r\n");
  RequestTarget t = std::get<RequestTarget>(InterpretHead(h, nullptr));
  PrepareUpstreamHead(h, t);
  EXPECT_EQ(std::string(h.target()), "/p?q");
  EXPECT_EQ(std::string(h[http::field::host]), "a.test:8080");
  EXPECT_EQ(h.version(), 11u);
  for (const char* gone : {"Connection", "X-Hop", "Keep-Alive", "Proxy-Connection",
                           "Proxy-Authorization", "TE", "Expect"}) {
    EXPECT_EQ(h.count(gone), 0u) << gone;
  }
  EXPECT_EQ(std::string(h["X-Keep"]), "yes");
  RequestTarget v6{false, "2001:db8::1", true, 443, "/"};
  PrepareUpstreamHead(h, v6);
  EXPECT_EQ(std::string(h[http::field::host]), "[2001:db8::1]");
}

TEST(BlockResponseTest, ShapeOfADenial) {
  auto res = BlockResponse(403, "deny:*.evil.test", "x.evil.test", "not allowed", 11, true);
  EXPECT_EQ(res.result_int(), 403);
  EXPECT_EQ(std::string(res["X-Esb-Blocked"]), "deny:*.evil.test");
  EXPECT_TRUE(res.keep_alive());
  boost::json::object body = boost::json::parse(res.body()).as_object();
  EXPECT_EQ(body["error"].as_string(), "egress_blocked");
  EXPECT_EQ(body["rule"].as_string(), "deny:*.evil.test");
  EXPECT_EQ(body["host"].as_string(), "x.evil.test");
  EXPECT_EQ(body["reason"].as_string(), "not allowed");
  EXPECT_NE(std::string(body["hint"].as_string()).find("will not help"), std::string::npos);
  auto err = BlockResponse(502, "upstream:connect_failed", "a", "refused", 11, false);
  EXPECT_EQ(err.count("X-Esb-Blocked"), 0u);
  EXPECT_EQ(boost::json::parse(err.body()).as_object()["error"].as_string(), "egress_error");
}

TEST(CheckRawHeadTest, FoldingAndFieldFloods) {
  EXPECT_EQ(CheckRawHead("GET / HTTP/1.1\r\nA: b\r\n\r\n"), "");
  EXPECT_NE(CheckRawHead("GET / HTTP/1.1\r\nA: b\r\n c\r\n\r\n"), "");
  std::string flood = "GET / HTTP/1.1\r\n";
  for (int i = 0; i < 200; ++i) flood += "a:\r\n";
  EXPECT_NE(CheckRawHead(flood + "\r\n"), "");
}

TEST(AddressTest, PrivateLoopbackLinkLocalMetadataUlaAndMappedAreForbidden) {
  for (const char* a : {"0.0.0.0",
                        "10.1.2.3",
                        "100.64.0.1",
                        "100.127.255.255",
                        "127.0.0.1",
                        "127.9.9.9",
                        "169.254.169.254",
                        "172.16.0.1",
                        "172.31.255.255",
                        "192.168.1.1",
                        "192.0.0.170",
                        "198.18.0.1",
                        "224.0.0.1",
                        "255.255.255.255",
                        "::",
                        "::1",
                        "::ffff:127.0.0.1",
                        "::ffff:8.8.8.8",
                        "::127.0.0.1",
                        "64:ff9b::a9fe:a9fe",
                        "fc00::1",
                        "fd00:ec2::254",
                        "fe80::1",
                        "fec0::1",
                        "ff02::1",
                        "2002:a9fe:a9fe::1",
                        "2001:db8::1",
                        "100::1"}) {
    EXPECT_TRUE(IsForbiddenAddress(asio::ip::make_address(a))) << a;
  }
  for (const char* a : {"8.8.8.8", "1.1.1.1", "100.63.255.255", "100.128.0.0", "172.32.0.1",
                        "169.253.255.255", "2606:4700::1111", "2a00:1450::1"}) {
    EXPECT_FALSE(IsForbiddenAddress(asio::ip::make_address(a))) << a;
  }
}

TEST(ResolveOverrideTest, ParsesNameHostPort) {
  auto o = ParseResolveOverride("Weather.Test=127.0.0.1:18080");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->name, "weather.test");
  EXPECT_EQ(o->endpoint.address().to_string(), "127.0.0.1");
  EXPECT_EQ(o->endpoint.port(), 18080);
  o = ParseResolveOverride("git.test=[::1]:8443");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->endpoint.address().to_string(), "::1");
  for (const char* bad : {"weather.test", "=1.2.3.4:80", "w.test=1.2.3.4", "w.test=host:80",
                          "w.test=1.2.3.4:0", "w.test=1.2.3.4:70000", "bad name=1.2.3.4:80"}) {
    EXPECT_FALSE(ParseResolveOverride(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace esb::governance::proxy
