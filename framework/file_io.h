// Whole-file writes that never leave a half-written file behind: the bytes go to a temporary file
// beside the target, are fsynced, and are renamed over it (rename is atomic within a file
// system). Used for config.pbtxt now and for checkpoint manifests next.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

namespace keel {

// Replaces `path` with `bytes` atomically. On failure `path` keeps its old content (or stays
// absent), the temporary file is removed, and kIo names the path and the OS reason.
void write_file_atomic(const std::string& path, std::string_view bytes);

// What a stat(2) mode is, for "not a regular file" messages: "a directory", "a FIFO", ...
const char* file_type_name(mode_t mode);

// Appends `bytes` (whole lines) to the file open as `fd`, whose complete content is `size` bytes;
// advances `size`. A short write (a full disk) cuts the partial bytes off again, so readers only
// ever see whole lines, and throws kIo naming `path` and the OS reason.
void append_whole(int fd, const std::string& path, std::string_view bytes, int64_t& size);

}  // namespace keel
