#include "governance/proxy/host_scan.h"

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace esb::governance::proxy {

absl::StatusOr<std::string> HostScanText(std::string_view host) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  for (size_t i = 0; i <= host.size(); ++i) {
    if (i == host.size() || host[i] == '.' || host[i] == '-') {
      if (i > start) parts.push_back(host.substr(start, i - start));
      start = i + 1;
    }
  }
  std::string text(host);
  text += '\n';
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    size_t run = parts[i].size();
    std::string line(parts[i]);
    for (size_t j = i + 1; j < parts.size(); ++j) {
      run += parts[j].size();
      if (run > kHostScanRunBytes) break;
      line.append(parts[j]);
      text.append(line);
      text += '\n';
      if (text.size() > kMaxHostScanBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("the host name has too many parts to be scanned (", parts.size(),
                         " parts between '.' and '-')"));
      }
    }
  }
  std::string upper = absl::AsciiStrToUpper(text);
  text += upper;
  return text;
}

absl::StatusOr<dlp::Result> ScanHost(const dlp::Engine& engine, std::string_view host) {
  absl::StatusOr<std::string> text = HostScanText(host);
  if (!text.ok()) return text.status();
  return engine.ScanText(*text, dlp::Where::kHost);
}

std::string StoppingRule(const dlp::Result& result) {
  if (!result.block_rule.empty()) return result.block_rule;
  for (const dlp::Finding& f : result.findings) {
    if (f.action == dlp::Action::kRedact) return f.rule_id;
  }
  return "";
}

}  // namespace esb::governance::proxy
