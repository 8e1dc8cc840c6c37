// The per-op profiler (framework/profiler.h): scopes add their time only when enabled, and a
// profiler given a sync (a device's synchronize) calls it at every enabled scope's start and end,
// so a device scope times the work it enqueued.
#include "framework/profiler.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace keel {
namespace {

TEST(Profiler, DisabledScopesRecordNothingAndNeverSync) {
  Profiler prof;
  int syncs = 0;
  prof.set_sync([&] { ++syncs; });
  { ProfileScope s(&prof, "matmul"); }
  { ProfileScope s(nullptr, "matmul"); }
  EXPECT_TRUE(prof.entries().empty());
  EXPECT_EQ(syncs, 0);
}

TEST(Profiler, EnabledScopesSyncAtStartAndEndAndSumByName) {
  Profiler prof;
  prof.set_enabled(true);
  std::vector<std::string> events;
  prof.set_sync([&] { events.push_back("sync"); });
  {
    ProfileScope a(&prof, "attention");
    events.push_back("work");
  }
  { ProfileScope b(&prof, "attention"); }
  { ProfileScope c(&prof, "loss"); }
  EXPECT_EQ(events,
            (std::vector<std::string>{"sync", "work", "sync", "sync", "sync", "sync", "sync"}));
  ASSERT_EQ(prof.entries().size(), 2u);
  EXPECT_EQ(prof.entries()[0].first, "attention");
  EXPECT_EQ(prof.entries()[1].first, "loss");
  EXPECT_GE(prof.entries()[0].second, 0.0);

  // Without a sync (the CPU) scopes still time; a sync that throws at a scope's end (a device
  // error) is left to the next checked call and the time is still recorded.
  prof.set_sync({});
  { ProfileScope d(&prof, "norm"); }
  int calls = 0;
  prof.set_sync([&] {
    if (++calls == 2) throw std::runtime_error("device error");
  });
  { ProfileScope e(&prof, "gelu"); }
  EXPECT_EQ(calls, 2);
  ASSERT_EQ(prof.entries().size(), 4u);
  EXPECT_EQ(prof.entries()[3].first, "gelu");
}

}  // namespace
}  // namespace keel
