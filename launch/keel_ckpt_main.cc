// keel-ckpt: look at, check and export checkpoints without training.
//   keel-ckpt info PATH     step, tokens, the parent checkpoint, the layout that wrote it, data
//                           fingerprints, and every tensor with its shape and slices
//   keel-ckpt verify PATH   every file size and every slice's XXH3 checksum and coverage
//   keel-ckpt export PATH OUT_DIR
//                           every parameter, whole and f32, into OUT_DIR/model.safetensors: under
//                           the names of the Hugging Face architecture the model matches exactly
//                           (GPT-2, OLMo 2, Qwen3, Llama) with OUT_DIR/config.json, under keel's
//                           names otherwise (checkpoints/EXPORT.md)
//   keel-ckpt anomaly DIR   one anomaly's evidence (RUN/anomalies/step_N, Note [anomaly evidence]
//                           in launch/train/forensics.cc): its figures, the replay's verdict and
//                           its batch decoded as text; DIR = RUN lists the run's anomalies
// PATH is a checkpoint directory (RUN/checkpoints/step_NNNNNNNN), or RUN/checkpoints or RUN, in
// which case the current checkpoint is taken: the first on LATEST's lineage whose manifest reads
// (Note [lineage], checkpoints/store.h), with a line on stdout for each one skipped. Exit codes:
// 0 fine; 2 bad usage or a bad checkpoint (one line naming the file, the tensor and the reason);
// 1 anything else (an I/O failure writing OUT_DIR).
// Export writes each file under a temporary name in OUT_DIR and renames it into place, so a
// failure part-way leaves the previous export (or nothing) behind.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "checkpoints/export.h"
#include "framework/config/config.h"
#include "framework/data/data_dir.h"
#include "framework/data/fingerprint.h"
#include "framework/data/tokenizer_json.h"
#include "framework/error.h"
#include "framework/file_io.h"

