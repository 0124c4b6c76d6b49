// The egress audit rows an integration test waits for (GET /audit?kind=egress).
#pragma once

#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "integration/daemon.h"

namespace esb::testing {

using EgressRowsReady = std::function<bool(const std::vector<boost::json::object>&)>;

// Egress audit rows of `env` (newest first); waits up to 10 s until `ready` holds for them (the
// proxy reports each request over its control socket, so rows land a moment later).
inline std::vector<boost::json::object> WaitForEgressRows(
    Daemon& daemon, const std::string& env,
    const EgressRowsReady& ready = [](const auto&) { return true; }) {
  std::vector<boost::json::object> rows;
  for (int i = 0; i < 100; ++i) {
    rows.clear();
    HttpResult r = daemon.Call("GET", "/audit?kind=egress&limit=1000&environment_id=" + env);
    EXPECT_EQ(r.status, 200) << r.body;
    if (const boost::json::value* e = r.obj().if_contains("entries"); e && e->is_array())
      for (const boost::json::value& v : e->as_array())
        if (v.is_object()) rows.push_back(v.as_object());
    if (ready(rows)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return rows;
}

}  // namespace esb::testing
