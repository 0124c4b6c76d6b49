// Project pages of a PEP 503 "simple" index (HTML) and its PEP 691 JSON form.
//
// Index pages come from a mirror the operator configured, but they are still parsed as
// untrusted input: the scanner is tolerant of any HTML, bounded, and never interprets scripts.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace esb::packages {

inline constexpr std::string_view kSimpleJsonContentType = "application/vnd.pypi.simple.v1+json";

struct IndexLink {
  std::string filename;  // last path segment of the URL, percent-decoded (else the link text)
  std::string url;       // absolute, resolved against the page URL, fragment removed
  std::string sha256;    // from "#sha256=..." (or JSON hashes), lowercase hex; may be empty
  bool yanked = false;   // data-yanked present (JSON: "yanked" true or a reason)
  std::string requires_python;  // entity-decoded, e.g. ">=3.8"; may be empty
};

// Decodes &amp; &lt; &gt; &quot; &#39; &apos; &#NN; &#xHH; (unknown entities stay as they are).
std::string DecodeHtmlEntities(std::string_view s);

// All <a href=...> links of an HTML project page. Links whose href cannot be resolved are
// skipped. Fails only if page_url itself is not an absolute http(s) URL.
absl::StatusOr<std::vector<IndexLink>> ParseSimpleIndexHtml(std::string_view html,
                                                            std::string_view page_url);

// The "files" of a PEP 691 JSON project page.
absl::StatusOr<std::vector<IndexLink>> ParseSimpleIndexJson(std::string_view json,
                                                            std::string_view page_url);

}  // namespace esb::packages
