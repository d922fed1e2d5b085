// libFuzzer target: the index file loaders (FlatIndex / IvfIndex
// Deserialize) must reject or accept any bytes without crashing, leaking or
// reading out of bounds; a file that loads must search and serialize back to
// the same bytes. Every section carries an xxh64 checksum, so random
// mutations mostly stop at the checksum check: each input is also parsed a
// second time with its header and section checksums recomputed (when its
// section structure can be walked), so the fuzzer reaches the section
// parsers too. Seed files: TQ_FUZZ_WRITE_SEEDS=DIR (docs/TESTING.md).
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "tq/format.h"
#include "tq/index.h"

namespace {

// Rewrites the header checksum and every section checksum of a file laid out
// as docs/FORMAT.md "Index files" says; false when the layout cannot be walked.
bool FixChecksums(std::vector<uint8_t>* b) {
  if (b->size() < 32) return false;
  uint8_t* p = b->data();
  tq::StoreLE64(XXH64(p, 24, 0), p + 24);
  const uint32_t count = tq::LoadLE32(p + 20);
  size_t at = 32;
  for (uint32_t i = 0; i < count && i < 64; ++i) {
    if (b->size() - at < 24) return false;
    const uint64_t len = tq::LoadLE64(p + at + 8);
    if (len > b->size() - at - 24) return false;
    tq::StoreLE64(XXH64(p + at + 24, len, 0), p + at + 16);
    at += 24 + (len + 7) / 8 * 8;
    if (at > b->size()) return false;
  }
  return true;
}

size_t Dim(const tq::FlatIndex& index) { return index.spec().dim; }
size_t Dim(const tq::IvfIndex& index) { return index.spec().index.dim; }

template <typename Index>
void Exercise(std::span<const uint8_t> bytes) {
  auto index = Index::Deserialize(bytes);
  if (!index.ok()) return;
  if (index->Serialize() != std::vector<uint8_t>(bytes.begin(), bytes.end())) std::abort();
  const size_t dim = Dim(*index);
  std::vector<float> q(dim);
  for (size_t j = 0; j < dim; ++j) q[j] = static_cast<float>((j % 7) + 1) * 0.125f;
  tq::SearchParams p;
  p.k = 3;
  p.fast_scan = index->fast_scan();
  p.nprobe = 2;
  (void)index->Search(q, p);
  p.fast_scan = false;
  (void)index->Search(q, p);
}

void WriteSeeds(const std::string& dir) {
  const size_t dim = 12;
  std::vector<float> x(40 * dim);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
  int n = 0;
  for (int bits : {2, 4, 6}) {
    for (tq::Metric m : {tq::Metric::kInnerProduct, tq::Metric::kL2}) {
      auto flat = tq::FlatIndex::Create({.dim = dim, .bits = bits, .metric = m,
                                         .store_originals = bits == 2});
      (void)flat->Add(x);
      (void)flat->Remove(std::vector<int64_t>{3});
      (void)flat->Save(dir + "/seed_flat_" + std::to_string(n++) + ".tqi");
    }
  }
  auto none = tq::FlatIndex::Create({.dim = 16, .bits = 3, .metric = tq::Metric::kCosine,
                                     .rotation = tq::RotationKind::kHaar,
                                     .scales = tq::IndexScales::kNone});
  (void)none->Add(std::span<const float>(x.data(), 20 * 16));
  (void)none->Save(dir + "/seed_flat_none.tqi");
  auto ivf = tq::IvfIndex::Create({.index = {.dim = dim, .bits = 4, .metric = tq::Metric::kL2},
                                   .nlist = 4, .kmeans_iters = 3});
  (void)ivf->Train(x);
  (void)ivf->Add(x);
  (void)ivf->Save(dir + "/seed_ivf.tqi");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("TQ_FUZZ_WRITE_SEEDS")) WriteSeeds(dir);
  return 0;
}

// Building the codec of a spec costs O(dim^3) for haar rotations (a QR of a
// dim x dim matrix) and O(dim) codebook solves: a legitimate 4096-d file
// takes minutes to open. That is not a defect of the parser, so the fuzzer
// keeps dims small: inputs whose first section (the spec) declares dim > 256
// are skipped.
bool SpecDimTooLarge(std::span<const uint8_t> b) {
  return b.size() >= 32 + 24 + 8 && tq::LoadLE64(b.data() + 56) > 256;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> bytes(data, size);
  if (SpecDimTooLarge(bytes)) return 0;
  Exercise<tq::FlatIndex>(bytes);
  Exercise<tq::IvfIndex>(bytes);
  std::vector<uint8_t> fixed(data, data + size);
  if (FixChecksums(&fixed)) {
    Exercise<tq::FlatIndex>(fixed);
    Exercise<tq::IvfIndex>(fixed);
  }
  return 0;
}
