// XXH3-64 tree hash of a token stream (see Note [data fingerprint]).
#include "framework/data/fingerprint.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <vector>

namespace keel {

uint64_t fingerprint(const TokenStream& stream) {
  const int64_t n = stream.size();
  const int64_t blocks = (n + kFingerprintBlock - 1) / kFingerprintBlock;
  // [0]: the token count, then one hash per block.
  std::vector<uint64_t> words(static_cast<size_t>(blocks) + 1);
  words[0] = static_cast<uint64_t>(n);
  // A read that fails (a file truncated while in use) throws; an exception must not leave an
  // OpenMP region, so the first is kept and rethrown after it.
  std::exception_ptr failed;
#pragma omp parallel
  {
    std::vector<int32_t> tokens(static_cast<size_t>(std::min(n, kFingerprintBlock)));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t start = b * kFingerprintBlock;
      const int64_t len = std::min(kFingerprintBlock, n - start);
      try {
        stream.copy(start, len, tokens.data());
      } catch (...) {
#pragma omp critical(keel_fingerprint_error)
        if (!failed) failed = std::current_exception();
        continue;
      }
      // Tokens are non-negative int32 values; on little-endian hosts their bytes are the
      // little-endian uint32 encoding the note names.
      words[static_cast<size_t>(b) + 1] =
          XXH3_64bits(tokens.data(), static_cast<size_t>(len) * sizeof(int32_t));
    }
  }
  if (failed) std::rethrow_exception(failed);
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "fingerprint assumes little-endian");
  return XXH3_64bits(words.data(), words.size() * sizeof(uint64_t));
}

std::string fingerprint_hex(uint64_t fp) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "xxh3:%016llx", static_cast<unsigned long long>(fp));
  return buf;
}

}  // namespace keel
