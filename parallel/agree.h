// Control agreement over a host communicator (Topology::world_comm), typed: agree(), where one
// rank decides and every rank learns the verdict or that the decision failed, and how (Note [one
// rank decides]); every_rank(), where each rank contributes int64 values and all see the table.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "framework/error.h"
#include "parallel/communicator.h"

namespace keel {

// Note [one rank decides]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Some decisions are taken by one rank for all (DESIGN.md rule 5: every decision identical on
// every rank): which checkpoint a run resumes from or a rewind goes back to, whether the run
// directory may be used. If that rank throws while the others wait in the collective that would
// tell them the verdict, they hang, or go on without it. agree(comm, root, what, decide):
//   - the root rank of `comm` calls decide(); nobody else does;
//   - one broadcast of a fixed-size record (comm->broadcast_bytes: 16 + sizeof(T) bytes) tells
//     every rank either the verdict, a value of decide()'s trivially copyable return type T (an
//     enum, an int64, std::optional<int64_t>, a small struct of these; or nothing, for void), or
//     that decide() threw, with the ErrorKind of a keel::Error (kInternal for any other
//     exception);
//   - on success every rank returns the root's value, bit for bit;
//   - on failure the root rethrows its own exception unchanged (message, kind, file:line), and
//     every other rank throws a keel::Error of the same kind, "rank <root> could not <what> (see
//     its message)", so the job ends with the exit code of the root's error (rank 0 prints it).
// A null comm, or a group of one, is one process: decide() runs here and its exceptions
// propagate as they are. The record carries the kind, not the root's message: only rank 0
// prints errors (DESIGN.md rule 7), and every rank throwing agrees on the exit code.

namespace detail {

// Header of agree()'s record: whether decide() threw, and the kind.
struct AgreeHeader {
  int64_t failed = 0;
  int64_t kind = 0;
};

inline ErrorKind error_kind_from_wire(int64_t v) {
  switch (static_cast<ErrorKind>(v)) {
    case ErrorKind::kUsage:
    case ErrorKind::kConfig:
    case ErrorKind::kData:
    case ErrorKind::kLayout:
    case ErrorKind::kIo:
    case ErrorKind::kInternal:
    case ErrorKind::kComm:
      return static_cast<ErrorKind>(v);
  }
  return ErrorKind::kInternal;
}

}  // namespace detail

// Note [one rank decides]. T = decide()'s return type (void allowed); `what` completes "rank
// <root> could not ...". Collective over comm: every rank calls it, in the same order.
template <typename Decide>
std::invoke_result_t<Decide&> agree(Communicator* comm, int root, std::string_view what,
                                    Decide&& decide) {
  using T = std::invoke_result_t<Decide&>;
  static_assert(std::is_void_v<T> || std::is_trivially_copyable_v<T>,
                "agree(): the verdict travels as bytes; return an enum, int64 or small struct");
  if (comm == nullptr || comm->size() == 1) return decide();
  KEEL_CHECK(root >= 0 && root < comm->size(), kInternal, "agree(): root ", root, " of a group of ",
             comm->size());
  constexpr size_t kValueBytes = [] {
    if constexpr (std::is_void_v<T>) {
      return size_t{0};
    } else {
      return sizeof(T);
    }
  }();
  std::array<unsigned char, sizeof(detail::AgreeHeader) + kValueBytes> record{};
  detail::AgreeHeader header;
  std::exception_ptr error;
  if (comm->rank() == root) {
    try {
      if constexpr (std::is_void_v<T>) {
        decide();
      } else {
        const T value = decide();
        std::memcpy(record.data() + sizeof(header), &value, sizeof(T));
      }
    } catch (const Error& e) {
      error = std::current_exception();
      header.kind = static_cast<int64_t>(e.kind());
    } catch (...) {
      error = std::current_exception();
      header.kind = static_cast<int64_t>(ErrorKind::kInternal);
    }
    header.failed = error ? 1 : 0;
    std::memcpy(record.data(), &header, sizeof(header));
  }
  comm->broadcast_bytes(record.data(), static_cast<int64_t>(record.size()), root);
  std::memcpy(&header, record.data(), sizeof(header));
  if (header.failed != 0) {
    if (error) std::rethrow_exception(error);
    throw Error(
        detail::error_kind_from_wire(header.kind),
        "rank " + std::to_string(root) + " could not " + std::string(what) + " (see its message)",
        __FILE__, __LINE__);
  }
  if constexpr (std::is_void_v<T>) {
    return;
  } else {
    std::array<unsigned char, sizeof(T)> bytes;
    std::memcpy(bytes.data(), record.data() + sizeof(header), sizeof(T));
    return std::bit_cast<T>(bytes);
  }
}

// Every rank's `mine` (the same count on every rank), in rank order: size() x mine.size() values,
// bit for bit (fingerprints, counts, signal numbers; each rank then reaches the same verdict from
// the same table). A null comm is one process: mine itself. Collective over comm.
inline std::vector<int64_t> every_rank(Communicator* comm, const std::vector<int64_t>& mine) {
  if (comm == nullptr) return mine;
  const auto n = static_cast<int64_t>(mine.size());
  std::vector<int64_t> table(static_cast<size_t>(n) * comm->size());
  comm->all_gather_int64(mine.data(), table.data(), n);
  return table;
}

}  // namespace keel
