// TensorBoard event files (RUN/tensorboard/): scalars and text summaries as TensorFlow Event
// protos (framework/tensorboard/event.proto, TensorFlow's field numbers) in TFRecord framing
// (tfrecord.h), readable by the real tensorboard package. TensorBoard output is a view of the run,
// never a reason to stop it: the writer never throws, reports its first I/O failure once through
// take_failure(), and turns every later call into a no-op. One writer per file, used from one
// thread (rank 0's training loop).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) when missing and starts a new event file there,
  //   events.out.tfevents.<unix seconds>.<hostname>.<pid>.keel
  // (".1", ".2", ... appended rather than overwrite an existing file of that name), whose first
  // record carries file_version "brain.Event:2". A failure here is kept for take_failure().
  explicit TensorBoardWriter(const std::string& dir);
  // Flushes; a failure then goes unreported, so call flush() and take_failure() before.
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One value at `step` for the scalars dashboard (Summary.Value.simple_value). NaN and
  // infinities are written as they are. `wall_time` is seconds since the Unix epoch (now()).
  void scalar(std::string_view tag, int64_t step, float value, double wall_time) noexcept;
  // A Markdown text summary for the text dashboard: a scalar DT_STRING tensor whose metadata
  // names the "text" plugin.
  void text(std::string_view tag, int64_t step, std::string_view markdown,
            double wall_time) noexcept;
  // Records are buffered and reach the file on flush() (or once 64 KiB are pending). Returns
  // false once output has stopped.
  bool flush() noexcept;
  // flush() and fsync: every event so far survives a crash of the machine (keel-train calls it
  // when a checkpoint commits). Returns false once output has stopped.
  bool sync() noexcept;

  // True until the first failure.
  bool ok() const { return fd_ >= 0; }
  // The event file's path (also when it could not be created).
  const std::string& path() const { return path_; }
  // After the first failure, once: "tensorboard: <file>: <reason>; tensorboard output stops".
  // Otherwise, and on every later call, nullopt.
  std::optional<std::string> take_failure();

  // Seconds since the Unix epoch, the wall_time TensorBoard expects.
  static double now();

 private:
  void append_event(const std::string& serialized) noexcept;
  void fail(const std::string& reason) noexcept;

  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;    // bytes of whole records in the file
  std::string buffer_;  // framed records not yet written
  std::optional<std::string> failure_;
  bool failure_taken_ = false;
};

// What keel's own reader (read_tensorboard_events) finds in one Summary.Value.
struct TensorBoardValue {
  std::string tag;
  std::string plugin_name;          // SummaryMetadata.plugin_data.plugin_name; empty when absent
  std::optional<float> scalar;      // simple_value
  std::optional<std::string> text;  // string_val of a scalar DT_STRING tensor
};

struct TensorBoardEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;  // set on the first record only
  std::vector<TensorBoardValue> values;
};

// Resume: drops every event of a step after `max_step` from the event file at `path` (a resumed
// run logs those steps again), keeping the file_version record and the events whose tags start
// with `keep_prefix` (when not empty) up to step `keep_until`. Reads whole records up to the
// first torn or corrupt one (a crash mid-write) and drops that tail too. Rewrites the file
// atomically when anything is dropped; returns how many records were. Throws kIo when the file
// cannot be read or rewritten.
int64_t trim_tensorboard_events(const std::string& path, int64_t max_step,
                                std::string_view keep_prefix = {}, int64_t keep_until = 0);

// Every event in the file at `path`, framing and CRCs checked (read_tfrecords). Throws kIo when
// unreadable and kData for a bad record or one that does not parse as an Event.
std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path);

}  // namespace keel
