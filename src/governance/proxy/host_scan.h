// DLP on destination host names (docs/design.md "Egress proxy", "Host names are data").
//
// A host name is data the sandbox sends before any request byte: resolving
// "akiaq2we3rt4yu5i6paz.attacker.test" hands the key to whoever runs attacker.test's DNS zone,
// and in mode open (or under a "*.suffix" the attacker controls) the policy allows it. The proxy
// scans the name (absolute-URI host, CONNECT target; the Host header and the TLS SNI inside an
// inspected tunnel must equal the CONNECT target) before it is decided, resolved or connected.
//
// What the scan sees, built from the normalised (lower-case) name:
//   - the name as sent ("4111-1111-1111-1111.x.test" matches the card rule as it is);
//   - every run of two or more consecutive parts joined without separators, one per line, where
//     the parts are what lies between '.' and '-' ("akiaq2we3r.t4yu5i6paz.x.test" gives the line
//     "akiaq2we3rt4yu5i6paz"; a card split over labels gives its 16 digits), runs up to
//     kHostScanRunBytes long;
//   - all of that again in upper case (DNS is case-insensitive and names are lower-cased, while
//     the AWS rules expect upper case).
// Punycode labels ("xn--...") are scanned in their ASCII form: the basic code points of a label
// stay verbatim in it, so ASCII secrets in an IDN are still seen; secrets re-encoded by the
// sender (hex, base32, reversed) are not recognisable, as in bodies.
// IP literals are not scanned (an address is a route, not a payload).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "governance/dlp/dlp.h"

namespace esb::governance::proxy {

// The longest joined run of parts scanned (longer than every built-in secret in a host name).
inline constexpr size_t kHostScanRunBytes = 128;
// The scan text of one name (each case); a name that needs more (a great many tiny parts,
// which no real host name has) is refused as unscannable instead of scanned partly.
inline constexpr size_t kMaxHostScanBytes = 32 << 10;

// The text scanned for `host` (a normalised name), see above. InvalidArgument when it would
// exceed kMaxHostScanBytes per case.
absl::StatusOr<std::string> HostScanText(std::string_view host);

// Scans `host` with `engine` (Where::kHost). The findings' spans are in HostScanText(host), not
// in the name: a name with any finding is recorded masked, whole. InvalidArgument as above.
absl::StatusOr<dlp::Result> ScanHost(const dlp::Engine& engine, std::string_view host);

// The rule a finding-bearing scan stops a request for: its first blocking rule, else its first
// redact rule (a host or a header name cannot be redacted and still mean the same: a redact
// rule on one blocks). "" when only log findings.
std::string StoppingRule(const dlp::Result& result);

}  // namespace esb::governance::proxy
