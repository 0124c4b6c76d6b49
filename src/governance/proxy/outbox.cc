#include "governance/proxy/outbox.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/util.h"

namespace esb::governance::proxy {

Outbox::Outbox(control::ControlChannel* channel, Options options)
    : channel_(channel), options_(options) {
  thread_ = std::thread([this] { Run(); });
}

Outbox::~Outbox() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Outbox::Push(control::ToEsbd m) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto* e = std::get_if<control::AuditEvent>(&m)) {
      PushAudit(std::move(*e));
    } else {
      if (control_.size() >= options_.max_queued_control) control_.pop_front();
      control_.push_back(std::move(m));
    }
  }
  cv_.notify_one();
}

int64_t Outbox::dropped_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_total_;
}

void Outbox::PushAudit(control::AuditEvent e) {
  std::deque<control::AuditEvent>& q = tenants_[e.tenant];
  if (q.empty()) order_.push_back(e.tenant);
  if (q.size() >= std::max<size_t>(1, options_.max_queued_per_tenant)) DropOldest(q);
  q.push_back(std::move(e));
  ++queued_;
  if (queued_ > std::max<size_t>(1, options_.max_queued_total)) {
    auto longest = std::max_element(
        tenants_.begin(), tenants_.end(),
        [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
    DropOldest(longest->second);
  }
}

void Outbox::DropOldest(std::deque<control::AuditEvent>& q) {
  Dropped& d = dropped_[q.front().env_id];
  d.tenant = q.front().tenant;
  ++d.count;
  ++dropped_total_;
  q.pop_front();
  --queued_;
}

std::optional<control::ToEsbd> Outbox::Next() {
  if (!control_.empty()) {
    control::ToEsbd m = std::move(control_.front());
    control_.pop_front();
    return m;
  }
  if (!dropped_.empty()) {
    auto it = dropped_.begin();
    control::AuditEvent gap;
    gap.time_ms = NowUnixMs();
    gap.env_id = it->first;
    gap.tenant = it->second.tenant;
    gap.decision = "error";
    gap.rule_ids = {"audit:dropped"};
    gap.reason = absl::StrCat("audit events dropped: ", it->second.count,
                              " of this environment (esb-proxy's audit queue for its tenant was "
                              "full: ",
                              options_.max_queued_per_tenant, " events)");
    dropped_.erase(it);
    return gap;
  }
  while (!order_.empty()) {
    std::string tenant = std::move(order_.front());
    order_.pop_front();
    auto it = tenants_.find(tenant);
    if (it == tenants_.end()) continue;
    if (it->second.empty()) {
      tenants_.erase(it);
      continue;
    }
    control::AuditEvent e = std::move(it->second.front());
    it->second.pop_front();
    --queued_;
    if (it->second.empty()) {
      tenants_.erase(it);
    } else {
      order_.push_back(std::move(tenant));
    }
    return e;
  }
  return std::nullopt;
}

void Outbox::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    std::optional<control::ToEsbd> m;
    cv_.wait(lock, [&] {
      m = Next();
      return done_ || m.has_value();
    });
    if (!m) return;
    lock.unlock();
    if (absl::Status s = channel_->Send(*m); !s.ok()) {
      LogWarn(absl::StrCat("esb-proxy: ", s.message()));
    }
    lock.lock();
  }
}

}  // namespace esb::governance::proxy
