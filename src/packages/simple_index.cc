#include "packages/simple_index.h"

#include <boost/json.hpp>
#include <cctype>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "packages/url.h"

namespace esb::packages {
namespace {

bool IsHex(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// Filename = last path segment of the URL (before any query), percent-decoded.
std::string FilenameFromUrl(const std::string& url) {
  std::string_view u = url;
  u = u.substr(0, u.find('?'));
  size_t slash = u.rfind('/');
  return PercentDecode(slash == std::string_view::npos ? u : u.substr(slash + 1));
}

// Builds a link from a resolved href and its fragment.
bool MakeLink(std::string_view page_url, std::string_view href, IndexLink* link) {
  std::string fragment;
  auto url = ResolveUrl(page_url, href, &fragment);
  if (!url.ok()) return false;
  link->url = *url;
  link->filename = FilenameFromUrl(link->url);
  // Fragments look like "sha256=<hex>" (PEP 503 allows other algorithms; only sha256 is used).
  std::string_view part = fragment;
  if (part.starts_with("sha256=") && part.size() == 7 + 64 && IsHex(part.substr(7))) {
    link->sha256 = absl::AsciiStrToLower(std::string(part.substr(7)));
  }
  return true;
}

absl::Status TooManyLinks() {
  return absl::FailedPreconditionError(
      absl::StrCat("the project page lists more than ", kMaxLinksPerPage, " files"));
}

}  // namespace

std::string DecodeHtmlEntities(std::string_view s) {
  static const std::map<std::string_view, std::string_view> kNamed = {
      {"amp", "&"}, {"lt", "<"}, {"gt", ">"}, {"quot", "\""}, {"apos", "'"}, {"nbsp", "\xC2\xA0"}};
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    // Look for the ';' only as far as the longest entity: searching the whole rest of `s`
    // for each '&' would be quadratic in a long attribute full of '&'.
    size_t semi = s.substr(i, 11).find(';');
    if (semi != std::string_view::npos) semi += i;
    if (semi == std::string_view::npos) {
      out += s[i];
      continue;
    }
    std::string_view ent = s.substr(i + 1, semi - i - 1);
    if (ent.size() >= 2 && ent[0] == '#') {
      uint32_t cp = 0;
      bool ok = false;
      if (ent[1] == 'x' || ent[1] == 'X') {
        std::string_view hex = ent.substr(2);
        ok = IsHex(hex) && hex.size() <= 6;
        if (ok) cp = std::stoul(std::string(hex), nullptr, 16);
      } else {
        std::string_view dec = ent.substr(1);
        ok = !dec.empty() && dec.size() <= 7 &&
             std::all_of(dec.begin(), dec.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (ok) cp = std::stoul(std::string(dec));
      }
      if (ok && cp > 0 && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF)) {
        AppendUtf8(cp, &out);
        i = semi;
        continue;
      }
    } else if (auto it = kNamed.find(ent); it != kNamed.end()) {
      out += it->second;
      i = semi;
      continue;
    }
    out += s[i];
  }
  return out;
}

absl::StatusOr<std::vector<IndexLink>> ParseSimpleIndexHtml(std::string_view html,
                                                            std::string_view page_url) {
  if (auto u = ParseUrl(page_url); !u.ok()) return u.status();
  std::vector<IndexLink> links;
  std::string lower = absl::AsciiStrToLower(std::string(html));
  size_t pos = 0;
  // The first "</a" at or after the last position searched from (npos: there is none).
  size_t next_close = 0;
  while (true) {
    size_t a = lower.find("<a", pos);
    if (a == std::string::npos) break;
    pos = a + 2;
    if (pos >= lower.size()) break;
    char after = lower[pos];
    if (!(std::isspace(static_cast<unsigned char>(after)) || after == '>' || after == '/')) {
      continue;  // <abbr>, <area> ...
    }
    // Attributes up to the closing '>' (quoted values may contain '>').
    std::map<std::string, std::string> attrs;
    size_t i = pos;
    bool closed = false;
    while (i < html.size()) {
      while (i < html.size() && (std::isspace(static_cast<unsigned char>(html[i])) || html[i] == '/')) ++i;
      if (i >= html.size()) break;
      if (html[i] == '>') {
        closed = true;
        ++i;
        break;
      }
      size_t name_start = i;
      while (i < html.size() && !std::isspace(static_cast<unsigned char>(html[i])) &&
             html[i] != '=' && html[i] != '>' && html[i] != '/') {
        ++i;
      }
      std::string name = lower.substr(name_start, i - name_start);
      while (i < html.size() && std::isspace(static_cast<unsigned char>(html[i]))) ++i;
      std::string value;
      if (i < html.size() && html[i] == '=') {
        ++i;
        while (i < html.size() && std::isspace(static_cast<unsigned char>(html[i]))) ++i;
        if (i < html.size() && (html[i] == '"' || html[i] == '\'')) {
          char q = html[i];
          size_t end = html.find(q, i + 1);
          if (end == std::string_view::npos) end = html.size();
          value = std::string(html.substr(i + 1, end - i - 1));
          i = end + 1;
        } else {
          size_t start = i;
          while (i < html.size() && !std::isspace(static_cast<unsigned char>(html[i])) &&
                 html[i] != '>') {
            ++i;
          }
          value = std::string(html.substr(start, i - start));
        }
      }
      if (!name.empty()) attrs.emplace(name, DecodeHtmlEntities(value));
    }
    if (!closed) break;
    // The link text ends at the next "</a". On a page of unclosed "<a>" tags, searching (and
    // copying and decoding) the rest of the page for every tag was quadratic: 400 kB of "<a>"
    // took minutes. So the position of the next "</a" is remembered (`i` only grows, so the
    // searches never overlap), and a text longer than kMaxAnchorTextBytes is ignored: it is
    // only a filename fallback.
    if (next_close != std::string::npos && next_close < i) next_close = lower.find("</a", i);
    std::string text;
    if (next_close != std::string::npos && next_close - i <= kMaxAnchorTextBytes) {
      text = DecodeHtmlEntities(html.substr(i, next_close - i));
      pos = next_close;
    } else {
      pos = i;
    }
    auto href = attrs.find("href");
    if (href == attrs.end() || href->second.empty()) continue;
    IndexLink link;
    if (!MakeLink(page_url, href->second, &link)) continue;
    if (link.filename.empty()) link.filename = std::string(absl::StripAsciiWhitespace(text));
    link.yanked = attrs.count("data-yanked") > 0;
    if (auto rp = attrs.find("data-requires-python"); rp != attrs.end()) {
      link.requires_python = rp->second;
    }
    if (links.size() >= kMaxLinksPerPage) return TooManyLinks();
    links.push_back(std::move(link));
  }
  return links;
}

absl::StatusOr<std::vector<IndexLink>> ParseSimpleIndexJson(std::string_view json,
                                                            std::string_view page_url) {
  if (auto u = ParseUrl(page_url); !u.ok()) return u.status();
  boost::system::error_code ec;
  boost::json::value doc = boost::json::parse(boost::json::string_view(json.data(), json.size()), ec);
  if (ec) return absl::InvalidArgumentError("index JSON page is not valid JSON: " + ec.message());
  const auto* obj = doc.if_object();
  const boost::json::value* files = obj ? obj->if_contains("files") : nullptr;
  if (files == nullptr || !files->is_array()) {
    return absl::InvalidArgumentError("index JSON page has no \"files\" array");
  }
  std::vector<IndexLink> links;
  for (const auto& f : files->get_array()) {
    const auto* fo = f.if_object();
    if (fo == nullptr) continue;
    const auto* url = fo->if_contains("url");
    if (url == nullptr || !url->is_string()) continue;
    IndexLink link;
    if (!MakeLink(page_url, std::string_view(url->get_string()), &link)) continue;
    if (const auto* fn = fo->if_contains("filename"); fn != nullptr && fn->is_string()) {
      link.filename = std::string(fn->get_string());
    }
    if (const auto* h = fo->if_contains("hashes"); h != nullptr && h->is_object()) {
      if (const auto* s = h->get_object().if_contains("sha256"); s != nullptr && s->is_string()) {
        std::string hex(s->get_string());
        if (hex.size() == 64 && IsHex(hex)) link.sha256 = absl::AsciiStrToLower(hex);
      }
    }
    if (const auto* y = fo->if_contains("yanked"); y != nullptr) {
      link.yanked = (y->is_bool() && y->get_bool()) || y->is_string();
    }
    if (const auto* rp = fo->if_contains("requires-python"); rp != nullptr && rp->is_string()) {
      link.requires_python = std::string(rp->get_string());
    }
    if (links.size() >= kMaxLinksPerPage) return TooManyLinks();
    links.push_back(std::move(link));
  }
  return links;
}

}  // namespace esb::packages
