// TokenStream: memory-mapped text files and llm.c shards, validated once at open (see header).
#include "framework/data/token_stream.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "framework/error.h"
#include "framework/file_io.h"

namespace keel {
namespace {

// A read-only private mapping of a whole file, unmapped when the last view goes away.
class Mapping {
 public:
  Mapping(void* addr, size_t bytes) : addr_(addr), bytes_(bytes) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { munmap(addr_, bytes_); }
  const uint8_t* data() const { return static_cast<const uint8_t*>(addr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* addr_;
  size_t bytes_;
};

// Closes a file descriptor on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Opens `path` for reading and checks that it is a regular file. O_NONBLOCK makes opening a FIFO
// return at once instead of waiting for a writer (it changes nothing for a regular file), so a
// FIFO, socket or device is refused rather than blocking or streaming forever.
Fd open_regular(const std::string& path, struct stat& st) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  KEEL_CHECK(fd.get() >= 0, kData, path, ": cannot open: ", std::strerror(errno));
  KEEL_CHECK(fstat(fd.get(), &st) == 0, kData, path, ": cannot stat: ", std::strerror(errno));
  KEEL_CHECK(S_ISREG(st.st_mode), kData, path, ": not a regular file (", file_type_name(st.st_mode),
             ")");
  return fd;
}

// Maps `path`; returns nullptr for an empty file (which mmap cannot map).
std::shared_ptr<Mapping> map_file(const std::string& path) {
  struct stat st {};
  Fd fd = open_regular(path, st);
  if (st.st_size == 0) return nullptr;
  void* addr = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd.get(), 0);
  KEEL_CHECK(addr != MAP_FAILED, kData, path, ": cannot mmap: ", std::strerror(errno));
  return std::make_shared<Mapping>(addr, static_cast<size_t>(st.st_size));
}

// The paths glob(3) expands `pattern` to, sorted by byte order (independent of the locale), or
// the glob(3) return code on failure.
int expand_glob(const std::string& pattern, std::vector<std::string>& files) {
  glob_t g{};
  const int rc = glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g);
  if (rc == 0) files.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  globfree(&g);
  std::sort(files.begin(), files.end());
  return rc;
}

// Index of the first token >= vocab_size, or -1. A branch-free max pass first (vectorised), so the
// common all-valid case costs one streaming read.
template <typename T>
int64_t first_out_of_vocab(const T* tokens, int64_t n, int32_t vocab_size) {
  T max_token = 0;
  for (int64_t i = 0; i < n; ++i) max_token = std::max(max_token, tokens[i]);
  if (static_cast<int64_t>(max_token) < vocab_size) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(tokens[i]) >= vocab_size) return i;
  }
  return -1;
}

int32_t header_field(const uint8_t* data, int index) {
  int32_t value;
  std::memcpy(&value, data + 4 * index, 4);
  return value;
}

}  // namespace

TokenStream TokenStream::from_bytes(std::vector<uint8_t> bytes, const std::string& description,
                                    int32_t vocab_size) {
  const int64_t bad =
      first_out_of_vocab(bytes.data(), static_cast<int64_t>(bytes.size()), vocab_size);
  KEEL_CHECK(bad < 0, kData, description, ": token ", static_cast<int>(bytes[bad]), " at index ",
             bad, " >= model.vocab_size=", vocab_size);
  auto owner = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  TokenStream s;
  s.size_ = static_cast<int64_t>(owner->size());
  if (s.size_ > 0) s.segments_.push_back({owner, owner->data(), 1, 0, s.size_});
  s.description_ = description;
  return s;
}

TokenStream TokenStream::open_text(const std::string& path, int32_t vocab_size,
                                   const std::string& field) {
  KEEL_CHECK(!path.empty(), kData, field, " is empty: no text file to read");
  std::shared_ptr<Mapping> map = map_file(path);
  KEEL_CHECK(map != nullptr, kData, path, ": empty text file");
  const int64_t n = static_cast<int64_t>(map->bytes());
  const int64_t bad = first_out_of_vocab(map->data(), n, vocab_size);
  KEEL_CHECK(bad < 0, kData, path, ": byte ", static_cast<int>(map->data()[bad]), " at index ", bad,
             " >= model.vocab_size=", vocab_size, " (text is read as bytes)");
  TokenStream s;
  s.segments_.push_back({map, map->data(), 1, 0, n});
  s.size_ = n;
  s.description_ = "text file '" + path + "' (" + std::to_string(n) + " bytes)";
  return s;
}

