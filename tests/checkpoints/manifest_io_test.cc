// The manifest read as untrusted input (checkpoints/manifest_io.h): its checksum (one flipped bit
// anywhere is refused; format 1 without one still reads), every field parse_manifest validates
// (each forged with a valid checksum so that it reaches its own check, and refused with one line
// naming the file, the tensor, the slice and the reason), coverage across TP blocks split into
// ZeRO-1 ranges, no std:: exception escaping on garbage, and read_manifest's file checks: the
// step against the directory's name, a FIFO, /dev/zero and missing or resized shards.
#include "checkpoints/manifest_io.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>

#include "tests/test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

constexpr char kPath[] = "run/checkpoints/step_00000020/manifest.pb";

// A manifest as a TP2 x DP2 ZeRO-1 run writes it, in miniature: "w" [4, 6] is sharded on dim 0
// into two TP blocks of 2 rows (12 elements each), each split into the ZeRO-1 ranges [0, 5) and
// [5, 12); "b" [6] is replicated, one slice. Everything lies back to back in one shard file.
//   slice:    w0a     w0b     w1a     w1b     b
//   floats:   5       7       5       7       6     (30 floats, 120 bytes)
ckpt::Manifest good_manifest() {
  ckpt::Manifest m;
  m.set_format_version(kCheckpointFormatVersion);
  m.set_step(20);
  m.set_parent_step(15);
  m.set_adam_t(20);
  m.mutable_layout()->set_world(4);
  m.mutable_layout()->set_tp(2);
  m.mutable_layout()->set_dp(2);
  m.mutable_layout()->set_zero_stage(1);
  int64_t offset = 0;
  auto add_slice = [&](ckpt::TensorRecord* t, int dim, int64_t begin, int64_t len, int64_t flat,
                       int64_t n) {
    ckpt::Slice* s = t->add_slices();
    s->set_shard_dim(dim);
    s->set_shard_begin(begin);
    s->set_shard_len(len);
    s->set_flat_begin(flat);
    s->set_n(n);
    s->set_file("shard_00000.bin");
    s->set_offset(offset);
    offset += 4 * n;
  };
  ckpt::TensorRecord* w = m.add_tensors();
  w->set_name("w");
  w->set_kind(ckpt::ADAM_M);
  w->set_dtype("f32");
  w->add_shape(4);
  w->add_shape(6);
  add_slice(w, 0, 0, 2, 0, 5);
  add_slice(w, 0, 0, 2, 5, 7);
  add_slice(w, 0, 2, 2, 0, 5);
  add_slice(w, 0, 2, 2, 5, 7);
  ckpt::TensorRecord* b = m.add_tensors();
  b->set_name("b");
  b->set_kind(ckpt::PARAM);
  b->set_dtype("f32");
  b->add_shape(6);
  add_slice(b, -1, 0, 0, 0, 6);
  ckpt::ShardFile* f = m.add_files();
  f->set_name("shard_00000.bin");
  f->set_bytes(offset);
  return m;
}

ckpt::Slice& w_slice(ckpt::Manifest& m, int k) { return *m.mutable_tensors(0)->mutable_slices(k); }

// parse_manifest's message for `m` forged with a valid checksum; "" when it parses.
std::string refusal(const ckpt::Manifest& m) {
  try {
    parse_manifest(serialize_manifest(m), kPath);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData) << e.what();
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  }
  return "";
}

// The refusal of good_manifest() after `edit`.
std::string refusal_after(const std::function<void(ckpt::Manifest&)>& edit) {
  ckpt::Manifest m = good_manifest();
  edit(m);
  return refusal(m);
}

const std::string kW = std::string(kPath) + ": tensor w (adam_m)";

// ---- the checksum --------------------------------------------------------------------------

