// The one masking rule for credentials in recorded egress traffic. The proxy applies it before
// it sends an audit event, and AuditLog::RecordEgress applies it again before storing, so no
// audit row holds a credential header in the clear, whoever built the event.
#pragma once

#include <string>
#include <string_view>

namespace esb::governance {

// True for a header whose value is a credential: Authorization, Proxy-Authorization, Cookie,
// Set-Cookie, and any name that contains (case-insensitively) key, token, secret, password,
// passwd, session, auth, credential or signature (X-Api-Key, X-Amz-Security-Token, ...).
bool IsSensitiveHeader(std::string_view name);

// The value to record for header `name`: unchanged unless IsSensitiveHeader(name). Masked:
//   Authorization / Proxy-Authorization: the scheme kept, the rest "[masked]"
//     ("Bearer [masked]", "Basic [masked]"; "[masked]" without a recognisable scheme);
//   Cookie: each cookie's name kept, its value "[masked]" ("a=[masked]; b=[masked]");
//   Set-Cookie: the cookie's name kept ("sid=[masked]"), attributes dropped;
//   others: "[masked]".
// Never returns any byte of a masked value.
std::string MaskHeaderValue(std::string_view name, std::string_view value);

// The URL path+query to record: the value of every query parameter whose name is sensitive by
// the same rule as header names ("?api_key=abc&x=1" -> "?api_key=[masked]&x=1"). Path and
// fragment are unchanged.
std::string MaskUrlQuery(std::string_view path_and_query);

}  // namespace esb::governance
