// A checkpoint's manifest read as untrusted input (DESIGN.md principle 6) and written with its own
// checksum. parse_manifest checks everything the bytes alone can show (the checksum, the format
// version, every tensor's shape and every slice's geometry, file and coverage) before anything
// sizes an allocation or names a file; read_manifest adds what needs the directory (the step in
// its name, the shard files' types and sizes). Every failure is one kData line naming the file,
// the tensor and the reason. See checkpoints/README.md ("The manifest's checksum").
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "checkpoints/manifest.pb.h"

namespace keel {

// 1: no manifest checksum. 2: manifest.pb ends with its checksum record, and parent_step.
inline constexpr uint32_t kCheckpointFormatVersion = 2;

// The largest manifest.pb a reader accepts (a world of thousands with every tensor sharded stays
// far below it), so a huge or endless file cannot exhaust memory.
inline constexpr int64_t kMaxManifestBytes = int64_t{1} << 30;

// The bytes of manifest.pb for `m`: the serialized manifest without manifest_xxh3, then that
// field alone (one tag byte and eight little-endian bytes) holding the XXH3-64 of every byte
// before it. Protobuf merges concatenated fields, so the whole file parses as the manifest.
std::string serialize_manifest(ckpt::Manifest m);

// Verifies `bytes`' checksum (format 2 on; format 1 has none), parses them and validates them
// (see the file comment). The manifest returned has manifest_xxh3 cleared. Never touches the file
// system; every failure, including any std:: exception, is a kData error whose line starts with
// `path`.
ckpt::Manifest parse_manifest(const std::string& bytes, const std::string& path);

// Reads and parses `dir`/manifest.pb, opened as a regular file only (never blocking on a FIFO,
// never reading more than kMaxManifestBytes), then checks that `step` matches the directory's
// step_NNNNNNNN name (when it has that form) and that every listed shard file is a regular file
// of the listed size. Throws kData naming the file and the reason.
ckpt::Manifest read_manifest(const std::string& dir);

// "step_00000120" for 120, and back (nullopt for anything but that canonical spelling).
std::string step_name(int64_t step);
std::optional<int64_t> parse_step_name(const std::string& name);

// Opens `path` read-only without following it into a FIFO's open(2) wait (O_NONBLOCK) and checks
// with fstat that it is a regular file; returns the descriptor. Throws kData naming `path`,
// `what` it is and the reason (missing, not a regular file, unreadable).
int open_regular_file(const std::string& path, const std::string& what);

// The whole of the regular file `path` (opened as open_regular_file does), refusing one larger
// than `max_bytes`. Throws kData naming `path` and the reason.
std::string read_regular_file(const std::string& path, int64_t max_bytes, const std::string& what);

}  // namespace keel
