// tq demo, tq distortion, tq bench codec.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common.h"
#include "commands.h"
#include "eval.h"
#include "options.h"
#include "core/thread_pool.h"
#include "tq/codec.h"
#include "tq/distortion.h"
#include "tq/kv_format.h"
#include "tq/simd.h"

namespace tq::tools {
namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Codec throughput: encode/decode GB/s of fp32 input next to memcpy of the
// same bytes, best of `reps`, on 1 thread and on `threads` threads.
// ---------------------------------------------------------------------------
struct Throughput {
  size_t threads = 1;
  double encode_gbps = 0;
  double decode_gbps = 0;
  double memcpy_gbps = 0;
};

template <typename F>
double BestSeconds(int reps, F&& f) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

std::vector<Throughput> MeasureThroughput(const Codec& codec, size_t rows, size_t threads,
                                          int reps, Progress* progress) {
  const size_t d = codec.dim();
  std::vector<float> x(rows * d), out(rows * d);
  SampleUnitVectors(Absorb(0x6265, d), rows, d, x.data());
  for (size_t i = 0; i < x.size(); ++i) x[i] *= 3.0f;  // not unit norm: a real scale
  std::vector<uint8_t> codes(rows * codec.row_bytes());
  const double bytes = static_cast<double>(x.size() * sizeof(float));
  std::vector<size_t> thread_counts = {1};
  if (threads > 1) thread_counts.push_back(threads);
  std::vector<Throughput> res;
  size_t step = 0;
  for (size_t t : thread_counts) {
    Throughput tp;
    tp.threads = t;
    const BatchOptions opt{.threads = t};
    Status st = codec.Encode(x, codes, opt);  // warm-up (page faults, codebooks)
    if (!st.ok()) Fail(st);
    std::memcpy(out.data(), x.data(), static_cast<size_t>(bytes));
    const double te = BestSeconds(reps, [&] { (void)codec.Encode(x, codes, opt); });
    if (progress) progress->Update(++step, 3 * thread_counts.size());
    const double td = BestSeconds(reps, [&] { (void)codec.Decode(codes, out, opt); });
    if (progress) progress->Update(++step, 3 * thread_counts.size());
    const double tm = BestSeconds(reps, [&] {
      ParallelFor(rows, t, 1024, [&](size_t b, size_t e) {
        std::memcpy(out.data() + b * d, x.data() + b * d, (e - b) * d * sizeof(float));
      });
    });
    if (progress) progress->Update(++step, 3 * thread_counts.size());
    tp.encode_gbps = bytes / te * 1e-9;
    tp.decode_gbps = bytes / td * 1e-9;
    tp.memcpy_gbps = bytes / tm * 1e-9;
    res.push_back(tp);
  }
  return res;
}

void PrintDistortionTable(const std::vector<DistortionRow>& rows, size_t dim) {
  Table t({"bits", "d_mse", "codebook", "lower", "upper", "d_prod", "(pi/2)d_mse(b-1)/d",
           "slope_mse", "slope_prod"});
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    std::string pred = "-";
    if (r.bits == 1) {
      pred = Fmt(M_PI / 2 / static_cast<double>(dim));
    } else {
      for (const auto& p : rows) {
        if (p.bits == r.bits - 1) pred = Fmt(M_PI / 2 * p.d_mse / static_cast<double>(dim));
      }
    }
    t.AddRow({std::to_string(r.bits), Fmt(r.d_mse, 5), Fmt(r.codebook_mse, 5), Fmt(r.lower, 4),
              Fmt(r.upper, 4), Fmt(r.d_prod, 4), pred, FmtFixed(r.ip_slope_mse, 4),
              FmtFixed(r.ip_slope_prod, 4)});
  }
  t.Print(stdout);
}

Status PlotDistortion(const std::string& path, const std::vector<DistortionRow>& rows, size_t dim) {
  PlotSpec p;
  p.title = "TurboQuant distortion vs bits (d = " + std::to_string(dim) + ")";
  p.x_label = "bits per coordinate";
  p.y_label = "distortion (log scale)";
  p.log_y = true;
  Series mse{"D_mse measured", {}, {}, false}, lo{"D_mse lower 4^-b", {}, {}, true},
      up{"D_mse upper", {}, {}, true}, prod{"D_prod measured", {}, {}, false},
      pup{"D_prod upper", {}, {}, true};
  for (const auto& r : rows) {
    mse.x.push_back(r.bits); mse.y.push_back(r.d_mse);
    lo.x.push_back(r.bits); lo.y.push_back(r.lower);
    up.x.push_back(r.bits); up.y.push_back(r.upper);
    prod.x.push_back(r.bits); prod.y.push_back(r.d_prod);
    pup.x.push_back(r.bits); pup.y.push_back(r.prod_upper);
  }
  p.series = {mse, lo, up, prod, pup};
  return WriteSvgPlot(path, p);
}

}  // namespace