TEST(ParseManifest, AWellFormedManifestRoundTrips) {
  const ckpt::Manifest m = good_manifest();
  const std::string bytes = serialize_manifest(m);
  const ckpt::Manifest back = parse_manifest(bytes, kPath);
  EXPECT_EQ(back.step(), 20);
  EXPECT_EQ(back.parent_step(), 15);
  // The checksum describes the bytes, not the content: the parsed manifest does not carry it.
  EXPECT_FALSE(back.has_manifest_xxh3());
  EXPECT_EQ(back.SerializeAsString(), m.SerializeAsString());
  // The checksum record is the file's last nine bytes: tag 0x79 (field 15, fixed64) and the hash.
  ASSERT_GT(bytes.size(), 9u);
  EXPECT_EQ(static_cast<unsigned char>(bytes[bytes.size() - 9]), 0x79);
  ckpt::Manifest with;
  ASSERT_TRUE(with.ParseFromString(bytes));
  ASSERT_TRUE(with.has_manifest_xxh3());
  EXPECT_EQ(XXH3_64bits(bytes.data(), bytes.size() - 9), with.manifest_xxh3());
  EXPECT_EQ(serialize_manifest(back), bytes);  // re-serializing a parsed manifest is stable
}

TEST(ParseManifest, EveryFlippedBitIsRefused) {
  const std::string bytes = serialize_manifest(good_manifest());
  int refused = 0, checksum = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = bytes;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      try {
        parse_manifest(bad, kPath);
        ADD_FAILURE() << "byte " << i << " bit " << bit << " flipped was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kData);
        ++refused;
        checksum += std::string(e.what()).find("checksum") != std::string::npos;
      }
    }
  }
  EXPECT_EQ(refused, static_cast<int>(8 * bytes.size()));
  EXPECT_GT(checksum, refused / 2);  // most are caught by the checksum itself
  // format_version 2, then step 20: flipping the step's low bit still parses (step 21).
  ASSERT_EQ(bytes.substr(0, 4), std::string("\x08\x02\x10\x14", 4));
  std::string bad = bytes;
  bad[3] = static_cast<char>(bad[3] ^ 0x01);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { parse_manifest(bad, kPath); }),
            std::string(kPath) + ": checksum mismatch (the manifest is corrupt or was edited)");
}

TEST(ParseManifest, TheChecksumRecordMustBeLastAndPresent) {
  const ckpt::Manifest m = good_manifest();
  // Bytes appended after it: another (valid) field, so the file still parses.
  std::string bytes = serialize_manifest(m) + std::string("\x10\x07", 2);  // step = 7
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { parse_manifest(bytes, kPath); }),
            std::string(kPath) +
                ": the checksum record is not at the end of the file (corrupt, or edited by a "
                "tool that rewrote it)");
  // A format-2 manifest without one (written by a tool that re-serialized it).
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { parse_manifest(m.SerializeAsString(), kPath); }),
            std::string(kPath) +
                ": has no checksum record (format version 2 requires one; the file is corrupt)");
}

TEST(ParseManifest, FormatOneHasNoChecksumAndIsStillValidated) {
  ckpt::Manifest m = good_manifest();
  m.set_format_version(1);
  m.clear_parent_step();
  const ckpt::Manifest back = parse_manifest(m.SerializeAsString(), kPath);
  EXPECT_EQ(back.format_version(), 1u);
  EXPECT_FALSE(back.has_parent_step());
  w_slice(m, 1).set_n(-1);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { parse_manifest(m.SerializeAsString(), kPath); }),
            kW + ": slice 1: elements [5, +-1) are empty or outside its block of 12");
}

TEST(ParseManifest, GarbageNeverEscapesAsAnotherException) {
  const std::string bytes = serialize_manifest(good_manifest());
  // Every truncation, and random bytes: parsed or refused as kData, nothing else.
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_THROW(parse_manifest(bytes.substr(0, n), kPath), Error) << n;
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string junk(rng() % 200, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    try {
      parse_manifest(junk, kPath);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kData);
    }
  }
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { parse_manifest("", kPath); }),
            std::string(kPath) + ": cannot parse (corrupt, or not a keel checkpoint manifest)");
}

// ---- slices ----------------------------------------------------------------------------------

