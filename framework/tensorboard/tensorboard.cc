// TensorBoard event-file writer and reader (see tensorboard.h).
#include "framework/tensorboard/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
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

bool TensorBoardWriter::sync() noexcept {
  if (!flush()) return false;
  int rc;
  do {
    rc = fsync(fd_);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    fail(std::string("fsync failed (") + std::strerror(errno) + ")");
    return false;
  }
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

int64_t trim_tensorboard_events(const std::string& path, int64_t max_step,
                                std::string_view keep_prefix, int64_t keep_until) {
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    KEEL_CHECK(in, kIo, path, ": cannot open (", std::strerror(errno), ")");
    std::ostringstream os;
    os << in.rdbuf();
    KEEL_CHECK(!in.bad(), kIo, path, ": read failed");
    bytes = os.str();
  }
  size_t whole = 0;
  const std::vector<std::string> records = split_tfrecords_prefix(bytes, &whole);
  std::string kept;
  int64_t dropped = 0;
  for (const std::string& r : records) {
    tb::Event e;
    // A record that is not an Event is not keel's: kept as it is.
    if (e.ParseFromString(r) && e.step() > max_step && e.file_version().empty()) {
      bool keep = false;
      for (const tb::Summary::Value& v : e.summary().value()) {
        keep |= !keep_prefix.empty() && e.step() <= keep_until &&
                std::string_view(v.tag()).substr(0, keep_prefix.size()) == keep_prefix;
      }
      if (!keep) {
        ++dropped;
        continue;
      }
    }
    append_tfrecord(kept, r);
  }
  if (dropped == 0 && whole == bytes.size()) return 0;
  if (whole != bytes.size()) ++dropped;  // the torn tail
  // Temporary file + fsync + rename (framework/file_io.h's write_file_atomic lives in a library
  // that links this one).
  const std::string tmp = path + ".trim." + std::to_string(getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KEEL_CHECK(fd >= 0, kIo, tmp, ": cannot write: ", std::strerror(errno));
  size_t done = 0;
  while (done < kept.size()) {
    const ssize_t n = write(fd, kept.data() + done, kept.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const int err = done < kept.size() ? (errno ? errno : ENOSPC) : 0;
  int rc = -1;
  if (err == 0) {
    do {
      rc = fsync(fd);
    } while (rc != 0 && errno == EINTR);
  }
  const bool synced = err == 0 && rc == 0;
  const int sync_err = errno;
  close(fd);
  if (err != 0 || !synced || rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = err != 0 ? err : !synced ? sync_err : errno;
    unlink(tmp.c_str());
    KEEL_FAIL(kIo, path, ": cannot rewrite without the steps after ", max_step, ": ",
              std::strerror(e));
  }
  return dropped;
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
