// Fuzzes the config reader: text-format config merged over the defaults, --set overrides and
// validate(), i.e. load_config without the file. An input is a config text whose lines starting
// with "--set " are taken out and applied, in order, as overrides. What passes validation must
// print (to_text) as text that reads back to the same config, and validate() must be idempotent.
#include <google/protobuf/util/message_differencer.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using google::protobuf::util::MessageDifferencer;

void one_input(const std::string& input) {
  std::string text;
  std::vector<std::string> sets;
  for (size_t begin = 0; begin < input.size();) {
    size_t end = input.find('\n', begin);
    end = end == std::string::npos ? input.size() : end + 1;
    const std::string line = input.substr(begin, end - begin);
    if (line.rfind("--set ", 0) == 0) {
      sets.push_back(line.substr(6, line.size() - 6 - (line.back() == '\n' ? 1 : 0)));
    } else {
      text += line;
    }
    begin = end;
  }
  keel::config::KeelConfig cfg = keel::default_config();
  const bool valid = keel::fuzz::accepts([&] {
    keel::merge_config_text(text, "fuzz.pbtxt", cfg);
    for (const std::string& s : sets) keel::apply_set(s, cfg);
    keel::validate(cfg);
  });
  if (!valid) return;

  const std::string printed = keel::to_text(cfg);
  keel::config::KeelConfig again = keel::default_config();
  const bool reads_back = keel::fuzz::accepts([&] {
    keel::merge_config_text(printed, "printed.pbtxt", again);
    keel::validate(again);
  });
  keel::fuzz::check(reads_back, "to_text's output is refused:\n" + printed);
  keel::fuzz::check(MessageDifferencer::Equals(cfg, again),
                    "to_text's output reads back as another config:\n" + printed + "\nvs\n" +
                        keel::to_text(again));
  keel::config::KeelConfig twice = cfg;
  keel::fuzz::check(
      keel::fuzz::accepts([&] { keel::validate(twice); }) && MessageDifferencer::Equals(cfg, twice),
      "validate() is not idempotent:\n" + printed);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  one_input(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
