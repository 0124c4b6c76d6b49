// The one shell-quoting helper (POSIX sh and bash), for commands esbd, the agent and the CLI
// build from untrusted words. Standard library only (the static agent links it).
#pragma once

#include <string>
#include <string_view>

namespace esb {

// `s` as exactly one shell word: unchanged when it is made only of characters no shell treats
// specially (letters, digits, - _ . / : , = + @ %), otherwise in single quotes with each
// embedded ' written as '\'' (nothing is special inside single quotes). "" becomes ''.
std::string ShellQuote(std::string_view s);

}  // namespace esb
