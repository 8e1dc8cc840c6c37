// AlertSink (launch/train/alerts.h): alerts.jsonl holds one parseable line per alert with every
// field (NaN and infinities as null, strings escaped, invalid UTF-8 as U+FFFD), byte for byte; the
// human line is one line; the hook gets exactly that line on stdin, in order; emit() returns
// while hooks wait; a non-zero exit and a signal are logged with their number; a hook that hangs
// (with a grandchild, and with a stdin it never reads) is killed with its process group after
// alert.timeout_s, logged once, and the next alert's hook still runs; a hook that exits without
// reading a large stdin does not take the process down (SIGPIPE); past 100 waiting alerts the
// oldest are dropped, said once; the destructor waits for the running hook only; the end of the
// run waits at most alert.drain_timeout_s in all (31 queued `sleep 60` hooks), then kills the
// running hook and counts the rest in one line; a hook that prints megabytes shows 64 KiB and a
// count of the rest, and is not slowed by it; ranks other than 0 and an empty run directory
// write nothing. Time is never asserted except as a hang bound: emit() under 20 s while its hook
// waits up to 60 s, a drain under its deadline plus 10 s.
#include "launch/train/alerts.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::read_file;
using testing::shell_quote;
using testing::TempDir;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
// A bound on a hang, not a speed: emit() takes milliseconds; a blocking one would wait for its
// hook (60 s in EmitNeverWaitsForTheHook).
constexpr double kHangBoundS = 20.0;

config::Alert hook(const std::string& command, double timeout_s = 30,
                   double drain_timeout_s = 120) {
  config::Alert cfg;
  cfg.set_command(command);
  cfg.set_timeout_s(timeout_s);
  cfg.set_drain_timeout_s(drain_timeout_s);
  return cfg;
}

int count(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + needle.size())) {
    ++n;
  }
  return n;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Waits (up to 30 s) for `path` to exist.
