// Engine: minimal implementation (the detectors land in the next commits).
#include "governance/dlp/dlp.h"

namespace esb::governance::dlp {

struct Engine::Impl {
  DlpConfig config;
};

namespace {

class StubBodyScanner : public BodyScanner {
 public:
  explicit StubBodyScanner(const Engine& engine) : engine_(engine) {}
  void Feed(std::string_view bytes) override { size_ += bytes.size(); }
  bool oversize() const override { return size_ > engine_.config().max_body_bytes; }
  Result Finish() override { return {}; }

 private:
  const Engine& engine_;
  uint64_t size_ = 0;
};

}  // namespace

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

absl::StatusOr<std::shared_ptr<const Engine>> Engine::Compile(const DlpConfig& config) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  return std::shared_ptr<const Engine>(new Engine(std::move(impl)));
}

Result Engine::ScanText(std::string_view text, Where where) const { return {}; }

std::unique_ptr<BodyScanner> Engine::NewBodyScanner(const BodyInfo& info) const {
  return std::make_unique<StubBodyScanner>(*this);
}

const DlpConfig& Engine::config() const { return impl_->config; }

Action Engine::ActionFor(std::string_view rule_id) const { return Action::kNone; }

}  // namespace esb::governance::dlp