TokenStream TokenStream::open_shards(const std::string& pattern, int32_t vocab_size,
                                     const std::string& field) {
  KEEL_CHECK(!pattern.empty(), kData, field, " is empty: no shard to read");
  std::vector<std::string> files;
  const int rc = expand_glob(pattern, files);
  KEEL_CHECK(rc != GLOB_NOMATCH && !(rc == 0 && files.empty()), kData, field, ": no file matches '",
             pattern, "'");
  KEEL_CHECK(rc == 0, kData, field, ": cannot expand '", pattern, "' (glob error ", rc, ")");

  TokenStream s;
  for (const std::string& file : files) {
    std::shared_ptr<Mapping> map = map_file(file);
    const int64_t bytes = map ? static_cast<int64_t>(map->bytes()) : 0;
    KEEL_CHECK(bytes >= kShardHeaderBytes, kData, file, ": truncated: ", bytes,
               " bytes, shorter than the ", kShardHeaderBytes, "-byte llm.c shard header");
    const int32_t magic = header_field(map->data(), 0);
    KEEL_CHECK(magic == kShardMagic, kData, file, ": bad magic ", magic, " (expected ", kShardMagic,
               ", an llm.c token shard)");
    const int32_t version = header_field(map->data(), 1);
    KEEL_CHECK(version == kShardVersion, kData, file, ": unsupported version ", version,
               " (expected ", kShardVersion, " = uint16 tokens)");
    const int64_t n = header_field(map->data(), 2);
    KEEL_CHECK(n > 0, kData, file, ": header says ", n, " tokens (expected > 0)");
    const int64_t held = (bytes - kShardHeaderBytes) / 2;
    KEEL_CHECK(held >= n, kData, file, ": truncated: header says ", n, " tokens, file holds ",
               held);
    KEEL_CHECK(bytes == kShardHeaderBytes + 2 * n, kData, file, ": header says ", n,
               " tokens but the file holds ", bytes - kShardHeaderBytes,
               " bytes of tokens (trailing bytes)");
    // The token area starts 1024 bytes into a page-aligned mapping, so uint16 access is aligned.
    const uint8_t* body = map->data() + kShardHeaderBytes;
    const auto* tokens = reinterpret_cast<const uint16_t*>(body);
    const int64_t bad = first_out_of_vocab(tokens, n, vocab_size);
    KEEL_CHECK(bad < 0, kData, file, ": token ", tokens[bad], " at index ", bad,
               " >= model.vocab_size=", vocab_size);
    s.segments_.push_back({map, body, 2, s.size_, n});
    s.size_ += n;
  }
  s.description_ = files.size() == 1
                       ? "shard '" + files[0] + "'"
                       : std::to_string(files.size()) + " shards matching '" + pattern + "'";
  s.description_ += " (" + std::to_string(s.size_) + " tokens)";
  return s;
}

std::optional<int64_t> TokenStream::peek_size(const std::string& source, bool shards) {
  std::vector<std::string> files;
  if (!shards) {
    files.push_back(source);
  } else if (expand_glob(source, files) != 0 || files.empty()) {
    return std::nullopt;
  }
  int64_t total = 0;
  for (const std::string& file : files) {
    struct stat st {};
    try {
      Fd fd = open_regular(file, st);
      if (!shards) return static_cast<int64_t>(st.st_size);
      int32_t header[3];
      if (pread(fd.get(), header, sizeof(header), 0) != static_cast<ssize_t>(sizeof(header))) {
        return std::nullopt;
      }
      if (header[0] != kShardMagic || header[1] != kShardVersion || header[2] <= 0) {
        return std::nullopt;
      }
      total += header[2];
    } catch (const Error&) {
      return std::nullopt;
    }
  }
  return total;
}

size_t TokenStream::segment_of(int64_t i) const {
  auto it = std::upper_bound(segments_.begin(), segments_.end(), i,
                             [](int64_t v, const Segment& seg) { return v < seg.start; });
  return static_cast<size_t>(it - segments_.begin()) - 1;
}

int32_t TokenStream::at(int64_t i) const {
  KEEL_ASSERT(i >= 0 && i < size_);
  const Segment& seg = segments_[segment_of(i)];
  const int64_t k = i - seg.start;
  if (seg.width == 1) return seg.data[k];
  return reinterpret_cast<const uint16_t*>(seg.data)[k];
}

void TokenStream::copy(int64_t start, int64_t n, int32_t* out) const {
  KEEL_ASSERT(start >= 0 && n >= 0 && start + n <= size_);
  if (n == 0) return;
  for (size_t si = segment_of(start); n > 0; ++si) {
    const Segment& seg = segments_[si];
    const int64_t k = start - seg.start;
    const int64_t take = std::min(n, seg.n - k);
    if (seg.width == 1) {
      const uint8_t* src = seg.data + k;
      for (int64_t j = 0; j < take; ++j) out[j] = src[j];
    } else {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(seg.data) + k;
      for (int64_t j = 0; j < take; ++j) out[j] = src[j];
    }
    out += take;
    start += take;
    n -= take;
  }
}

TokenStream TokenStream::slice(int64_t start, int64_t n) const {
  KEEL_ASSERT(start >= 0 && n >= 0 && start + n <= size_);
  TokenStream s;
  s.size_ = n;
  s.description_ =
      description_ + " [" + std::to_string(start) + ", " + std::to_string(start + n) + ")";
  if (n == 0) return s;
  for (size_t si = segment_of(start); si < segments_.size(); ++si) {
    const Segment& seg = segments_[si];
    const int64_t lo = std::max(start, seg.start);
    const int64_t hi = std::min(start + n, seg.start + seg.n);
    if (lo >= hi) break;
    s.segments_.push_back(
        {seg.owner, seg.data + (lo - seg.start) * seg.width, seg.width, lo - start, hi - lo});
  }
  return s;
}

}  // namespace keel