bool wait_for_file(const std::string& path) {
  for (int i = 0; i < 3000 && !std::filesystem::exists(path); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return std::filesystem::exists(path);
}

// Processes of process group `pgid` that are alive (zombies, which are only waiting for their
// parent to reap them, do not count).
std::vector<int> live_members(int pgid) {
  std::vector<int> pids;
  DIR* proc = opendir("/proc");
  if (!proc) return pids;
  while (dirent* e = readdir(proc)) {
    const int pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    const std::string stat = read_file("/proc/" + std::string(e->d_name) + "/stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat.substr(close + 1));
    char state = 0;
    int ppid = 0, pgrp = 0;
    fields >> state >> ppid >> pgrp;
    if (pgrp == pgid && state != 'Z' && state != 'X') pids.push_back(pid);
  }
  closedir(proc);
  return pids;
}

// Waits (up to 10 s: SIGKILL is delivered asynchronously) for group `pgid` to have no live
// process; returns the ones left.
std::vector<int> wait_group_gone(int pgid) {
  std::vector<int> left = live_members(pgid);
  for (int i = 0; i < 1000 && !left.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    left = live_members(pgid);
  }
  return left;
}

// A stand-in curl in DIR/bin: writes its stdin to DIR/curl_config, its arguments (one a line)
// to DIR/curl_args and the file of its --data-binary @FILE to DIR/curl_data.
void make_fake_curl(const TempDir& dir) {
  std::filesystem::create_directory(dir.file("bin"));
  const std::string d = shell_quote(dir.path());
  std::string body = "#!/bin/sh\n";
  body += "cat > " + d + "/curl_config\n";
  body += "printf '%s\\n' \"$@\" > " + d + "/curl_args\n";
  body += "for a; do case \"$a\" in @*) cp \"${a#@}\" " + d + "/curl_data;; esac; done\n";
  const std::string curl = dir.write("bin/curl", body);
  std::filesystem::permissions(curl, std::filesystem::perms::owner_all);
}

Alert spike_alert() {
  return Alert{.time = 1700000000.25,
               .step = 42,
               .kind = "loss_spike",
               .loss = 7.5,
               .baseline = 3.25,
               .threshold = 6.5,
               .grad_norm = kNaN,
               .max_attn_logit = 41.5,
               .max_attn_logit_layer = 7,
               .action = "skip",
               .batches_skipped = 1,
               .rewinds = 0,
               .message = "loss 7.5 > 6.5 \"quoted\" \\ back\nslash\ttab \xc3\xa9 \xff"};
}

Alert rewind_alert() {
  return Alert{.time = 1700000001.5,
               .step = 30,
               .kind = "rewind",
               .loss = kInf,
               .baseline = -kInf,
               .threshold = 0.1,
               .grad_norm = 12,
               .action = "rewind",
               .checkpoint = "runs/x/checkpoints/step_00000020",
               .rewound_to = 20,
               .batches_skipped = 3,
               .rewinds = 1,
               .message = "rewound to step 20"};
}

const char kSpikeJson[] =
    "{\"time\": 1700000000.25, \"step\": 42, \"kind\": \"loss_spike\", \"action\": \"skip\", "
    "\"loss\": 7.5, \"baseline\": 3.25, \"threshold\": 6.5, \"grad_norm\": null, "
    "\"max_attn_logit\": 41.5, \"max_attn_logit_layer\": 7, "
    "\"checkpoint\": \"\", \"rewound_to\": null, \"batches_skipped\": 1, \"rewinds\": 0, "
    "\"message\": \"loss 7.5 > 6.5 \\\"quoted\\\" \\\\ back\\nslash\\ttab \xc3\xa9 \\ufffd\"}";
const char kRewindJson[] =
    "{\"time\": 1700000001.5, \"step\": 30, \"kind\": \"rewind\", \"action\": \"rewind\", "
    "\"loss\": null, \"baseline\": null, \"threshold\": 0.10000000000000001, \"grad_norm\": 12, "
    "\"max_attn_logit\": null, \"max_attn_logit_layer\": null, "
    "\"checkpoint\": \"runs/x/checkpoints/step_00000020\", \"rewound_to\": 20, "
    "\"batches_skipped\": 3, \"rewinds\": 1, \"message\": \"rewound to step 20\"}";

TEST(AlertSink, JsonlHasOneExactParseableLinePerAlert) {
  TempDir dir;
  {
    AlertSink sink(dir.path(), config::Alert(), /*is_rank0=*/true);
    ::testing::internal::CaptureStderr();
    sink.emit(spike_alert());
    sink.emit(rewind_alert());
    ::testing::internal::GetCapturedStderr();
  }
  const std::string text = read_file(dir.file("alerts.jsonl"));
  EXPECT_EQ(text, std::string(kSpikeJson) + "\n" + kRewindJson + "\n");

  const std::vector<std::string> lines = lines_of(text);
  ASSERT_EQ(lines.size(), 2u);
  const auto spike = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(spike.size(), 15u);
  EXPECT_DOUBLE_EQ(spike["time"].get<double>(), 1700000000.25);
  EXPECT_EQ(spike["step"].get<int64_t>(), 42);
  EXPECT_EQ(spike["kind"], "loss_spike");
  EXPECT_EQ(spike["action"], "skip");
  EXPECT_EQ(spike["loss"].get<double>(), 7.5);
  EXPECT_EQ(spike["baseline"].get<double>(), 3.25);
  EXPECT_EQ(spike["threshold"].get<double>(), 6.5);
  EXPECT_TRUE(spike["grad_norm"].is_null());
  EXPECT_EQ(spike["max_attn_logit"].get<double>(), 41.5);
  EXPECT_EQ(spike["max_attn_logit_layer"].get<int>(), 7);
  EXPECT_EQ(spike["checkpoint"], "");
  EXPECT_TRUE(spike["rewound_to"].is_null());
  EXPECT_EQ(spike["batches_skipped"].get<int64_t>(), 1);
  EXPECT_EQ(spike["rewinds"].get<int>(), 0);
  EXPECT_EQ(spike["message"],
            "loss 7.5 > 6.5 \"quoted\" \\ back\nslash\ttab \xc3\xa9 \xef\xbf\xbd");  // U+FFFD
  const auto rewind = nlohmann::json::parse(lines[1]);
  EXPECT_TRUE(rewind["loss"].is_null());
  EXPECT_TRUE(rewind["baseline"].is_null());
  EXPECT_TRUE(rewind["max_attn_logit_layer"].is_null());
  EXPECT_EQ(rewind["threshold"].get<double>(), 0.1);  // %.17g round-trips
  EXPECT_EQ(rewind["rewound_to"].get<int64_t>(), 20);
  EXPECT_EQ(rewind["checkpoint"], "runs/x/checkpoints/step_00000020");
}

TEST(AlertSink, InvalidUtf8BecomesReplacementCharacters) {
  Alert a = spike_alert();
  // A lone continuation byte, an overlong '/', a surrogate, a cut-off 3-byte sequence, then
  // valid 2-, 3- and 4-byte characters.
  a.message =
      std::string("\x80|\xc0\xaf|\xed\xa0\x80|\xe2\x82") + "|\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";
  const auto j = nlohmann::json::parse(alert_json(a));
  EXPECT_EQ(j["message"],
            "\xef\xbf\xbd|\xef\xbf\xbd\xef\xbf\xbd|\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd|"
            "\xef\xbf\xbd\xef\xbf\xbd|\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
}

TEST(AlertSink, HumanLineIsOneLine) {
  AlertSink sink("", config::Alert(), /*is_rank0=*/true);
  ::testing::internal::CaptureStderr();
  Alert a = spike_alert();
  a.message = "loss 7.5 > 6.5\n(line two)\r";
  sink.emit(a);
  sink.emit(Alert{.step = 7, .kind = "halt", .action = "halt"});
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "keel-train: ALERT step 42: loss 7.5 > 6.5 (line two)  [loss_spike -> skip]\n"
            "keel-train: ALERT step 7: [halt -> halt]\n");
}

TEST(AlertSink, HookGetsExactlyTheJsonLineOnStdinInOrder) {
  TempDir dir;
  const std::string got = dir.file("hook_stdin");
  ::testing::internal::CaptureStderr();
  {
    AlertSink sink(dir.path(), hook("cat >> " + shell_quote(got)), true);
    sink.emit(spike_alert());
    sink.emit(rewind_alert());
    sink.drain();
    EXPECT_EQ(read_file(got), read_file(dir.file("alerts.jsonl")));
  }
  EXPECT_EQ(read_file(got), std::string(kSpikeJson) + "\n" + kRewindJson + "\n");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "keel-train: alert hook"), 0) << err;
  EXPECT_EQ(lines_of(err).size(), 2u) << err;  // the two human lines only
}

