// keel's configuration: defaults, loading (text-format file merged over the defaults, then
// `--set dotted.path=value` overrides), validation with derived values resolved, and printing.
// Every failure throws keel::Error (kConfig, or kUsage for a malformed --set) with one line that
// names the file position or the dotted field and the reason.
#pragma once

#include <string>
#include <vector>

#include "framework/config/keel.pb.h"

namespace keel {

// The full default configuration (parsed from a text-format string in config_defaults.cc, so the
// defaults read like a .pbtxt). Not yet validated: d_ff, max_positions and data.format are still
// the "resolve me" values 0 / 0 / AUTO.
config::KeelConfig default_config();

// default_config(), with the text-format file at `path` merged over it (an empty path means
// defaults only), then each `sets` entry ("dotted.path=value") applied in order, then validate().
// The file must be a regular file (a FIFO is refused, not waited on) of at most 64 MiB.
config::KeelConfig load_config(const std::string& path, const std::vector<std::string>& sets);

// Merges text-format `text` over `cfg`; `source` names it in errors ("<source>:<line>:<col>: ...",
// 1-based). A field given twice, an integer written in octal (010) or hexadecimal (0x20), and a
// block left open at the end ("model {" without "}", named with where it opened) are errors; a
// leading UTF-8 byte-order mark is skipped. Echoed tokens are cut to 64 bytes.
void merge_config_text(const std::string& text, const std::string& source, config::KeelConfig& cfg);

// Applies one override "dotted.path=value" (e.g. "model.qk_norm=L2", "data.path=/d/x.bin").
// Strings take the value verbatim (no quotes needed); other fields parse it as text format, and
// numbers must be decimal (010 and 0x20 are errors).
void apply_set(const std::string& assignment, config::KeelConfig& cfg);

// Resolves derived values (model.d_ff 0 -> 4 x d_model, model.max_positions 0 -> seq_len,
// data.format AUTO -> BUILTIN / SHARDS / TEXT) and checks every field's range. Idempotent.
// A field whose feature is not built yet (spike.enabled, checkpoint.every, debug.inject_*) must
// keep its default. Checks that involve the world size, the machine (threads, memory) or the
// data's size belong to the launcher, not here.
void validate(config::KeelConfig& cfg);

// `s` with ASCII letters upper-cased: the enum-like string settings (train.device, train.precision,
// parallel.tp_comm_dtype) are case-insensitive.
std::string upper_ascii(std::string s);

// Text format with every field printed, zeros and falses included, so that merging the output
// over default_config() reproduces `cfg` exactly (config.pbtxt in the run directory).
std::string to_text(const config::KeelConfig& cfg);

// The built-in defaults as text (every field, zeros and falses included): what default_config()
// parses.
std::string default_config_text();

}  // namespace keel
