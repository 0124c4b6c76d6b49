// How the core hands governed environments to the egress proxy (issue 12). The core decides
// (policy, intents, CA: core/environment_manager.h) and stores; an EgressControl carries that
// state to esb-proxy and keeps it there (implementation: g-net, over governance/control.h).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "governance/policy.h"

namespace esb {

struct EgressAttachment {
  std::string env_id;
  std::string tenant;
  governance::EgressPolicy policy;
  std::vector<governance::ActiveIntent> intents;  // the complete list, absolute expiry
  std::string ca_cert_pem;
  std::string ca_key_pem;  // secret: never logged, never inside a sandbox
};

class EgressControl {
 public:
  virtual ~EgressControl() = default;
  // After the driver created a governed environment (its netns exists), and for each live one
  // after an esbd restart: opens its listener (through the driver) and attaches it to the
  // proxy; remembered for re-attach after a proxy restart. An error fails the create.
  virtual absl::Status Attach(const EgressAttachment& attachment) = 0;
  // Replaces the policy and intents (the complete current list). The core has stored the new
  // state before calling: a re-attach must send that state even if this call failed.
  virtual absl::Status Update(const std::string& env_id, const governance::EgressPolicy& policy,
                              const std::vector<governance::ActiveIntent>& intents) = 0;
  // Before the driver destroys the environment; idempotent, never fails.
  virtual void Detach(const std::string& env_id) = 0;
};

}  // namespace esb
