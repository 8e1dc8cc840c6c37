// Manifest checksum, parsing and validation, and defensive opening of a checkpoint's files. See
// manifest_io.h.
#include "checkpoints/manifest_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <new>
#include <tuple>
#include <utility>
#include <vector>

#include "framework/error.h"
#include "framework/file_io.h"

namespace keel {
namespace {

// manifest_xxh3 (field 15, wire type 1: fixed64) as the one byte that tags it.
constexpr unsigned char kChecksumTag = (15 << 3) | 1;
constexpr size_t kChecksumRecordBytes = 1 + 8;

// Bounds that no real model reaches and that keep every product and sum below int64's range.
constexpr int kMaxRank = 8;
constexpr int64_t kMaxTensorElements = int64_t{1} << 40;
constexpr size_t kMaxNameBytes = 255;

// A name safe to echo in a one-line error and (for files) to join onto a directory: printable
// ASCII without spaces, at most kMaxNameBytes.
bool printable_name(const std::string& s) {
  if (s.empty() || s.size() > kMaxNameBytes) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return c > ' ' && c < 127; });
}

// A file name that stays inside the checkpoint directory: no '/', not "." or "..".
bool plain_file_name(const std::string& s) {
  return printable_name(s) && s.find('/') == std::string::npos && s != "." && s != "..";
}

const char* kind_name(int kind) {
  switch (kind) {
    case ckpt::PARAM:
      return "param";
    case ckpt::ADAM_M:
      return "adam_m";
    case ckpt::ADAM_V:
      return "adam_v";
    default:
      return "unknown";
  }
}

uint64_t load_le64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

void check_checksum(const std::string& bytes, const ckpt::Manifest& m, const std::string& path) {
  if (m.format_version() < 2 && !m.has_manifest_xxh3()) return;  // format 1: none
  KEEL_CHECK(m.has_manifest_xxh3(), kData, path, ": has no checksum record (format version ",
             m.format_version(), " requires one; the file is corrupt)");
  const size_t body =
      bytes.size() >= kChecksumRecordBytes ? bytes.size() - kChecksumRecordBytes : 0;
  const bool trailing = bytes.size() >= kChecksumRecordBytes &&
                        static_cast<unsigned char>(bytes[body]) == kChecksumTag &&
                        load_le64(bytes.data() + body + 1) == m.manifest_xxh3();
  KEEL_CHECK(trailing, kData, path,
             ": the checksum record is not at the end of the file (corrupt, or edited by a tool "
             "that rewrote it)");
  KEEL_CHECK(XXH3_64bits(bytes.data(), body) == m.manifest_xxh3(), kData, path,
             ": checksum mismatch (the manifest is corrupt or was edited)");
}

// The slices of one tensor, validated one by one; then their coverage.
struct SliceRef {
  int64_t block_begin, block_len, flat_begin, n;
  int index;
};

