// TokenStream: text files and llm.c shards read through pread(2), validated once at open (see
// header and Note [token files are read, not mapped]).
#include "framework/data/token_stream.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/resource.h>
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

// An open token file. Reads are pread(2)s whose length is checked: a file that shrank since it
// was opened gives a short read, which throws kData naming the file.
class TokenStream::File {
 public:
  File(std::string path, int fd, int64_t bytes) : path_(std::move(path)), fd_(fd), bytes_(bytes) {}
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() { close(fd_); }

  const std::string& path() const { return path_; }
  int64_t bytes() const { return bytes_; }  // the size at open

  // dst[0, n) = the file's bytes [offset, offset + n).
  void read(int64_t offset, int64_t n, void* dst) const {
    auto* out = static_cast<uint8_t*>(dst);
    int64_t done = 0;
    while (done < n) {
      const ssize_t got = pread(fd_, out + done, static_cast<size_t>(n - done), offset + done);
      if (got < 0 && errno == EINTR) continue;
      KEEL_CHECK(got >= 0, kData, path_, ": cannot read ", n, " bytes at byte ", offset, ": ",
                 std::strerror(errno));
      KEEL_CHECK(got > 0, kData, path_, ": truncated while in use: ends before byte ",
                 offset + done, " of the ", bytes_, " it held when opened (read ", done, " of ", n,
                 " bytes at byte ", offset, ")");
      done += got;
    }
  }

 private:
  std::string path_;
  int fd_;
  int64_t bytes_;
};

namespace {

// Opens `path` for reading and checks that it is a regular file. O_NONBLOCK makes opening a FIFO
// return at once instead of waiting for a writer (it changes nothing for a regular file), so a
// FIFO, socket or device is refused rather than blocking or streaming forever.
int open_regular(const std::string& path, struct stat& st) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  const int open_errno = errno;
  KEEL_CHECK(fd >= 0, kData, path, ": cannot open: ", std::strerror(open_errno),
             open_errno == EMFILE ? " (each shard of data.path and data.val_path stays open; "
                                    "raise `ulimit -n`)"
                                  : "");
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    close(fd);
    KEEL_FAIL(kData, path, ": cannot stat: ", std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    KEEL_FAIL(kData, path, ": not a regular file (", file_type_name(st.st_mode), ")");
  }
  return fd;
}

// Closes a file descriptor on scope exit (peek_size).
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { close(fd_); }
  int get() const { return fd_; }

 private:
  int fd_;
};

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

// Lets this process hold `more` descriptors beyond those it may already have open: raises the soft
// RLIMIT_NOFILE towards the hard limit when `more` plus a margin for everything else (MPI,
// checkpoints, logs) exceeds it. Where the hard limit is lower, open() reports EMFILE.
void allow_open_files(size_t more) {
  constexpr rlim_t kMargin = 256;
  struct rlimit lim {};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  const rlim_t want = static_cast<rlim_t>(more) + kMargin;
  if (lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur >= want) return;
  lim.rlim_cur = lim.rlim_max == RLIM_INFINITY ? want : std::min(want, lim.rlim_max);
  setrlimit(RLIMIT_NOFILE, &lim);
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

// Reads `n` tokens of type T from `file` at byte `offset` in blocks and throws kData at the first
// one >= vocab_size, naming the file, the token and its index.
template <typename T>
void check_vocab(const TokenStream::File& file, int64_t offset, int64_t n, int32_t vocab_size,
                 const char* unit, const char* note) {
  constexpr int64_t kBlock = int64_t{1} << 18;  // tokens per read
  std::vector<T> buf(static_cast<size_t>(std::min(n, kBlock)));
  for (int64_t first = 0; first < n; first += kBlock) {
    const int64_t len = std::min(kBlock, n - first);
    file.read(offset + first * static_cast<int64_t>(sizeof(T)),
              len * static_cast<int64_t>(sizeof(T)), buf.data());
    const int64_t bad = first_out_of_vocab(buf.data(), len, vocab_size);
    KEEL_CHECK(bad < 0, kData, file.path(), ": ", unit, " ", static_cast<int64_t>(buf[bad]),
               " at index ", first + bad, " >= model.vocab_size=", vocab_size, note);
  }
}

// out[0, n) = the n tokens of `width` bytes (1, 2 or 4; unsigned) at `src`. uint32 tokens were
// checked against the vocabulary (an int32) at open, so they fit.
void widen(const uint8_t* src, int width, int64_t n, int32_t* out) {
  if (width == 1) {
    for (int64_t j = 0; j < n; ++j) out[j] = src[j];
  } else if (width == 2) {
    const auto* t = reinterpret_cast<const uint16_t*>(src);
    for (int64_t j = 0; j < n; ++j) out[j] = t[j];
  } else {
    KEEL_ASSERT(width == 4);
    const auto* t = reinterpret_cast<const uint32_t*>(src);
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<int32_t>(t[j]);
  }
}

int32_t header_field(std::string_view head, int index) {
  int32_t value;
  std::memcpy(&value, head.data() + 4 * index, 4);
  return value;
}

// Opens `path` as a token file.
std::shared_ptr<const TokenStream::File> open_file(const std::string& path) {
  struct stat st {};
  const int fd = open_regular(path, st);
  return std::make_shared<const TokenStream::File>(path, fd, static_cast<int64_t>(st.st_size));
}

}  // namespace

