// CheckpointStore: listing, LATEST, the lineage rule (Note [lineage]) and removal. See store.h.
#include "checkpoints/store.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "checkpoints/manifest_io.h"
#include "framework/error.h"
#include "framework/file_io.h"

namespace keel {
namespace fs = std::filesystem;

namespace {

// LATEST holds "step_NNNNNNNN\n"; anything much longer is not a LATEST keel wrote.
constexpr int64_t kMaxLatestBytes = 64;

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() > n && s.compare(s.size() - n, n, suffix) == 0;
}

}  // namespace

std::string CheckpointStore::path_of(int64_t step) const { return root_ + "/" + step_name(step); }

std::vector<int64_t> CheckpointStore::steps() const {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    std::error_code type_ec;
    if (!e.is_directory(type_ec)) continue;
    if (auto s = parse_step_name(e.path().filename().string())) out.push_back(*s);
  }
  std::sort(out.rbegin(), out.rend());
  return out;
}

std::optional<int64_t> CheckpointStore::latest_named() const {
  std::string text;
  try {
    text = read_regular_file(root_ + "/LATEST", kMaxLatestBytes, "LATEST");
  } catch (const Error&) {
    return std::nullopt;  // missing, not a regular file, unreadable or too long: unusable
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return parse_step_name(text);
}

std::optional<int64_t> CheckpointStore::latest() const {
  const std::optional<int64_t> s = latest_named();
  std::error_code ec;
  if (!s || !fs::is_directory(path_of(*s), ec)) return std::nullopt;
  return s;
}

void CheckpointStore::set_latest(int64_t step) const {
  write_file_atomic(root_ + "/LATEST", step_name(step) + "\n");
}

CheckpointStore::Split CheckpointStore::split() const {
  const std::vector<int64_t> all = steps();
  const std::optional<int64_t> head = latest();
  if (!head) return {all, {}};
  Split out;
  for (int64_t s : all) {
    if (s <= *head) continue;
    bool child = false;
    try {
      // The manifest alone says where a checkpoint descends from: a damaged shard makes it
      // unusable, not another branch (the resume that tries it says why).
      const std::string path = path_of(s) + "/manifest.pb";
      const ckpt::Manifest m =
          parse_manifest(read_regular_file(path, kMaxManifestBytes, "a checkpoint manifest"), path);
      child = m.has_parent_step() && m.parent_step() == *head;
    } catch (const Error&) {
      // Unreadable: it cannot be shown to descend from LATEST.
    }
    (child ? out.on : out.off).push_back(s);
  }
  for (int64_t s : all) {
    if (s <= *head) out.on.push_back(s);
  }
  return out;
}

std::vector<int64_t> CheckpointStore::lineage() const { return split().on; }

std::vector<int64_t> CheckpointStore::off_lineage() const { return split().off; }

void CheckpointStore::remove_checkpoint(int64_t step) const {
  const std::string dir = path_of(step);
  const std::string doomed = dir + ".tmp";
  std::error_code ec;
  fs::remove_all(doomed, ec);
  KEEL_CHECK(!ec, kIo, doomed, ": cannot remove: ", ec.message());
  KEEL_CHECK(::rename(dir.c_str(), doomed.c_str()) == 0, kIo, dir,
             ": cannot remove (rename aside failed): ", std::strerror(errno));
  fs::remove_all(doomed, ec);
  KEEL_CHECK(!ec, kIo, doomed, ": cannot remove: ", ec.message());
}

std::vector<int64_t> CheckpointStore::remove_newer_than(int64_t step) const {
  const Split now = split();
  std::vector<int64_t> order;
  for (int64_t s : now.off) {
    if (s > step) order.push_back(s);
  }
  for (auto it = now.on.rbegin(); it != now.on.rend(); ++it) {
    if (*it > step) order.push_back(*it);
  }
  const std::optional<int64_t> named = latest_named();
  for (int64_t s : order) remove_checkpoint(s);
  if (named && *named > step) {
    const std::vector<int64_t> left = steps();
    if (!left.empty()) {
      set_latest(left.front());
    } else if (::unlink((root_ + "/LATEST").c_str()) != 0 && errno != ENOENT) {
      KEEL_FAIL(kIo, root_, "/LATEST: cannot remove: ", std::strerror(errno));
    }
  }
  std::sort(order.rbegin(), order.rend());
  return order;
}

size_t CheckpointStore::remove_all() const {
  const size_t n = steps().size();
  std::error_code ec;
  std::filesystem::remove_all(root_, ec);
  KEEL_CHECK(!ec, kIo, root_, ": cannot delete: ", ec.message());
  return n;
}

int CheckpointStore::remove_stale() const {
  int n = 0;
  std::error_code ec;
  std::vector<fs::path> stale;
  std::vector<fs::path> latest_tmp;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("LATEST.tmp.", 0) == 0) {
      latest_tmp.push_back(e.path());
      continue;
    }
    const bool suffix = ends_with(name, ".tmp") || ends_with(name, ".old");
    if (suffix && parse_step_name(name.substr(0, name.size() - 4))) stale.push_back(e.path());
  }
  // An interrupted set_latest's temporary file (write_file_atomic's LATEST.tmp.<pid>).
  for (const auto& p : latest_tmp) fs::remove(p, ec);
  for (const auto& p : stale) {
    const std::string name = p.filename().string();
    const fs::path committed = p.parent_path() / name.substr(0, name.size() - 4);
    // A crash between moving a re-saved step aside and renaming its replacement into place
    // leaves step_N.old whole and step_N missing: put it back rather than lose it.
    if (ends_with(name, ".old") && !fs::exists(committed, ec)) {
      fs::rename(p, committed, ec);
      if (!ec) continue;
    }
    if (fs::remove_all(p, ec) != static_cast<std::uintmax_t>(-1) && !ec) ++n;
  }
  return n;
}

std::vector<int64_t> CheckpointStore::retain(int keep, int keep_every,
                                             const std::function<bool(int64_t)>& pinned) const {
  std::vector<int64_t> removed;
  const std::vector<int64_t> line = lineage();
  const std::optional<int64_t> head = latest();
  for (size_t i = 0; i < line.size(); ++i) {
    const int64_t s = line[i];
    const bool keep_it = static_cast<int>(i) < keep || (keep_every > 0 && s % keep_every == 0) ||
                         (pinned && pinned(s)) || (head && *head == s);
    if (keep_it) continue;
    try {
      remove_checkpoint(s);
      removed.push_back(s);
    } catch (const Error&) {
      // Retention is housekeeping: a checkpoint that cannot be removed now is tried again at the
      // next commit.
    }
  }
  return removed;
}

}  // namespace keel