void check_tensor(const ckpt::TensorRecord& rec, int t, const std::map<std::string, int64_t>& files,
                  const std::string& path) {
  KEEL_CHECK(printable_name(rec.name()), kData, path, ": tensor record ", t,
             ": its name is empty, too long or not printable");
  const std::string what = path + ": tensor " + rec.name() + " (" + kind_name(rec.kind()) + ")";
  KEEL_CHECK(rec.kind() == ckpt::PARAM || rec.kind() == ckpt::ADAM_M || rec.kind() == ckpt::ADAM_V,
             kData, what, ": unknown kind ", static_cast<int>(rec.kind()));
  KEEL_CHECK(rec.dtype() == "f32", kData, what, ": dtype is not f32");
  const int rank = rec.shape_size();
  KEEL_CHECK(rank >= 1 && rank <= kMaxRank, kData, what, ": ", rank, " dimensions (1 to ", kMaxRank,
             " allowed)");
  int64_t numel = 1;
  for (int d = 0; d < rank; ++d) {
    const int64_t extent = rec.shape(d);
    KEEL_CHECK(extent > 0 && extent <= kMaxTensorElements / numel, kData, what, ": dimension ", d,
               " is ", extent, " (each must be positive and the tensor at most ",
               kMaxTensorElements, " elements)");
    numel *= extent;
  }
  KEEL_CHECK(rec.slices_size() > 0, kData, what, ": has no slices");
  const int dim = rec.slices(0).shard_dim();
  std::vector<SliceRef> refs;
  refs.reserve(static_cast<size_t>(rec.slices_size()));
  for (int k = 0; k < rec.slices_size(); ++k) {
    const ckpt::Slice& s = rec.slices(k);
    const std::string where = what + ": slice " + std::to_string(k);
    KEEL_CHECK(s.shard_dim() >= -1 && s.shard_dim() < rank, kData, where, ": shard_dim ",
               s.shard_dim(), " is out of range for ", rank, " dimensions");
    KEEL_CHECK(s.shard_dim() == dim, kData, where, ": sharded on dimension ", s.shard_dim(),
               ", slice 0 on ", dim, " (one layout per tensor)");
    int64_t block = numel;
    if (dim < 0) {
      KEEL_CHECK(s.shard_begin() == 0 && s.shard_len() == 0, kData, where,
                 ": an unsharded slice with shard_begin ", s.shard_begin(), " and shard_len ",
                 s.shard_len(), " (both must be 0)");
    } else {
      const int64_t extent = rec.shape(dim);
      KEEL_CHECK(
          s.shard_len() > 0 && s.shard_begin() >= 0 && s.shard_begin() <= extent - s.shard_len(),
          kData, where, ": block [", s.shard_begin(), ", +", s.shard_len(),
          ") is empty or outside dimension ", dim, " of extent ", extent);
      block = numel / extent * s.shard_len();
    }
    KEEL_CHECK(s.n() > 0 && s.flat_begin() >= 0 && s.flat_begin() <= block - s.n(), kData, where,
               ": elements [", s.flat_begin(), ", +", s.n(), ") are empty or outside its block of ",
               block);
    KEEL_CHECK(plain_file_name(s.file()), kData, where,
               ": file is not a plain name within the checkpoint directory");
    const auto f = files.find(s.file());
    KEEL_CHECK(f != files.end(), kData, where, ": file ", s.file(),
               " is not listed in the manifest's files");
    KEEL_CHECK(s.offset() >= 0 && s.offset() <= f->second &&
                   s.n() <= (f->second - s.offset()) / static_cast<int64_t>(sizeof(float)),
               kData, where, ": ", s.n(), " floats at byte ", s.offset(), " lie outside ", s.file(),
               " of ", f->second, " bytes");
    refs.push_back(
        {dim < 0 ? 0 : s.shard_begin(), dim < 0 ? numel : s.shard_len(), s.flat_begin(), s.n(), k});
  }
  // Coverage: the blocks tile the sharded dimension, and each block's flat ranges tile it.
  std::sort(refs.begin(), refs.end(), [](const SliceRef& a, const SliceRef& b) {
    return std::tie(a.block_begin, a.block_len, a.flat_begin, a.index) <
           std::tie(b.block_begin, b.block_len, b.flat_begin, b.index);
  });
  const int64_t extent = dim < 0 ? numel : rec.shape(dim);
  const int64_t per_row = numel / extent;  // elements per unit of the sharded dimension
  int64_t rows_done = 0;                   // blocks tile [0, rows_done) so far
  for (size_t i = 0; i < refs.size();) {
    const SliceRef& first = refs[i];
    KEEL_CHECK(first.block_begin <= rows_done, kData, what, ": nothing covers [", rows_done, ", ",
               first.block_begin, ") along dimension ", dim);
    KEEL_CHECK(first.block_begin == rows_done, kData, what, ": slice ", first.index,
               " overlaps slice ", refs[i - 1].index);
    const int64_t block = dim < 0 ? numel : per_row * first.block_len;
    int64_t done = 0;
    size_t j = i;
    for (; j < refs.size() && refs[j].block_begin == first.block_begin &&
           refs[j].block_len == first.block_len;
         ++j) {
      KEEL_CHECK(refs[j].flat_begin <= done, kData, what, ": nothing covers elements [", done, ", ",
                 refs[j].flat_begin, ") of the block at ", first.block_begin);
      KEEL_CHECK(refs[j].flat_begin == done, kData, what, ": slice ", refs[j].index,
                 " overlaps slice ", refs[j - 1].index);
      done += refs[j].n;
    }
    KEEL_CHECK(done == block, kData, what, ": nothing covers elements [", done, ", ", block,
               ") of the block at ", first.block_begin);
    rows_done = first.block_begin + first.block_len;
    i = j;
  }
  KEEL_CHECK(rows_done == extent, kData, what, ": nothing covers [", rows_done, ", ", extent,
             ") along dimension ", dim < 0 ? 0 : dim);
}

