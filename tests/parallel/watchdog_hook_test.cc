// The watchdog's abort hooks (parallel/watchdog.h, Note [abort hooks] in parallel/watchdog.cc)
// and the MPI communicators Distributed exposes for bootstrapping NCCL on its groups.
// The watchdog ends its process, so each stalled collective runs in a forked child (which uses no
// MPI): the child registers hooks that write to its stderr, begins a collective that never ends
// (as the stop-signal tests in tests/launch/preemption_test.cc do), and the parent reads what the
// child wrote until it ends. Every rank runs the forked tests on its own (no communication), so
// they run under mpiexec at np 1, 2 and 4 like the rest; the communicator test uses every rank.
#include <gtest/gtest.h>
#include <mpi.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "parallel/topology.h"
#include "parallel/watchdog.h"
#include "tests/parallel/parallel_test_util.h"

namespace keel {
namespace {

using keel::testing::mpi_env;
using keel::testing::world_size;

// parallel.timeout_s of the stalled children. Its grace (a quarter: 0.5 s) is all a hook that
// only writes a line, or sleeps briefly, gets before it is abandoned: it must not be a bet on
// how soon a loaded machine schedules the hook's thread.
constexpr double kTimeout = 2.0;
// A bound on a hang, never a speed: the child ends about kTimeout plus one grace per hook after
// it stalls; the slack only separates "ended" from "hung" on a loaded two-core machine.
constexpr double kHangSlack = 30.0;
constexpr unsigned kChildAlarm = 120;  // SIGALRM ends a child the watchdog failed to end

void say(const std::string& text) {
  const std::string line = text + "\n";
  ssize_t rc;
  do {
    rc = ::write(STDERR_FILENO, line.data(), line.size());
  } while (rc < 0 && errno == EINTR);
}

struct Child {
  bool exited = false;  // false: ended by a signal (or never started)
  int code = -1;        // exit status when exited
  std::string output;   // its stderr
  double seconds = 0;   // from the fork to the end of its output
};

// Forks; the child runs body() with stderr into a pipe and must end the process itself.
template <typename Body>
Child run_child(Body body) {
  Child c;
  int fds[2];
  if (pipe(fds) != 0) {
    ADD_FAILURE() << "pipe failed";
    return c;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid < 0) {
    ADD_FAILURE() << "fork failed";
    return c;
  }
  if (pid == 0) {
    alarm(kChildAlarm);
    close(fds[0]);
    dup2(fds[1], STDERR_FILENO);
    close(fds[1]);
    body();
    _exit(99);  // body() returned: the watchdog did not end the process
  }
  close(fds[1]);
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n > 0) {
      c.output.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  c.exited = WIFEXITED(status);
  c.code = c.exited ? WEXITSTATUS(status) : -1;
  return c;
}

// The stalled collective: begun, never ended (a peer that never arrives).
[[noreturn]] void stall(Watchdog& w) {
  w.begin("all-reduce", "test");
  for (;;) pause();
}

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

std::string timeout_line(int rank) {
  return "keel-train: communication error: rank " + std::to_string(rank) +
         ": all-reduce over the test group at step 7 did not complete within "
         "parallel.timeout_s=2 s (a peer rank died or hangs); ending the job\n";
}

TEST(WatchdogAbortHooks, GraceIsAQuarterOfTheTimeoutAtMostTwoSeconds) {
  EXPECT_DOUBLE_EQ(Watchdog::abort_hook_grace_s(1.0), 0.25);
  EXPECT_DOUBLE_EQ(Watchdog::abort_hook_grace_s(4.0), 1.0);
  EXPECT_DOUBLE_EQ(Watchdog::abort_hook_grace_s(600.0), 2.0);
}

TEST(WatchdogAbortHooks, AStalledCollectiveRunsEachHookOnceInOrderThenEndsTheProcess) {
  const int rank = mpi_env().world_rank();
  const Child c = run_child([rank] {
    Watchdog w(kTimeout, rank);
    w.set_step(7);
    for (const char* name : {"A", "B", "C"}) {
      w.add_abort_hook([name] { say(std::string("hook ") + name + " ran"); });
    }
    stall(w);
  });
  ASSERT_TRUE(c.exited) << c.output;
  EXPECT_EQ(c.code, 1) << c.output;
  const size_t line = c.output.find(timeout_line(rank));
  ASSERT_NE(line, std::string::npos) << c.output;
  EXPECT_EQ(count(c.output, "did not complete"), 1) << c.output;
  size_t previous = line;
  for (const char* name : {"A", "B", "C"}) {
    const std::string ran = std::string("hook ") + name + " ran\n";
    EXPECT_EQ(count(c.output, ran), 1) << c.output;
    const size_t at = c.output.find(ran);
    EXPECT_GT(at, previous) << name << " out of order:\n" << c.output;
    previous = at;
  }
  EXPECT_EQ(c.output.find("abort hook"), std::string::npos) << c.output;  // none abandoned
  EXPECT_GE(c.seconds, kTimeout) << c.output;
  EXPECT_LT(c.seconds, kTimeout + 3 * Watchdog::abort_hook_grace_s(kTimeout) + kHangSlack);
}

TEST(WatchdogAbortHooks, AHookThatHangsIsAbandonedAndTheProcessStillEnds) {
  const int rank = mpi_env().world_rank();
  const Child c = run_child([rank] {
    Watchdog w(kTimeout, rank);
    w.set_step(7);
    w.add_abort_hook([] {
      say("hook 1 started");
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    });
    w.add_abort_hook([] { throw std::runtime_error("cannot abort"); });
    w.add_abort_hook([] { say("hook 3 ran"); });
    stall(w);
  });
  ASSERT_TRUE(c.exited) << c.output;
  EXPECT_EQ(c.code, 1) << c.output;
  const std::string prefix = "keel-train: rank " + std::to_string(rank) + ": abort hook ";
  const size_t line = c.output.find(timeout_line(rank));
  const size_t started = c.output.find("hook 1 started\n");
  const size_t abandoned = c.output.find(prefix + "1 did not return within 0.5 s; abandoned\n");
  const size_t failed = c.output.find(prefix + "2 failed: cannot abort\n");
  const size_t ran = c.output.find("hook 3 ran\n");
  ASSERT_NE(line, std::string::npos) << c.output;
  ASSERT_NE(started, std::string::npos) << c.output;
  ASSERT_NE(abandoned, std::string::npos) << c.output;
  ASSERT_NE(failed, std::string::npos) << c.output;
  ASSERT_NE(ran, std::string::npos) << c.output;
  EXPECT_LT(line, started) << c.output;
  EXPECT_LT(started, abandoned) << c.output;
  EXPECT_LT(abandoned, failed) << c.output;
  EXPECT_LT(failed, ran) << c.output;
  EXPECT_EQ(count(c.output, prefix), 2) << c.output;  // hook 3 returned: no line of its own
  EXPECT_GE(c.seconds, kTimeout + Watchdog::abort_hook_grace_s(kTimeout)) << c.output;
  EXPECT_LT(c.seconds, kTimeout + 3 * Watchdog::abort_hook_grace_s(kTimeout) + kHangSlack);
}

TEST(WatchdogAbortHooks, RemovedHooksDoNotRun) {
  const int rank = mpi_env().world_rank();
  const Child c = run_child([rank] {
    Watchdog w(kTimeout, rank);
    w.set_step(7);
    std::vector<int> ids;
    for (const char* name : {"A", "B", "C", "D"}) {
      ids.push_back(w.add_abort_hook([name] { say(std::string("hook ") + name + " ran"); }));
    }
    w.remove_abort_hook(ids[1]);
    w.remove_abort_hook(ids[3]);
    w.remove_abort_hook(ids[3]);      // twice: ignored
    w.remove_abort_hook(ids[3] + 1);  // never registered: ignored
    stall(w);
  });
  ASSERT_TRUE(c.exited) << c.output;
  EXPECT_EQ(c.code, 1) << c.output;
  ASSERT_NE(c.output.find(timeout_line(rank)), std::string::npos) << c.output;
  EXPECT_EQ(count(c.output, "hook A ran\n"), 1) << c.output;
  EXPECT_EQ(count(c.output, "hook C ran\n"), 1) << c.output;
  EXPECT_LT(c.output.find("hook A ran\n"), c.output.find("hook C ran\n")) << c.output;
  EXPECT_EQ(c.output.find("hook B"), std::string::npos) << c.output;
  EXPECT_EQ(c.output.find("hook D"), std::string::npos) << c.output;
}

TEST(WatchdogAbortHooks, ARemovalWhileTheHooksRunWaitsForTheEnd) {
  // Another thread removes its hook (an NCCL communicator being destroyed) while the watchdog
  // runs it: the removal must not return, or the hook would use a freed object. The process ends
  // (exit 1) with the hook's line and without the remover's.
  const int rank = mpi_env().world_rank();
  const Child c = run_child([rank] {
    Watchdog w(kTimeout, rank);
    w.set_step(7);
    std::atomic<bool> hook_started{false}, removing{false};
    const int id = w.add_abort_hook([&hook_started, &removing] {
      hook_started.store(true);
      // Until the remover is about to call remove_abort_hook, then a little longer, so that the
      // call is made while this hook runs (a later one must not return either).
      while (!removing.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      say("hook ran");
    });
    std::thread remover([&w, &hook_started, &removing, id] {
      while (!hook_started.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      removing.store(true);
      w.remove_abort_hook(id);
      say("removal returned");
    });
    remover.detach();
    stall(w);
  });
  ASSERT_TRUE(c.exited) << c.output;
  EXPECT_EQ(c.code, 1) << c.output;
  EXPECT_EQ(count(c.output, "hook ran\n"), 1) << c.output;
  EXPECT_EQ(c.output.find("removal returned"), std::string::npos) << c.output;
}

TEST(WatchdogAbortHooks, CollectivesThatCompleteRunNoHook) {
  // In process: a watchdog that never fires must not run the hooks (nor end the process).
  std::atomic<int> runs{0};
  {
    // A timeout no pause of this thread between begin() and end() reaches on a loaded machine
    // (the watchdog would end the test process).
    Watchdog w(kTimeout, mpi_env().world_rank());
    w.add_abort_hook([&runs] { ++runs; });
    for (int i = 0; i < 3; ++i) {
      w.begin("all-reduce", "test");
      w.end();
    }
    // Past the timeout, by several watchdog periods (50 ms), with no collective in flight.
    std::this_thread::sleep_for(std::chrono::duration<double>(kTimeout + 0.5));
  }
  Watchdog disabled(0.0, mpi_env().world_rank());
  disabled.add_abort_hook([&runs] { ++runs; });
  disabled.begin("all-reduce", "test");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  disabled.end();
  EXPECT_EQ(runs.load(), 0);
}

// The world ranks of `comm`'s members in its rank order.
std::vector<int> world_ranks_of(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  MPI_Group group, world;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> ranks(static_cast<size_t>(size)), out(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[static_cast<size_t>(i)] = i;
  MPI_Group_translate_ranks(group, size, ranks.data(), world, out.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  return out;
}

TEST(DistributedMpiComms, MatchTheTopologyGroups) {
  const int world = world_size(), rank = mpi_env().world_rank();
  for (int tp = 1; tp <= world; ++tp) {
    if (world % tp != 0) continue;
    SCOPED_TRACE("tp=" + std::to_string(tp));
    Distributed dist(mpi_env(), tp, 0.0);
    const Topology& t = dist.topology();
    struct Group {
      const char* name;
      MPI_Comm comm;
      int size, rank;
      std::vector<int> members;
      Communicator* keel_comm;
    };
    std::vector<int> everyone;
    for (int r = 0; r < world; ++r) everyone.push_back(r);
    for (const Group& g :
         {Group{"tp", dist.tp_mpi_comm(), t.tp, t.tp_rank, tp_group_ranks(rank, tp, world),
                t.tp_comm},
          Group{"dp", dist.dp_mpi_comm(), t.dp, t.dp_rank, dp_group_ranks(rank, tp, world),
                t.dp_comm},
          Group{"world", dist.world_mpi_comm(), world, rank, everyone, t.world_comm}}) {
      SCOPED_TRACE(g.name);
      ASSERT_NE(g.comm, MPI_COMM_NULL);
      int size = 0, grank = -1;
      MPI_Comm_size(g.comm, &size);
      MPI_Comm_rank(g.comm, &grank);
      EXPECT_EQ(size, g.size);
      EXPECT_EQ(grank, g.rank);
      EXPECT_EQ(size, g.keel_comm->size());
      EXPECT_EQ(grank, g.keel_comm->rank());
      EXPECT_EQ(world_ranks_of(g.comm), g.members);
      // A collective on the exposed handle reaches exactly the group's members.
      int sum = 0;
      MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, g.comm);
      int expected = 0;
      for (int r : g.members) expected += r;
      EXPECT_EQ(sum, expected);
    }
    int cmp = MPI_UNEQUAL;
    MPI_Comm_compare(dist.world_mpi_comm(), MPI_COMM_WORLD, &cmp);
    EXPECT_EQ(cmp, MPI_CONGRUENT);  // a duplicate, so its traffic never mixes with the world's
  }
}

}  // namespace
}  // namespace keel
