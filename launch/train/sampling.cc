// Text sampling from the trained model (see sampling.h).
#include "launch/train/sampling.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "framework/error.h"
#include "framework/philox.h"

namespace keel {

std::string sample_text(GPT& model, const Dataset& data, const Topology& topo, int64_t n_chars,
                        uint64_t seed, float temperature, const TokenizerJson* tokenizer) {
  const ModelDims& d = model.dims();
  KEEL_CHECK(topo.tp == 1, kUsage, "sampling reads whole logit rows: it needs parallel.tp=1");
  const int64_t T = d.T;
  // A token's text: its bytes through the tokenizer, or the token itself as a byte.
  const auto text_of = [tokenizer](int32_t tok) {
    return tokenizer ? tokenizer->decode(tok) : std::string(1, static_cast<char>(tok));
  };
  std::string out;
  // Prompt: the start of a validation window (or of the training data), so the model continues
  // text in its own domain.
  const TokenStream& src = data.has_val() ? data.val() : data.train();
  int64_t len = std::min<int64_t>(16, src.size());
  std::vector<int32_t> ctx(len);  // the whole text so far; len == ctx.size() throughout
  src.copy(0, len, ctx.data());
  for (int64_t i = 0; i < len; ++i) out += text_of(ctx[i]);
  const size_t prompt_bytes = out.size();
  std::vector<double> p(d.V);
  for (int64_t i = 0; i < n_chars && out.size() - prompt_bytes < static_cast<size_t>(n_chars);
       ++i) {
    const int64_t start = std::max<int64_t>(0, len - T);
    std::vector<int32_t> window(ctx.begin() + start,
                                ctx.begin() + std::min<int64_t>(len, start + T));
    window.resize(T, 0);
    model.forward(window.data(), nullptr, 1);
    const std::vector<float> row = model.logits_row(len - start - 1);  // the last position
    double mx = -1e300, sum = 0.0;
    for (int64_t v = 0; v < d.V; ++v) mx = std::max(mx, static_cast<double>(row[v]) / temperature);
    for (int64_t v = 0; v < d.V; ++v) sum += p[v] = std::exp(row[v] / temperature - mx);
    const double u = philox_uniform(seed, fnv1a64("sample"), static_cast<uint64_t>(i)) * sum;
    double acc = 0.0;
    int32_t tok = static_cast<int32_t>(d.V - 1);
    for (int64_t v = 0; v < d.V; ++v) {
      acc += p[v];
      if (u < acc) {
        tok = static_cast<int32_t>(v);
        break;
      }
    }
    ctx.push_back(tok);
    ++len;
    out += text_of(tok);
  }
  return out;
}

}  // namespace keel
