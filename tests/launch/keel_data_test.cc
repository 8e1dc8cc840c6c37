// launch/tools/keel-data end to end: generated text (files, a directory, JSONL) -> a trained
// byte-level BPE and shards -> keel-train on the directory (model.vocab_size 0 taken from it, the
// validation shards as the split, the sample decoded through tokenizer.json); a vocabulary above
// 65,536 written as uint32 shards that train; and the refusals of both tools (exit 2, one line).
// keel-data runs with tests/run's venv python (it needs `tokenizers`): a missing venv fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "framework/data/token_stream.h"
#include "tests/launch/launch_test_util.h"

namespace keel::testing {
namespace {

namespace fs = std::filesystem;

#define EXPECT_HAS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << "'" << (part) << "' not in: " << (message)

const std::string kKeelData = std::string(KEEL_SOURCE_DIR) + "/launch/tools/keel-data";

bool have_python() {
  const bool ok = fs::exists(KEEL_TEST_PYTHON);
  EXPECT_TRUE(ok) << KEEL_TEST_PYTHON
                  << " is missing: run tests/run, which makes the venv this test needs "
                     "(with Hugging Face tokenizers)";
  return ok;
}

CommandResult keel_data(const std::vector<std::string>& args, const TempDir& dir) {
  std::vector<std::string> all = {kKeelData};
  all.insert(all.end(), args.begin(), args.end());
  return run_command(command_line(KEEL_TEST_PYTHON, all), dir);
}

// Sentences of invented words (nothing copied from anywhere), seeded.
std::string generated_text(std::mt19937& rng, int sentences) {
  static const std::vector<std::string> syllables = {"ka",  "lo",  "mi",  "re",  "su",  "ta",
                                                     "ven", "dor", "pli", "qua", "zen", "ith"};
  std::string out;
  for (int s = 0; s < sentences; ++s) {
    const int words = 4 + static_cast<int>(rng() % 10);
    for (int w = 0; w < words; ++w) {
      const int parts = 1 + static_cast<int>(rng() % 3);
      for (int p = 0; p < parts; ++p) out += syllables[rng() % syllables.size()];
      out += w + 1 < words ? " " : ".\n";
    }
  }
  return out;
}

struct Corpus {
  std::string root;
  int64_t text_bytes = 0;  // of the 33 documents' text (ASCII: one byte per character)
};

// DIR/corpus: three text files (one in a subdirectory), a JSONL file of 30 documents and a file
// that is neither (skipped): 33 documents, about 12 KB.
Corpus make_corpus(const TempDir& dir) {
  std::mt19937 rng(29);
  Corpus c{dir.file("corpus")};
  fs::create_directories(c.root + "/sub");
  for (const char* name : {"/a.txt", "/b.txt", "/sub/c.txt"}) {
    const std::string text = generated_text(rng, 40);
    write_file(c.root + name, text);
    c.text_bytes += static_cast<int64_t>(text.size());
  }
  std::string jsonl;
  for (int i = 0; i < 30; ++i) {
    const std::string text = generated_text(rng, 3);
    jsonl += nlohmann::json{{"id", i}, {"text", text}}.dump() + "\n";
    c.text_bytes += static_cast<int64_t>(text.size());
  }
  write_file(c.root + "/sub/d.jsonl", jsonl);
  write_file(c.root + "/notes.md", "not read");
  return c;
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_file(path)); }

const std::vector<std::string> kTinyModel = {
    "--set", "model.d_model=16",      "--set", "model.n_layers=1",     "--set", "model.n_heads=2",
    "--set", "model.seq_len=16",      "--set", "train.global_batch=4", "--set", "train.steps=6",
    "--set", "train.eval_every=3",    "--set", "train.eval_batches=1", "--set", "train.plot=false",
    "--set", "train.sample_chars=60", "--set", "checkpoint.every=6"};

CommandResult train_on(const std::string& data, const std::string& vocab, const TempDir& dir,
                       const std::string& run) {
  std::vector<std::string> args = {"--set",     "data.path=" + data,
                                   "--set",     "model.vocab_size=" + vocab,
                                   "--run-dir", dir.file(run)};
  args.insert(args.end(), kTinyModel.begin(), kTinyModel.end());
  return run_command(train_command(args, 1), dir);
}

TEST(KeelData, TextToShardsToATrainingRunWithADecodedSample) {
  if (!have_python()) return;
  TempDir dir;
  const std::string corpus = make_corpus(dir).root;
  const std::string out = dir.file("data");
  const CommandResult r = keel_data(
      {corpus, "--out", out, "--vocab-size", "300", "--val-fraction", "0.2", "--workers", "2"},
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_HAS(r.out, "keel-data: 4 files");
  EXPECT_HAS(r.out, "33 documents");
  EXPECT_HAS(r.out, "uint16 tokens");
  EXPECT_HAS(r.out, "keel-data: vocab_size 300 (end of text <|endoftext|> = 0)");
  EXPECT_HAS(r.out, "--set model.vocab_size=300");
  EXPECT_EQ(r.err, "");  // no progress: stderr is not a terminal and --progress is off

  const nlohmann::json meta = read_json(out + "/keel-data.json");
  EXPECT_EQ(meta["vocab_size"], 300);
  EXPECT_EQ(meta["shard"]["magic"], kShardMagic);
  EXPECT_EQ(meta["shard"]["token_bytes"], 2);
  EXPECT_EQ(meta["end_of_text"]["token"], "<|endoftext|>");
  EXPECT_EQ(meta["input_files"], 4);
  // Every fifth document (round(1 / 0.2)) is held out: 6 of 33.
  EXPECT_EQ(meta["train"]["documents"], 27);
  EXPECT_EQ(meta["val"]["documents"], 6);
  EXPECT_TRUE(fs::exists(out + "/tokenizer.json"));
  EXPECT_FALSE(fs::exists(out + "/.keel-data-tmp"));

  // The shards hold what the metadata says, every token in the vocabulary, and one end-of-text
  // token per document, each document's first.
  const int32_t eot = meta["end_of_text"]["id"];
  for (const std::string split : {"train", "val"}) {
    const TokenStream s = TokenStream::open_shards(out + "/" + split + "_*.bin", 300, "data.path");
    EXPECT_EQ(s.size(), meta[split]["tokens"].get<int64_t>()) << split;
    std::vector<int32_t> tokens(static_cast<size_t>(s.size()));
    s.copy(0, s.size(), tokens.data());
    EXPECT_EQ(tokens.front(), eot) << split;
    EXPECT_EQ(std::count(tokens.begin(), tokens.end(), eot), meta[split]["documents"]) << split;
    EXPECT_EQ(*std::max_element(tokens.begin(), tokens.end()), 299) << "BPE uses its merges";
  }
  // The text compresses: fewer tokens than bytes.
  EXPECT_LT(meta["train"]["tokens"].get<int64_t>() + meta["val"]["tokens"].get<int64_t>(),
            meta["input_bytes"].get<int64_t>() / 2);

  // keel-train reads the directory: vocab_size 0 takes the data's, the val shards are the split,
  // and the sample decodes through tokenizer.json (the prompt starts a validation document).
  const CommandResult t = train_on(out, "0", dir, "run");
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;
  EXPECT_HAS(t.out, "keel-train: data directory " + out +
                        " (keel-data): vocabulary 300 (tokenizer.json), model.vocab_size 300");
  EXPECT_HAS(t.out, "shard '" + out + "/train_000000.bin' (" +
                        std::to_string(meta["train"]["tokens"].get<int64_t>()) + " tokens)");
  EXPECT_HAS(t.out, "val loss");
  const size_t at = t.out.find("keel-train: sample from the trained model:\n");
  ASSERT_NE(at, std::string::npos) << t.out;
  const std::string sample = t.out.substr(at + 43);
  EXPECT_EQ(sample.rfind("<|endoftext|>", 0), 0u) << sample;
  // The prompt's 15 tokens after it are the validation document's text: letters of the invented
  // words, spaces and full stops, which bytes 0..255 read as tokens would not give.
  std::string prompt_text = sample.substr(13, 20);
  EXPECT_TRUE(prompt_text.find_first_not_of(
                  "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ. \n") == std::string::npos)
      << sample;
  EXPECT_GE(sample.size(), 13u + 60u) << "the prompt and at least 60 bytes of sampled text";

  // keel-ckpt export puts the tokenizer beside the model, and transformers loads it.
  const std::string exported = dir.file("exported");
  const CommandResult e = run_command(
      command_line(KEEL_CKPT_BIN, {"export", dir.file("run/checkpoints/step_00000006"), exported}),
      dir);
  ASSERT_EQ(e.exit_code, 0) << e.out << e.err;
  EXPECT_HAS(e.out, "tokenizer.json and tokenizer_config.json from " + out);
  EXPECT_EQ(read_file(exported + "/tokenizer.json"), read_file(out + "/tokenizer.json"));
  const std::string load = R"(
import sys
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained(sys.argv[1])
ids = t("kaven lo quadorith.")["input_ids"]
print("decoded:", repr(t.decode(ids)), "eos:", t.eos_token_id, "n:", len(t))
)";
  const CommandResult a = run_command(command_line(KEEL_TEST_PYTHON, {"-c", load, exported}), dir);
  ASSERT_EQ(a.exit_code, 0) << a.out << a.err;
  EXPECT_HAS(a.out, "decoded: 'kaven lo quadorith.' eos: 0 n: 300");

  // A config vocab_size below the tokenizer's: exit 2 naming both numbers.
  const CommandResult small = train_on(out, "256", dir, "small");
  EXPECT_EQ(small.exit_code, 2) << small.out << small.err;
  EXPECT_HAS(small.err,
             "keel-train: config error: model.vocab_size=256 is smaller than the 300 "
             "tokens of " +
                 out + "/tokenizer.json");
  EXPECT_EQ(small.out, "");
}

TEST(KeelData, AVocabularyAbove65536WritesUint32ShardsThatTrain) {
  if (!have_python()) return;
  TempDir dir;
  // A byte-level tokenizer of 100,257 tokens: the 256 bytes, 100,000 tokens the data never uses
  // and <|endoftext|> last (id 100256), so the shards hold ids above 65,535.
  const std::string make = R"(
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
vocab.update({f"unused{i}": 256 + i for i in range(100000)})
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens(["<|endoftext|>"])
tok.save(sys.argv[1])
)";
  const std::string tok = dir.file("big.json");
  const CommandResult m = run_command(command_line(KEEL_TEST_PYTHON, {"-c", make, tok}), dir);
  ASSERT_EQ(m.exit_code, 0) << m.err;
  const Corpus corpus = make_corpus(dir);
  const std::string out = dir.file("data");
  const CommandResult r =
      keel_data({corpus.root, "--out", out, "--tokenizer", tok, "--val-fraction", "0.2"}, dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_HAS(r.out, "uint32 tokens");
  EXPECT_HAS(r.out, "vocab_size 100257 (end of text <|endoftext|> = 100256)");
  const nlohmann::json meta = read_json(out + "/keel-data.json");
  EXPECT_EQ(meta["shard"]["magic"], kShardMagicU32);
  EXPECT_EQ(meta["shard"]["version"], kShardVersionU32);
  EXPECT_EQ(meta["shard"]["token_bytes"], 4);
  EXPECT_EQ(meta["tokenizer"]["source"], tok);
  const TokenStream s = TokenStream::open_shards(out + "/train_*.bin", 100257, "data.path");
  EXPECT_EQ(s.at(0), 100256);
  // Byte-level with no merges: one token per byte of text, plus one per document.
  EXPECT_EQ(meta["train"]["tokens"].get<int64_t>() + meta["val"]["tokens"].get<int64_t>(),
            corpus.text_bytes + 33);
  // One worker and shards of 1000 tokens: the same tokens, in the same order.
  const std::string out1 = dir.file("data1");
  const CommandResult r1 =
      keel_data({corpus.root, "--out", out1, "--tokenizer", tok, "--val-fraction", "0.2",
                 "--workers", "1", "--shard-tokens", "1000"},
                dir);
  ASSERT_EQ(r1.exit_code, 0) << r1.out << r1.err;
  const nlohmann::json meta1 = read_json(out1 + "/keel-data.json");
  EXPECT_EQ(meta1["train"]["shards"].size(),
            static_cast<size_t>((meta["train"]["tokens"].get<int64_t>() + 999) / 1000));
  for (const std::string split : {"train", "val"}) {
    const TokenStream a = TokenStream::open_shards(out + "/" + split + "_*.bin", 100257, "p");
    const TokenStream b = TokenStream::open_shards(out1 + "/" + split + "_*.bin", 100257, "p");
    ASSERT_EQ(a.size(), b.size()) << split;
    std::vector<int32_t> ta(static_cast<size_t>(a.size())), tb(ta.size());
    a.copy(0, a.size(), ta.data());
    b.copy(0, b.size(), tb.data());
    EXPECT_EQ(ta, tb) << split;
  }
  for (const auto& name : meta1["train"]["shards"]) {
    const std::string head = read_file(out1 + "/" + name.get<std::string>()).substr(0, 12);
    int32_t fields[3];
    std::memcpy(fields, head.data(), 12);
    EXPECT_EQ(fields[0], kShardMagicU32);
    EXPECT_LE(fields[2], 1000) << name;
  }

  const CommandResult t = train_on(out, "0", dir, "run");
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;
  EXPECT_HAS(t.out, "vocabulary 100257 (tokenizer.json), model.vocab_size 100257");
  EXPECT_HAS(t.out, "keel-train: sample from the trained model:\n<|endoftext|>");
}

TEST(KeelData, RefusalsExitTwoWithOneLineNamingTheCause) {
  if (!have_python()) return;
  TempDir dir;
  const std::string corpus = make_corpus(dir).root;
  const auto refused = [&](const std::vector<std::string>& args, const std::string& expected) {
    const CommandResult r = keel_data(args, dir);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_EQ(r.err.rfind("keel-data: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
    EXPECT_HAS(r.err, expected);
  };
  refused({dir.file("nope.txt"), "--out", dir.file("o1"), "--vocab-size", "300"},
          dir.file("nope.txt") + ": no such file or directory");
  fs::create_directories(dir.file("empty_dir"));
  refused({dir.file("empty_dir"), "--out", dir.file("o1"), "--vocab-size", "300"},
          dir.file("empty_dir") + ": no *.txt or *.jsonl file in this directory");
  refused({corpus, "--out", dir.file("o1"), "--vocab-size", "256"},
          "--vocab-size 256: too small: a byte-level BPE needs at least 257 tokens");
  write_file(dir.file("bad.jsonl"), "{\"text\": \"one\"}\n\n{\"body\": \"two\"}\n");
  refused({dir.file("bad.jsonl"), "--out", dir.file("o1"), "--vocab-size", "300"},
          dir.file("bad.jsonl") + ":3: no \"text\" field (fields: body)");
  write_file(dir.file("num.jsonl"), "{\"text\": 5}\n");
  refused({dir.file("num.jsonl"), "--out", dir.file("o1"), "--vocab-size", "300"},
          dir.file("num.jsonl") + ":1: the \"text\" field is not a string (int)");
  write_file(dir.file("broken.jsonl"), "{\"text\": \"a\"}\n{\"text\": \n");
  refused({dir.file("broken.jsonl"), "--out", dir.file("o1"), "--vocab-size", "300"},
          dir.file("broken.jsonl") + ":2: not valid JSON");
  write_file(dir.file("tok.json"), "{\"model\": 1}");
  refused(
      {corpus, "--out", dir.file("o1"), "--tokenizer", dir.file("tok.json")},
      "--tokenizer " + dir.file("tok.json") + ": cannot read it as a Hugging Face tokenizer.json");
  refused({corpus, "--out", dir.file("o1"), "--tokenizer", dir.file("none.json")},
          "--tokenizer " + dir.file("none.json") + ": no such file");
  EXPECT_FALSE(fs::exists(dir.file("o1"))) << "a refused run writes nothing";
  // The JSONL refusal also stops an encoding-only run (the workers find it).
  ASSERT_EQ(keel_data({corpus, "--out", dir.file("good"), "--vocab-size", "260"}, dir).exit_code,
            0);
  refused({dir.file("bad.jsonl"), "--out", dir.file("o2"), "--tokenizer",
           dir.file("good/tokenizer.json"), "--workers", "2"},
          dir.file("bad.jsonl") + ":3: no \"text\" field");
  // An output directory that already holds shards: a glob would mix them in.
  refused({corpus, "--out", dir.file("good"), "--vocab-size", "300"},
          "--out " + dir.file("good") + ": already holds keel-data.json");
  // A single document cannot be split.
  write_file(dir.file("one.jsonl"), "{\"text\": \"only one\"}\n");
  refused({dir.file("one.jsonl"), "--out", dir.file("o3"), "--vocab-size", "260"},
          "the inputs hold 1 document: the validation split needs a second one");
  // Refusals found after the tokenizer was written leave nothing behind either.
  EXPECT_FALSE(fs::exists(dir.file("o2")));
  EXPECT_FALSE(fs::exists(dir.file("o3")));
}

}  // namespace
}  // namespace keel::testing
