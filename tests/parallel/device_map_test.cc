// Device mapping and group construction across nodes (parallel/device_map.h, parallel/topology.h,
// Note [fake nodes] in parallel/mpi_env.h). The pure functions are checked for whole simulated
// clusters (2 nodes x 4 GPUs, 4 x 8, 8 x 8: 64 ranks) without launching them; then the
// KEEL_FAKE_NODE_SIZE path runs for real under mpiexec (np 1, 2, 4): MpiEnv's split, the device of
// each rank, and Distributed's TP groups staying inside a simulated node. No GPU is needed.
#include "parallel/device_map.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "framework/error.h"
#include "parallel/mpi_env.h"
#include "parallel/topology.h"
#include "tests/parallel/parallel_test_util.h"

namespace keel {
namespace {

using keel::testing::world_size;

// The ErrorKind and message of what fn() throws (kInternal and "" when it does not throw).
template <typename Fn>
std::pair<ErrorKind, std::string> thrown(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return {e.kind(), e.what()};
  }
  return {ErrorKind::kInternal, ""};
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(FakeNodeSize, ParsesDivisorsOfTheWorld) {
  EXPECT_EQ(parse_fake_node_size("1", 4), 1);
  EXPECT_EQ(parse_fake_node_size("2", 4), 2);
  EXPECT_EQ(parse_fake_node_size("4", 4), 4);
  EXPECT_EQ(parse_fake_node_size("8", 64), 8);
}

TEST(FakeNodeSize, RejectsWhatIsNotAPositiveIntegerDividingTheWorld) {
  for (const char* bad : {"0", "-2", "+2", "2x", " 2", "2 ", "", "abc", "1.5", "99999999999"}) {
    const auto [kind, msg] = thrown([&] { parse_fake_node_size(bad, 4); });
    EXPECT_EQ(kind, ErrorKind::kConfig) << "'" << bad << "'";
    EXPECT_TRUE(contains(msg, "KEEL_FAKE_NODE_SIZE=")) << msg;
    EXPECT_TRUE(contains(msg, "not a positive integer")) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  const auto [kind, msg] = thrown([] { parse_fake_node_size("3", 4); });
  EXPECT_EQ(kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(msg, "KEEL_FAKE_NODE_SIZE=3 does not divide the 4 ranks")) << msg;
}

TEST(DeviceMap, NodeLocalRankPicksTheDevice) {
  for (int r = 0; r < 8; ++r) EXPECT_EQ(device_for_rank(r, 8, 8, "n0", nullptr), r);
  // Fewer ranks than GPUs: the first ones are used.
  EXPECT_EQ(device_for_rank(3, 4, 8, "n0", nullptr), 3);
  // CUDA_VISIBLE_DEVICES=4,5,6,7: indices are into the visible list (the runtime renumbers).
  for (int r = 0; r < 4; ++r) EXPECT_EQ(device_for_rank(r, 4, 4, "n0", "4,5,6,7"), r);
}

TEST(DeviceMap, PerTaskBindingUsesTheOneVisibleDevice) {
  // srun --gpus-per-task=1: 8 ranks on the node, each sees only its own GPU.
  for (int r = 0; r < 8; ++r) EXPECT_EQ(device_for_rank(r, 8, 1, "n0", "5"), 0);
  EXPECT_EQ(device_for_rank(7, 8, 1, "n0", "GPU-8f2c1a3e-0000-0000-0000-000000000000"), 0);
}

TEST(DeviceMap, MoreRanksThanGpusIsALayoutErrorNamingTheNode) {
  const auto [kind, msg] = thrown([] { device_for_rank(8, 9, 8, "gpu-a17", nullptr); });
  EXPECT_EQ(kind, ErrorKind::kLayout);
  EXPECT_EQ(exit_code_for(kind), 2);
  EXPECT_TRUE(contains(msg, "node gpu-a17 runs 9 ranks but each rank sees 8 GPUs")) << msg;
  EXPECT_TRUE(contains(msg, "at most 8 ranks per node")) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // Every rank of the node finds it, not only the ones beyond the GPU count.
  for (int r = 0; r < 9; ++r) {
    EXPECT_EQ(thrown([&] { device_for_rank(r, 9, 8, "gpu-a17", nullptr); }).first,
              ErrorKind::kLayout)
        << "local rank " << r;
  }
  // Two ranks sharing a node with one visible GPU that is not a per-task binding.
  const auto [kind1, msg1] = thrown([] { device_for_rank(1, 2, 1, "box", "0,1"); });
  EXPECT_EQ(kind1, ErrorKind::kLayout);
  EXPECT_TRUE(
      contains(msg1, "node box runs 2 ranks but each rank sees 1 GPU (CUDA_VISIBLE_DEVICES=0,1)"))
      << msg1;
  const auto [kind0, msg0] = thrown([] { device_for_rank(0, 1, 0, "cpu-only", nullptr); });
  EXPECT_EQ(kind0, ErrorKind::kLayout);
  EXPECT_TRUE(contains(msg0, "node cpu-only runs 1 rank but each rank sees 0 GPUs")) << msg0;
}

// A simulated cluster of `nodes` x `gpus` ranks placed by slot (consecutive ranks per node), as
// KEEL_FAKE_NODE_SIZE=gpus lays it out: every rank's device, and the TP and DP groups of every tp
// that divides the world.
void check_cluster(int nodes, int gpus) {
  SCOPED_TRACE(::testing::Message() << nodes << " nodes x " << gpus << " GPUs");
  const int world = nodes * gpus;
  std::vector<int> node_of(world), device_of(world);
  for (int r = 0; r < world; ++r) {
    const NodeSplit s = fake_node_split(r, world, gpus);
    EXPECT_EQ(s.nodes, nodes);
    EXPECT_EQ(s.local_size, gpus);
    node_of[r] = s.node;
    device_of[r] = device_for_rank(s.local_rank, s.local_size, gpus,
                                   "fake-node-" + std::to_string(s.node), nullptr);
  }
  // Each node holds gpus consecutive ranks, and they use its devices 0..gpus-1 once each.
  for (int n = 0; n < nodes; ++n) {
    std::set<int> devices;
    for (int r = 0; r < world; ++r) {
      if (node_of[r] == n) {
        EXPECT_EQ(r / gpus, n) << "rank " << r;
        devices.insert(device_of[r]);
      }
    }
    EXPECT_EQ(devices.size(), static_cast<size_t>(gpus)) << "node " << n;
    EXPECT_EQ(*devices.begin(), 0);
    EXPECT_EQ(*devices.rbegin(), gpus - 1);
  }
  for (int tp = 1; tp <= world; tp *= 2) {
    if (world % tp != 0) continue;
    SCOPED_TRACE(::testing::Message() << "tp " << tp);
    std::vector<int> tp_seen(world, 0), dp_seen(world, 0);
    for (int r = 0; r < world; ++r) {
      const std::vector<int> tpg = tp_group_ranks(r, tp, world);
      const std::vector<int> dpg = dp_group_ranks(r, tp, world);
      ASSERT_EQ(tpg.size(), static_cast<size_t>(tp));
      ASSERT_EQ(dpg.size(), static_cast<size_t>(world / tp));
      // r's place in each group is its rank there (what Distributed's split gives).
      EXPECT_EQ(tpg[r % tp], r);
      EXPECT_EQ(dpg[r / tp], r);
      std::set<int> tp_nodes, tp_devices;
      for (int m : tpg) {
        EXPECT_EQ(tp_group_of(m, tp), tp_group_of(r, tp));
        tp_nodes.insert(node_of[m]);
        tp_devices.insert(device_of[m]);
      }
      // TP inside a node whenever it fits (tp = 8 on 8-GPU nodes), on distinct GPUs.
      if (tp <= gpus) {
        EXPECT_EQ(tp_nodes.size(), 1u) << "TP group of rank " << r << " spans nodes";
        EXPECT_EQ(tp_devices.size(), static_cast<size_t>(tp));
      } else {
        EXPECT_EQ(tp_nodes.size(), static_cast<size_t>(tp / gpus));  // whole nodes
      }
      // A DP group takes one rank of every TP group, all with the same TP rank (and, when tp
      // divides the GPUs per node, devices that agree mod tp).
      std::set<int> dp_tp_groups;
      for (int m : dpg) {
        EXPECT_EQ(m % tp, r % tp);
        EXPECT_EQ(dp_group_of(m, tp), dp_group_of(r, tp));
        dp_tp_groups.insert(tp_group_of(m, tp));
        if (tp <= gpus) {
          EXPECT_EQ(device_of[m] % tp, device_of[r] % tp);
        }
      }
      EXPECT_EQ(dp_tp_groups.size(), static_cast<size_t>(world / tp));
      if (tpg.front() == r) {
        for (int m : tpg) ++tp_seen[m];
      }
      if (dpg.front() == r) {
        for (int m : dpg) ++dp_seen[m];
      }
    }
    // The groups partition the world.
    EXPECT_EQ(std::count(tp_seen.begin(), tp_seen.end(), 1), world);
    EXPECT_EQ(std::count(dp_seen.begin(), dp_seen.end(), 1), world);
    EXPECT_EQ(tp_placement_warning(node_of, tp), "");
  }
}

TEST(ClusterLayout, TwoNodesOfFourGpus) { check_cluster(2, 4); }
TEST(ClusterLayout, FourNodesOfEightGpus) { check_cluster(4, 8); }
TEST(ClusterLayout, EightNodesOfEightGpus) { check_cluster(8, 8); }

TEST(ClusterLayout, TpGroupsAcrossNodesAreNamedInTheWarning) {
  // Ranks placed round-robin over 4 nodes of 8 (mpirun --map-by node): tp = 8 spans all four.
  std::vector<int> round_robin(32);
  for (int r = 0; r < 32; ++r) round_robin[r] = r % 4;
  const std::string w = tp_placement_warning(round_robin, 8);
  EXPECT_TRUE(contains(w, "the tensor-parallel group of world ranks 0..7 spans nodes 0 and 1"))
      << w;
  EXPECT_TRUE(contains(w, "as do 3 more groups")) << w;
  EXPECT_TRUE(contains(w, "--map-by slot")) << w;
  // Nodes of 6 ranks, tp = 4: the group of ranks 4..7 straddles nodes 0 and 1.
  std::vector<int> sixes(12);
  for (int r = 0; r < 12; ++r) sixes[r] = r / 6;
  const std::string w6 = tp_placement_warning(sixes, 4);
  EXPECT_TRUE(contains(w6, "world ranks 4..7 spans nodes 0 and 1 (parallel.tp=4, node 0 runs 6"))
      << w6;
  EXPECT_FALSE(contains(w6, "more groups")) << w6;
  // tp larger than a node cannot stay inside one: no warning.
  std::vector<int> fours(16);
  for (int r = 0; r < 16; ++r) fours[r] = r / 4;
  EXPECT_EQ(tp_placement_warning(fours, 8), "");
}

// ---- KEEL_FAKE_NODE_SIZE under mpiexec ----------------------------------------------------------

// An MpiEnv made while KEEL_FAKE_NODE_SIZE=value (MPI is already up: it reads the world and
// splits it). Never destroyed: its destructor would finalise MPI (as parallel_test_util.h's).
// The variable is restored afterwards (a launch may have set it for the last test).
const MpiEnv& env_with_fake_nodes(const std::string& value) {
  const char* launched = std::getenv(MpiEnv::kFakeNodeSizeVar);
  const std::string saved = launched != nullptr ? launched : "";
  setenv(MpiEnv::kFakeNodeSizeVar, value.c_str(), 1);
  const MpiEnv* env = new MpiEnv(nullptr, nullptr);
  if (launched != nullptr) {
    setenv(MpiEnv::kFakeNodeSizeVar, saved.c_str(), 1);
  } else {
    unsetenv(MpiEnv::kFakeNodeSizeVar);
  }
  return *env;
}

TEST(FakeNodesUnderMpi, WithoutTheVariableOneHostIsOneNode) {
  if (std::getenv(MpiEnv::kFakeNodeSizeVar) != nullptr) GTEST_SKIP() << "launched with fake nodes";
  // mpiexec on this machine: every rank shares its memory.
  const NodeSplit s = MpiEnv::split_world();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  EXPECT_EQ(s.node, 0);
  EXPECT_EQ(s.nodes, 1);
  EXPECT_EQ(s.local_size, world_size());
  EXPECT_EQ(s.local_rank, rank);
}

TEST(FakeNodesUnderMpi, TheVariableSplitsRanksIntoConsecutiveNodes) {
  const int world = world_size();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (int n = 1; n <= world; ++n) {
    if (world % n != 0) continue;
    const MpiEnv& env = env_with_fake_nodes(std::to_string(n));
    EXPECT_EQ(env.world_rank(), rank);
    EXPECT_EQ(env.local_size(), n);
    EXPECT_EQ(env.local_rank(), rank % n);
    EXPECT_EQ(env.node(), rank / n);
    EXPECT_EQ(env.nodes(), world / n);
    EXPECT_TRUE(contains(env.node_name(), "/fake-node-" + std::to_string(rank / n)))
        << env.node_name();
    // Each simulated node of n GPUs: the node-local rank is the device; n - 1 GPUs is too few.
    EXPECT_EQ(device_for_rank(env, n), rank % n);
    const auto [kind, msg] = thrown([&] { device_for_rank(env, n - 1); });
    EXPECT_EQ(kind, ErrorKind::kLayout);
    EXPECT_TRUE(contains(msg, "node " + env.node_name() + " runs " + std::to_string(n))) << msg;
    // TP groups of every size that fits a node stay inside it: Distributed warns of nothing and
    // its TP group is this node's block of ranks.
    for (int tp = 1; tp <= n; ++tp) {
      if (n % tp != 0) continue;
      Distributed dist(env, tp, 0.0);
      EXPECT_EQ(dist.placement_warning(), "") << "tp " << tp << " node size " << n;
      const Topology& t = dist.topology();
      EXPECT_EQ(t.tp_rank, rank % tp);
      EXPECT_EQ(t.dp_rank, rank / tp);
      // Every member of this rank's TP group is on this rank's node: the group's largest node
      // index and its smallest (the largest negated) are both this rank's.
      const float node = static_cast<float>(env.node());
      float latest = node, earliest_negated = -node;
      t.tp_comm->all_reduce(&latest, 1, ReduceOp::kMax);
      t.tp_comm->all_reduce(&earliest_negated, 1, ReduceOp::kMax);
      EXPECT_EQ(latest, node) << "a TP group member sits on a later node";
      EXPECT_EQ(-earliest_negated, node) << "a TP group member sits on an earlier node";
    }
  }
}

TEST(FakeNodesUnderMpi, AnInvalidValueIsAConfigErrorOnEveryRankBeforeAnyCollective) {
  const int world = world_size();
  for (const std::string& bad : {std::string("0"), std::string("two"), std::to_string(world + 1)}) {
    const MpiEnv& env = env_with_fake_nodes(bad);  // MPI is up; the error waits for its first use
    EXPECT_EQ(env.world_size(), world);
    const auto [kind, msg] = thrown([&] { env.local_rank(); });
    EXPECT_EQ(kind, ErrorKind::kConfig) << bad;
    EXPECT_TRUE(contains(msg, "KEEL_FAKE_NODE_SIZE=" + bad)) << msg;
    // Distributed raises it before its first collective (this would hang otherwise when only
    // some ranks went on).
    const auto [dkind, dmsg] = thrown([&] { Distributed dist(env, 1, 0.0); });
    EXPECT_EQ(dkind, ErrorKind::kConfig);
    EXPECT_EQ(dmsg, msg);
  }
}

// Launched as `KEEL_FAKE_NODE_SIZE=2 mpiexec -n 4 device_map_test`: the process's own MpiEnv
// (made at start-up, as keel-train's) reads the variable.
TEST(FakeNodesUnderMpi, ALaunchWithTheVariableSplitsTheProcessEnv) {
  const char* value = std::getenv(MpiEnv::kFakeNodeSizeVar);
  if (value == nullptr) GTEST_SKIP() << "not launched with KEEL_FAKE_NODE_SIZE";
  const int n = std::atoi(value);
  const MpiEnv& env = keel::testing::mpi_env();
  EXPECT_EQ(env.local_size(), n);
  EXPECT_EQ(env.local_rank(), env.world_rank() % n);
  EXPECT_EQ(env.node(), env.world_rank() / n);
  EXPECT_EQ(device_for_rank(env, n), env.world_rank() % n);
  Distributed dist(env, n, 0.0);
  EXPECT_EQ(dist.placement_warning(), "");
  EXPECT_EQ(dist.topology().tp_rank, env.local_rank());
}

}  // namespace
}  // namespace keel