TEST(ParseManifest, AValidLayoutOfBlocksAndRangesIsAccepted) {
  EXPECT_EQ(refusal(good_manifest()), "");
  // The same tensor as four TP blocks of one row, whole (no ZeRO-1), in any order.
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              ckpt::TensorRecord* w = m.mutable_tensors(0);
              w->clear_slices();
              for (int64_t row : {2, 0, 3, 1}) {
                ckpt::Slice* s = w->add_slices();
                s->set_shard_dim(0);
                s->set_shard_begin(row);
                s->set_shard_len(1);
                s->set_n(6);
                s->set_file("shard_00000.bin");
                s->set_offset(24 * row);
              }
            }),
            "");
}

TEST(ParseManifest, NegativeOrZeroLengthsAreRefused) {
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 0).set_n(-1); }),
            kW + ": slice 0: elements [0, +-1) are empty or outside its block of 12");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 0).set_n(0); }),
            kW + ": slice 0: elements [0, +0) are empty or outside its block of 12");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 2).set_shard_len(0); }),
            kW + ": slice 2: block [2, +0) is empty or outside dimension 0 of extent 4");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 1).set_flat_begin(-5); }),
            kW + ": slice 1: elements [-5, +7) are empty or outside its block of 12");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 3).set_flat_begin(6); }),
            kW + ": slice 3: elements [6, +7) are empty or outside its block of 12");
}

TEST(ParseManifest, ShardDimensionsAndBlocksMustLieInTheTensor) {
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 0).set_shard_dim(1 << 30); }),
            kW + ": slice 0: shard_dim 1073741824 is out of range for 2 dimensions");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 0).set_shard_dim(-2); }),
            kW + ": slice 0: shard_dim -2 is out of range for 2 dimensions");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 1).set_shard_dim(1); }),
            kW + ": slice 1: sharded on dimension 1, slice 0 on 0 (one layout per tensor)");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 2).set_shard_begin(3); }),
            kW + ": slice 2: block [3, +2) is empty or outside dimension 0 of extent 4");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 2).set_shard_begin(-1); }),
            kW + ": slice 2: block [-1, +2) is empty or outside dimension 0 of extent 4");
  const std::string b = std::string(kPath) + ": tensor b (param): slice 0";
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              m.mutable_tensors(1)->mutable_slices(0)->set_shard_len(6);
            }),
            b + ": an unsharded slice with shard_begin 0 and shard_len 6 (both must be 0)");
}

TEST(ParseManifest, DuplicatedOverlappingAndMissingSlicesAreRefused) {
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              *m.mutable_tensors(0)->add_slices() = w_slice(m, 3);  // duplicated
            }),
            kW + ": slice 4 overlaps slice 3");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              w_slice(m, 1).set_flat_begin(4);  // [4, 11) overlaps [0, 5)
              w_slice(m, 1).set_n(7);
            }),
            kW + ": slice 1 overlaps slice 0");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              // The second block moved up a row: rows [1, 3) overlap the first block's [0, 2).
              w_slice(m, 2).set_shard_begin(1);
              w_slice(m, 3).set_shard_begin(1);
            }),
            kW + ": slice 2 overlaps slice 1");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              m.mutable_tensors(0)->mutable_slices()->DeleteSubrange(1, 1);  // [5, 12) of block 0
            }),
            kW + ": nothing covers elements [5, 12) of the block at 0");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              m.mutable_tensors(0)->mutable_slices()->DeleteSubrange(2, 2);  // rows [2, 4)
            }),
            kW + ": nothing covers [2, 4) along dimension 0");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              m.mutable_tensors(0)->mutable_slices()->DeleteSubrange(0, 2);  // rows [0, 2)
            }),
            kW + ": nothing covers [0, 2) along dimension 0");
  // Summed n is right (24) but two ranges overlap and one is missing: the old check's blind spot.
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              w_slice(m, 2).set_flat_begin(5);
              w_slice(m, 2).set_n(7);
              w_slice(m, 3).set_n(5);
              w_slice(m, 3).set_offset(w_slice(m, 2).offset() + 28);
            }),
            kW + ": nothing covers elements [0, 5) of the block at 2");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.mutable_tensors(0)->clear_slices(); }),
            kW + ": has no slices");
}

