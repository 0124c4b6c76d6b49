#include "agent/peer_cred.h"

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>

namespace esb::agent {
namespace {

constexpr char kSandboxMap[] = "         0 1879048192      65534\n";
constexpr char kHostMap[] = "         0          0 4294967295\n";

TEST(PeerCredTest, IdMappedReadsEveryExtent) {
  EXPECT_TRUE(IdMapped(kSandboxMap, 0));
  EXPECT_TRUE(IdMapped(kSandboxMap, 1000));
  EXPECT_TRUE(IdMapped(kSandboxMap, 65533));
  EXPECT_FALSE(IdMapped(kSandboxMap, 65534));
  EXPECT_TRUE(IdMapped("0 5 10\n100 200 1\n", 100));
  EXPECT_FALSE(IdMapped("0 5 10\n100 200 1\n", 101));
  EXPECT_TRUE(IdMapped(kHostMap, 65534));
  EXPECT_FALSE(IdMapped("", 0));
}

// esbd as the agent sees it through a user namespace: pid 0, overflow ids.
TEST(PeerCredTest, AcceptsOnlyAnUnmappedPeerFromOutsideThePidNamespace) {
  ucred host_root{0, 65534, 65534};
  EXPECT_TRUE(IsUnmappedOutsidePeer(host_root, kSandboxMap, kSandboxMap, 65534, 65534));
  // A sandbox process: a pid of its own, whatever its ids.
  ucred sandbox{7, 65534, 65534};
  EXPECT_FALSE(IsUnmappedOutsidePeer(sandbox, kSandboxMap, kSandboxMap, 65534, 65534));
  ucred sandbox_user{0, 1000, 1000};
  EXPECT_FALSE(IsUnmappedOutsidePeer(sandbox_user, kSandboxMap, kSandboxMap, 65534, 65534));
  // Without a user namespace (or one that maps the overflow id) the rule accepts nobody: the
  // overflow uid is then a real uid that a process could have.
  EXPECT_FALSE(IsUnmappedOutsidePeer(host_root, kHostMap, kHostMap, 65534, 65534));
  EXPECT_FALSE(IsUnmappedOutsidePeer(host_root, kSandboxMap, kHostMap, 65534, 65534));
  EXPECT_FALSE(IsUnmappedOutsidePeer(host_root, "", "", 65534, 65534));
  ucred wrong_gid{0, 65534, 1000};
  EXPECT_FALSE(IsUnmappedOutsidePeer(wrong_gid, kSandboxMap, kSandboxMap, 65534, 65534));
}

// The test process itself runs in the host's namespaces: its own rule accepts nobody.
TEST(PeerCredTest, HostProcessAcceptsNoOverflowPeer) {
  std::ifstream in("/proc/self/uid_map");
  std::string map((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!IdMapped(map, 65534)) GTEST_SKIP() << "this test runs inside a user namespace: " << map;
  ucred host_root{0, 65534, 65534};
  EXPECT_FALSE(IsUnmappedOutsidePeer(host_root));
}

}  // namespace
}  // namespace esb::agent
