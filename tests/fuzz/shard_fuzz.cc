// Fuzzes the llm.c token-shard reader: an input is a whole shard file, uint16 (magic 20240520) or
// uint32 (magic 20240801). The header check on the bytes (read_shard_header) and the reader on the
// file (TokenStream::open_shards, through a temporary file) must agree; a shard that opens must
// read back exactly its bytes, as a shard and as a text file, and peek_size must count what
// open_shards counts. Then the file is cut short (by an amount the input's last byte picks) while
// the stream is open: reading it all must either succeed (nothing read was cut) or throw kData
// "truncated while in use" naming the file (Note [token files are read, not mapped]).
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "framework/data/token_stream.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr int32_t kVocab = 50257;  // GPT-2's: tokens past it are refused

// A file in a directory of this process's own, made once (in memory, /dev/shm, where there is
// one: every input writes and truncates it), and removed at exit.
const std::string& scratch_file() {
  static const std::string path = [] {
    std::string dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm/keel_shard_fuzz_XXXXXX"
                                                    : "/tmp/keel_shard_fuzz_XXXXXX";
    keel::fuzz::check(mkdtemp(dir.data()) != nullptr, "mkdtemp failed");
    return dir + "/shard.bin";
  }();
  static const bool cleanup = [] {
    return std::atexit([] {
             unlink(path.c_str());
             rmdir(path.substr(0, path.rfind('/')).c_str());
           }) == 0;
  }();
  (void)cleanup;
  return path;
}

void one_input(const std::string& bytes) {
  const std::string& path = scratch_file();
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  const int64_t size = static_cast<int64_t>(bytes.size());

  keel::ShardHeader h{-1, 0};
  const bool header_ok = keel::fuzz::accepts(
      [&] { h = keel::read_shard_header(bytes.substr(0, keel::kShardHeaderBytes), size, path); });
  const int64_t n = h.tokens;
  const int width = h.width;
  keel::TokenStream s;
  const bool opened =
      keel::fuzz::accepts([&] { s = keel::TokenStream::open_shards(path, kVocab, "data.path"); });
  keel::fuzz::check(header_ok || !opened, "open_shards opened a shard whose header is refused");
  if (!opened) return;
  keel::fuzz::check(width == 2 || width == 4, "a shard of another width than 2 or 4 bytes");
  keel::fuzz::check(s.size() == n && n == (size - keel::kShardHeaderBytes) / width,
                    "open_shards counts another size than the header");
  keel::fuzz::check(keel::TokenStream::peek_size(path, true) == n, "peek_size disagrees");

  std::vector<int32_t> tokens(static_cast<size_t>(n));
  s.copy(0, n, tokens.data());
  for (int64_t i = 0; i < n; ++i) {
    uint32_t t = 0;  // little-endian host: the low bytes of a uint32 hold the uint16
    std::memcpy(&t, bytes.data() + keel::kShardHeaderBytes + width * i, width);
    keel::fuzz::check(static_cast<uint32_t>(tokens[i]) == t && t < kVocab,
                      "a token reads back wrong");
  }
  const uint8_t pick = static_cast<uint8_t>(bytes.back());
  const int64_t mid = n * pick / 256;
  keel::fuzz::check(s.at(mid) == tokens[mid], "at() disagrees with copy()");
  const keel::TokenStream tail = s.slice(mid, n - mid);
  if (tail.size() > 0) keel::fuzz::check(tail.at(0) == tokens[mid], "a slice reads back wrong");

  const keel::TokenStream text = keel::TokenStream::open_text(path, 256, "data.path");
  std::vector<int32_t> chars(bytes.size());
  text.copy(0, size, chars.data());
  keel::fuzz::check(std::equal(chars.begin(), chars.end(), bytes.begin(),
                               [](int32_t c, char b) { return c == static_cast<uint8_t>(b); }),
                    "the file as text reads back wrong");

  // Cut to the header and `keep` of the n tokens (all of them when pick is 255).
  const int64_t keep = pick == 255 ? n : n * pick / 255;
  keel::fuzz::check(truncate(path.c_str(), keel::kShardHeaderBytes + width * keep) == 0,
                    "truncate failed");
  bool read_all = false;
  try {
    s.copy(0, n, tokens.data());
    read_all = true;
  } catch (const keel::Error& e) {
    const std::string what = e.what();
    keel::fuzz::check(e.kind() == keel::ErrorKind::kData &&
                          what.find(path + ": truncated while in use") != std::string::npos,
                      "a cut file's read fails with another error: " + what);
  }
  keel::fuzz::check(read_all == (keep == n),
                    "a read of a cut file did not fail, or a whole one did");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;  // the cut needs a last byte; an empty file is refused at open anyway
  one_input(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