TEST(AlertSink, HookSeesItsLineAlreadyInTheFile) {
  TempDir dir;
  const std::string seen = dir.file("seen");
  const std::string file = dir.file("alerts.jsonl");
  AlertSink sink(dir.path(),
                 hook("cat >/dev/null; cp " + shell_quote(file) + " " + shell_quote(seen)), true);
  ::testing::internal::CaptureStderr();
  sink.emit(spike_alert());
  sink.drain();
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(read_file(seen), std::string(kSpikeJson) + "\n");
}

TEST(AlertSink, NonZeroExitAndSignalAreLogged) {
  AlertSink sink("", hook("cat >/dev/null; exit 3"), true);
  ::testing::internal::CaptureStderr();
  sink.emit(spike_alert());
  sink.drain();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "keel-train: alert hook exited with code 3: cat >/dev/null; exit 3\n"), 1)
      << err;

  AlertSink killed("", hook("kill -TERM $$"), true);
  ::testing::internal::CaptureStderr();
  killed.emit(spike_alert());
  killed.drain();
  const std::string err2 = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err2, "keel-train: alert hook killed by signal 15 (Terminated): kill -TERM $$\n"),
            1)
      << err2;
}

TEST(AlertSink, EmitNeverWaitsForTheHook) {
  TempDir dir;
  const std::string go = dir.file("GO"), out = dir.file("OUT");
  // Every hook waits for GO (up to its 60 s timeout), then appends its line to OUT.
  AlertSink sink("",
                 hook("while [ ! -e " + shell_quote(go) + " ]; do sleep 0.02; done; cat >> " +
                          shell_quote(out),
                      60),
                 true);
  ::testing::internal::CaptureStderr();
  for (int step = 1; step <= 3; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    sink.emit(Alert{.step = step, .kind = "loss_spike"});
    EXPECT_LT(seconds_since(t0), kHangBoundS) << "emit() waited for the hook";
  }
  testing::write_file(go, "");
  sink.drain();
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(lines_of(read_file(out)).size(), 3u);
}