TEST(ParseManifest, SliceFilesArePlainNamesListedInTheManifest) {
  for (const char* name : {"../../x", "/etc/passwd", "sub/shard", ".", "..", "", "a b"}) {
    EXPECT_EQ(refusal_after([&](ckpt::Manifest& m) { w_slice(m, 0).set_file(name); }),
              kW + ": slice 0: file is not a plain name within the checkpoint directory")
        << name;
  }
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 0).set_file("shard_00009.bin"); }),
            kW + ": slice 0: file shard_00009.bin is not listed in the manifest's files");
  EXPECT_EQ(
      refusal_after([](ckpt::Manifest& m) { m.mutable_files(0)->set_name("../x"); }),
      std::string(kPath) + ": files entry 0: not a plain name within the checkpoint directory");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { *m.add_files() = m.files(0); }),
            std::string(kPath) + ": file shard_00000.bin is listed twice");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.mutable_files(0)->set_bytes(-1); }),
            std::string(kPath) + ": file shard_00000.bin: size -1 is negative");
}

TEST(ParseManifest, SliceBytesLieWithinTheirFileAndApart) {
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 3).set_offset(100); }),
            kW + ": slice 3: 7 floats at byte 100 lie outside shard_00000.bin of 120 bytes");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { w_slice(m, 3).set_offset(-4); }),
            kW + ": slice 3: 7 floats at byte -4 lie outside shard_00000.bin of 120 bytes");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.mutable_files(0)->set_bytes(100); }),
            std::string(kPath) +
                ": tensor b (param): slice 0: 6 floats at byte 96 lie outside shard_00000.bin of "
                "100 bytes");
  // Two slices reading the same bytes: a manifest could otherwise describe more elements than
  // its files hold.
  EXPECT_EQ(refusal_after(
                [](ckpt::Manifest& m) { m.mutable_tensors(1)->mutable_slices(0)->set_offset(0); }),
            std::string(kPath) +
                ": tensor b (param): slice 0 shares bytes of shard_00000.bin from 0 with slice 0 "
                "of tensor w (adam_m)");
}

TEST(ParseManifest, ShapesAreBoundedAndTensorsRecordedOnce) {
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.mutable_tensors(0)->set_shape(1, 0); }),
            kW + ": dimension 1 is 0 (each must be positive and the tensor at most "
                 "1099511627776 elements)");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.mutable_tensors(0)->set_shape(1, -6); }),
            kW + ": dimension 1 is -6 (each must be positive and the tensor at most "
                 "1099511627776 elements)");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              m.mutable_tensors(0)->set_shape(1, int64_t{1} << 62);  // 4 x 2^62 overflows int64
            }),
            kW + ": dimension 1 is 4611686018427387904 (each must be positive and the tensor at "
                 "most 1099511627776 elements)");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.mutable_tensors(0)->clear_shape(); }),
            kW + ": 0 dimensions (1 to 8 allowed)");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              for (int i = 0; i < 7; ++i) m.mutable_tensors(0)->add_shape(1);
            }),
            kW + ": 9 dimensions (1 to 8 allowed)");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.mutable_tensors(0)->set_dtype("bf16"); }),
            kW + ": dtype is not f32");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              m.mutable_tensors(0)->set_kind(static_cast<ckpt::TensorKind>(9));
            }),
            std::string(kPath) + ": tensor w (unknown): unknown kind 9");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.mutable_tensors(0)->set_name("a\nb"); }),
            std::string(kPath) + ": tensor record 0: its name is empty, too long or not printable");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) {
              ckpt::TensorRecord copy = m.tensors(1);
              copy.mutable_slices(0)->set_offset(120);
              m.mutable_files(0)->set_bytes(144);
              *m.add_tensors() = copy;
            }),
            std::string(kPath) + ": tensor b (param) is recorded twice");
}

TEST(ParseManifest, RunCountersAreChecked) {
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.set_step(-3); }),
            std::string(kPath) + ": step -3 is negative");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.set_adam_t(-1); }),
            std::string(kPath) + ": adam_t -1 is negative");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.set_parent_step(20); }),
            std::string(kPath) + ": parent_step 20 is not -1 or a step before 20");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.mutable_layout()->set_tp(0); }),
            std::string(kPath) + ": layout world 4, tp 0, dp 2 (each must be at least 1)");
  EXPECT_EQ(refusal_after([](ckpt::Manifest& m) { m.set_format_version(3); }),
            std::string(kPath) +
                ": format version 3 is newer than this keel's 2 (written by a "
                "newer keel)");
}