void RegisterDistortion(CLI::App& app) {
  struct Args {
    size_t dim = 128;
    std::string bits = "1,2,3,4";
    size_t samples = 100000;
    std::string rotation = "block";
    std::string codebook = "sphere";
    bool norm_correction = false;
    bool f16 = false;
    uint64_t seed = 0;
    size_t threads = 0;
    bool json = false;
    std::string plot;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "distortion", "paper Thm 1/2 experiment: D_mse, D_prod and inner-product slopes on uniform unit vectors");
  AddInteger(cmd, "--dim", &args->dim, "vector dimension", 1, 4096, "the experiment's largest dim");
  cmd->add_option("--bits", args->bits, "comma-separated bit widths (1..8)")->capture_default_str();
  AddInteger(cmd, "--samples", &args->samples, "number of (x, y) pairs", 2, 100000000);
  cmd->add_option("--rotation", args->rotation, "rht | block | haar | mix")->capture_default_str();
  cmd->add_option("--codebook", args->codebook, "sphere | gaussian")->capture_default_str();
  cmd->add_flag("--norm-correction", args->norm_correction, "store corrected norms (default: plain norms, as the paper)");
  cmd->add_flag("--f16-scales", args->f16, "store scales as fp16 (default fp32, as the paper)");
  AddInteger(cmd, "--seed", &args->seed, "seed", 0, kMaxSeed);
  AddInteger(cmd, "--threads", &args->threads, "threads (0 = all)", 0, kMaxThreads);
  cmd->add_flag("--json", args->json, "print JSON");
  cmd->add_option("--plot", args->plot, "write distortion vs bits to this .svg file");
  cmd->callback([args] {
    DistortionOptions o;
    o.dim = args->dim;
    o.bits = ParseIntList(args->bits, "--bits", 1, 8);
    o.samples = args->samples;
    // x, y and the decoded x (fp32), the codes and the exact inner products.
    CheckFitsInMemory(static_cast<double>(o.samples) * (static_cast<double>(o.dim) * 14.0 + 8.0),
                      "--samples x --dim", "three fp32 vectors and a code row per sample");
    auto rot = ParseRotationKind(args->rotation);
    if (!rot.ok()) Fail(rot.status());
    o.rotation = *rot;
    if (args->codebook == "sphere") {
      o.codebook = CodebookFamily::kSphere;
    } else if (args->codebook == "gaussian") {
      o.codebook = CodebookFamily::kGaussian;
    } else {
      Fail(InvalidArgumentError("--codebook must be sphere or gaussian, got '" + args->codebook + "'"));
    }
    o.norm_correction = args->norm_correction;
    o.scale_dtype = args->f16 ? ScaleDtype::kF16 : ScaleDtype::kF32;
    o.seed = args->seed;
    o.threads = args->threads;
    Progress progress("distortion (bit widths)");
    auto rows = MeasureDistortion(o, [&](size_t a, size_t b) { progress.Update(a, b); });
    if (!rows.ok()) Fail(rows.status());
    progress.Done();
    if (!args->plot.empty()) {
      Status st = PlotDistortion(args->plot, *rows, o.dim);
      if (!st.ok()) Fail(st);
    }
    if (args->json) {
      nlohmann::json j;
      j["dim"] = o.dim;
      j["samples"] = o.samples;
      j["rotation"] = RotationKindName(o.rotation);
      j["codebook"] = CodebookFamilyName(o.codebook);
      j["results"] = nlohmann::json::array();
      for (const auto& r : *rows) {
        j["results"].push_back({{"bits", r.bits}, {"d_mse", r.d_mse}, {"d_prod", r.d_prod},
                                {"ip_slope_mse", r.ip_slope_mse}, {"ip_slope_prod", r.ip_slope_prod},
                                {"lower", r.lower}, {"upper", r.upper},
                                {"codebook_mse", r.codebook_mse}, {"prod_lower", r.prod_lower},
                                {"prod_upper", r.prod_upper}, {"mse_row_bytes", r.mse_row_bytes},
                                {"prod_row_bytes", r.prod_row_bytes}});
      }
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("distortion: dim %zu, %zu samples, rotation %s, codebook %s\n", o.dim, o.samples,
                  RotationKindName(o.rotation), CodebookFamilyName(o.codebook));
      PrintDistortionTable(*rows, o.dim);
      if (!args->plot.empty()) std::printf("plot written to %s\n", args->plot.c_str());
    }
  });
}