TEST(AlertSink, HangingHookIsKilledWithItsGroupAndTheNextHookRuns) {
  TempDir dir;
  const std::string pid_file = dir.file("P"), grandchild_file = dir.file("G");
  const std::string next_file = dir.file("NEXT");
  // The "hang" alert's hook records its pid (= its process group) and waits in a child shell
  // that has a background grandchild; any other alert's hook writes its stdin to NEXT.
  const std::string command = "G=" + shell_quote(grandchild_file) +
                              "; export G; read -r line; case \"$line\" in " +
                              "*'\"kind\": \"hang\"'*) echo $$ > " + shell_quote(pid_file) +
                              "; sh -c 'sleep 60 & echo $! > \"$G\"; sleep 60';; " +
                              "*) printf '%s\\n' \"$line\" > " + shell_quote(next_file) + ";; esac";
  const std::string timeout_line = "keel-train: alert hook timed out after 0.5 s (killed): ";

  ::testing::internal::CaptureStderr();
  {
    AlertSink sink("", hook(command, 0.5), true);
    auto t0 = std::chrono::steady_clock::now();
    sink.emit(Alert{.step = 5, .kind = "hang", .message = "this hook hangs"});
    EXPECT_LT(seconds_since(t0), kHangBoundS);
    t0 = std::chrono::steady_clock::now();
    sink.emit(rewind_alert());
    EXPECT_LT(seconds_since(t0), kHangBoundS);
    sink.drain();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, timeout_line), 1) << err;
  EXPECT_EQ(count(err, "keel-train: alert hook"), 1) << err;
  EXPECT_EQ(read_file(next_file), std::string(kRewindJson) + "\n");

  const int pgid = std::atoi(read_file(pid_file).c_str());
  const int grandchild = std::atoi(read_file(grandchild_file).c_str());
  ASSERT_GT(pgid, 1);
  ASSERT_GT(grandchild, 1);  // the background sleep was started before the kill
  EXPECT_TRUE(wait_group_gone(pgid).empty()) << "processes of the hook's group still alive";
  const std::string stat = read_file("/proc/" + std::to_string(grandchild) + "/stat");
  EXPECT_TRUE(stat.empty() || stat.find(") Z") != std::string::npos) << stat;
}

TEST(AlertSink, HookThatNeverReadsALargeStdinIsKilledOrLeftToExit) {
  Alert big = spike_alert();
  big.message = std::string(1 << 20, 'x');  // far past a pipe's buffer

  // It hangs without reading: the write stops at the timeout and the hook is killed.
  ::testing::internal::CaptureStderr();
  {
    AlertSink sink("", hook("sleep 60", 0.5), true);
    const auto t0 = std::chrono::steady_clock::now();
    sink.emit(big);
    EXPECT_LT(seconds_since(t0), kHangBoundS);
    sink.drain();
  }
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "keel-train: alert hook timed out after 0.5 s (killed): sleep 60\n"), 1);

  // It exits without reading: the write fails with EPIPE. This test process does not ignore
  // SIGPIPE, so reaching the checks below shows it was not raised at the process.
  ::testing::internal::CaptureStderr();
  {
    AlertSink sink("", hook("exit 0"), true);
    sink.emit(big);
    sink.emit(big);
    sink.drain();
  }
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "keel-train: alert hook"), 0);
  EXPECT_EQ(count(err, "keel-train: ALERT step 42: "), 2);
}

TEST(AlertSink, FallingBehindDropsTheOldestSaidOnce) {
  TempDir dir;
  const std::string started = dir.file("STARTED"), go = dir.file("GO"), out = dir.file("OUT");
  // Step 0's hook waits for GO; every hook then appends its line to OUT.
  const std::string command = "read -r line; case \"$line\" in *'\"step\": 0,'*) touch " +
                              shell_quote(started) + "; while [ ! -e " + shell_quote(go) +
                              " ]; do sleep 0.02; done;; esac; printf '%s\\n' \"$line\" >> " +
                              shell_quote(out);
  ::testing::internal::CaptureStderr();
  {
    AlertSink sink("", hook(command, 60), true);
    sink.emit(Alert{.step = 0, .kind = "loss_spike"});
    ASSERT_TRUE(wait_for_file(started));
    for (int step = 1; step <= 150; ++step) sink.emit(Alert{.step = step, .kind = "loss_spike"});
    testing::write_file(go, "");
    sink.drain();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err,
                  "keel-train: alert hook falling behind: more than 100 alerts waiting, "
                  "dropping the oldest"),
            1);
  EXPECT_EQ(count(err, "keel-train: 50 alert(s) in all were not given to the hook"), 1);
  const std::vector<std::string> lines = lines_of(read_file(out));
  ASSERT_EQ(lines.size(), 101u);
  EXPECT_EQ(nlohmann::json::parse(lines[0])["step"].get<int>(), 0);
  for (int i = 1; i <= 100; ++i) {
    EXPECT_EQ(nlohmann::json::parse(lines[i])["step"].get<int>(), 50 + i);
  }
}