namespace {

namespace fs = std::filesystem;
using keel::ExportNaming;
using keel::ExportPlan;
using keel::ExportTensor;
using keel::HfConfig;

const char* kUsage =
    "usage: keel-ckpt info PATH | keel-ckpt verify PATH | keel-ckpt export PATH OUT_DIR |\n"
    "       keel-ckpt anomaly DIR\n"
    "  PATH  a checkpoint directory (RUN/checkpoints/step_NNNNNNNN), or RUN/checkpoints or RUN\n"
    "        (then the current one: the first on LATEST's lineage that reads)\n"
    "  info    step, tokens, writer layout, data fingerprints, tensors and their slices\n"
    "  verify  every file size and every slice checksum; exit 0 when all hold, 2 otherwise\n"
    "  export  every parameter, whole and f32, into OUT_DIR/model.safetensors (created if\n"
    "          missing); a model that is exactly GPT-2, OLMo 2, Qwen3 or Llama gets that Hugging\n"
    "          Face architecture's names and OUT_DIR/config.json (load with\n"
    "          AutoModelForCausalLM.from_pretrained(OUT_DIR)), any other model keel's names\n"
    "          and a line per architecture saying which options prevent it\n"
    "          (checkpoints/EXPORT.md); a run on a keel-data directory also gets its\n"
    "          tokenizer.json and a tokenizer_config.json (AutoTokenizer.from_pretrained)\n"
    "  anomaly  DIR = RUN/anomalies/step_N: the anomaly's figures, the replay's verdict and the\n"
    "          batch decoded as text (through the run's tokenizer.json, or as bytes); DIR = RUN:\n"
    "          one line per anomaly\n";

std::string step_list(const std::vector<int64_t>& steps) {
  std::string s;
  for (int64_t step : steps) s += (s.empty() ? "" : ", ") + std::to_string(step);
  return s;
}

bool present(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// The current checkpoint of the store at `root` (Note [lineage]): the first on LATEST's lineage
// whose manifest reads. Says on stdout what it skipped and what it ignored.
std::string current_of(const keel::CheckpointStore& store) {
  const std::string& root = store.root();
  const std::vector<int64_t> line = store.lineage();
  const std::vector<int64_t> off = store.off_lineage();
  KEEL_CHECK(!line.empty(), kData, root, ": no committed checkpoint (step_NNNNNNNN directory)");
  if (!store.latest() && present(root + "/LATEST")) {
    std::printf(
        "note: %s/LATEST does not name a committed checkpoint: trying every checkpoint, "
        "newest first\n",
        root.c_str());
  }
  if (!off.empty()) {
    std::printf(
        "note: ignored %zu checkpoint(s) newer than LATEST and not on its lineage "
        "(steps %s)\n",
        off.size(), step_list(off).c_str());
  }
  std::string last;
  for (int64_t step : line) {
    const std::string dir = store.path_of(step);
    try {
      keel::read_manifest(dir);
      return dir;
    } catch (const keel::Error& e) {
      std::printf("skipped %s: %s\n", dir.c_str(), e.what());
      last = e.what();
    }
  }
  KEEL_FAIL(kData, root, ": none of the ", line.size(),
            " checkpoint(s) on LATEST's lineage reads (the oldest: ", last, ")");
}

// A checkpoint directory from what the user typed.
std::string resolve(const std::string& path) {
  if (present(path + "/manifest.pb")) return path;
  for (const std::string& root : {path, path + "/checkpoints"}) {
    const keel::CheckpointStore store(root);
    if (present(root + "/LATEST") || !store.steps().empty()) return current_of(store);
  }
  // Not a checkpoint: let read_manifest name what is missing.
  std::error_code ec;
  KEEL_CHECK(fs::is_directory(path, ec), kUsage, path,
             fs::exists(path, ec) ? ": not a directory" : ": no such directory",
             " (expected a checkpoint directory or a run directory)");
  return path;
}

std::string shape_text(const keel::ckpt::TensorRecord& t) {
  std::string s = "[";
  for (int i = 0; i < t.shape_size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape(i));
  return s + "]";
}

int info(const std::string& dir) {
  const keel::ckpt::Manifest m = keel::read_manifest(dir);
  std::printf("checkpoint %s\n", dir.c_str());
  std::printf("format version %u | step %lld | %lld tokens | next sample %llu | AdamW t %lld\n",
              m.format_version(), static_cast<long long>(m.step()),
              static_cast<long long>(m.tokens()), static_cast<unsigned long long>(m.next_sample()),
              static_cast<long long>(m.adam_t()));
  if (!m.has_parent_step()) {
    std::printf("parent: not recorded (format 1)\n");
  } else if (m.parent_step() < 0) {
    std::printf("parent: none (the first checkpoint of its lineage)\n");
  } else {
    std::printf("parent: step %lld\n", static_cast<long long>(m.parent_step()));
  }
  std::printf("written by %d ranks = dp %d x tp %d%s\n", m.layout().world(), m.layout().dp(),
              m.layout().tp(), m.layout().zero_stage() ? " (ZeRO-1)" : "");
  std::printf("data: train %s, validation %s | skipped ranges %d\n",
              keel::fingerprint_hex(m.train_fingerprint()).c_str(),
              keel::fingerprint_hex(m.val_fingerprint()).c_str(), m.skipped_size());
  int64_t bytes = 0;
  for (const auto& f : m.files()) bytes += f.bytes();
  std::printf("%d shard files, %lld bytes\n", m.files_size(), static_cast<long long>(bytes));
  int64_t params = 0;
  for (const auto& t : m.tensors()) {
    int64_t n = 1;
    for (int64_t d : t.shape()) n *= d;
    if (t.kind() == keel::ckpt::PARAM) params += n;
    std::printf("  %-28s %-7s %-5s %-18s %d slice(s)\n", t.name().c_str(),
                keel::tensor_kind_name(t.kind()), t.dtype().c_str(), shape_text(t).c_str(),
                t.slices_size());
  }
  std::printf("%lld parameters\n", static_cast<long long>(params));
  return 0;
}

int verify(const std::string& dir) {
  keel::verify_checkpoint(dir);
  const keel::ckpt::Manifest m = keel::read_manifest(dir);
  int slices = 0;
  for (const auto& t : m.tensors()) slices += t.slices_size();
  int64_t bytes = 0;
  for (const auto& f : m.files()) bytes += f.bytes();
  std::printf("%s: ok (step %lld, %d tensors, %d slices, %lld bytes checked)\n", dir.c_str(),
              static_cast<long long>(m.step()), m.tensors_size(), slices,
              static_cast<long long>(bytes));
  return 0;
}

// ---- export ------------------------------------------------------------------------------------

static_assert(std::endian::native == std::endian::little,
              "safetensors and keel's shards are little-endian; export copies floats as they are");

// A file written under a temporary name beside `path` and renamed over it by commit(); the
// temporary is removed if commit() is never reached (an error part-way leaves nothing behind).
class StagedFile {
 public:
  explicit StagedFile(std::string path) : path_(std::move(path)) {
    tmp_ = path_ + ".tmp." + std::to_string(::getpid());
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    KEEL_CHECK(fd_ >= 0, kIo, tmp_, ": cannot create: ", std::strerror(errno));
  }
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;
  ~StagedFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    for (size_t done = 0; done < n;) {
      const ssize_t w = ::write(fd_, p + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      KEEL_CHECK(w > 0, kIo, tmp_, ": write failed: ", std::strerror(w < 0 ? errno : ENOSPC));
      done += static_cast<size_t>(w);
    }
    bytes_ += static_cast<int64_t>(n);
  }
  // fsync, rename over `path`, fsync the directory.
  void commit() {
    KEEL_CHECK(::fsync(fd_) == 0, kIo, tmp_, ": fsync failed: ", std::strerror(errno));
    const int rc = ::close(fd_);
    fd_ = -1;
    KEEL_CHECK(rc == 0, kIo, tmp_, ": write failed: ", std::strerror(errno));
    KEEL_CHECK(::rename(tmp_.c_str(), path_.c_str()) == 0, kIo, path_,
               ": cannot rename the temporary file into place: ", std::strerror(errno));
    committed_ = true;
    const int dfd = ::open(fs::path(path_).parent_path().c_str(), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }
  int64_t bytes() const { return bytes_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
  int64_t bytes_ = 0;
};

// A float as the shortest decimal that reads back as it (1e-05f -> 1e-05, not 9.99999974e-06).
double shortest_decimal(float f) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), f);
  return std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
}

// The safetensors header (github.com/huggingface/safetensors, "Format"): a JSON object mapping each
// tensor's name to its dtype, shape and [begin, end) byte offsets in the data that follows (back
// to back, no holes), plus "__metadata__" (string -> string); padded with spaces to a multiple
// of 8 bytes so the data is aligned. The file is the header's length (u64, little-endian), the
// header, the data.
std::string safetensors_header(const ExportPlan& plan,
                               const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h;
  h["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const ExportTensor& t : plan.tensors) {
    const int64_t bytes = keel::shape_numel(t.shape) * static_cast<int64_t>(sizeof(float));
    h[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string s = h.dump();
  s.append((8 - s.size() % 8) % 8, ' ');
  return s;
}

// Hugging Face GPT2Config (transformers/models/gpt2/configuration_gpt2.py) for keel's model.
nlohmann::ordered_json gpt2_config(const HfConfig& g) {
  return {
      {"model_type", "gpt2"},
      {"architectures", {"GPT2LMHeadModel"}},
      {"vocab_size", g.vocab_size},
      {"n_positions", g.max_positions},
      {"n_embd", g.hidden_size},
      {"n_layer", g.num_layers},
      {"n_head", g.num_heads},
      {"n_inner", g.intermediate_size},
      {"activation_function", g.activation},
      {"layer_norm_epsilon", shortest_decimal(g.norm_eps)},
      // keel scales q.k by 1/sqrt(head_dim) and nothing else.
      {"scale_attn_weights", true},
      {"scale_attn_by_inverse_layer_idx", false},
      {"reorder_and_upcast_attn", false},
      // keel trains without dropout.
      {"resid_pdrop", 0.0},
      {"embd_pdrop", 0.0},
      {"attn_pdrop", 0.0},
      {"tie_word_embeddings", true},
      {"initializer_range", shortest_decimal(g.initializer_range)},
      // keel's vocabulary has no special tokens (GPT2Config's default 50256 may not even exist).
      {"bos_token_id", nullptr},
      {"eos_token_id", nullptr},
      {"torch_dtype", "float32"}};
}

// Hugging Face Olmo2Config / Qwen3Config / LlamaConfig
// (transformers/models/{olmo2,qwen3,llama}/configuration_*.py).
nlohmann::ordered_json llama_like_config(ExportNaming arch, const HfConfig& g) {
  const bool qwen3 = arch == ExportNaming::kQwen3, llama = arch == ExportNaming::kLlama;
  const char* architecture = qwen3   ? "Qwen3ForCausalLM"
                             : llama ? "LlamaForCausalLM"
                                     : "Olmo2ForCausalLM";
  nlohmann::ordered_json c = {
      {"model_type", keel::naming_id(arch)},
      {"architectures", {architecture}},
      {"vocab_size", g.vocab_size},
      {"hidden_size", g.hidden_size},
      {"intermediate_size", g.intermediate_size},
      {"num_hidden_layers", g.num_layers},
      {"num_attention_heads", g.num_heads},
      // model.n_kv_heads: query head j reads k/v head j / (num_attention_heads /
      // num_key_value_heads), as transformers' repeat_kv does.
      {"num_key_value_heads", g.num_kv_heads},
  };
  // Qwen3Config's head_dim defaults to 128 whatever the width, LlamaConfig's to hidden_size /
  // num_attention_heads; both take keel's. OLMo 2 derives it from the width (export requires
  // model.head_dim to be that).
  if (arch != ExportNaming::kOlmo2) c["head_dim"] = g.head_dim;
  c["hidden_act"] = g.activation;
  c["max_position_embeddings"] = g.max_positions;
  // transformers < 5 reads rope_theta (and rope_scaling); 5 reads rope_parameters.
  c["rope_theta"] = g.rope_theta;
  c["rope_scaling"] = nullptr;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", g.rope_theta}};
  // One epsilon for the block, final and QK norms, as keel (checkpoints/EXPORT.md).
  c["rms_norm_eps"] = shortest_decimal(g.norm_eps);
  // keel's qkv and output projections have no bias (model.bias=false).
  c["attention_bias"] = false;
  c["attention_dropout"] = 0.0;
  if (llama) {
    // ... nor its MLP; and no tensor-parallel slicing of the weights (Llama 2's pretraining_tp).
    c["mlp_bias"] = false;
    c["pretraining_tp"] = 1;
  }
  if (qwen3) {
    // Full causal attention in every layer.
    c["use_sliding_window"] = false;
    c["sliding_window"] = nullptr;
    c["max_window_layers"] = g.num_layers;
  }
  c["tie_word_embeddings"] = g.tie_word_embeddings;
  c["initializer_range"] = shortest_decimal(g.initializer_range);
  // keel's vocabulary has no special tokens (Olmo2Config's pad 1 and eos 50279, LlamaConfig's bos
  // 1 and eos 2, are their tokenizers').
  c["pad_token_id"] = nullptr;
  c["bos_token_id"] = nullptr;
  c["eos_token_id"] = nullptr;
  c["use_cache"] = true;
  c["torch_dtype"] = "float32";
  return c;
}

std::string config_json(const ExportPlan& plan) {
  const nlohmann::ordered_json c = plan.naming == ExportNaming::kGpt2
                                       ? gpt2_config(plan.hf)
                                       : llama_like_config(plan.naming, plan.hf);
  return c.dump(2) + "\n";
}

// The run's tokenizer beside the model, when it trained on a keel-data directory that is still
// where its data.path says: OUT_DIR/tokenizer.json (a copy) and OUT_DIR/tokenizer_config.json
// (the fast tokenizer class and the end-of-text token), so AutoTokenizer.from_pretrained(OUT_DIR)
// loads it. Returns the data directory, or "" when there is none.
std::string export_tokenizer(const keel::ckpt::Manifest& m, const std::string& out_dir) {
  const std::string data_dir = keel::data_dir_of(m.config().data().path());
  std::error_code ec;
  const fs::path tok = fs::path(data_dir) / keel::kDataDirTokenizer;
  if (data_dir.empty() || !fs::exists(tok, ec)) return "";
  std::ifstream in(tok, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  KEEL_CHECK(in.good() || in.eof(), kIo, tok.string(), ": cannot read");
  std::string eot = "<|endoftext|>";
  try {
    std::ifstream meta(fs::path(data_dir) / keel::kDataDirMetadata);
    const nlohmann::json j = nlohmann::json::parse(meta);
    eot = j.at("end_of_text").at("token").get<std::string>();
  } catch (const nlohmann::json::exception&) {
    // keel-data's metadata names it; without it, keel-data's own token
  }
  nlohmann::ordered_json cfg = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                                {"bos_token", eot},
                                {"eos_token", eot},
                                {"model_max_length", m.config().model().seq_len()}};
  keel::write_file_atomic(out_dir + "/tokenizer.json", text.str());
  keel::write_file_atomic(out_dir + "/tokenizer_config.json", cfg.dump(2) + "\n");
  return data_dir;
}

int export_checkpoint(const std::string& dir, const std::string& out_dir) {
  const keel::ckpt::Manifest m = keel::read_manifest(dir);
  const ExportPlan plan = keel::plan_export(dir, m);
  std::error_code ec;
  const bool existed = fs::exists(out_dir, ec);
  if (existed) {
    KEEL_CHECK(fs::is_directory(out_dir, ec), kUsage, out_dir,
               ": exists and is not a directory (OUT_DIR is the directory model.safetensors is "
               "written to)");
  } else {
    fs::create_directories(out_dir, ec);
    KEEL_CHECK(!ec, kIo, out_dir, ": cannot create: ", ec.message());
  }
  const bool hf = plan.naming != ExportNaming::kKeel;
  const std::string model_path = out_dir + "/model.safetensors";
  const std::string config_path = out_dir + "/config.json";
  int64_t params = 0, bytes = 0;
  bool removed_config = false;
  std::string tokenizer_from;
  try {
    const std::map<std::string, std::string> metadata = {
        {"format", "pt"},  // transformers refuses a safetensors file without it
        {"keel.step", std::to_string(m.step())},
        {"keel.checkpoint_format_version", std::to_string(m.format_version())},
        {"keel.source", fs::absolute(dir).lexically_normal().string()},
        {"keel.naming", keel::naming_id(plan.naming)},
        {"keel.vocab_size", std::to_string(m.config().model().vocab_size())}};
    const std::string header = safetensors_header(plan, metadata);
    StagedFile file(model_path);
    const uint64_t header_len = header.size();
    file.write(&header_len, sizeof(header_len));
    file.write(header.data(), header.size());
    for (const ExportTensor& t : plan.tensors) {
      const std::vector<float> values = keel::export_values(dir, m, t);
      file.write(values.data(), values.size() * sizeof(float));
      params += static_cast<int64_t>(values.size());
    }
    file.commit();
    bytes = file.bytes();
    if (hf) {
      keel::write_file_atomic(config_path, config_json(plan));
    } else if (fs::exists(config_path, ec)) {
      // An earlier Hugging Face export's config.json would describe tensors this file no longer
      // has.
      fs::remove(config_path, ec);
      KEEL_CHECK(!ec, kIo, config_path,
                 ": cannot remove the config.json of an earlier export: ", ec.message());
      removed_config = true;
    }
    tokenizer_from = export_tokenizer(m, out_dir);
  } catch (...) {
    if (!existed) fs::remove(out_dir, ec);  // only when still empty
    throw;
  }
  if (!hf) {
    std::printf("keel names, no config.json%s: no Hugging Face architecture matches exactly\n",
                removed_config ? " (removed the earlier one)" : "");
    for (const auto& [arch, why] : plan.mismatches) {
      std::printf("  not %s: %s\n", keel::naming_title(arch), why.c_str());
    }
  }
  const std::string what = std::string(" (") + keel::naming_title(plan.naming) + " names)" +
                           (hf ? " and " + config_path : "");
  std::printf("exported step %lld of %s: %zu tensors, %lld parameters, %lld bytes -> %s%s\n",
              static_cast<long long>(m.step()), dir.c_str(), plan.tensors.size(),
              static_cast<long long>(params), static_cast<long long>(bytes), model_path.c_str(),
              what.c_str());
  if (!tokenizer_from.empty()) {
    std::printf("tokenizer.json and tokenizer_config.json from %s -> %s\n", tokenizer_from.c_str(),
                out_dir.c_str());
  }
  return 0;
}

// keel-ckpt anomaly: Note [anomaly evidence] (launch/train/forensics.cc).
nlohmann::json read_summary(const fs::path& dir) {
  const fs::path file = dir / "summary.json";
  std::ifstream in(file);
  KEEL_CHECK(in.good(), kUsage, dir.string(),
             ": not an anomaly directory (no summary.json; expected RUN/anomalies/step_N or RUN)");
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    KEEL_FAIL(kData, file.string(), ": not JSON: ", e.what());
  }
}

std::string shown_text(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) {
    if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7f) {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\x%02x", c);
      out += esc;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

int anomaly(const std::string& path) {
  const fs::path dir(path);
  std::error_code ec;
  if (fs::is_directory(dir / "anomalies", ec)) {
    std::vector<fs::path> steps;
    for (const auto& e : fs::directory_iterator(dir / "anomalies")) steps.push_back(e.path());
    std::sort(steps.begin(), steps.end());
    std::printf("%zu anomal%s in %s\n", steps.size(), steps.size() == 1 ? "y" : "ies",
                (dir / "anomalies").c_str());
    for (const fs::path& p : steps) {
      const nlohmann::json j = read_summary(p);
      std::printf("  %s  step %lld  %s  replay %s%s\n", p.filename().c_str(), j.value("step", 0LL),
                  j.value("kind", "").c_str(), j.value("replay", "").c_str(),
                  j.value("ranks", "").empty() ? "" : (" (" + j.value("ranks", "") + ")").c_str());
    }
    return 0;
  }
  const nlohmann::json j = read_summary(dir);
  auto num = [&](const char* key) {
    return j.contains(key) && j[key].is_number() ? j[key].get<double>() : std::nan("");
  };
  std::printf("step %lld: %s; replay: %s%s\n", j.value("step", 0LL), j.value("kind", "").c_str(),
              j.value("replay", "").c_str(),
              j.value("ranks", "").empty() ? "" : (" (" + j.value("ranks", "") + ")").c_str());
  std::printf(
      "  loss %.6g (replay %.6g), gradient norm %.6g (replay %.6g), z-loss %.6g, log Z %.6g\n",
      num("loss"), num("replay_loss"), num("grad_norm"), num("replay_grad_norm"), num("z_loss"),
      num("log_z"));
  auto top = [&](const char* key, const char* what) {
    if (!j.contains(key) || !j[key].is_array() || j[key].empty()) return;
    size_t best = 0;
    for (size_t i = 0; i < j[key].size(); ++i) {
      if (j[key][i].is_number() &&
          (!j[key][best].is_number() || j[key][i].get<double>() > j[key][best].get<double>())) {
        best = i;
      }
    }
    std::string all;
    for (const auto& v : j[key]) {
      char b[32];
      std::snprintf(b, sizeof(b), "%s%.4g", all.empty() ? "" : " ",
                    v.is_number() ? v.get<double>() : std::nan(""));
      all += b;
    }
    std::printf("  %s per block: %s (largest: block %zu)\n", what, all.c_str(), best);
  };
  top("max_attn_logit_layers", "max attention logit");
  top("grad_norm_layers", "gradient norm (last: outside the blocks)");
  top("act_norm_layers", "output norm");
  // The batch: int32 ids [batch, seq_len], decoded through the run's tokenizer.json when its data
  // has one, else as bytes.
  const int64_t seq_len = j.value("seq_len", 0LL);
  std::ifstream in(dir / "tokens.bin", std::ios::binary);
  std::vector<int32_t> ids;
  for (int32_t id; in.read(reinterpret_cast<char*>(&id), sizeof(id));) ids.push_back(id);
  KEEL_CHECK(seq_len > 0 && !ids.empty() && ids.size() % static_cast<size_t>(seq_len) == 0, kData,
             (dir / "tokens.bin").string(), ": ", ids.size(), " token ids, not a whole batch of ",
             seq_len);
  std::optional<keel::TokenizerJson> tok;
  const fs::path run = dir.parent_path().parent_path();
  if (fs::exists(run / "config.pbtxt", ec)) {
    const auto cfg = keel::load_config((run / "config.pbtxt").string(), {});
    const std::string data_dir = keel::data_dir_of(cfg.data().path());
    const fs::path t = fs::path(data_dir) / keel::kDataDirTokenizer;
    if (!data_dir.empty() && fs::exists(t, ec)) tok = keel::TokenizerJson::load(t.string());
  }
  const size_t n = ids.size() / static_cast<size_t>(seq_len);
  std::printf("  batch: %zu samples of %lld tokens from sample %lld, decoded %s:\n", n,
              static_cast<long long>(seq_len), j.value("first_sample", 0LL),
              tok ? "through the run's tokenizer.json" : "as bytes");
  for (size_t i = 0; i < n; ++i) {
    std::vector<int32_t> row(ids.begin() + static_cast<int64_t>(i) * seq_len,
                             ids.begin() + static_cast<int64_t>(i + 1) * seq_len);
    std::string bytes;
    if (tok) {
      bytes = tok->decode(row);
    } else {
      for (int32_t id : row) bytes += static_cast<char>(id & 0xff);
    }
    const auto offsets = j.value("sample_offsets", std::vector<long long>{});
    std::printf("  [%zu] offset %lld: %s\n", i, i < offsets.size() ? offsets[i] : -1LL,
                shown_text(bytes).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "-h" || cmd == "--help") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (cmd == "anomaly") {
      KEEL_CHECK(argc == 3, kUsage, "expected 'anomaly DIR' (see --help)");
      return anomaly(argv[2]);
    }
    KEEL_CHECK((argc == 3 && (cmd == "info" || cmd == "verify")) || (argc == 4 && cmd == "export"),
               kUsage,
               "expected 'info PATH', 'verify PATH', 'export PATH OUT_DIR' or 'anomaly DIR' (see "
               "--help)");
    const std::string dir = resolve(argv[2]);
    if (cmd == "export") return export_checkpoint(dir, argv[3]);
    return cmd == "info" ? info(dir) : verify(dir);
  } catch (const keel::Error& e) {
    std::fprintf(stderr, "keel-ckpt: %s: %s\n", keel::error_kind_name(e.kind()), e.what());
    return keel::exit_code_for(e.kind());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel-ckpt: internal error: %s\n", e.what());
    return 1;
  }
}
