// TensorBoard event files (framework/tensorboard/): CRC32C against the RFC 3720 vectors, keel's
// own reader on the framing and CRCs (every flipped byte of a file is caught), the real
// tensorboard package reading keel's files (tensorboard_check.py, run with the venv tests/run
// makes) and keel reading tensorboard's, and I/O failures reported once without a throw.
#include "framework/tensorboard/tensorboard.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "framework/tensorboard/tfrecord.h"
#include "tests/launch/launch_test_util.h"
#include "tests/test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::command_line;
using testing::CommandResult;
using testing::error_of;
using testing::read_file;
using testing::run_command;
using testing::TempDir;
using testing::write_file;

// tests/run makes this venv (tensorboard from PyPI); KEEL_BINARY_DIR is the build directory.
const std::string kPython = std::string(KEEL_BINARY_DIR) + "/venv/bin/python";
const std::string kCheckScript =
    std::string(KEEL_SOURCE_DIR) + "/tests/framework/tensorboard_check.py";

constexpr double kWallTime0 = 1.7e9 + 0.125;  // exact in a double; the checker compares exactly
constexpr int64_t kAlertStep = 37;
const std::string kAlertText =
    "**spike** at step 37: loss 9.5 > 3.2 (z = 8.1, \xcf\x83 = 0.4)\n\n"
    "| figure | value |\n|---|---|\n| grad_norm | 12.5 |";
const std::string kRewindText = "rewind to step 30, skipping 2 batches";

float loss_at(int64_t step) { return 10.0f / (1.0f + 0.1f * static_cast<float>(step)); }
float lr_at(int64_t step) { return 3e-4f * static_cast<float>(step) / 50.0f; }

uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

std::string hex(std::string_view bytes) {
  std::string out;
  char buf[3];
  for (char c : bytes) {
    std::snprintf(buf, sizeof(buf), "%02x", static_cast<unsigned char>(c));
    out += buf;
  }
  return out;
}

std::string wall_text(double wall_time) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", wall_time);
  return buf;
}

// What a run writes: loss at steps 1..50, lr, grad_norm with a NaN and an infinity, and two text
// summaries. Returns the expected values in tensorboard_check.py's format, in writing order.
struct Sample {
  std::string expected;
  size_t n_values = 0;
};

Sample write_sample(TensorBoardWriter& w) {
  Sample s;
  auto scalar = [&](const std::string& tag, int64_t step, float v) {
    const double t = kWallTime0 + static_cast<double>(step);
    w.scalar(tag, step, v, t);
    const std::string bits = hex(std::string_view(reinterpret_cast<const char*>(&v), sizeof(v)));
    s.expected +=
        "scalar\t" + tag + "\t" + std::to_string(step) + "\t" + bits + "\t" + wall_text(t) + "\n";
    ++s.n_values;
  };
  auto text = [&](const std::string& tag, int64_t step, const std::string& md) {
    const double t = kWallTime0 + static_cast<double>(step) + 0.5;
    w.text(tag, step, md, t);
    s.expected +=
        "text\t" + tag + "\t" + std::to_string(step) + "\t" + hex(md) + "\t" + wall_text(t) + "\n";
    ++s.n_values;
  };
  for (int64_t step = 1; step <= 50; ++step) {
    scalar("train/loss", step, loss_at(step));
    scalar("train/lr", step, lr_at(step));
    if (step == kAlertStep) text("alerts/text", step, kAlertText);
  }
  scalar("train/grad_norm", 1, 0.75f);
  scalar("train/grad_norm", 2, std::numeric_limits<float>::quiet_NaN());
  scalar("train/grad_norm", 3, std::numeric_limits<float>::infinity());
  text("alerts/text", 51, kRewindText);
  return s;
}

std::string only_event_file(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().string());
  EXPECT_EQ(files.size(), 1u);
  return files.empty() ? "" : files[0];
}

TEST(Crc32c, MatchesRfc3720Vectors) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending += static_cast<char>(i);
    descending += static_cast<char>(31 - i);
  }
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending), 0x113FDB5Cu);
  // ((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xa282ead8, mod 2^32.
  EXPECT_EQ(masked_crc32c("123456789"), 0xC78AB0E5u);
}

TEST(TfRecord, FramesLengthAndDataWithMaskedCrcs) {
  std::string out;
  append_tfrecord(out, "abc");
  ASSERT_EQ(out.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(out.substr(0, 8), std::string("\x03\0\0\0\0\0\0\0", 8));
  auto le32 = [&](size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(out[at + i])} << (8 * i);
    return v;
  };
  EXPECT_EQ(le32(8), masked_crc32c(out.substr(0, 8)));
  EXPECT_EQ(out.substr(12, 3), "abc");
  EXPECT_EQ(le32(15), masked_crc32c("abc"));
}

