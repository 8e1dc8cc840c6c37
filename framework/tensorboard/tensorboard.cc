// TensorBoard event-file writer and reader (see tensorboard.h).
#include "framework/tensorboard/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "framework/error.h"
#include "framework/tensorboard/event.pb.h"
#include "framework/tensorboard/tfrecord.h"

namespace keel {
namespace {

constexpr size_t kFlushBytes = 64 * 1024;
constexpr int kMaxNameSuffix = 1000;

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

std::string serialize(const tb::Event& event) {
  std::string bytes;
  event.SerializeToString(&bytes);
  return bytes;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  const double start = now();
  try {
    const std::string base = dir + "/events.out.tfevents." +
                             std::to_string(static_cast<int64_t>(start)) + "." + host_name() + "." +
                             std::to_string(getpid()) + ".keel";
    path_ = base;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      fail("cannot create its directory (" + ec.message() + ")");
      return;
    }
    for (int suffix = 0; suffix <= kMaxNameSuffix; ++suffix) {
      path_ = suffix == 0 ? base : base + "." + std::to_string(suffix);
      fd_ = open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd_ >= 0 || errno != EEXIST) break;
    }
    if (fd_ < 0) {
      fail(std::string("cannot create (") + std::strerror(errno) + ")");
      return;
    }
    tb::Event event;
    event.set_wall_time(start);
    event.set_file_version("brain.Event:2");
    append_event(serialize(event));
    flush();
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

TensorBoardWriter::~TensorBoardWriter() {
  flush();
  if (fd_ >= 0) close(fd_);
}

void TensorBoardWriter::scalar(std::string_view tag, int64_t step, float value,
                               double wall_time) noexcept {
  if (fd_ < 0) return;
  try {
    tb::Event event;
    event.set_wall_time(wall_time);
    event.set_step(step);
    tb::Summary::Value* v = event.mutable_summary()->add_value();
    v->set_tag(std::string(tag));
    v->set_simple_value(value);
    append_event(serialize(event));
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void TensorBoardWriter::text(std::string_view tag, int64_t step, std::string_view markdown,
                             double wall_time) noexcept {
  if (fd_ < 0) return;
  try {
    tb::Event event;
    event.set_wall_time(wall_time);
    event.set_step(step);
    tb::Summary::Value* v = event.mutable_summary()->add_value();
    v->set_tag(std::string(tag));
    // The text plugin's content is a serialized TextPluginData; empty is its version 0.
    v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
    v->mutable_metadata()->set_data_class(tb::DATA_CLASS_TENSOR);
    tb::TensorProto* t = v->mutable_tensor();
    t->set_dtype(tb::DT_STRING);
    t->mutable_tensor_shape();  // no dims: a scalar string
    t->add_string_val(std::string(markdown));
    append_event(serialize(event));
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void TensorBoardWriter::append_event(const std::string& serialized) noexcept {
  try {
    append_tfrecord(buffer_, serialized);
  } catch (const std::exception& e) {
    fail(e.what());
    return;
  }
  if (buffer_.size() >= kFlushBytes) flush();
}

bool TensorBoardWriter::flush() noexcept {
  if (fd_ < 0) return false;
  size_t done = 0;
  while (done < buffer_.size()) {
    const ssize_t n = write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      // Cut a partly written record off again, so the file ends with a whole record.
      const bool whole = done == 0 || ftruncate(fd_, size_) == 0;
      fail(std::string("write failed (") + std::strerror(err) + ")" +
           (whole ? "" : ", and the file now ends mid-record"));
      return false;
    }
    done += static_cast<size_t>(n);
  }
  size_ += static_cast<int64_t>(buffer_.size());
  buffer_.clear();
  return true;
}

void TensorBoardWriter::fail(const std::string& reason) noexcept {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  buffer_.clear();
  buffer_.shrink_to_fit();
  if (failure_ || failure_taken_) return;
  try {
    failure_ = "tensorboard: " + path_ + ": " + reason + "; tensorboard output stops";
  } catch (const std::exception&) {
    failure_ = std::nullopt;
  }
}

std::optional<std::string> TensorBoardWriter::take_failure() {
  if (!failure_) return std::nullopt;
  std::optional<std::string> out = std::move(failure_);
  failure_ = std::nullopt;
  failure_taken_ = true;
  return out;
}

double TensorBoardWriter::now() {
  using std::chrono::duration;
  using std::chrono::system_clock;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path) {
  std::vector<TensorBoardEvent> events;
  const std::vector<std::string> records = read_tfrecords(path);
  for (size_t i = 0; i < records.size(); ++i) {
    tb::Event proto;
    KEEL_CHECK(proto.ParseFromString(records[i]), kData, path, ": record ", i, " is not an Event");
    TensorBoardEvent& e = events.emplace_back();
    e.wall_time = proto.wall_time();
    e.step = proto.step();
    e.file_version = proto.file_version();
    for (const tb::Summary::Value& v : proto.summary().value()) {
      TensorBoardValue& out = e.values.emplace_back();
      out.tag = v.tag();
      out.plugin_name = v.metadata().plugin_data().plugin_name();
      if (v.has_simple_value()) out.scalar = v.simple_value();
      if (v.has_tensor() && v.tensor().dtype() == tb::DT_STRING &&
          v.tensor().tensor_shape().dim_size() == 0 && v.tensor().string_val_size() == 1) {
        out.text = v.tensor().string_val(0);
      }
    }
  }
  return events;
}

}  // namespace keel
