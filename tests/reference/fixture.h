// Header-only reader for the KEELFIX1 parity fixtures written by
// tests/reference/make_fixtures.py. Standard library only.
//
// File format (little-endian):
//   magic "KEELFIX1" (8 bytes); uint32 n_entries; then per entry:
//   uint32 name_len; name bytes (no NUL); uint32 dtype (0=float32, 1=int32,
//   2=float64); uint32 ndim; int64 dims[ndim]; raw element data.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace keel::testing {

struct FixtureEntry {
  static constexpr int kFloat32 = 0;
  static constexpr int kInt32 = 1;
  static constexpr int kFloat64 = 2;

  std::string name;
  int dtype = 0;
  std::vector<int64_t> dims;
  std::vector<double> values;  // every entry, converted to double
  std::vector<float> f32;      // filled only when dtype == kFloat32 (exact stored values)
  std::vector<int32_t> i32;    // filled only when dtype == kInt32

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
};

class Fixture {
 public:
  static Fixture load(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("fixture: cannot open " + path);
    std::vector<unsigned char> buf((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
    if (in.bad()) throw std::runtime_error("fixture: read error in " + path);
    return parse(buf, path);
  }

  bool has(const std::string& name) const { return index_.count(name) != 0; }

  const FixtureEntry& at(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end())
      throw std::runtime_error("fixture: no entry '" + name + "' in " + path_);
    return entries_[it->second];
  }

  // Entry names in file order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(entries_.size());
    for (const auto& e : entries_) out.push_back(e.name);
    return out;
  }

 private:
  struct Reader {
    const std::vector<unsigned char>& buf;
    std::size_t pos;
    const std::string& path;

    void need(std::size_t n) const {
      if (n > buf.size() - pos) throw std::runtime_error("fixture: truncated file " + path);
    }
    uint64_t uint_le(std::size_t nbytes) {
      need(nbytes);
      uint64_t v = 0;
      for (std::size_t i = 0; i < nbytes; ++i) v |= static_cast<uint64_t>(buf[pos + i]) << (8 * i);
      pos += nbytes;
      return v;
    }
    uint32_t u32() { return static_cast<uint32_t>(uint_le(4)); }
    int64_t i64() { return static_cast<int64_t>(uint_le(8)); }
  };

  static Fixture parse(const std::vector<unsigned char>& buf, const std::string& path) {
    static constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'F', 'I', 'X', '1'};
    Fixture fx;
    fx.path_ = path;
    Reader r{buf, 0, path};
    r.need(8);
    if (std::memcmp(buf.data(), kMagic, 8) != 0)
      throw std::runtime_error("fixture: bad magic in " + path);
    r.pos = 8;
    const uint32_t n_entries = r.u32();
    for (uint32_t k = 0; k < n_entries; ++k) {
      FixtureEntry e;
      const uint32_t name_len = r.u32();
      r.need(name_len);
      e.name.assign(reinterpret_cast<const char*>(buf.data() + r.pos), name_len);
      r.pos += name_len;
      const uint32_t dtype = r.u32();
      if (dtype > 2) throw std::runtime_error("fixture: bad dtype for '" + e.name + "' in " + path);
      e.dtype = static_cast<int>(dtype);
      const uint32_t ndim = r.u32();
      if (ndim > 16) throw std::runtime_error("fixture: bad ndim for '" + e.name + "' in " + path);
      uint64_t n = 1;
      for (uint32_t d = 0; d < ndim; ++d) {
        const int64_t dim = r.i64();
        if (dim < 0 || (dim > 0 && n > (uint64_t{1} << 40) / static_cast<uint64_t>(dim)))
          throw std::runtime_error("fixture: bad dims for '" + e.name + "' in " + path);
        e.dims.push_back(dim);
        n *= static_cast<uint64_t>(dim);
      }
      const std::size_t elem = (dtype == FixtureEntry::kFloat64) ? 8 : 4;
      r.need(static_cast<std::size_t>(n) * elem);
      e.values.resize(static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < e.values.size(); ++i) {
        if (dtype == FixtureEntry::kFloat32) {
          const float f = std::bit_cast<float>(static_cast<uint32_t>(r.uint_le(4)));
          e.f32.push_back(f);
          e.values[i] = f;
        } else if (dtype == FixtureEntry::kInt32) {
          const int32_t v = std::bit_cast<int32_t>(static_cast<uint32_t>(r.uint_le(4)));
          e.i32.push_back(v);
          e.values[i] = v;
        } else {
          e.values[i] = std::bit_cast<double>(r.uint_le(8));
        }
      }
      if (fx.index_.count(e.name))
        throw std::runtime_error("fixture: duplicate entry '" + e.name + "' in " + path);
      fx.index_.emplace(e.name, fx.entries_.size());
      fx.entries_.push_back(std::move(e));
    }
    if (r.pos != buf.size()) throw std::runtime_error("fixture: trailing bytes in " + path);
    return fx;
  }

  std::string path_;
  std::vector<FixtureEntry> entries_;
  std::map<std::string, std::size_t> index_;
};

}  // namespace keel::testing