TEST(TensorBoardWriter, KeelsReaderFindsEveryValue) {
  TempDir dir;
  const std::string logdir = dir.file("tensorboard");
  std::string path;
  {
    TensorBoardWriter w(logdir);
    ASSERT_TRUE(w.ok());
    write_sample(w);
    EXPECT_TRUE(w.flush());
    EXPECT_FALSE(w.take_failure().has_value());
    path = w.path();
  }
  EXPECT_EQ(only_event_file(logdir), path);
  EXPECT_NE(fs::path(path).filename().string().find("events.out.tfevents."), std::string::npos);

  const std::vector<TensorBoardEvent> events = read_tensorboard_events(path);
  ASSERT_EQ(events.size(), 1u + 100 + 1 + 3 + 1);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].values.empty());
  EXPECT_NEAR(events[0].wall_time, TensorBoardWriter::now(), 60.0);

  int64_t losses = 0;
  int texts = 0;
  for (const TensorBoardEvent& e : events) {
    if (e.values.empty()) continue;
    ASSERT_EQ(e.values.size(), 1u);
    const TensorBoardValue& v = e.values[0];
    if (v.tag == "train/loss") {
      ++losses;
      EXPECT_EQ(e.step, losses);
      ASSERT_TRUE(v.scalar.has_value());
      EXPECT_EQ(bits_of(*v.scalar), bits_of(loss_at(e.step))) << "step " << e.step;
      EXPECT_EQ(e.wall_time, kWallTime0 + static_cast<double>(e.step));
      EXPECT_EQ(v.plugin_name, "");
    } else if (v.tag == "train/grad_norm" && e.step == 2) {
      EXPECT_TRUE(std::isnan(*v.scalar));
    } else if (v.tag == "train/grad_norm" && e.step == 3) {
      EXPECT_EQ(*v.scalar, std::numeric_limits<float>::infinity());
    } else if (v.tag == "alerts/text") {
      ++texts;
      EXPECT_EQ(v.plugin_name, "text");
      EXPECT_FALSE(v.scalar.has_value());
      ASSERT_TRUE(v.text.has_value());
      EXPECT_EQ(*v.text, e.step == kAlertStep ? kAlertText : kRewindText);
    }
  }
  EXPECT_EQ(losses, 50);
  EXPECT_EQ(texts, 2);
}

// Every byte of the file is under a CRC (the length under the header CRC, the data under the data
// CRC, each CRC under itself), so flipping any one byte must be caught; so must a cut-off tail.
TEST(TensorBoardWriter, EveryFlippedByteFailsTheCrcCheck) {
  TempDir dir;
  std::string path;
  {
    TensorBoardWriter w(dir.file("tb"));
    for (int64_t step = 1; step <= 5; ++step) w.scalar("train/loss", step, loss_at(step), 1.0);
    w.text("alerts/text", 5, kAlertText, 2.0);
    path = w.path();
  }  // the destructor flushes
  const std::string good = read_file(path);
  ASSERT_EQ(read_tfrecords(path).size(), 7u);
  const std::string bad = dir.file("bad");
  int caught = 0;
  for (size_t i = 0; i < good.size(); ++i) {
    std::string corrupt = good;
    corrupt[i] = static_cast<char>(corrupt[i] ^ 0x20);
    write_file(bad, corrupt);
    const std::string message = error_of(ErrorKind::kData, [&] { read_tfrecords(bad); });
    caught += message.find("CRC mismatch") != std::string::npos;
  }
  EXPECT_EQ(caught, static_cast<int>(good.size()));
  // A flip in record 0's length names the length CRC; one in its data, the data CRC.
  std::string corrupt = good;
  corrupt[2] ^= 1;
  write_file(bad, corrupt);
  EXPECT_NE(error_of(ErrorKind::kData, [&] { read_tfrecords(bad); })
                .find("record 0 at byte 0: length CRC mismatch"),
            std::string::npos);
  corrupt = good;
  corrupt[14] ^= 1;
  write_file(bad, corrupt);
  EXPECT_NE(error_of(ErrorKind::kData, [&] { read_tfrecords(bad); })
                .find("record 0 at byte 0: data CRC mismatch"),
            std::string::npos);
  write_file(bad, good.substr(0, good.size() - 1));
  EXPECT_NE(error_of(ErrorKind::kData, [&] { read_tfrecords(bad); }).find("truncated"),
            std::string::npos);
}

