// keel-ckpt export through the real binaries, checked by tests/launch/export_check.py with the
// real safetensors and transformers libraries and tests/launch/hf_reference.py:
//   - a GPT-2-shaped model trained at TP2xDP2 with ZeRO-1 exports Hugging Face GPT-2 names and a
//     config.json; GPT2LMHeadModel.from_pretrained(OUT_DIR) loads it with no missing or unexpected
//     weights and its logits on fixed tokens equal keel's to 1e-5 (absolute), every exported
//     tensor equals the checkpoint's parameter bit for bit in GPT-2's layout, and the vocabulary
//     padding of the TP2 layout (300 -> 384 rows) is gone;
//   - an OLMo 2-style model (TP2xDP2, ZeRO-1: the PROJECTION QK-norm's statistics span both TP
//     ranks) and a Qwen3-style model (TP2) export Olmo2ForCausalLM / Qwen3ForCausalLM names and
//     config.json; an independent float64 implementation of each architecture reading only the
//     export gives keel's logits to 1e-5, on the trained weights and with q and k made so small
//     that the QK-norm epsilon matters, while interleaved RoPE, another rope_theta and another
//     QK-norm epsilon miss by far more;
//   - a model no architecture expresses (RMS QK-norm per head, RMSNorm, untied head, RoPE, GEGLU,
//     no biases) exports keel's names with the same bit-for-bit values, no config.json, and a line
//     per architecture naming each field that prevents it;
//   - bad input (not a checkpoint, a flipped byte in a parameter slice, OUT_DIR a regular file,
//     a missing argument) exits 2 with one line naming the file and the reason, and leaves no
//     model.safetensors, no temporary file, and an earlier export untouched.
// keel's side of each comparison is the checkpoint loaded by load_checkpoint into a one-process
// model: its parameters (written out raw) and its logits on the same tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "checkpoints/train_state.h"
#include "framework/optim/optimizer.h"
#include "layers/gpt.h"
#include "parallel/zero_partition.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::command_line;
using testing::CommandResult;
using testing::read_file;
using testing::run_command;
using testing::shell_quote;
using testing::TempDir;

// Not a multiple of 64 x 2: the TP2 layout stores 384 vocabulary rows and export keeps 300.
constexpr int kVocab = 300;
constexpr int kBatch = 2, kSeqLen = 16;