TEST(AlertSink, DestructorWaitsForTheRunningHookOnly) {
  TempDir dir;
  const std::string started = dir.file("STARTED");
  auto sink = std::make_unique<AlertSink>(
      "", hook("touch " + shell_quote(started) + "; exec sleep 60", 0.5), true);
  ::testing::internal::CaptureStderr();
  for (int step = 1; step <= 3; ++step) sink->emit(Alert{.step = step, .kind = "loss_spike"});
  ASSERT_TRUE(wait_for_file(started));
  const auto t0 = std::chrono::steady_clock::now();
  sink.reset();
  EXPECT_LT(seconds_since(t0), 30.0);  // bounded by the timeout, not by the 60 s sleeps
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "keel-train: alert hook timed out after 0.5 s (killed): touch "), 1);
  EXPECT_EQ(count(err, "keel-train: 2 alert hook(s) not run: the run ended first"), 1);
}

// The number in `text` right after `prefix`, or -1.
int64_t number_after(const std::string& text, const std::string& prefix) {
  const size_t at = text.find(prefix);
  if (at == std::string::npos) return -1;
  return std::atoll(text.c_str() + at + prefix.size());
}

TEST(AlertSink, DrainStopsAtItsDeadlineAndCountsWhatItDropped) {
  // The case: 31 alerts whose hooks each hang until alert.timeout_s=2 kills them would
  // take 62 s to drain one by one; alert.drain_timeout_s=3 ends it after 3 s.
  constexpr int kAlerts = 31;
  constexpr double kTimeout = 2, kDrainTimeout = 3;
  ::testing::internal::CaptureStderr();
  double drain_s = 0;
  {
    AlertSink sink("", hook("sleep 60", kTimeout, kDrainTimeout), true);
    for (int step = 1; step <= kAlerts; ++step) sink.emit(Alert{.step = step, .kind = "halt"});
    const auto t0 = std::chrono::steady_clock::now();
    sink.drain();
    drain_s = seconds_since(t0);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_LT(drain_s, kDrainTimeout + 10.0) << err;
  // Every hook is accounted for: timed out, killed at the deadline, or not run. Each one that
  // ran took at least its 2 s, so at most two started within the 3 s.
  const std::string cut =
      "keel-train: alert hooks cut short at the end of the run "
      "(alert.drain_timeout_s=3 s): ";
  ASSERT_EQ(count(err, cut), 1) << err;
  const int64_t killed = err.find(cut + "1 killed, ") != std::string::npos ? 1 : 0;
  const int64_t not_run = number_after(err, cut + (killed ? "1 killed, " : ""));
  const int timed_out = count(err, "keel-train: alert hook timed out after 2 s (killed): sleep 60");
  EXPECT_EQ(count(err, " not run: sleep 60\n"), 1) << err;
  EXPECT_EQ(timed_out + killed + not_run, kAlerts) << err;
  EXPECT_GE(not_run, kAlerts - 2) << err;
  EXPECT_EQ(count(err, "keel-train: alert hook "), timed_out) << err;  // no other hook line
}

TEST(AlertSink, DrainKillsAHookThatOutlastsTheDeadline) {
  TempDir dir;
  const std::string pid_file = dir.file("P");
  ::testing::internal::CaptureStderr();
  {
    // The hook's own timeout (60 s) is longer than the whole drain may take (1 s).
    AlertSink sink("", hook("echo $$ > " + shell_quote(pid_file) + "; sleep 60", 60, 1), true);
    sink.emit(Alert{.step = 1, .kind = "halt"});
    const auto t0 = std::chrono::steady_clock::now();
    sink.drain();
    EXPECT_LT(seconds_since(t0), 1 + 10.0);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err,
                  "keel-train: alert hooks cut short at the end of the run "
                  "(alert.drain_timeout_s=1 s): 1 killed, 0 not run: echo $$ > "),
            1)
      << err;
  EXPECT_EQ(count(err, "keel-train: alert hook "), 0) << err;  // the line above only
  if (std::filesystem::exists(pid_file)) {                     // the hook got as far as writing it
    EXPECT_TRUE(wait_group_gone(std::atoi(read_file(pid_file).c_str())).empty());
  }
}