// ---- read_manifest: the directory ------------------------------------------------------------

struct OnDisk {
  TempDir td{"keel_manifest"};
  std::string dir = td.path() + "/step_00000020";
  std::string manifest = dir + "/manifest.pb";
  std::string shard = dir + "/shard_00000.bin";
  OnDisk() {
    fs::create_directories(dir);
    write(good_manifest());
    std::ofstream(shard, std::ios::binary) << std::string(120, '\0');
  }
  void write(const ckpt::Manifest& m) const {
    std::ofstream(manifest, std::ios::binary | std::ios::trunc) << serialize_manifest(m);
  }
};

TEST(ReadManifest, TheStepMustMatchTheDirectoryName) {
  const OnDisk d;
  EXPECT_EQ(read_manifest(d.dir).step(), 20);
  ckpt::Manifest m = good_manifest();
  m.set_step(7);
  m.set_parent_step(-1);
  d.write(m);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(d.dir); }),
            d.manifest + ": step 7 does not match the directory name step_00000020");
  // A directory not named step_NNNNNNNN (a copy elsewhere) has no name to match.
  fs::rename(d.dir, d.td.path() + "/copy");
  EXPECT_EQ(read_manifest(d.td.path() + "/copy").step(), 7);
}

TEST(ReadManifest, AFifoOrADeviceIsRefusedWithoutBlocking) {
  const OnDisk d;
  fs::remove(d.manifest);
  ASSERT_EQ(::mkfifo(d.manifest.c_str(), 0644), 0);
  ::alarm(30);  // a hang ends the test binary instead of the test suite's time
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(d.dir); }),
            d.manifest + ": is a FIFO, not a regular file (a checkpoint manifest)");
  ::alarm(0);
  fs::remove(d.manifest);
  fs::create_symlink("/dev/zero", d.manifest);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(d.dir); }),
            d.manifest + ": is a character device, not a regular file (a checkpoint manifest)");
  fs::remove(d.manifest);
  fs::create_symlink("nowhere", d.manifest);  // dangling
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(d.dir); }),
            d.manifest + ": missing (a checkpoint manifest)");
}

TEST(ReadManifest, ListedShardsMustBeRegularFilesOfTheirSize) {
  const OnDisk d;
  fs::remove(d.shard);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(d.dir); }),
            d.shard + ": No such file or directory (a shard the manifest lists)");
  ASSERT_EQ(::mkfifo(d.shard.c_str(), 0644), 0);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(d.dir); }),
            d.shard + ": is a FIFO, not a regular file (a shard the manifest lists)");
  fs::remove(d.shard);
  std::ofstream(d.shard, std::ios::binary) << std::string(121, '\0');
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(d.dir); }),
            d.shard + ": 121 bytes, the manifest says 120 (truncated or overwritten)");
}

TEST(ReadRegularFile, ReadsAtMostTheCap) {
  const TempDir td;
  const std::string f = td.write("small", "0123456789");
  EXPECT_EQ(read_regular_file(f, 10, "a test file"), "0123456789");
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_regular_file(f, 9, "a test file"); }),
            f + ": larger than 9 bytes (a test file)");
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_regular_file(td.path(), 9, "a test file"); }),
            td.path() + ": is a directory, not a regular file (a test file)");
}

TEST(StepName, OnlyTheCanonicalSpellingParses) {
  EXPECT_EQ(step_name(20), "step_00000020");
  EXPECT_EQ(parse_step_name("step_00000020"), std::optional<int64_t>(20));
  EXPECT_EQ(parse_step_name("step_123456789"), std::optional<int64_t>(123456789));
  EXPECT_EQ(parse_step_name("step_000000020"), std::nullopt);
  EXPECT_EQ(parse_step_name("step_0000002x"), std::nullopt);
  EXPECT_EQ(parse_step_name("step_999999999999999999"), std::optional<int64_t>(999999999999999999));
  EXPECT_EQ(parse_step_name("step_9999999999999999999"), std::nullopt);  // past int64
}

}  // namespace
}  // namespace keel
