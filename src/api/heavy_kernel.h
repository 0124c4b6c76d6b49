// The stateful Python kernel of the heavy (container) tier: a small Python program that
// esbd writes into the environment and runs through the ordinary Exec call. See
// heavy_kernel.cc for the protocol.
#pragma once

#include <string_view>

namespace esb::api {

// Where the kernel lives inside a container environment.
inline constexpr std::string_view kHeavyKernelDir = "/tmp/.esb-kernel";
inline constexpr std::string_view kHeavyKernelPath = "/tmp/.esb-kernel/kernel.py";

// The source of kernel.py (Python 3.11+, stdlib only).
std::string_view HeavyKernelSource();

}  // namespace esb::api