TEST(AlertSink, TheDestructorWaitsAtMostTheDrainTimeout) {
  TempDir dir;
  const std::string started = dir.file("STARTED");
  auto sink = std::make_unique<AlertSink>(
      "", hook("touch " + shell_quote(started) + "; exec sleep 60", 60, 1), true);
  ::testing::internal::CaptureStderr();
  sink->emit(Alert{.step = 1, .kind = "halt"});
  sink->emit(Alert{.step = 2, .kind = "halt"});
  ASSERT_TRUE(wait_for_file(started));
  const auto t0 = std::chrono::steady_clock::now();
  sink.reset();
  EXPECT_LT(seconds_since(t0), 1 + 10.0);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err,
                  "keel-train: alert hook killed: alert.drain_timeout_s=1 s passed at the "
                  "end of the run: touch "),
            1)
      << err;
  EXPECT_EQ(count(err, "keel-train: 1 alert hook(s) not run: the run ended first"), 1) << err;
}

TEST(AlertSink, AHookThatPrintsMegabytesShowsTheFirst64KiBAndCountsTheRest) {
  constexpr int64_t kPrinted = 5000000;
  const std::string command = "yes 0123456789abcdef | head -c " + std::to_string(kPrinted);
  ::testing::internal::CaptureStderr();
  {
    AlertSink sink("", hook(command, 60), true);
    sink.emit(Alert{.step = 1, .kind = "halt"});
    sink.drain();
  }
  {
    AlertSink sink("", hook("cat >/dev/null; echo 'a short hook line'", 60), true);
    sink.emit(Alert{.step = 2, .kind = "halt"});
    sink.drain();
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  const size_t cap = AlertSink::kMaxHookOutputBytes;
  ASSERT_EQ(cap, 65536u);
  // Its output, cut at 64 KiB (mid-line, so a newline ends it), then the count of the rest.
  const std::string shown = err.substr(err.find("0123456789abcdef"), cap);
  std::string expected;
  while (expected.size() < cap) expected += "0123456789abcdef\n";
  expected.resize(cap);
  EXPECT_TRUE(shown == expected) << "the shown output is not the hook's first 64 KiB";
  EXPECT_EQ(count(err, "keel-train: alert hook output cut at 65536 bytes (" +
                           std::to_string(kPrinted - 65536) + " more bytes not shown): yes "),
            1)
      << err.substr(0, 300) << " ... "
      << err.substr(err.size() - std::min<size_t>(err.size(), 600));
  EXPECT_LT(err.size(), cap + 1000);
  EXPECT_EQ(count(err, "keel-train: alert hook"), 1);  // neither timed out nor failed
  EXPECT_EQ(count(err, "\na short hook line\n"), 1);   // the next hook's output in full
}

TEST(AlertSink, OtherRanksDoNothing) {
  TempDir dir;
  const std::string ran = dir.file("ran");
  {
    AlertSink sink(dir.path(), hook("touch " + shell_quote(ran)), /*is_rank0=*/false);
    ::testing::internal::CaptureStderr();
    sink.emit(spike_alert());
    sink.drain();
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("alerts.jsonl")));
  EXPECT_FALSE(std::filesystem::exists(ran));
}

