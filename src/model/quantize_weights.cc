// QuantizeLinearLayers (tq/model.h): a model whose linear layers carry a
// weight format's reconstruction error.
#include <memory>
#include <vector>

#include "tq/model.h"
#include "tq/weights.h"

namespace tq {
namespace {

// w [rows][cols] replaced in place by what `spec`'s codes stand for; the
// matrix appended to `codes` when that is not null.
Status RoundTrip(std::vector<float>& w, size_t rows, size_t cols, const WeightSpec& spec, size_t threads,
                 const char* name, size_t layer, WeightQuantReport* rep,
                 std::vector<std::shared_ptr<const WeightMatrix>>* codes) {
  auto m = WeightMatrix::Quantize(w, rows, cols, spec, {.threads = threads});
  if (!m.ok()) {
    return Status(m.status().code(),
                  "layer " + std::to_string(layer) + " " + name + ": " + m.status().message());
  }
  TQ_RETURN_IF_ERROR(m->Dequantize(w, {.threads = threads}));
  rep->quantized_weights += rows * cols;
  rep->bytes += m->bytes().size();
  if (codes) codes->push_back(std::make_shared<const WeightMatrix>(std::move(*m)));
  return Status::Ok();
}

}  // namespace

Result<Model> QuantizeLinearLayers(const Model& model, const WeightSpec& spec, size_t threads,
                                   WeightQuantReport* report, bool multiply_from_codes) {
  const ModelConfig& c = model.config();
  ModelWeights w = model.weights();
  const size_t D = c.dim, F = c.hidden_dim, qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  WeightQuantReport rep;
  for (size_t l = 0; l < w.layers.size(); ++l) {
    WeightSpec s = spec;
    s.layer = static_cast<uint32_t>(l);
    LayerWeights& L = w.layers[l];
    L.codes.clear();
    auto* codes = multiply_from_codes ? &L.codes : nullptr;
    TQ_RETURN_IF_ERROR(RoundTrip(L.wq, qd, D, s, threads, "wq", l, &rep, codes));
    TQ_RETURN_IF_ERROR(RoundTrip(L.wk, kvd, D, s, threads, "wk", l, &rep, codes));
    TQ_RETURN_IF_ERROR(RoundTrip(L.wv, kvd, D, s, threads, "wv", l, &rep, codes));
    TQ_RETURN_IF_ERROR(RoundTrip(L.wo, D, qd, s, threads, "wo", l, &rep, codes));
    TQ_RETURN_IF_ERROR(RoundTrip(L.w_gate, F, D, s, threads, "w_gate", l, &rep, codes));
    TQ_RETURN_IF_ERROR(RoundTrip(L.w_up, F, D, s, threads, "w_up", l, &rep, codes));
    TQ_RETURN_IF_ERROR(RoundTrip(L.w_down, D, F, s, threads, "w_down", l, &rep, codes));
  }
  rep.bits_per_weight = rep.quantized_weights
                            ? 8.0 * static_cast<double>(rep.bytes) / static_cast<double>(rep.quantized_weights)
                            : 0.0;
  if (report) *report = rep;
  return Model::FromWeights(c, std::move(w));
}

}  // namespace tq