ShardHeader read_shard_header(std::string_view head, int64_t file_bytes, const std::string& file) {
  KEEL_CHECK(
      file_bytes >= kShardHeaderBytes && static_cast<int64_t>(head.size()) >= kShardHeaderBytes,
      kData, file, ": truncated: ", file_bytes, " bytes, shorter than the ", kShardHeaderBytes,
      "-byte llm.c shard header");
  const int32_t magic = header_field(head, 0);
  const int32_t version = header_field(head, 1);
  KEEL_CHECK(magic == kShardMagic || magic == kShardMagicU32, kData, file, ": bad magic ", magic,
             " (expected an llm.c token shard: ", kShardMagic, " for uint16 tokens or ",
             kShardMagicU32, " for uint32 tokens)");
  const bool u16 = magic == kShardMagic;
  KEEL_CHECK(version == (u16 ? kShardVersion : kShardVersionU32), kData, file,
             ": unsupported version ", version, " for magic ", magic, " (expected magic ",
             kShardMagic, " version ", kShardVersion, " = uint16 tokens, or magic ", kShardMagicU32,
             " version ", kShardVersionU32, " = uint32 tokens)");
  const int width = u16 ? 2 : 4;
  const int64_t n = header_field(head, 2);
  KEEL_CHECK(n > 0, kData, file, ": header says ", n, " tokens (expected > 0)");
  const int64_t held = (file_bytes - kShardHeaderBytes) / width;
  KEEL_CHECK(held >= n, kData, file, ": truncated: header says ", n, " tokens, file holds ", held);
  KEEL_CHECK(file_bytes == kShardHeaderBytes + width * n, kData, file, ": header says ", n,
             " tokens but the file holds ", file_bytes - kShardHeaderBytes,
             " bytes of tokens (trailing bytes)");
  return {n, width};
}

int64_t shard_token_count(std::string_view head, int64_t file_bytes, const std::string& file) {
  return read_shard_header(head, file_bytes, file).tokens;
}

TokenStream TokenStream::from_bytes(std::vector<uint8_t> bytes, const std::string& description,
                                    int32_t vocab_size) {
  const int64_t bad =
      first_out_of_vocab(bytes.data(), static_cast<int64_t>(bytes.size()), vocab_size);
  KEEL_CHECK(bad < 0, kData, description, ": token ", static_cast<int>(bytes[bad]), " at index ",
             bad, " >= model.vocab_size=", vocab_size);
  auto owner = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  TokenStream s;
  s.size_ = static_cast<int64_t>(owner->size());
  if (s.size_ > 0) s.segments_.push_back({owner, owner->data(), nullptr, 0, 1, 0, s.size_});
  s.description_ = description;
  return s;
}