TEST(AlertSink, EmptyRunDirWritesNoFile) {
  TempDir dir;
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  {
    AlertSink sink("", config::Alert(), true);
    ::testing::internal::CaptureStderr();
    sink.emit(spike_alert());
    EXPECT_EQ(count(::testing::internal::GetCapturedStderr(), "keel-train: ALERT step 42: "), 1);
  }
  std::filesystem::current_path(cwd);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(AlertSink, AppendKeepsOldLinesTruncateDropsThem) {
  TempDir dir;
  const std::string file = dir.write("alerts.jsonl", "{\"old\": 1}\n");
  ::testing::internal::CaptureStderr();
  {
    AlertSink sink(dir.path(), config::Alert(), true, AlertFileMode::kAppend);
    sink.emit(spike_alert());
  }
  EXPECT_EQ(read_file(file), std::string("{\"old\": 1}\n") + kSpikeJson + "\n");
  {
    AlertSink sink(dir.path(), config::Alert(), true, AlertFileMode::kTruncate);
    EXPECT_EQ(read_file(file), "");
    sink.emit(rewind_alert());
  }
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(read_file(file), std::string(kRewindJson) + "\n");
}

TEST(AlertSink, BadTimeoutAndUnwritableDirAreErrors) {
  const std::string msg =
      testing::error_of(ErrorKind::kConfig, [] { AlertSink sink("", hook("true", 0), true); });
  EXPECT_NE(msg.find("alert.timeout_s=0"), std::string::npos) << msg;
  const std::string drain =
      testing::error_of(ErrorKind::kConfig, [] { AlertSink sink("", hook("true", 10, 0), true); });
  EXPECT_NE(drain.find("alert.drain_timeout_s=0: must be > 0 when alert.command is set"),
            std::string::npos)
      << drain;
  AlertSink other_rank("", hook("true", 0), false);  // does nothing, so checks nothing
  const std::string io = testing::error_of(
      ErrorKind::kIo, [] { AlertSink sink("/nonexistent/keel_run", config::Alert(), true); });
  EXPECT_NE(io.find("/nonexistent/keel_run/alerts.jsonl: cannot open for writing"),
            std::string::npos)
      << io;
}

// launch/tools/alert_webhook.sh as the hook, with a stand-in curl first on PATH that records its
// config (stdin), its arguments and the payload file: the URL reaches curl only through its
// config, the payload is Slack's {"text": ...} naming the step, kind, action and message, and
// the post is bounded by --max-time. Without KEEL_ALERT_WEBHOOK_URL it exits 2 and says why.
TEST(AlertWebhookExample, PostsASlackPayloadAndRefusesWithoutAUrl) {
  TempDir dir;
  const std::string script = std::string(KEEL_SOURCE_DIR) + "/launch/tools/alert_webhook.sh";
  ASSERT_EQ(access(script.c_str(), X_OK), 0) << script << " is not executable";
  make_fake_curl(dir);
  const std::string url = "http://hooks.invalid/T000/secret";
  ::testing::internal::CaptureStderr();
  {
    AlertSink sink("",
                   hook("PATH=" + shell_quote(dir.file("bin")) + ":$PATH " +
                        "KEEL_ALERT_WEBHOOK_URL=" + url + " " + shell_quote(script)),
                   true);
    sink.emit(spike_alert());
    sink.drain();
  }
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "keel-train: alert hook"), 0) << err;
  EXPECT_EQ(read_file(dir.file("curl_config")), "url = \"" + url + "\"\n");
  const std::string args = read_file(dir.file("curl_args"));
  EXPECT_NE(args.find("--max-time\n10\n"), std::string::npos) << args;
  EXPECT_EQ(args.find(url), std::string::npos) << "the URL is on curl's command line";
  const auto payload = nlohmann::json::parse(read_file(dir.file("curl_data")));
  ASSERT_EQ(payload.size(), 1u);
  const std::string text = payload["text"];
  EXPECT_NE(text.find("ALERT step 42 [loss_spike -> skip]: loss 7.5 > 6.5 \"quoted\""),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("(loss 7.5, baseline 3.25, threshold 6.5, grad norm -)"), std::string::npos)
      << text;

  ::testing::internal::CaptureStderr();
  {
    AlertSink sink("", hook("env -u KEEL_ALERT_WEBHOOK_URL " + shell_quote(script)), true);
    sink.emit(spike_alert());
    sink.drain();
  }
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "alert_webhook.sh: KEEL_ALERT_WEBHOOK_URL is not set; alert not posted\n"),
            1)
      << err;
  EXPECT_EQ(count(err, "keel-train: alert hook exited with code 2: "), 1) << err;
}

}  // namespace
}  // namespace keel
