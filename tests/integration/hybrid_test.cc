// The heavy tier's notebook features end to end, against the real esbd and real containers:
// matplotlib figures captured as PNG artifacts (pixels checked), files under
// /workspace/artifacts, DataFrame tables, output streamed over SSE while a cell runs, and
// `packages` installed from a package index served on loopback by the test itself (then from
// the host cache with that index gone).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>

#include "integration/daemon.h"

namespace esb::testing {
namespace {
namespace json = boost::json;

// ---------------------------------------------------------------------------------------------
// A small PNG reader (8-bit RGB/RGBA, non-interlaced: what matplotlib's Agg writes).

struct Image {
  int width = 0, height = 0, channels = 0;
  std::vector<uint8_t> pixels;  // rows of width*channels bytes
  std::array<int, 3> Rgb(int x, int y) const {
    const uint8_t* p = &pixels[(static_cast<size_t>(y) * width + x) * channels];
    return {p[0], p[1], p[2]};
  }
};

uint32_t Be32(const std::string& s, size_t at) {
  return (uint32_t(uint8_t(s[at])) << 24) | (uint32_t(uint8_t(s[at + 1])) << 16) |
         (uint32_t(uint8_t(s[at + 2])) << 8) | uint32_t(uint8_t(s[at + 3]));
}

bool DecodePng(const std::string& png, Image* img, std::string* why) {
  if (png.size() < 8 || png.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0) {
    *why = "no PNG signature";
    return false;
  }
  std::string idat;
  int depth = 0, color = 0, interlace = 0;
  for (size_t at = 8; at + 12 <= png.size();) {
    uint32_t len = Be32(png, at);
    std::string type = png.substr(at + 4, 4);
    if (at + 12 + len > png.size()) break;
    if (type == "IHDR") {
      img->width = static_cast<int>(Be32(png, at + 8));
      img->height = static_cast<int>(Be32(png, at + 12));
      depth = uint8_t(png[at + 16]);
      color = uint8_t(png[at + 17]);
      interlace = uint8_t(png[at + 20]);
    } else if (type == "IDAT") {
      idat += png.substr(at + 8, len);
    }
    at += 12 + len;
  }
  if (depth != 8 || (color != 2 && color != 6) || interlace != 0) {
    *why = "unsupported PNG format";
    return false;
  }
  img->channels = color == 6 ? 4 : 3;
  const size_t stride = static_cast<size_t>(img->width) * img->channels;
  std::vector<uint8_t> raw((stride + 1) * img->height);
  uLongf raw_len = raw.size();
  if (uncompress(raw.data(), &raw_len, reinterpret_cast<const Bytef*>(idat.data()),
                 idat.size()) != Z_OK ||
      raw_len != raw.size()) {
    *why = "bad IDAT stream";
    return false;
  }
  img->pixels.assign(stride * img->height, 0);
  const int bpp = img->channels;
  for (int y = 0; y < img->height; ++y) {
    uint8_t filter = raw[y * (stride + 1)];
    const uint8_t* in = &raw[y * (stride + 1) + 1];
    uint8_t* out = &img->pixels[y * stride];
    const uint8_t* prev = y > 0 ? &img->pixels[(y - 1) * stride] : nullptr;
    for (size_t i = 0; i < stride; ++i) {
      int a = i >= static_cast<size_t>(bpp) ? out[i - bpp] : 0;
      int b = prev ? prev[i] : 0;
      int c = (prev && i >= static_cast<size_t>(bpp)) ? prev[i - bpp] : 0;
      int pred = 0;
      switch (filter) {
        case 0: pred = 0; break;
        case 1: pred = a; break;
        case 2: pred = b; break;
        case 3: pred = (a + b) / 2; break;
        case 4: {
          int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
          pred = (pa <= pb && pa <= pc) ? a : (pb <= pc ? b : c);
          break;
        }
        default: *why = "bad filter type"; return false;
      }
      out[i] = static_cast<uint8_t>(in[i] + pred);
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------

class HybridTest : public SharedDaemonTest<HybridTest> {
 protected:
  void TearDown() override {
    if (daemon_ && !id_.empty()) daemon_->Call("DELETE", "/environments/" + id_);
  }
  std::string Env() {
    if (id_.empty()) id_ = daemon_->CreateEnv(json::object{{"runtime", "container"}});
    return id_;
  }
  HttpResult Cell(const std::string& code, json::object extra = {}) {
    extra["code"] = code;
    HttpResult r = daemon_->Call("POST", "/environments/" + Env() + "/run", extra);
    EXPECT_EQ(r.status, 200) << r.body;
    return r;
  }
  static const json::array& Artifacts(const HttpResult& r) {
    static const json::array kEmpty;
    const json::value* a = r.obj().if_contains("artifacts");
    return a && a->is_array() ? a->as_array() : kEmpty;
  }
  static std::string S(const json::value& o, const char* key) {
    const json::value* v = o.as_object().if_contains(key);
    return v && v->is_string() ? std::string(v->as_string()) : "";
  }
  std::string id_;
};

// A 100x50 figure: left half red (the figure's background), right half a blue rectangle.
constexpr char kTwoColourFigure[] = R"PY(
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle
fig = plt.figure(figsize=(2, 1), dpi=50)
fig.patch.set_facecolor((1, 0, 0))
ax = fig.add_axes([0.5, 0, 0.5, 1])
ax.set_axis_off()
ax.add_patch(Rectangle((0, 0), 1, 1, color=(0, 0, 1)))
ax.set_xlim(0, 1)
ax.set_ylim(0, 1)
fig.suptitle("two colours", fontsize=4)
)PY";

TEST_F(HybridTest, PltShowIsCapturedAsAPngArtifactWithTheRightPixels) {
  HttpResult r = Cell(std::string(kTwoColourFigure) + "plt.show()\nprint('shown')");
  ASSERT_EQ(r.num("exit_code"), 0) << r.body;
  EXPECT_EQ(r.str("stdout"), "shown\n");
  ASSERT_EQ(Artifacts(r).size(), 1u) << r.body;
  const json::value& a = Artifacts(r)[0];
  EXPECT_EQ(S(a, "kind"), "image");
  EXPECT_EQ(S(a, "mime_type"), "image/png");
  EXPECT_EQ(S(a, "name"), "figure-1.png");
  EXPECT_EQ(S(a, "title"), "two colours");
  EXPECT_EQ(S(a, "environment_id"), id_);
  EXPECT_GT(a.as_object().at("step").as_int64(), 0);
  const std::string url = S(a, "url");
  EXPECT_EQ(url, "/environments/" + id_ + "/artifacts/" + S(a, "id"));
  HttpResult png = daemon_->Call("GET", url);
  ASSERT_EQ(png.status, 200);
  EXPECT_EQ(png.headers["content-type"], "image/png");
  EXPECT_EQ(static_cast<int64_t>(png.body.size()), a.as_object().at("size").as_int64());
  Image img;
  std::string why;
  ASSERT_TRUE(DecodePng(png.body, &img, &why)) << why;
  EXPECT_EQ(img.width, 100);
  EXPECT_EQ(img.height, 50);
  auto near = [](std::array<int, 3> got, std::array<int, 3> want) {
    for (int i = 0; i < 3; ++i)
      if (std::abs(got[i] - want[i]) > 8) return false;
    return true;
  };
  // Away from the title (top centre) and the boundary.
  for (int y : {25, 40, 48}) {
    EXPECT_TRUE(near(img.Rgb(10, y), {255, 0, 0})) << "left pixel at y=" << y;
    EXPECT_TRUE(near(img.Rgb(90, y), {0, 0, 255})) << "right pixel at y=" << y;
  }
  // The figure was closed after capture: the next cell captures nothing.
  EXPECT_TRUE(Artifacts(Cell("1 + 1")).empty());
  // The listing has it.
  HttpResult list = daemon_->Call("GET", "/environments/" + id_ + "/artifacts");
  ASSERT_EQ(list.status, 200) << list.body;
  ASSERT_EQ(list.obj().at("artifacts").as_array().size(), 1u);
}

TEST_F(HybridTest, OpenFiguresAndSvgAndArtifactFilesAreCapturedAtTheEndOfACell) {
  HttpResult r = Cell(std::string(kTwoColourFigure) +
                          "import os\n"
                          "open('/workspace/artifacts/report.csv', 'w').write('a,b\\n1,2\\n')\n",
                      json::object{{"figure_formats", json::array{"png", "svg"}}});
  ASSERT_EQ(r.num("exit_code"), 0) << r.body;
  ASSERT_EQ(Artifacts(r).size(), 3u) << r.body;
  EXPECT_EQ(S(Artifacts(r)[0], "mime_type"), "image/png");
  EXPECT_EQ(S(Artifacts(r)[1], "mime_type"), "image/svg+xml");
  EXPECT_EQ(S(Artifacts(r)[2], "name"), "report.csv");
  EXPECT_EQ(S(Artifacts(r)[2], "kind"), "file");
  EXPECT_EQ(S(Artifacts(r)[2], "mime_type"), "text/csv");
  HttpResult svg = daemon_->Call("GET", S(Artifacts(r)[1], "url"));
  ASSERT_EQ(svg.status, 200);
  EXPECT_NE(svg.body.find("<svg"), std::string::npos);
  // Script in an SVG must never run in a browser that opens it from the daemon's origin.
  EXPECT_NE(svg.headers["content-security-policy"].find("sandbox"), std::string::npos);
  EXPECT_EQ(svg.headers["x-content-type-options"], "nosniff");
  HttpResult csv = daemon_->Call("GET", S(Artifacts(r)[2], "url"));
  ASSERT_EQ(csv.status, 200);
  EXPECT_EQ(csv.body, "a,b\n1,2\n");
  // An unchanged file is not reported again; a rewritten one is.
  EXPECT_TRUE(Artifacts(Cell("x = 1")).empty());
  HttpResult again = Cell("open('/workspace/artifacts/report.csv', 'a').write('3,4\\n')");
  ASSERT_EQ(Artifacts(again).size(), 1u) << again.body;
  EXPECT_EQ(daemon_->Call("GET", S(Artifacts(again)[0], "url")).body, "a,b\n1,2\n3,4\n");
}

// Figures left open beyond the per-cell limit are closed, not drawn, and the answer says so.
TEST_F(HybridTest, TooManyOpenFiguresAreCappedAndReported) {
  HttpResult r = Cell(
      "import matplotlib.pyplot as plt\n"
      "for i in range(40):\n    plt.figure(figsize=(0.5, 0.5))\n"
      "len(plt.get_fignums())");
  ASSERT_EQ(r.num("exit_code"), 0) << r.body.substr(0, 500);
  EXPECT_EQ(r.str("value"), "40");
  EXPECT_EQ(Artifacts(r).size(), 32u);
  ASSERT_TRUE(r.obj().contains("artifact_errors")) << r.body.substr(0, 500);
  EXPECT_NE(json::serialize(r.obj().at("artifact_errors")).find("8 more open figure"),
            std::string::npos)
      << json::serialize(r.obj().at("artifact_errors"));
  EXPECT_EQ(Cell("import matplotlib.pyplot as plt\nlen(plt.get_fignums())").str("value"), "0");
}

TEST_F(HybridTest, ArtifactsOfOneShotRunsOutliveTheirEnvironment) {
  HttpResult r = daemon_->Call(
      "POST", "/run",
      json::object{{"code", std::string(kTwoColourFigure) + "plt.show()"}, {"runtime", "auto"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.str("tier"), "heavy") << r.body;  // matplotlib routes to heavy
  ASSERT_EQ(Artifacts(r).size(), 1u) << r.body;
  const std::string env = S(Artifacts(r)[0], "environment_id");
  EXPECT_EQ(daemon_->Call("GET", "/environments/" + env).str("state"), "destroyed");
  HttpResult png = daemon_->Call("GET", S(Artifacts(r)[0], "url"));
  ASSERT_EQ(png.status, 200);
  Image img;
  std::string why;
  ASSERT_TRUE(DecodePng(png.body, &img, &why)) << why;
  EXPECT_EQ(img.width, 100);
}

// Attack (issue 11): sandbox code replaces the Python kernel so that the next cell, or esbd
// reading its result, runs the attacker's code. The kernel is a read-only bind from the
// driver's share (/usr/lib/esb/kernel.py); a copy planted where esbd used to write it
// (/tmp/.esb-kernel/kernel.py) is never run.
TEST_F(HybridTest, KernelReplacedFromInsideTheSandboxIsNeverRun) {
  HttpResult r = Cell(R"PY(
import os
try:
    open('/usr/lib/esb/kernel.py', 'a').write('\nraise SystemExit("pwned")\n')
    print('kernel writable')
except OSError as e:
    print('refused', e.errno)
try:
    os.remove('/usr/lib/esb/kernel.py')
    print('kernel removed')
except OSError as e:
    print('refused', e.errno)
os.makedirs('/tmp/.esb-kernel', exist_ok=True)
open('/tmp/.esb-kernel/kernel.py', 'w').write('print("planted kernel ran")\n')
)PY");
  EXPECT_EQ(r.str("stdout").find("kernel writable"), std::string::npos) << r.body;
  EXPECT_EQ(r.str("stdout").find("kernel removed"), std::string::npos) << r.body;
  EXPECT_NE(r.str("stdout").find("refused"), std::string::npos) << r.body;
  // The next cell still runs in the real kernel, with the first cell's state.
  HttpResult next = Cell("1 + 1");
  EXPECT_EQ(next.str("value"), "2") << next.body;
  EXPECT_EQ(next.str("stdout").find("planted"), std::string::npos) << next.body;
  HttpResult ls =
      daemon_->Call("POST", "/environments/" + Env() + "/execute",
                    json::object{{"command", "stat -c '%U %a' /usr/lib/esb/kernel.py"}});
  // Owned by the host's root: "root" without a user namespace, the unmapped "nobody" with one
  // (docs/design.md, user namespaces); never the sandbox user, never writable by it.
  EXPECT_TRUE(ls.str("stdout") == "root 644\n" || ls.str("stdout") == "nobody 644\n") << ls.body;
}

TEST_F(HybridTest, UnknownArtifactsGet404) {
  HttpResult r = Cell("open('/workspace/artifacts/secret.txt', 'w').write('s3cret')");
  ASSERT_EQ(Artifacts(r).size(), 1u) << r.body;
  const std::string aid = S(Artifacts(r)[0], "id");
  EXPECT_EQ(daemon_->Call("GET", "/environments/" + id_ + "/artifacts/art_000000000000000000000000")
                .status,
            404);
  EXPECT_EQ(daemon_->Call("GET", "/environments/env_nope/artifacts/" + aid).status, 404);
  EXPECT_EQ(daemon_->Call("GET", "/environments/env_nope/artifacts").status, 404);
  // Tenant scoping of the store itself is covered by artifact_store_test; the SDK's
  // two-tenant end-to-end tests cover it through the API.
}

TEST_F(HybridTest, OnlyRasterImagesAreServedInline) {
  HttpResult r = Cell(
      "open('/workspace/artifacts/page.html', 'w').write('<script>alert(1)</script>')\n"
      "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()");
  ASSERT_EQ(Artifacts(r).size(), 2u) << r.body;
  HttpResult png = daemon_->Call("GET", S(Artifacts(r)[0], "url"));
  EXPECT_EQ(png.headers["content-type"], "image/png");
  EXPECT_EQ(png.headers.count("content-disposition"), 0u);
  HttpResult html = daemon_->Call("GET", S(Artifacts(r)[1], "url"));
  EXPECT_EQ(html.headers["content-type"], "text/html");
  EXPECT_EQ(html.headers["content-disposition"], "attachment; filename=\"page.html\"");
  EXPECT_NE(html.headers["content-security-policy"].find("sandbox"), std::string::npos);
}

TEST_F(HybridTest, DataFrameFinalValueComesBackAsATable) {
  HttpResult r = Cell(
      "import pandas as pd\n"
      "df = pd.DataFrame({'city': ['Oslo', 'Lima', None], 'temp': [3.5, 19.0, float('nan')],"
      " 'n': [1, 2, 3]})\n"
      "df");
  ASSERT_EQ(r.num("exit_code"), 0) << r.body;
  const json::value* t = r.obj().if_contains("table");
  ASSERT_TRUE(t && t->is_object()) << r.body;
  const json::object& table = t->as_object();
  EXPECT_EQ(json::serialize(table.at("columns")), R"(["city","temp","n"])");
  EXPECT_EQ(json::serialize(table.at("rows")),
            R"([["Oslo",3.5E0,1],["Lima",1.9E1,2],[null,null,3]])");
  EXPECT_EQ(json::serialize(table.at("index")), "[0,1,2]");
  EXPECT_EQ(table.at("total_rows").as_int64(), 3);
  EXPECT_FALSE(table.at("truncated").as_bool());
  EXPECT_NE(r.str("value").find("Oslo"), std::string::npos);  // the text form too
  // A big frame is cut, and says so.
  HttpResult big = Cell("pd.DataFrame({'i': range(5000)})");
  const json::object& bt = big.obj().at("table").as_object();
  EXPECT_EQ(bt.at("total_rows").as_int64(), 5000);
  EXPECT_TRUE(bt.at("truncated").as_bool());
  EXPECT_LT(bt.at("rows").as_array().size(), 5000u);
  // Not a DataFrame: no table.
  EXPECT_TRUE(Cell("[1, 2]").obj().at("table").is_null());
}

TEST_F(HybridTest, CellOutputStreamsOverSseBeforeTheResult) {
  HttpResult r = daemon_->Call(
      "POST", "/environments/" + Env() + "/run",
      json::object{{"code", "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n"
                            "    time.sleep(0.3)\n'done'"}},
      {{"Accept", "text/event-stream"}});
  ASSERT_EQ(r.status, 200) << r.body;
  std::vector<SseEvent> events = ParseSse(r.body);
  ASSERT_FALSE(events.empty());
  std::string streamed;
  int stdout_events = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    ASSERT_EQ(events[i].event, "stdout") << r.body;
    streamed += json::value_to<std::string>(events[i].data.at("data"));
    ++stdout_events;
  }
  // Three prints 0.3 s apart arrive as three events (one per line, the newline included),
  // not as one blob at the end.
  EXPECT_EQ(stdout_events, 3) << r.body;
  EXPECT_EQ(json::value_to<std::string>(events[0].data.at("data")), "tick 0\n");
  EXPECT_EQ(streamed, "tick 0\ntick 1\ntick 2\n");
  ASSERT_EQ(events.back().event, "result");
  EXPECT_EQ(json::value_to<std::string>(events.back().data.at("value")), "'done'");
  EXPECT_EQ(events.back().data.at("exit_code").as_int64(), 0);
  // One-shot runs stream too, and a bad id is a plain 404 rather than a stream.
  HttpResult one = daemon_->Call("POST", "/run",
                                 json::object{{"code", "print('hi')"}, {"runtime", "heavy"}},
                                 {{"Accept", "text/event-stream"}});
  ASSERT_EQ(one.status, 200);
  std::vector<SseEvent> ev = ParseSse(one.body);
  ASSERT_GE(ev.size(), 2u) << one.body;
  EXPECT_EQ(ev.front().event, "stdout");
  EXPECT_EQ(ev.back().event, "result");
  EXPECT_EQ(daemon_->Call("POST", "/environments/env_nope/run", json::object{{"code", "1"}},
                          {{"Accept", "text/event-stream"}})
                .status,
            404);
}

// stdout and stderr events come in the order the cell wrote them, in both kinds of run.
TEST_F(HybridTest, StdoutAndStderrEventsKeepTheirOrder) {
  const std::string code =
      "import sys\nfor i in range(20):\n    sys.stderr.write('E%d\\n' % i)\n"
      "    print('O%d' % i)\n";
  std::string expected;
  for (int i = 0; i < 20; ++i) expected += "stderr:E" + std::to_string(i) + "\n" +
                                           "stdout:O" + std::to_string(i) + "\n";
  for (const std::string target : {"/environments/" + Env() + "/run", std::string("/run")}) {
    SCOPED_TRACE(target);
    json::object body{{"code", code}};
    if (target == "/run") body["runtime"] = "heavy";
    HttpResult r = daemon_->Call("POST", target, body, {{"Accept", "text/event-stream"}});
    ASSERT_EQ(r.status, 200) << r.body;
    std::string seen;
    for (const SseEvent& e : ParseSse(r.body)) {
      if (e.event != "stdout" && e.event != "stderr") continue;
      seen += e.event + ":" + json::value_to<std::string>(e.data.at("data"));
    }
    EXPECT_EQ(seen, expected);
    // Without SSE the two texts come back whole.
    HttpResult plain = daemon_->Call("POST", target, body);
    ASSERT_EQ(plain.status, 200) << plain.body;
    EXPECT_EQ(plain.str("stdout").substr(0, 6), "O0\nO1\n");
    EXPECT_EQ(plain.str("stderr").substr(0, 6), "E0\nE1\n");
  }
}

TEST_F(HybridTest, WithoutAnIndexOnlyPreinstalledPackagesAreAccepted) {
  // Without an index, what the image already has is accepted (pandas is in it)...
  HttpResult ok = daemon_->Call(
      "POST", "/run",
      json::object{{"code", "import pandas\nprint('ok')"}, {"packages", json::array{"pandas"}}});
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(ok.str("stdout"), "ok\n");
  ASSERT_TRUE(ok.obj().at("packages").is_array()) << ok.body;
  EXPECT_EQ(json::serialize(ok.obj().at("packages").as_array().at(0).at("preinstalled")), "true");
  // ... anything else is refused, naming the setting.
  HttpResult r = daemon_->Call(
      "POST", "/run", json::object{{"code", "1"}, {"packages", json::array{"esbtestpkg"}}});
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("packages.index_url"), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("esbtestpkg"), std::string::npos) << r.body;
  r = daemon_->Call("POST", "/run",
                    json::object{{"code", "1"}, {"runtime", "nano"}, {"packages", json::array{"six"}}});
  EXPECT_EQ(r.status, 400) << r.body;
  r = daemon_->Call("POST", "/run", json::object{{"code", "1"}, {"figure_formats", json::array{"gif"}}});
  EXPECT_EQ(r.status, 400) << r.body;
  // `requirements`: requirements.txt text (comments, blank lines, CRLF) joins `packages` and,
  // like them, sends a run that imports nothing special to the heavy tier.
  HttpResult req = daemon_->Call(
      "POST", "/run",
      json::object{{"code", "print('req ok')"},
                   {"requirements", "# what the notebook needs\r\nnumpy  # in the image\n\npandas\n"}});
  ASSERT_EQ(req.status, 200) << req.body;
  EXPECT_EQ(req.str("stdout"), "req ok\n");
  EXPECT_EQ(req.str("tier"), "heavy") << req.body;
  EXPECT_EQ(req.str("reason"), "packages requested") << req.body;
  ASSERT_TRUE(req.obj().at("packages").is_array()) << req.body;
  EXPECT_EQ(req.obj().at("packages").as_array().size(), 2u) << req.body;
  for (const json::value& bad :
       {json::value("-r other.txt"), json::value("numpy \\\n  >=1"), json::value(5),
        json::value(json::array{"numpy", 7}), json::value(json::array{"--index-url x"})}) {
    r = daemon_->Call("POST", "/run", json::object{{"code", "1"}, {"requirements", bad}});
    EXPECT_EQ(r.status, 400) << json::serialize(bad) << ": " << r.body;
    EXPECT_NE(r.body.find("requirements"), std::string::npos) << r.body;
  }
}

// ---------------------------------------------------------------------------------------------
// packages: a daemon configured with the test's own index.

class PackagesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!Daemon::SkipReason().empty()) return;
    if (!StartIndex()) return;
    daemon_ = new Daemon();
    Daemon::Options o;
    o.config_json = json::serialize(json::object{
        {"packages", json::object{{"index_url", "http://127.0.0.1:" +
                                                    std::to_string(index_port_) + "/simple/"}}}});
    if (!daemon_->Start(o)) {
      delete daemon_;
      daemon_ = nullptr;
    }
  }
  static void TearDownTestSuite() {
    StopIndex();
    if (daemon_) daemon_->StopAndCleanup();
    delete daemon_;
    daemon_ = nullptr;
  }
  // Starts the index; on `port` when given (a restart keeps the daemon's index_url valid).
  static bool StartIndex(int port = 0) {
    int out[2];
    if (::pipe(out) != 0) return false;
    index_pid_ = ::fork();
    if (index_pid_ == 0) {
      ::dup2(out[1], 1);
      ::close(out[0]);
      ::close(out[1]);
      std::string script = std::string(ESB_SOURCE_DIR) + "/tests/integration/package_index.py";
      const std::string port_arg = std::to_string(port);
      ::execlp("python3", "python3", script.c_str(), port_arg.c_str(), nullptr);
      ::_exit(127);
    }
    ::close(out[1]);
    std::string line;
    char c;
    while (::read(out[0], &c, 1) == 1 && c != '\n') line += c;
    ::close(out[0]);
    if (line.rfind("PORT ", 0) != 0) return false;
    index_port_ = std::stoi(line.substr(5));
    return true;
  }
  static void StopIndex() {
    if (index_pid_ > 0) {
      ::kill(index_pid_, SIGKILL);
      ::waitpid(index_pid_, nullptr, 0);
      index_pid_ = -1;
    }
  }
  static json::array IndexRequests() {
    HttpResult r = Http(index_port_, "GET", "/_requests");
    return r.json.is_array() ? r.json.as_array() : json::array{};
  }
  void SetUp() override {
    std::string why = Daemon::SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    ASSERT_GT(index_port_, 0) << "the test's package index did not start";
    ASSERT_NE(daemon_, nullptr) << "suite set-up failed";
  }
  static std::string Packages(const HttpResult& r) {
    std::string out;
    const json::value* p = r.obj().if_contains("packages");
    if (!p || !p->is_array()) return "<none>";
    for (const json::value& v : p->as_array()) {
      const json::object& o = v.as_object();
      out += json::value_to<std::string>(o.at("name")) + "=" +
             json::value_to<std::string>(o.at("version"));
      if (const json::value* fc = o.if_contains("from_cache"))
        out += fc->as_bool() ? "(cache)" : "(index)";
      if (o.contains("preinstalled")) out += "(preinstalled)";
      out += " ";
    }
    return out;
  }
  static Daemon* daemon_;
  static pid_t index_pid_;
  static int index_port_;
};
Daemon* PackagesTest::daemon_ = nullptr;
pid_t PackagesTest::index_pid_ = -1;
int PackagesTest::index_port_ = 0;

TEST_F(PackagesTest, BadRequirementsAre400) {
  for (const char* bad : {"-e git+https://example.org/x.git", "pkg @ https://evil/x.whl",
                          "../../etc/passwd", "a b", ""}) {
    HttpResult r = daemon_->Call(
        "POST", "/run", json::object{{"code", "1"}, {"packages", json::array{bad}}});
    EXPECT_EQ(r.status, 400) << bad << ": " << r.body;
  }
  HttpResult missing = daemon_->Call(
      "POST", "/run",
      json::object{{"code", "1"}, {"packages", json::array{"no-such-package-anywhere"}}});
  EXPECT_GE(missing.status, 400) << missing.body;
  EXPECT_NE(missing.body.find("no-such-package-anywhere"), std::string::npos) << missing.body;
}

TEST_F(PackagesTest, InstallsFromTheIndexWithDependenciesThenFromTheHostCacheOffline) {
  const std::string code = "import esbtestpkg\nprint(esbtestpkg.hello())";
  // 1. From the index: esbtestpkg 1.0 needs esbtestdep, which pip asks for and esbd fetches.
  HttpResult r = daemon_->Call(
      "POST", "/run", json::object{{"code", code}, {"packages", json::array{"esbtestpkg"}}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.num("exit_code"), 0) << r.body;
  EXPECT_EQ(r.str("tier"), "heavy");
  EXPECT_EQ(r.str("stdout"), "hello from esbtestpkg 1.0 with dep 1.1\n") << r.body;
  EXPECT_EQ(Packages(r), "esbtestpkg=1.0(index) esbtestdep=1.1(index) ") << r.body;
  json::array seen = IndexRequests();
  EXPECT_GE(seen.size(), 4u) << json::serialize(seen);
  auto requested = [&](const std::string& path) {
    for (const auto& v : seen)
      if (v.as_string() == path) return true;
    return false;
  };
  EXPECT_TRUE(requested("/simple/esbtestpkg/"));
  EXPECT_TRUE(requested("/files/esbtestpkg-1.0-py3-none-any.whl"));
  EXPECT_TRUE(requested("/simple/esbtestdep/"));
  EXPECT_TRUE(requested("/files/esbtestdep-1.1-py3-none-any.whl"));
  // The download is in the audit log.
  HttpResult audit = daemon_->Call("GET", "/audit?action=package.fetch");
  EXPECT_NE(audit.body.find("esbtestpkg==1.0"), std::string::npos) << audit.body;

  // 2. The index goes away: a second environment installs from the host cache.
  StopIndex();
  HttpResult again = daemon_->Call(
      "POST", "/run", json::object{{"code", code}, {"packages", json::array{"esbtestpkg"}}});
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(again.str("stdout"), "hello from esbtestpkg 1.0 with dep 1.1\n") << again.body;
  EXPECT_EQ(Packages(again), "esbtestpkg=1.0(cache) esbtestdep=1.1(cache) ") << again.body;

  // 3. Stateful: install into a running kernel, then import in the same kernel; streamed.
  std::string env = daemon_->CreateEnv(json::object{{"runtime", "container"}});
  ASSERT_FALSE(env.empty());
  HttpResult cell = daemon_->Call("POST", "/environments/" + env + "/run",
                                  json::object{{"code", "x = 41"}});
  ASSERT_EQ(cell.num("exit_code"), 0) << cell.body;
  HttpResult sse = daemon_->Call(
      "POST", "/environments/" + env + "/run",
      json::object{{"code", "import esbtestpkg\nesbtestpkg.hello() + ' ' + str(x + 1)"},
                   {"packages", json::array{"esbtestpkg==1.0"}}},
      {{"Accept", "text/event-stream"}});
  ASSERT_EQ(sse.status, 200) << sse.body;
  std::vector<SseEvent> events = ParseSse(sse.body);
  ASSERT_FALSE(events.empty());
  bool install_output = false;
  for (const auto& e : events) install_output = install_output || e.event == "install";
  EXPECT_TRUE(install_output) << sse.body;
  ASSERT_EQ(events.back().event, "result") << sse.body;
  EXPECT_EQ(json::value_to<std::string>(events.back().data.at("value")),
            "'hello from esbtestpkg 1.0 with dep 1.1 42'")
      << sse.body;
  // Asking again in the same environment needs nothing: it is installed there already.
  HttpResult third = daemon_->Call(
      "POST", "/environments/" + env + "/run",
      json::object{{"code", "esbtestpkg.hello()"}, {"packages", json::array{"esbtestpkg"}}});
  EXPECT_EQ(Packages(third), "esbtestpkg=1.0(preinstalled) ") << third.body;

  // 4. A version that was never cached cannot come from anywhere now: a clear error.
  HttpResult old = daemon_->Call(
      "POST", "/run", json::object{{"code", code}, {"packages", json::array{"esbtestpkg==0.9"}}});
  EXPECT_GE(old.status, 400) << old.body;
  EXPECT_NE(old.body.find("esbtestpkg"), std::string::npos) << old.body;
  daemon_->Call("DELETE", "/environments/" + env);
}

// An extra of a distribution the environment already has still installs what the extra needs.
TEST_F(PackagesTest, ExtrasOfAnInstalledDistributionAreInstalled) {
  if (index_pid_ <= 0) ASSERT_TRUE(StartIndex(index_port_)) << "cannot restart the index";
  std::string env = daemon_->CreateEnv(json::object{{"runtime", "container"}});
  ASSERT_FALSE(env.empty());
  HttpResult base = daemon_->Call(
      "POST", "/environments/" + env + "/run",
      json::object{{"code", "import esbtestpkg"}, {"packages", json::array{"esbtestpkg"}}});
  ASSERT_EQ(base.status, 200) << base.body;
  EXPECT_EQ(base.num("exit_code"), 0) << base.body;
  HttpResult fancy = daemon_->Call(
      "POST", "/environments/" + env + "/run",
      json::object{{"code", "import esbtestextra\nesbtestextra.VALUE"},
                   {"packages", json::array{"esbtestpkg[fancy]"}}});
  ASSERT_EQ(fancy.status, 200) << fancy.body;
  EXPECT_EQ(fancy.str("value"), "'extra 1.0'") << fancy.body;
  EXPECT_EQ(Packages(fancy), "esbtestpkg=1.0(preinstalled) esbtestextra=1.0(index) ")
      << fancy.body;
  daemon_->Call("DELETE", "/environments/" + env);
}

}  // namespace
}  // namespace esb::testing