// A small job; `extra` picks the model. A large init_std and learning rate make every weight
// and bias matter to the logits (a misplaced bias or a wrong GELU shows far above 1e-5).
std::vector<std::string> job(const std::string& run_dir, std::vector<std::string> extra) {
  std::vector<std::string> args = {"--set",     "model.vocab_size=" + std::to_string(kVocab),
                                   "--set",     "model.seq_len=" + std::to_string(kSeqLen),
                                   "--set",     "model.d_model=32",
                                   "--set",     "model.n_heads=4",
                                   "--set",     "model.init_std=0.2",
                                   "--set",     "train.global_batch=4",
                                   "--set",     "data.builtin_bytes=50000",
                                   "--set",     "train.eval_every=0",
                                   "--set",     "train.sample_chars=0",
                                   "--set",     "train.threads=1",
                                   "--set",     "optim.lr=1e-2",
                                   "--set",     "optim.warmup_steps=0",
                                   "--run-dir", run_dir};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// keel-train on `ranks` processes (1: no mpiexec).
CommandResult train(const TempDir& dir, int ranks, const std::vector<std::string>& args) {
  std::string cmd = command_line(KEEL_TRAIN_BIN, args);
  if (ranks > 1) {
    cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " +
          shell_quote(KEEL_MPIEXEC) + " -n " + std::to_string(ranks) +
          " --oversubscribe --bind-to none " + cmd;
  }
  return run_command(cmd, dir);
}

CommandResult ckpt(const TempDir& dir, const std::vector<std::string>& args) {
  return run_command(command_line(KEEL_CKPT_BIN, args), dir);
}

// Runs export_check.py; a missing venv is a failure, never a skip.
CommandResult check_export(const TempDir& dir, const std::string& naming, const std::string& out,
                           const std::string& ref) {
  const bool have_python = fs::exists(KEEL_TEST_PYTHON);
  EXPECT_TRUE(have_python) << KEEL_TEST_PYTHON
                           << " is missing: run tests/run, which makes the venv this test needs";
  if (!have_python) return {};
  const std::string script = std::string(KEEL_SOURCE_DIR) + "/tests/launch/export_check.py";
  return run_command(command_line(KEEL_TEST_PYTHON, {script, naming, out, ref}), dir);
}

// The figure export_check.py printed after `label` ("max |logit difference| = "). The script
// asserts its bound itself; reading the figure back means a script that stopped comparing
// cannot pass.
double printed_diff(const std::string& out, const std::string& label) {
  const size_t at = out.find(label);
  EXPECT_NE(at, std::string::npos) << out;
  return at == std::string::npos ? 1e30 : std::stod(out.substr(at + label.size()));
}

// q and k rows of every qkv weight times this for logits_qk_small.f32: a power of two (exact in
// float), small enough that mean(q^2) ~ 1e-6 is below the QK-norm epsilon (1e-5).
constexpr float kQkScale = 1.0f / 1024.0f;

// Writes keel's side into `ref`: the checkpoint in `ckpt_dir` loaded into a one-process model,
// its parameters (ref.txt lists "param NAME DIMS..."; param_<i>.f32 holds the i-th), fixed tokens
// (tokens.i32, [B, T], "tokens B T" in ref.txt) and the model's logits on them (logits.f32, [B, T,
// vocab_size]). With QK-norm, also the logits with the q and k rows of every qkv weight times
// kQkScale (logits_qk_small.f32, "qk_scale S" in ref.txt).
void write_reference(const std::string& ckpt_dir, const std::string& ref) {
  fs::create_directories(ref);
  const ckpt::Manifest m = read_manifest(ckpt_dir);
  config::KeelConfig cfg = m.config();
  const int64_t V = cfg.model().vocab_size();
  // One process stores exactly vocab_size rows; the writer's layout padded them. A model of the
  // padded vocabulary loads the checkpoint as it is, and for tokens < V its first V logits are
  // the model's (the padding rows are never looked up).
  int64_t rows = 0;
  for (const ckpt::TensorRecord& t : m.tensors()) {
    if (t.name() == "wte" && t.kind() == ckpt::PARAM) rows = t.shape(0);
  }
  ASSERT_GT(rows, V) << "the test wants a padded vocabulary";
  cfg.mutable_model()->set_vocab_size(static_cast<int32_t>(rows));
  cfg.mutable_parallel()->set_tp(1);
  cfg.mutable_parallel()->set_zero_stage(0);
  std::unique_ptr<Communicator> tp_holder, dp_holder;
  const Topology topo = Topology::single(tp_holder, dp_holder);
  GPT model(cfg, topo, kBatch);
  ParamStore& ps = model.params();
  AdamW opt(cfg.optim(), ps.total_elems(), {{0, ps.total_elems(), true}});
  TrainState state(ps, opt, ZeroPartition(ps.total_elems(), 1, 0, false));
  load_checkpoint(ckpt_dir, state);

  std::string listing = "vocab " + std::to_string(V) + "\n";
  for (int id = 0; id < ps.size(); ++id) {
    const ParamInfo& info = ps.info(id);
    // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on `" " + std::to_string(d)`.
    listing += "param ";
    listing += info.spec.name;
    for (int64_t d : info.spec.logical) {
      listing += ' ';
      listing += std::to_string(d);
    }
    listing += '\n';
    testing::write_file(ref + "/param_" + std::to_string(id) + ".f32",
                        std::string(reinterpret_cast<const char*>(ps.param(id)),
                                    static_cast<size_t>(info.numel()) * sizeof(float)));
  }
  listing += "tokens " + std::to_string(kBatch) + " " + std::to_string(kSeqLen) + "\n";
  const bool qk_norm = cfg.model().qk_norm() != config::NONE;
  if (qk_norm) {
    char scale[32];
    std::snprintf(scale, sizeof(scale), "%.17g", kQkScale);  // exact: a power of two
    listing += "qk_scale " + std::string(scale) + "\n";
  }
  testing::write_file(ref + "/ref.txt", listing);

  std::vector<int32_t> tokens(kBatch * kSeqLen);
  for (int i = 0; i < kBatch * kSeqLen; ++i) tokens[i] = (i * 67 + 5) % V;
  tokens[3] = static_cast<int32_t>(V - 1);  // the last real row
  testing::write_file(ref + "/tokens.i32", std::string(reinterpret_cast<const char*>(tokens.data()),
                                                       tokens.size() * sizeof(int32_t)));
  auto write_logits = [&](const std::string& path) {
    model.forward(tokens.data(), nullptr, kBatch);
    std::vector<float> logits;
    for (int i = 0; i < kBatch * kSeqLen; ++i) {
      logits.insert(logits.end(), model.logits().f32() + i * rows,
                    model.logits().f32() + i * rows + V);
    }
    testing::write_file(path, std::string(reinterpret_cast<const char*>(logits.data()),
                                          logits.size() * sizeof(float)));
  };
  write_logits(ref + "/logits.f32");
  if (!qk_norm) return;
  // q and k: the first two thirds of qkv.weight [3, H, D, C]; with grouped-query attention all of
  // q.weight [H, D, C] and the first half of kv.weight [2, Hkv, D, C].
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (int id = 0; id < ps.size(); ++id) {
    const std::string& name = ps.info(id).spec.name;
    const int64_t n = ps.info(id).numel();
    const int64_t scaled = ends_with(name, ".attn.qkv.weight")  ? n / 3 * 2
                           : ends_with(name, ".attn.q.weight")  ? n
                           : ends_with(name, ".attn.kv.weight") ? n / 2
                                                                : 0;
    for (int64_t i = 0; i < scaled; ++i) ps.param(id)[i] *= kQkScale;
  }
  write_logits(ref + "/logits_qk_small.f32");
}

// Names in `dir` other than `keep` (temporary files, half-written exports).
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(CkptExport, Gpt2ShapedModelLoadsInTransformersWithKeelsLogits) {
  TempDir dir("keel_export_gpt2");
  const std::string run = dir.file("run"), out = dir.file("hf"), ref = dir.file("ref");
  const CommandResult t =
      train(dir, 4,
            job(run, {"--set", "model.qk_norm=NONE", "--set", "model.n_layers=2", "--set",
                      "model.d_ff=48", "--set", "model.max_positions=24", "--set", "train.steps=4",
                      "--set", "checkpoint.every=2", "--set", "parallel.tp=2", "--set",
                      "parallel.zero_stage=1"}));
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;
  const std::string step4 = run + "/checkpoints/step_00000004";

  const CommandResult e = ckpt(dir, {"export", run, out});  // the run directory: LATEST
  ASSERT_EQ(e.exit_code, 0) << e.out << e.err;
  // 2 embeddings + 12 per block + ln_f's 2; the tied LM head has no tensor of its own.
  EXPECT_EQ(e.out, "exported step 4 of " + step4 + ": 28 tensors, " + "25440 parameters, " +
                       std::to_string(fs::file_size(out + "/model.safetensors")) + " bytes -> " +
                       out + "/model.safetensors (GPT-2 names) and " + out + "/config.json\n");
  EXPECT_EQ(entries(out), (std::vector<std::string>{"config.json", "model.safetensors"}));

  write_reference(step4, ref);
  const CommandResult c = check_export(dir, "gpt2", out, ref);
  ASSERT_EQ(c.exit_code, 0) << c.out << c.err;
  std::printf("%s", c.out.c_str());
  const double diff = printed_diff(c.out, "max |logit difference| = ");
  EXPECT_LE(diff, 1e-5);
  RecordProperty("max_logit_abs_diff", std::to_string(diff));
}

// The modern blocks' options; `scope` and `placement` pick OLMo 2 or Qwen3.
std::vector<std::string> modern(const std::string& scope, const std::string& placement,
                                const std::string& theta, const std::string& tied) {
  return {"--set", "model.qk_norm=RMS",
          "--set", "model.qk_norm_scope=" + scope,
          "--set", "model.norm=RMSNORM",
          "--set", "model.position=ROPE",
          "--set", "model.rope_theta=" + theta,
          "--set", "model.mlp=SWIGLU",
          "--set", "model.bias=false",
          "--set", "model.norm_placement=" + placement,
          "--set", "model.tie_embeddings=" + tied,
          "--set", "model.n_layers=2",
          "--set", "model.d_ff=48",
          "--set", "train.steps=4",
          "--set", "checkpoint.every=2"};
}

// Llama's block: the modern options without QK-norm, pre-norm.
std::vector<std::string> llama(const std::string& theta, const std::string& tied) {
  std::vector<std::string> args = modern("HEAD_SHARED", "PRE", theta, tied);
  args[1] = "model.qk_norm=NONE";
  return args;
}

// `n` sentences of invented words (nothing copied from anywhere): a corpus for keel-data.
std::string invented_text(int n, unsigned seed) {
  static const char* syllables[] = {"ka",  "lo",  "mi",  "re",  "su",  "ta",
                                    "ven", "dor", "pli", "qua", "zen", "ith"};
  std::mt19937 rng(seed);
  std::string out;
  for (int s = 0; s < n; ++s) {
    const int words = 4 + static_cast<int>(rng() % 9);
    for (int w = 0; w < words; ++w) {
      for (int p = 0, parts = 1 + static_cast<int>(rng() % 3); p < parts; ++p) {
        out += syllables[rng() % std::size(syllables)];
      }
      out += w + 1 < words ? " " : ".\n";
    }
  }
  return out;
}

struct ExportCase {
  std::string naming;  // export_check.py's: olmo2, qwen3, llama
  std::string title;   // what keel-ckpt calls the names
  int ranks = 1;
  std::vector<std::string> args;
  size_t tensors = 0;           // how many keel-ckpt writes
  bool tokenizer_data = false;  // train on a keel-data directory (vocabulary 300, tokenizer.json)
};

// Trains the case's model on `ranks` processes, exports it, and checks the export against keel's
// logits with export_check.py: OLMo 2 and Qwen3 through hf_reference.py, Llama through
// transformers. With tokenizer_data, the data is a keel-data directory and the export carries its
// tokenizer, which AutoTokenizer must load.
void check_llama_like(const ExportCase& c) {
  TempDir dir("keel_export_" + c.naming);
  const std::string run = dir.file("run"), out = dir.file("hf"), ref = dir.file("ref");
  std::vector<std::string> args = c.args;
  std::string data;
  if (c.tokenizer_data) {
    ASSERT_TRUE(fs::exists(KEEL_TEST_PYTHON)) << KEEL_TEST_PYTHON << " is missing: run tests/run";
    fs::create_directories(dir.file("corpus"));
    dir.write("corpus/a.txt", invented_text(80, 29));
    dir.write("corpus/b.txt", invented_text(40, 30));
    data = dir.file("data");
    const CommandResult d = run_command(
        command_line(KEEL_TEST_PYTHON,
                     {std::string(KEEL_SOURCE_DIR) + "/launch/tools/keel-data", dir.file("corpus"),
                      "--out", data, "--vocab-size", std::to_string(kVocab), "--workers", "1"}),
        dir);
    ASSERT_EQ(d.exit_code, 0) << d.out << d.err;
    args.insert(args.end(), {"--set", "data.path=" + data});
  }
  const CommandResult t = train(dir, c.ranks, job(run, std::move(args)));
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;
  const std::string step4 = run + "/checkpoints/step_00000004";
  const CommandResult e = ckpt(dir, {"export", run, out});
  ASSERT_EQ(e.exit_code, 0) << e.out << e.err;
  const std::string head =
      "exported step 4 of " + step4 + ": " + std::to_string(c.tensors) + " tensors, ";
  EXPECT_EQ(e.out.rfind(head, 0), 0u) << e.out;
  EXPECT_TRUE(contains(e.out, " -> " + out + "/model.safetensors (" + c.title + " names) and " +
                                  out + "/config.json\n"))
      << e.out;
  if (c.tokenizer_data) {
    EXPECT_TRUE(contains(e.out, "tokenizer.json and tokenizer_config.json from " + data)) << e.out;
    EXPECT_EQ(entries(out), (std::vector<std::string>{"config.json", "model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"}));
  } else {
    EXPECT_EQ(entries(out), (std::vector<std::string>{"config.json", "model.safetensors"}));
  }

  write_reference(step4, ref);
  const CommandResult r = check_export(dir, c.naming, out, ref);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::printf("%s", r.out.c_str());
  const double diff = printed_diff(r.out, "max |logit difference| = ");
  EXPECT_LE(diff, 1e-5);
  ::testing::Test::RecordProperty("max_logit_abs_diff", std::to_string(diff));
  if (c.naming != "llama") {
    const double small = printed_diff(r.out, "): max |logit difference| = ");
    EXPECT_LE(small, 1e-5);
    ::testing::Test::RecordProperty("max_logit_abs_diff_small_qk", std::to_string(small));
  }
  if (c.tokenizer_data) {
    EXPECT_TRUE(contains(r.out, "tokenizer: 300 tokens")) << r.out;
  }
}

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(CkptExport, Olmo2StyleModelGivesKeelsLogitsInAnIndependentOlmo2) {
  // TP2 x DP2 with ZeRO-1, untied: embed_tokens, 11 per layer, the final norm, lm_head.
  check_llama_like(
      {"olmo2", "OLMo 2", 4,
       modern("PROJECTION", "POST_SUBLAYER", "500000", "false") +
           std::vector<std::string>{"--set", "parallel.tp=2", "--set", "parallel.zero_stage=1"},
       1 + 11 * 2 + 2});
}

TEST(CkptExport, Qwen3StyleModelGivesKeelsLogitsInAnIndependentQwen3) {
  // TP2, tied: no lm_head tensor.
  check_llama_like({"qwen3", "Qwen3", 2,
                    modern("HEAD_SHARED", "PRE", "1000000", "true") +
                        std::vector<std::string>{"--set", "parallel.tp=2"},
                    1 + 11 * 2 + 1});
}

// Grouped-query attention, checked against hf_reference.py (transformers 4.46 has neither model).
// OLMo 2 multi-query at TP2: the one k/v head, its kv.weight and its PROJECTION k gains are
// replicated on both ranks (Note [gqa layouts]); k_norm is over the narrower k projection.
TEST(CkptExport, Olmo2MultiQueryModelGivesKeelsLogitsInAnIndependentOlmo2) {
  check_llama_like(
      {"olmo2", "OLMo 2", 2,
       modern("PROJECTION", "POST_SUBLAYER", "500000", "false") +
           std::vector<std::string>{"--set", "model.n_kv_heads=1", "--set", "parallel.tp=2"},
       1 + 11 * 2 + 2});
}

// Qwen3 with 2 k/v heads of 12 (not d_model / n_heads = 8) at TP2: the k/v heads shard with the
// query heads.
TEST(CkptExport, Qwen3GroupedQueryModelWithItsOwnHeadDimGivesKeelsLogitsInAnIndependentQwen3) {
  check_llama_like({"qwen3", "Qwen3", 2,
                    modern("HEAD_SHARED", "PRE", "1000000", "true") +
                        std::vector<std::string>{"--set", "model.n_kv_heads=2", "--set",
                                                 "model.head_dim=12", "--set", "parallel.tp=2"},
                    1 + 11 * 2 + 1});
}

// Llama through transformers' own LlamaForCausalLM (9 tensors per layer: no QK-norm gains).
// Grouped-query (2 of 4 heads, sharded at TP2), untied, trained on a keel-data directory whose
// tokenizer goes with the export.
TEST(CkptExport, LlamaGroupedQueryModelLoadsInTransformersWithKeelsLogitsAndTokenizer) {
  check_llama_like(
      {"llama", "Llama", 2,
       llama("500000", "false") +
           std::vector<std::string>{"--set", "model.n_kv_heads=2", "--set", "parallel.tp=2"},
       1 + 9 * 2 + 2, true});
}

// Multi-query (replicated at TP2), head_dim 12 (not 8), tied.
TEST(CkptExport, LlamaMultiQueryModelWithItsOwnHeadDimLoadsInTransformersWithKeelsLogits) {
  check_llama_like({"llama", "Llama", 2,
                    llama("10000", "true") + std::vector<std::string>{"--set", "model.n_kv_heads=1",
                                                                      "--set", "model.head_dim=12",
                                                                      "--set", "parallel.tp=2"},
                    1 + 9 * 2 + 1});
}

TEST(CkptExport, OtherModelsExportKeelNamesAndSayWhy) {
  TempDir dir("keel_export_keel");
  const std::string run = dir.file("run"), out = dir.file("out"), ref = dir.file("ref");
  const CommandResult t =
      train(dir, 2, job(run, {"--set", "model.qk_norm=RMS",   "--set", "model.qk_norm_scope=HEAD",
                              "--set", "model.norm=RMSNORM",  "--set", "model.tie_embeddings=false",
                              "--set", "model.position=ROPE", "--set", "model.mlp=GEGLU",
                              "--set", "model.bias=false",    "--set", "model.n_layers=1",
                              "--set", "train.steps=2",       "--set", "checkpoint.every=2",
                              "--set", "parallel.tp=2"}));
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;
  const std::string step2 = run + "/checkpoints/step_00000002";
  // An earlier GPT-2 export's config.json would describe tensors the new file does not have.
  fs::create_directories(out);
  testing::write_file(out + "/config.json", "{}\n");

  const CommandResult e = ckpt(dir, {"export", step2, out});
  ASSERT_EQ(e.exit_code, 0) << e.out << e.err;
  EXPECT_EQ(e.out.substr(0, e.out.find("exported step")),
            "keel names, no config.json (removed the earlier one): no Hugging Face architecture "
            "matches exactly\n"
            "  not GPT-2: model.qk_norm=RMS (GPT-2 has no QK-norm); model.tie_embeddings=false "
            "(GPT-2 ties the LM head to the token embedding); model.norm=RMSNORM (GPT-2 uses "
            "LayerNorm); model.position=ROPE (GPT-2 learns absolute positions); model.mlp=GEGLU "
            "(GPT-2's MLP is GELU); model.bias=false (GPT-2 has biases in every linear layer and "
            "norm)\n"
            "  not OLMo 2: model.qk_norm_scope=HEAD (OLMo 2 normalises q and k over the whole "
            "projection, all heads at once); model.mlp=GEGLU (OLMo 2's MLP is SwiGLU); "
            "model.norm_placement=PRE (OLMo 2 normalises each sublayer's output)\n"
            "  not Qwen3: model.qk_norm_scope=HEAD (Qwen3 normalises each head with one gain "
            "shared by all heads); model.mlp=GEGLU (Qwen3's MLP is SwiGLU)\n"
            "  not Llama: model.qk_norm=RMS (Llama has no QK-norm); model.mlp=GEGLU (Llama's MLP "
            "is SwiGLU)\n");
  EXPECT_TRUE(contains(e.out, " (keel names)\n")) << e.out;
  EXPECT_EQ(entries(out), (std::vector<std::string>{"model.safetensors"}));

  write_reference(step2, ref);
  const CommandResult c = check_export(dir, "keel", out, ref);
  EXPECT_EQ(c.exit_code, 0) << c.out << c.err;
}

TEST(CkptExport, BadInputExits2AndLeavesNothingHalfWritten) {
  TempDir dir("keel_export_errors");
  const std::string run = dir.file("run"), out = dir.file("out");
  const CommandResult t =
      train(dir, 1,
            job(run, {"--set", "model.qk_norm=NONE", "--set", "model.n_layers=1", "--set",
                      "train.steps=1", "--set", "checkpoint.every=1"}));
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;
  const std::string step1 = run + "/checkpoints/step_00000001";
  // Expects exit 2 and one stderr line starting `prefix` and holding `reason`.
  auto refused = [&](const std::vector<std::string>& args, const std::string& prefix,
                     const std::string& reason) {
    const CommandResult r = ckpt(dir, args);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_EQ(r.err.rfind(prefix, 0), 0u) << r.err;
    EXPECT_TRUE(contains(r.err, reason)) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
    EXPECT_EQ(r.out, "");
  };

  // Not a checkpoint: an empty directory and a regular file. OUT_DIR is not even created.
  fs::create_directories(dir.file("empty"));
  refused({"export", dir.file("empty"), out},
          "keel-ckpt: data error: " + dir.file("empty") + "/manifest.pb: ", "missing");
  const std::string note = dir.write("note.txt", "hello\n");
  refused({"export", note, out}, "keel-ckpt: usage error: " + note + ": not a directory", "");
  EXPECT_FALSE(fs::exists(out));
  refused({"export", step1}, "keel-ckpt: usage error: ", "export PATH OUT_DIR");

  // OUT_DIR is a regular file: left as it was.
  const std::string file_out = dir.write("out.txt", "keep me\n");
  refused({"export", step1, file_out}, "keel-ckpt: usage error: " + file_out + ": ",
          "is not a directory");
  EXPECT_EQ(read_file(file_out), "keep me\n");

  // A good export, then a flipped byte in a parameter slice: the second export fails on it and
  // leaves the first one's file as it was, with no temporary beside it.
  const CommandResult good = ckpt(dir, {"export", step1, out});
  ASSERT_EQ(good.exit_code, 0) << good.out << good.err;
  const std::string before = read_file(out + "/model.safetensors");
  const ckpt::Manifest m = read_manifest(step1);
  const ckpt::Slice* slice = nullptr;
  for (const ckpt::TensorRecord& rec : m.tensors()) {
    if (rec.name() == "blocks.0.mlp.fc.weight" && rec.kind() == ckpt::PARAM) {
      slice = &rec.slices(0);
    }
  }
  ASSERT_NE(slice, nullptr);
  const std::string shard = step1 + "/" + slice->file();
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(slice->offset() + 5);
    const char c = static_cast<char>(f.get());
    f.seekp(slice->offset() + 5);
    f.put(static_cast<char>(c ^ 0x10));
  }
  refused({"export", step1, out}, "keel-ckpt: data error: " + shard + ": tensor ",
          "checksum mismatch");
  EXPECT_EQ(read_file(out + "/model.safetensors"), before);
  EXPECT_EQ(entries(out), (std::vector<std::string>{"config.json", "model.safetensors"}));
  // Into a new directory: nothing is left, not even the directory.
  refused({"export", step1, dir.file("fresh")}, "keel-ckpt: data error: " + shard,
          "checksum mismatch");
  EXPECT_FALSE(fs::exists(dir.file("fresh")));
}

}  // namespace
}  // namespace keel
