#include "exe/keys_command.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/util.h"

namespace esb {
namespace {

constexpr char kUsage[] =
    "usage: esbd keys add --tenant T [--name N] | keys list | keys revoke KEY_ID";

int Fail(std::ostream& err, std::string_view message) {
  err << "esbd: " << message << "\n";
  return 2;
}

int Add(Store* store, const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  std::string tenant, name;
  for (size_t i = 2; i < args.size(); i += 2) {
    if (i + 1 >= args.size())
      return Fail(err, absl::StrCat("keys add: '", args[i], "' needs a value"));
    if (args[i] == "--tenant")
      tenant = args[i + 1];
    else if (args[i] == "--name")
      name = args[i + 1];
    else
      return Fail(err, absl::StrCat("keys add: unknown argument '", args[i], "'"));
  }
  if (tenant.empty()) return Fail(err, "keys add: --tenant is required");
  std::string secret;
  auto rec = store->CreateApiKey(tenant, name, &secret);
  if (!rec.ok()) return Fail(err, rec.status().ToString());
  out << "key_id: " << rec->key_id << "\ntenant: " << rec->tenant << "\napi_key: " << secret
      << "\n(the api_key is shown only once; esbd stores only its hash)\n";
  return 0;
}

int List(Store* store, std::ostream& out, std::ostream& err) {
  auto keys = store->ListApiKeys();
  if (!keys.ok()) return Fail(err, keys.status().ToString());
  out << absl::StrFormat("%-28s %-20s %-16s %-25s %s\n", "KEY_ID", "TENANT", "NAME", "CREATED",
                         "STATE");
  for (const auto& k : *keys) {
    out << absl::StrFormat("%-28s %-20s %-16s %-25s %s\n", k.key_id, k.tenant, k.name,
                           FormatRfc3339(k.created_ms), k.revoked ? "revoked" : "active");
  }
  return 0;
}

}  // namespace

int RunKeysCommand(Store* store, const std::vector<std::string>& args, std::ostream& out,
                   std::ostream& err) {
  if (args.size() < 2) return Fail(err, kUsage);
  const std::string& cmd = args[1];
  if (cmd == "add") return Add(store, args, out, err);
  if (cmd == "list" && args.size() == 2) return List(store, out, err);
  if (cmd == "revoke" && args.size() == 3) {
    if (absl::Status st = store->RevokeApiKey(args[2]); !st.ok()) return Fail(err, st.ToString());
    out << "revoked " << args[2] << "\n";
    return 0;
  }
  return Fail(err, kUsage);
}

}  // namespace esb