// The key test: the real tensorboard package reads keel's file through its Python loader, its
// CRC-checking record reader and the Rust data server, and every value matches bit for bit.
TEST(TensorBoardWriter, RealTensorBoardReadsEveryValue) {
  const bool have_python = fs::exists(kPython);
  ASSERT_TRUE(have_python) << kPython
                           << " is missing: run tests/run, which makes the venv this test needs "
                              "(with tensorboard from PyPI)";
  TempDir dir;
  const std::string logdir = dir.file("run/tensorboard");
  Sample sample;
  {
    TensorBoardWriter w(logdir);
    sample = write_sample(w);
    ASSERT_TRUE(w.flush());
  }
  const std::string expected = dir.write("expected.tsv", sample.expected);
  const CommandResult r =
      run_command(command_line(kPython, {kCheckScript, "check", logdir, expected}), dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const char* line : {
           "event_accumulator: file_version 2, scalar tags train/grad_norm train/loss train/lr\n",
           "event_accumulator: scalar train/loss: 50 points, steps 1..50, values match\n",
           "event_accumulator: scalar train/lr: 50 points, steps 1..50, values match\n",
           "event_accumulator: scalar train/grad_norm: 3 points, steps 1..3, values match\n",
           "event_accumulator: text alerts/text step 37 html: <p><strong>spike</strong> at step "
           "37: loss 9.5 &gt; 3.2 (z = 8.1, \xcf\x83 = 0.4)</p> <table> <thead> <tr> "
           "<th>figure</th> "
           "<th>value</th> </tr> </thead> <tbody> <tr> <td>grad_norm</td> <td>12.5</td> </tr> "
           "</tbody> </table>\n",
           "event_accumulator: text alerts/text step 51 html: <p>rewind to step 30, skipping 2 "
           "batches</p>\n",
           "record reader: 106 records, both CRCs of each verified\n",
           "record reader: flipped length byte: failed header crc32 check\n",
           "record reader: flipped data byte: failed event crc32 check\n",
           "data server: scalar train/loss: 50 points, steps 1..50, values match\n",
           "data server: scalar train/lr: 50 points, steps 1..50, values match\n",
           "data server: scalar train/grad_norm: 3 points, steps 1..3, values match\n",
           "data server: text alerts/text: 2 summaries match\n",
           "all checks passed\n",
       }) {
    EXPECT_NE(r.out.find(std::string(line)), std::string::npos) << "missing: " << line << "\nin:\n"
                                                                << r.out;
  }
  EXPECT_EQ(sample.n_values, 105u);
}

// The other direction: keel's reader on a file from tensorboard's own EventFileWriter.
TEST(TensorBoardReader, ReadsTensorBoardsOwnWriter) {
  ASSERT_TRUE(fs::exists(kPython)) << kPython << " is missing: run tests/run";
  TempDir dir;
  const std::string outdir = dir.file("py");
  const CommandResult r = run_command(command_line(kPython, {kCheckScript, "write", outdir}), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<TensorBoardEvent> events = read_tensorboard_events(only_event_file(outdir));
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  ASSERT_EQ(events[1].values.size(), 1u);
  EXPECT_EQ(events[1].values[0].tag, "py/loss");
  EXPECT_EQ(events[1].step, 1);
  EXPECT_EQ(events[1].wall_time, 1001.0);
  EXPECT_EQ(events[1].values[0].scalar, 1.5f);
  EXPECT_TRUE(std::isnan(events[2].values[0].scalar.value_or(0.0f)));
  EXPECT_EQ(events[3].values[0].scalar, 0.25f);
  ASSERT_EQ(events[4].values.size(), 1u);
  EXPECT_EQ(events[4].values[0].plugin_name, "text");
  EXPECT_EQ(events[4].values[0].text, "h\xc3\xa9llo **markdown**");
}

// A directory that cannot exist (its parent is a regular file): one report naming the file and
// the reason, then every call is a quiet no-op.
TEST(TensorBoardWriter, UnwritableDirectoryIsReportedOnceAndNeverThrows) {
  TempDir dir;
  const std::string blocker = dir.write("not_a_dir", "x");
  std::optional<TensorBoardWriter> w;
  ASSERT_NO_THROW(w.emplace(blocker + "/tensorboard"));
  EXPECT_FALSE(w->ok());
  const std::optional<std::string> failure = w->take_failure();
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(failure->rfind("tensorboard: " + blocker + "/tensorboard/events.out.tfevents.", 0), 0u)
      << *failure;
  EXPECT_NE(failure->find("Not a directory"), std::string::npos) << *failure;
  EXPECT_NE(failure->find("; tensorboard output stops"), std::string::npos) << *failure;
  EXPECT_EQ(failure->find('\n'), std::string::npos);
  EXPECT_NO_THROW({
    w->scalar("train/loss", 1, 1.0f, 1.0);
    w->text("alerts/text", 1, "x", 1.0);
    EXPECT_FALSE(w->flush());
  });
  EXPECT_FALSE(w->take_failure().has_value());
  ASSERT_NO_THROW(w.reset());
  EXPECT_TRUE(fs::is_regular_file(blocker));
}

// Sets a file-size limit for its lifetime, with SIGXFSZ ignored so writes fail with EFBIG.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    getrlimit(RLIMIT_FSIZE, &old_);
    rlimit lim = old_;
    lim.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit old_{};
  void (*old_handler_)(int) = nullptr;
};