// No two slices (of any tensors) share a byte of a file, so the elements a manifest describes
// never exceed its files' bytes.
void check_file_bytes(const ckpt::Manifest& m, const std::string& path) {
  struct Extent {
    const std::string* file;
    int64_t offset, bytes;
    int tensor, slice;
  };
  std::vector<Extent> extents;
  for (int t = 0; t < m.tensors_size(); ++t) {
    for (int k = 0; k < m.tensors(t).slices_size(); ++k) {
      const ckpt::Slice& s = m.tensors(t).slices(k);
      extents.push_back({&s.file(), s.offset(), s.n() * static_cast<int64_t>(sizeof(float)), t, k});
    }
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return std::tie(*a.file, a.offset, a.tensor, a.slice) <
           std::tie(*b.file, b.offset, b.tensor, b.slice);
  });
  for (size_t i = 1; i < extents.size(); ++i) {
    const Extent& a = extents[i - 1];
    const Extent& b = extents[i];
    if (*a.file != *b.file || a.offset + a.bytes <= b.offset) continue;
    KEEL_FAIL(kData, path, ": tensor ", m.tensors(b.tensor).name(), " (",
              kind_name(m.tensors(b.tensor).kind()), "): slice ", b.slice, " shares bytes of ",
              *b.file, " from ", b.offset, " with slice ", a.slice, " of tensor ",
              m.tensors(a.tensor).name(), " (", kind_name(m.tensors(a.tensor).kind()), ")");
  }
}

void validate(const ckpt::Manifest& m, const std::string& path) {
  KEEL_CHECK(m.step() >= 0, kData, path, ": step ", m.step(), " is negative");
  KEEL_CHECK(m.adam_t() >= 0, kData, path, ": adam_t ", m.adam_t(), " is negative");
  KEEL_CHECK(!m.has_parent_step() || (m.parent_step() >= -1 && m.parent_step() < m.step()), kData,
             path, ": parent_step ", m.parent_step(), " is not -1 or a step before ", m.step());
  const ckpt::Layout& l = m.layout();
  KEEL_CHECK(l.world() >= 1 && l.tp() >= 1 && l.dp() >= 1, kData, path, ": layout world ",
             l.world(), ", tp ", l.tp(), ", dp ", l.dp(), " (each must be at least 1)");
  std::map<std::string, int64_t> files;
  for (int i = 0; i < m.files_size(); ++i) {
    const ckpt::ShardFile& f = m.files(i);
    KEEL_CHECK(plain_file_name(f.name()), kData, path, ": files entry ", i,
               ": not a plain name within the checkpoint directory");
    KEEL_CHECK(f.bytes() >= 0, kData, path, ": file ", f.name(), ": size ", f.bytes(),
               " is negative");
    KEEL_CHECK(files.emplace(f.name(), f.bytes()).second, kData, path, ": file ", f.name(),
               " is listed twice");
  }
  std::map<std::pair<std::string, int>, int> seen;
  for (int t = 0; t < m.tensors_size(); ++t) {
    const ckpt::TensorRecord& rec = m.tensors(t);
    check_tensor(rec, t, files, path);
    KEEL_CHECK(seen.emplace(std::make_pair(rec.name(), static_cast<int>(rec.kind())), t).second,
               kData, path, ": tensor ", rec.name(), " (", kind_name(rec.kind()),
               ") is recorded twice");
  }
  check_file_bytes(m, path);
}

}  // namespace

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::optional<int64_t> parse_step_name(const std::string& name) {
  // step_%08lld: at least 8 digits (more from step 10^8 on), at most 18 (no overflow).
  if (name.size() < 13 || name.size() > 23 || name.rfind("step_", 0) != 0) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  if (step_name(v) != name) return std::nullopt;  // only the canonical spelling
  return v;
}

