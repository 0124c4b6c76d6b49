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

// Links per project page at most (the largest real projects have a few thousand files); more
// is FailedPrecondition rather than unbounded memory and work.
inline constexpr size_t kMaxLinksPerPage = 50'000;
// A longer link text is ignored (it is only a fallback filename).
inline constexpr size_t kMaxAnchorTextBytes = 4096;

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
// skipped. Fails if page_url itself is not an absolute http(s) URL (InvalidArgument) or the page
// has more than kMaxLinksPerPage links (FailedPrecondition). Linear in the page size, whatever
// the markup (an unclosed <a> does not make every later tag rescan the rest of the page).
absl::StatusOr<std::vector<IndexLink>> ParseSimpleIndexHtml(std::string_view html,
                                                            std::string_view page_url);

// The "files" of a PEP 691 JSON project page. InvalidArgument when it is not such a page,
// FailedPrecondition over kMaxLinksPerPage files.
absl::StatusOr<std::vector<IndexLink>> ParseSimpleIndexJson(std::string_view json,
                                                            std::string_view page_url);

}  // namespace esb::packages