void RegisterBenchCodec(CLI::App& bench) {
  struct Args {
    size_t dim = 128;
    int bits = 3;
    std::string kind = "mse";
    size_t threads = 0;
    size_t mbytes = 64;
    int reps = 5;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand("codec", "encode/decode throughput vs memcpy of the same bytes");
  AddInteger(cmd, "--dim", &args->dim, "vector dimension", 1, 65536, "the codec's largest dim");
  AddInteger(cmd, "--bits", &args->bits, "bits per coordinate", 1, 8);
  cmd->add_option("--kind", args->kind, "mse | prod")->capture_default_str();
  AddInteger(cmd, "--threads", &args->threads, "threads for the multi-thread row (0 = all)", 0, kMaxThreads);
  AddInteger(cmd, "--mbytes", &args->mbytes, "MiB of fp32 input per run", 1, 1 << 20);
  AddInteger(cmd, "--reps", &args->reps, "repetitions (best is kept)", 1, 1000);
  cmd->add_flag("--json", args->json, "print JSON");
  cmd->callback([args] {
    CodecSpec spec;
    spec.dim = args->dim;
    spec.bits = args->bits;
    if (args->kind == "mse") {
      spec.kind = CodecKind::kMse;
    } else if (args->kind == "prod") {
      spec.kind = CodecKind::kProd;
    } else {
      Fail(InvalidArgumentError("--kind must be mse or prod, got '" + args->kind + "'"));
    }
    auto codec = Codec::Create(spec);
    if (!codec.ok()) Fail(codec.status());
    // The fp32 input, its decoded copy and the codes (at most 2 bytes a value
    // with QJL and scales).
    CheckFitsInMemory(static_cast<double>(args->mbytes) * 1048576.0 * 2.5, "--mbytes",
                      "the input, a decoded copy and the codes");
    const size_t threads = args->threads ? args->threads : HardwareThreads();
    const size_t rows = std::max<size_t>(1, (args->mbytes << 20) / (args->dim * sizeof(float)));
    Progress progress("bench codec");
    auto res = MeasureThroughput(*codec, rows, threads, args->reps, &progress);
    progress.Done();
    if (args->json) {
      nlohmann::json j;
      j["codec"] = ToString(spec);
      j["cpu"] = CpuModel();
      j["simd_target"] = ActiveSimdTarget();
      j["rows"] = rows;
      j["row_bytes"] = codec->row_bytes();
      j["results"] = nlohmann::json::array();
      for (const auto& r : res) {
        j["results"].push_back({{"threads", r.threads}, {"encode_gbps", r.encode_gbps},
                                {"decode_gbps", r.decode_gbps}, {"memcpy_gbps", r.memcpy_gbps},
                                {"encode_vs_memcpy", r.encode_gbps / r.memcpy_gbps},
                                {"decode_vs_memcpy", r.decode_gbps / r.memcpy_gbps}});
      }
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("codec %s, %zu rows (%zu MiB fp32), %zu B/row, %s, SIMD %s\n", ToString(spec).c_str(),
                  rows, args->mbytes, codec->row_bytes(), CpuModel().c_str(), ActiveSimdTarget());
      Table t({"threads", "encode GB/s", "decode GB/s", "memcpy GB/s", "encode/memcpy"});
      for (const auto& r : res) {
        t.AddRow({std::to_string(r.threads), FmtFixed(r.encode_gbps, 2), FmtFixed(r.decode_gbps, 2),
                  FmtFixed(r.memcpy_gbps, 2), FmtFixed(r.encode_gbps / r.memcpy_gbps, 2)});
      }
      t.Print(stdout);
    }
  });
}

void RegisterDemo(CLI::App& app) {
  struct Args {
    size_t samples = 20000;
    std::string model;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("demo", "built-in showcase: distortion vs the paper's bounds, bytes, throughput");
  AddInteger(cmd, "--samples", &args->samples, "vectors per bit width", 2, 10000000);
  cmd->add_option("--model", args->model,
                  "model for the model section (default: ../shared/data/stories260K.bin when present)");
  cmd->callback([args] {
    const size_t dim = 128;
    CheckFitsInMemory(static_cast<double>(args->samples) * (dim * 14.0 + 8.0), "--samples",
                      "three fp32 vectors and a code row per sample");
    std::printf("turboquant demo: TurboQuant codecs on %zu uniform random unit vectors, d = %zu\n",
                args->samples, dim);
    std::printf("CPU: %s, SIMD target: %s, hardware threads: %zu\n\n", CpuModel().c_str(), ActiveSimdTarget(),
                HardwareThreads());
    DistortionOptions o;
    o.dim = dim;
    o.samples = args->samples;
    Progress progress("demo distortion");
    auto rows = MeasureDistortion(o, [&](size_t a, size_t b) { progress.Update(a, b); });
    if (!rows.ok()) Fail(rows.status());
    progress.Done();
    std::printf("1) Distortion (paper Thm 1: 4^-b <= D_mse <= sqrt(3)pi/2 4^-b; Thm 2: prod is unbiased)\n");
    PrintDistortionTable(*rows, dim);

    std::printf("\n2) Stored bytes per %zu-d vector (fp16 scales, norm correction on) and throughput (1 thread)\n", dim);
    Table t({"codec", "bytes", "bits/value", "vs fp16", "encode GB/s", "decode GB/s", "memcpy GB/s"});
    for (int b = 1; b <= 4; ++b) {
      CodecSpec spec{.dim = dim, .bits = b};
      auto c = Codec::Create(spec);
      if (!c.ok()) Fail(c.status());
      auto tp = MeasureThroughput(*c, 32768, 1, 3, nullptr);
      t.AddRow({"mse b=" + std::to_string(b), std::to_string(c->row_bytes()),
                FmtFixed(c->bits_per_value(), 3), FmtFixed(2.0 * dim / c->row_bytes(), 2) + "x",
                FmtFixed(tp[0].encode_gbps, 2), FmtFixed(tp[0].decode_gbps, 2),
                FmtFixed(tp[0].memcpy_gbps, 2)});
    }
    for (const char* recipe : {"turboquant25", "turboquant35"}) {
      auto s = SplitRecipe(recipe, dim);
      if (!s.ok()) Fail(s.status());
      auto sc = SplitCodec::Create(*s);
      if (!sc.ok()) Fail(sc.status());
      t.AddRow({recipe, std::to_string(sc->row_bytes()), FmtFixed(sc->bits_per_value(), 3),
                FmtFixed(2.0 * dim / sc->row_bytes(), 2) + "x", "-", "-", "-"});
    }
    t.Print(stdout);

    std::printf("\n3) KV cache presets for a Llama-3-8B-shaped model (32 layers, 8 KV heads, head_dim 128):\n"
                "   bytes per token (K+V, all layers, every byte of metadata) and tokens per 16 GiB\n");
    Table kv({"preset", "bits/value", "bytes/token", "vs fp16", "tokens in 16 GiB"});
    for (const char* name : {"k16_v16", "k8_v8", "k4_v4", "k4_v3", "k3_v3", "turboquant35", "kivi4"}) {
      auto p = GetKVPreset(name);
      auto bytes = PresetBytesPerTokenHead(*p, dim);
      if (!bytes.ok()) Fail(bytes.status());
      const double per_token = 32.0 * 8.0 * static_cast<double>(*bytes);
      kv.AddRow({name, FmtFixed(*PresetBitsPerValue(*p, dim), 3), FmtFixed(per_token, 0),
                 FmtFixed(512.0 / static_cast<double>(*bytes), 2) + "x",
                 std::to_string(static_cast<size_t>(16.0 * 1073741824.0 / per_token))});
    }
    kv.Print(stdout);
    std::printf("   (row sizes; a live cache's ledger also counts dense windows and buffer slack: tq bench kv)\n");

    // Attention on K/V of the head_dim that served models use, before the
    // tiny model (head_dim 8), where per-row scales weigh more.
    const KVSource src = QualitySources({}, 0).front();
    std::printf("\n4) Attention on the compressed cache: %s,\n"
                "   every token compressed; error vs fp64 attention on the original K/V\n", src.name.c_str());
    Table q({"preset", "bits/value", "K rel MSE", "V rel MSE", "attn out rel err"});
    Progress qp("demo attention quality");
    const char* quality_presets[] = {"k8_v8", "k4_v4", "k4_v3", "k3_v3", "kivi4", "kivi2"};
    for (size_t i = 0; i < std::size(quality_presets); ++i) {
      qp.Update(i, std::size(quality_presets));
      const QualityRow r = MeasureQuality(quality_presets[i], src);
      q.AddRow({r.preset, FmtFixed(r.bits_per_value, 3), Fmt(r.k_rel_mse, 3), Fmt(r.v_rel_mse, 3),
                Fmt(r.attn_rel_err, 3)});
    }
    qp.Done();
    q.Print(stdout);
    std::printf("   (more presets and real K/V: tq bench kv-quality; a real encoder: docs/BENCHMARKS.md)\n");
    DemoModelSection(args->model);
    std::printf("\nMore: tq distortion --help, tq bench codec --help, tq bench kv --help, tq eval --help\n");
  });
}

}  // namespace tq::tools
