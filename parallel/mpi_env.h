// MPI lifetime for a process: MPI_Init_thread on construction (MPI_THREAD_FUNNELED: only the main
// thread calls MPI; OpenMP workers never do), MPI_Finalize on destruction, and the world size,
// rank and node-local rank (MPI_Comm_split_type SHARED; the GPU index later).
#pragma once

namespace keel {

class MpiEnv {
 public:
  MpiEnv(int* argc, char*** argv);
  ~MpiEnv();
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;

  int world_size() const { return world_size_; }
  int world_rank() const { return world_rank_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  // Waits (non-blocking barrier, polled) until every rank arrives or `seconds` pass; true when
  // all arrived. Lets rank 0 finish printing an error every rank found before any rank exits
  // (the launcher kills the job at the first non-zero exit).
  static bool barrier_for(double seconds);
  // Ends every rank of the job at once (for a fatal error seen by only some ranks).
  [[noreturn]] static void abort(int code);

 private:
  int world_size_ = 1, world_rank_ = 0, local_rank_ = 0, local_size_ = 1;
};

}  // namespace keel
