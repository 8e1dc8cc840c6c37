// Content fingerprint of a token stream: XXH3-64 (libxxhash) over the token values, so two ranks,
// two runs or a run and its checkpoint can tell whether they read the same data. It depends on
// the token values and their order only: the built-in corpus, a text file and llm.c shards
// holding the same tokens give the same fingerprint. See Note [data fingerprint].
#pragma once

#include <cstdint>
#include <string>

#include "framework/data/token_stream.h"

namespace keel {

// Note [data fingerprint]: the stream is cut into blocks of kFingerprintBlock tokens; each block's
// tokens, as little-endian uint32, are hashed with XXH3-64 (blocks in parallel, OpenMP), and the
// fingerprint is XXH3-64 of (token count, block hashes...) as little-endian uint64. A tree hash
// keeps it as fast as the memory reads on many cores while every token still counts.
inline constexpr int64_t kFingerprintBlock = int64_t{1} << 20;

uint64_t fingerprint(const TokenStream& stream);

// "xxh3:0123456789abcdef": how a fingerprint is printed in messages, metrics and checkpoints.
std::string fingerprint_hex(uint64_t fp);

}  // namespace keel