std::string serialize_manifest(ckpt::Manifest m) {
  m.clear_manifest_xxh3();
  std::string bytes = m.SerializeAsString();
  const uint64_t h = XXH3_64bits(bytes.data(), bytes.size());
  bytes.push_back(static_cast<char>(kChecksumTag));
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((h >> (8 * i)) & 0xff));
  return bytes;
}

ckpt::Manifest parse_manifest(const std::string& bytes, const std::string& path) {
  try {
    KEEL_CHECK(static_cast<int64_t>(bytes.size()) <= kMaxManifestBytes, kData, path, ": ",
               bytes.size(), " bytes, more than a manifest may have (", kMaxManifestBytes, ")");
    ckpt::Manifest m;
    KEEL_CHECK(m.ParseFromString(bytes) && m.format_version() > 0, kData, path,
               ": cannot parse (corrupt, or not a keel checkpoint manifest)");
    KEEL_CHECK(m.format_version() <= kCheckpointFormatVersion, kData, path, ": format version ",
               m.format_version(), " is newer than this keel's ", kCheckpointFormatVersion,
               " (written by a newer keel)");
    check_checksum(bytes, m, path);
    // The checksum describes the file's bytes, not the content: a parsed manifest compares and
    // re-serializes (serialize_manifest) without it.
    m.clear_manifest_xxh3();
    validate(m, path);
    return m;
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    KEEL_FAIL(kData, path, ": out of memory while reading the manifest");
  } catch (const std::exception& e) {
    KEEL_FAIL(kData, path, ": cannot read the manifest: ", e.what());
  }
}

int open_regular_file(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    KEEL_CHECK(err != ENOENT, kData, path, ": missing (", what, ")");
    KEEL_FAIL(kData, path, ": cannot open (", what, "): ", std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    KEEL_FAIL(kData, path, ": cannot stat (", what, "): ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    KEEL_FAIL(kData, path, ": is ", file_type_name(st.st_mode), ", not a regular file (", what,
              ")");
  }
  return fd;
}

std::string read_regular_file(const std::string& path, int64_t max_bytes, const std::string& what) {
  const int fd = open_regular_file(path, what);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      ::close(fd);
      KEEL_FAIL(kData, path, ": cannot read (", what, "): ", std::strerror(err));
    }
    if (r == 0) break;
    if (static_cast<int64_t>(out.size()) + r > max_bytes) {
      ::close(fd);
      KEEL_FAIL(kData, path, ": larger than ", max_bytes, " bytes (", what, ")");
    }
    out.append(buf, static_cast<size_t>(r));
  }
  ::close(fd);
  return out;
}

ckpt::Manifest read_manifest(const std::string& dir) {
  const std::string path = dir + "/manifest.pb";
  struct stat st {};
  KEEL_CHECK(::lstat(path.c_str(), &st) == 0 || errno != ENOENT, kData, path,
             ": missing (an incomplete or damaged checkpoint)");
  const std::string bytes = read_regular_file(path, kMaxManifestBytes, "a checkpoint manifest");
  ckpt::Manifest m = parse_manifest(bytes, path);
  const std::string base = std::filesystem::path(dir).filename().string();
  if (const auto named = parse_step_name(base)) {
    KEEL_CHECK(*named == m.step(), kData, path, ": step ", m.step(),
               " does not match the directory name ", base);
  }
  for (const ckpt::ShardFile& f : m.files()) {
    const std::string file = dir + "/" + f.name();
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) {
      KEEL_FAIL(kData, file, ": ", std::strerror(errno), " (a shard the manifest lists)");
    }
    KEEL_CHECK(S_ISREG(st.st_mode), kData, file, ": is ", file_type_name(st.st_mode),
               ", not a regular file (a shard the manifest lists)");
    KEEL_CHECK(static_cast<int64_t>(st.st_size) == f.bytes(), kData, file, ": ",
               static_cast<int64_t>(st.st_size), " bytes, the manifest says ", f.bytes(),
               " (truncated or overwritten)");
  }
  return m;
}

}  // namespace keel