// A write that fails mid-run (a full disk looks like this to the writer): reported once, the
// partly written flush cut back off so the file still ends with a whole record, later calls quiet.
TEST(TensorBoardWriter, FailedWriteIsReportedOnceAndLeavesWholeRecords) {
  TempDir dir;
  TensorBoardWriter w(dir.file("tb"));
  for (int64_t step = 1; step <= 3; ++step) w.scalar("train/loss", step, loss_at(step), 1.0);
  ASSERT_TRUE(w.flush());
  const auto good_size = static_cast<rlim_t>(fs::file_size(w.path()));
  {
    FileSizeLimit limit(good_size + 100);
    for (int64_t step = 4; step <= 50; ++step) w.scalar("train/loss", step, loss_at(step), 1.0);
    EXPECT_FALSE(w.flush());
  }
  EXPECT_FALSE(w.ok());
  const std::optional<std::string> failure = w.take_failure();
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(*failure, "tensorboard: " + w.path() + ": write failed (" + std::strerror(EFBIG) +
                          "); tensorboard output stops");
  EXPECT_EQ(fs::file_size(w.path()), good_size);
  EXPECT_EQ(read_tensorboard_events(w.path()).size(), 4u);
  EXPECT_NO_THROW(w.scalar("train/loss", 51, 1.0f, 1.0));
  EXPECT_FALSE(w.flush());
  EXPECT_FALSE(w.take_failure().has_value());
  EXPECT_EQ(fs::file_size(w.path()), good_size);
}

// Two writers on one directory in the same second get two files; neither overwrites the other.
TEST(TensorBoardWriter, NeverOverwritesAnEventFile) {
  TempDir dir;
  TensorBoardWriter a(dir.path());
  TensorBoardWriter b(dir.path());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(b.ok());
  EXPECT_NE(a.path(), b.path());
  a.scalar("x", 1, 1.0f, 1.0);
  b.scalar("x", 1, 2.0f, 1.0);
  ASSERT_TRUE(a.flush());
  ASSERT_TRUE(b.flush());
  EXPECT_EQ(read_tensorboard_events(a.path()).at(1).values.at(0).scalar, 1.0f);
  EXPECT_EQ(read_tensorboard_events(b.path()).at(1).values.at(0).scalar, 2.0f);
}

// Resume's trimming (trim_tensorboard_events): events of steps after the resumed one go, the
// file_version record and alert events up to the kept step stay, a torn last record (a crash
// mid-write) goes too, and the file is rewritten only when something was dropped.
TEST(TensorBoardTrim, DropsLaterStepsAndATornTailKeepsAlertsUpToTheirStep) {
  TempDir dir;
  std::string path;
  {
    TensorBoardWriter w(dir.file("tb"));
    for (int64_t step = 1; step <= 10; ++step) w.scalar("train/loss", step, 1.0f * step, 1.0);
    w.scalar("alerts/rewind", 8, 8.0f, 1.0);
    w.scalar("alerts/rewind", 9, 9.0f, 1.0);
    ASSERT_TRUE(w.flush());
    path = w.path();
  }
  EXPECT_EQ(trim_tensorboard_events(path, 10), 0);  // nothing after step 10: left as it is
  // A torn record at the end, as a crash mid-write leaves.
  std::string bytes = testing::read_file(path);
  const std::string whole = bytes;
  bytes += whole.substr(whole.size() - 30, 17);
  testing::write_file(path, bytes);
  EXPECT_EQ(trim_tensorboard_events(path, 5, "alerts/", 8), 5 + 1 + 1);  // 6..10, step 9, torn
  std::vector<int64_t> loss_steps, alert_steps;
  const std::vector<TensorBoardEvent> events = read_tensorboard_events(path);
  EXPECT_EQ(events.at(0).file_version, "brain.Event:2");
  for (const TensorBoardEvent& e : events) {
    for (const TensorBoardValue& v : e.values) {
      (v.tag == "train/loss" ? loss_steps : alert_steps).push_back(e.step);
    }
  }
  EXPECT_EQ(loss_steps, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(alert_steps, (std::vector<int64_t>{8}));
  EXPECT_EQ(trim_tensorboard_events(path, 5, "alerts/", 8), 0);
}

}  // namespace
}  // namespace keel
