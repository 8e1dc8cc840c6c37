// A read-only view of a token stream: in-memory bytes (the built-in corpus), a text file read as
// bytes, or llm.c token shards with uint16 or uint32 tokens (one file or a sorted glob,
// concatenated in order; the two widths may be mixed). Every token is
// checked against the vocabulary once at open. Copies share the underlying storage; views are
// cheap to copy and safe to read from many threads.
//
// Note [token files are read, not mapped]: files stay open and every read is a pread(2) into the
// caller's buffer whose length is checked. A file truncated while a run uses it (a mapping would
// kill the process with SIGBUS on the next access to a page past the new end) makes the read
// short, and the read throws kData naming the file and "truncated while in use". The cost: a
// system call per read; the sampler fills 8 windows of 1024 tokens in 8.2 us against 4.0 us from
// a mapping, and keel-train's tokens/s shows no measurable difference.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

// llm.c shard layouts (docs/data.md, byte for byte): little-endian int32 header[256] =
// {magic, version, n_tokens, 0...}, then n_tokens little-endian tokens. llm.c's GPT-2 shards
// (dev/data/data_common.py "gpt-2") hold uint16 tokens; its LLaMA-3 shards ("llama-3") hold
// uint32 tokens under their own magic and version, which keel reads and keel-data writes as they
// are, so shards move between keel and llm.c unchanged.
inline constexpr int32_t kShardMagic = 20240520;  // uint16 tokens
inline constexpr int32_t kShardVersion = 1;
inline constexpr int32_t kShardMagicU32 = 20240801;  // uint32 tokens
inline constexpr int32_t kShardVersionU32 = 7;
inline constexpr int64_t kShardHeaderBytes = 256 * 4;

struct ShardHeader {
  int64_t tokens;  // n_tokens, > 0
  int width;       // bytes per token: 2 (uint16) or 4 (uint32)
};

// What an llm.c shard's header declares, checked against the file's size: `head` holds the file's
// first min(file_bytes, kShardHeaderBytes) bytes (bytes beyond the header are ignored) and `file`
// names the file in errors. Throws kData when the file is shorter than the header, the magic or
// version is neither layout's, the header declares no tokens, or the file does not hold exactly
// the declared tokens (truncated, or trailing bytes).
ShardHeader read_shard_header(std::string_view head, int64_t file_bytes, const std::string& file);
// read_shard_header(...).tokens.
int64_t shard_token_count(std::string_view head, int64_t file_bytes, const std::string& file);

class TokenStream {
 public:
  TokenStream() = default;  // empty

  // Each byte is a token. `description` names the source in errors and describe().
  static TokenStream from_bytes(std::vector<uint8_t> bytes, const std::string& description,
                                int32_t vocab_size);
  // A text file read as bytes. `field` (e.g. "data.path") names the setting in errors.
  static TokenStream open_text(const std::string& path, int32_t vocab_size,
                               const std::string& field);
  // One llm.c shard file or a glob(3) pattern of them, sorted by name and concatenated (uint16 and
  // uint32 shards may be mixed: each is read at its own width). Each file
  // stays open (one descriptor per shard; the soft RLIMIT_NOFILE is raised towards the hard one
  // when a glob matches more files than it allows).
  static TokenStream open_shards(const std::string& pattern, int32_t vocab_size,
                                 const std::string& field);

  // The token count open_text (shards false: the file's size) or open_shards (the counts in the
  // shard headers) would find, from sizes and headers alone: nothing is mapped and no token is
  // checked. nullopt when a file is missing, not a regular file or has a malformed header (the
  // open_* call then says why).
  static std::optional<int64_t> peek_size(const std::string& source, bool shards);

  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // Reads throw kData naming the file when it was truncated while in use (see the Note above).
  int32_t at(int64_t i) const;                              // 0 <= i < size()
  void copy(int64_t start, int64_t n, int32_t* out) const;  // out[0, n) = tokens [start, start+n)
  // A view of tokens [start, start + n), sharing storage.
  TokenStream slice(int64_t start, int64_t n) const;
  const std::string& describe() const { return description_; }

  class File;  // an open token file (token_stream.cc)

 private:
  // A run of tokens of one width (1: uint8, 2: uint16, 4: uint32): in memory at `data`, kept alive
  // by `owner`, or (data == nullptr) in `file` from byte `offset` on.
  struct Segment {
    std::shared_ptr<const void> owner;
    const uint8_t* data;
    std::shared_ptr<const File> file;
    int64_t offset;
    int width;
    int64_t start;  // index of the segment's first token in the stream
    int64_t n;
  };
  // out[0, n) = the segment's tokens [k, k + n).
  static void read_segment(const Segment& seg, int64_t k, int64_t n, int32_t* out);
  size_t segment_of(int64_t i) const;

  std::vector<Segment> segments_;
  int64_t size_ = 0;
  std::string description_ = "empty token stream";
};

}  // namespace keel
