# cmake -DIN=<text file> -DOUT=<.cc> -DHEADER=<header> -DFUNCTION=<qualified name> -P embed_text.cmake
# Writes OUT: a definition of `std::string_view FUNCTION()` returning IN's bytes, as a raw
# string literal (so the embedded file stays an ordinary file in the tree: editable, testable).
file(READ "${IN}" content)
set(delim "esb_embed")
string(FIND "${content}" ")${delim}\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw-string terminator )${delim}\"")
endif()
string(REGEX MATCH "^(.*)::([^:]+)$" _ "${FUNCTION}")
set(ns "${CMAKE_MATCH_1}")
set(fn "${CMAKE_MATCH_2}")
file(WRITE "${OUT}.tmp"
  "// Generated from ${IN} by embed_text.cmake: edit that file, not this one.\n"
  "#include \"${HEADER}\"\n\n"
  "namespace ${ns} {\n\n"
  "std::string_view ${fn}() {\n"
  "  static constexpr std::string_view kText = R\"${delim}(${content})${delim}\";\n"
  "  return kText;\n"
  "}\n\n"
  "}  // namespace ${ns}\n")
file(RENAME "${OUT}.tmp" "${OUT}")
