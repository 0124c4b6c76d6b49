#include "agent/peer_cred.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace esb::agent {
namespace {

std::string ReadSmallFile(const char* path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A kernel overflow id; an unreadable or odd file yields 0, which every namespace maps
// (the sandbox's root), so the rule then accepts nobody.
uint32_t ReadOverflowId(const char* path) {
  const std::string text = ReadSmallFile(path);
  char* end = nullptr;
  unsigned long v = std::strtoul(text.c_str(), &end, 10);
  return end != text.c_str() && v <= 0xffffffffUL ? static_cast<uint32_t>(v) : 0;
}

}  // namespace

bool IdMapped(std::string_view id_map, uint32_t id) {
  std::istringstream lines{std::string(id_map)};
  uint64_t inside = 0, outside = 0, count = 0;
  while (lines >> inside >> outside >> count) {
    if (id >= inside && id - inside < count) return true;
  }
  return false;
}

bool IsUnmappedOutsidePeer(const ucred& cred, std::string_view uid_map, std::string_view gid_map,
                           uint32_t overflow_uid, uint32_t overflow_gid) {
  // SECURITY: pid 0 = not in this pid namespace; unmapped overflow ids = not in this user
  // namespace. A sandbox process can present neither.
  return cred.pid == 0 && cred.uid == overflow_uid && cred.gid == overflow_gid &&
         !uid_map.empty() && !gid_map.empty() && !IdMapped(uid_map, overflow_uid) &&
         !IdMapped(gid_map, overflow_gid);
}

bool IsUnmappedOutsidePeer(const ucred& cred) {
  static const std::string uid_map = ReadSmallFile("/proc/self/uid_map");
  static const std::string gid_map = ReadSmallFile("/proc/self/gid_map");
  static const uint32_t overflow_uid = ReadOverflowId("/proc/sys/kernel/overflowuid");
  static const uint32_t overflow_gid = ReadOverflowId("/proc/sys/kernel/overflowgid");
  return IsUnmappedOutsidePeer(cred, uid_map, gid_map, overflow_uid, overflow_gid);
}

}  // namespace esb::agent
