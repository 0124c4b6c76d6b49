// Finds the images `make images` built, so that esbd started by hand or from a service unit,
// with no environment variables, runs the newest complete build.
//
// scripts/build-images.sh writes one manifest per run into <cache>/builds/ (atomically, after
// the artefacts are published):
//   {"format": 1, "created_unix_ms": 1764000000000, "complete": true,
//    "artefacts": {"rootfs": "/var/cache/entersandbox/rootfs/<hash>",
//                  "python_wasm": "/var/cache/entersandbox/python-wasm/<hash>"}}
// A build is complete when its manifest says so, names both artefacts, and both still exist.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace esb {

struct ImageBuild {
  std::string manifest;  // path of the manifest file
  int64_t created_unix_ms = 0;
  std::string rootfs;       // the container tier's default image (rootfs directory)
  std::string python_wasm;  // the nano tier's artefact directory
};

// The newest complete build under `cache_root` (by created_unix_ms, then manifest name).
// NotFound, saying what was looked at and why nothing qualified, when there is none.
absl::StatusOr<ImageBuild> FindNewestImageBuild(const std::string& cache_root);

}  // namespace esb