TokenStream TokenStream::open_text(const std::string& path, int32_t vocab_size,
                                   const std::string& field) {
  KEEL_CHECK(!path.empty(), kData, field, " is empty: no text file to read");
  std::shared_ptr<const File> file = open_file(path);
  const int64_t n = file->bytes();
  KEEL_CHECK(n > 0, kData, path, ": empty text file");
  check_vocab<uint8_t>(*file, 0, n, vocab_size, "byte", " (text is read as bytes)");
  TokenStream s;
  s.segments_.push_back({nullptr, nullptr, file, 0, 1, 0, n});
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
  allow_open_files(files.size());

  TokenStream s;
  for (const std::string& path : files) {
    std::shared_ptr<const File> file = open_file(path);
    std::string head(static_cast<size_t>(std::min(file->bytes(), kShardHeaderBytes)), '\0');
    file->read(0, static_cast<int64_t>(head.size()), head.data());
    const ShardHeader h = read_shard_header(head, file->bytes(), path);
    if (h.width == 2) {
      check_vocab<uint16_t>(*file, kShardHeaderBytes, h.tokens, vocab_size, "token", "");
    } else {
      check_vocab<uint32_t>(*file, kShardHeaderBytes, h.tokens, vocab_size, "token", "");
    }
    s.segments_.push_back({nullptr, nullptr, file, kShardHeaderBytes, h.width, s.size_, h.tokens});
    s.size_ += h.tokens;
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
      Fd fd(open_regular(file, st));
      if (!shards) return static_cast<int64_t>(st.st_size);
      int32_t header[3];
      if (pread(fd.get(), header, sizeof(header), 0) != static_cast<ssize_t>(sizeof(header))) {
        return std::nullopt;
      }
      const bool u16 = header[0] == kShardMagic && header[1] == kShardVersion;
      const bool u32 = header[0] == kShardMagicU32 && header[1] == kShardVersionU32;
      if (!(u16 || u32) || header[2] <= 0) return std::nullopt;
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

void TokenStream::read_segment(const Segment& seg, int64_t k, int64_t n, int32_t* out) {
  if (seg.data != nullptr) {
    widen(seg.data + k * seg.width, seg.width, n, out);
    return;
  }
  // Through a block on the stack: one pread per block, then a forward (vectorised) widening.
  constexpr int64_t kBlockBytes = 16384;
  alignas(64) uint8_t raw[kBlockBytes];
  const int64_t per_block = kBlockBytes / seg.width;
  for (int64_t first = 0; first < n; first += per_block) {
    const int64_t len = std::min(per_block, n - first);
    seg.file->read(seg.offset + (k + first) * seg.width, len * seg.width, raw);
    widen(raw, seg.width, len, out + first);
  }
}

int32_t TokenStream::at(int64_t i) const {
  KEEL_ASSERT(i >= 0 && i < size_);
  const Segment& seg = segments_[segment_of(i)];
  int32_t token;
  read_segment(seg, i - seg.start, 1, &token);
  return token;
}

void TokenStream::copy(int64_t start, int64_t n, int32_t* out) const {
  KEEL_ASSERT(start >= 0 && n >= 0 && start + n <= size_);
  if (n == 0) return;
  for (size_t si = segment_of(start); n > 0; ++si) {
    const Segment& seg = segments_[si];
    const int64_t k = start - seg.start;
    const int64_t take = std::min(n, seg.n - k);
    read_segment(seg, k, take, out);
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
    const int64_t skip = (lo - seg.start) * seg.width;
    s.segments_.push_back({seg.owner, seg.data ? seg.data + skip : nullptr, seg.file,
                           seg.offset + (seg.data ? 0 : skip), seg.width, lo - start, hi - lo});
  }
  return s;
}

}  // namespace keel
