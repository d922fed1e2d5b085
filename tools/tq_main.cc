// tq: the turboquant command-line tool.
#include <cstdio>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "tq/version.h"

int main(int argc, char** argv) {
  CLI::App app{"tq: TurboQuant online vector quantization (codecs, distortion, benchmarks)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::to_string(TQ_VERSION_MAJOR) + "." +
                                        std::to_string(TQ_VERSION_MINOR) + "." +
                                        std::to_string(TQ_VERSION_PATCH));
  tq::tools::RegisterDemo(app);
  tq::tools::RegisterDistortion(app);
  CLI::App* bench = app.add_subcommand("bench", "benchmarks (JSON with --json)");
  bench->require_subcommand(1);
  tq::tools::RegisterBenchCodec(*bench);
  tq::tools::RegisterBenchKv(*bench);
  tq::tools::RegisterBenchKvQuality(*bench);
  tq::tools::RegisterBenchAttention(*bench);
  tq::tools::RegisterBenchAttentionQuality(*bench);
  tq::tools::RegisterSearch(app);
  tq::tools::RegisterEval(app);
  tq::tools::RegisterKv(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return 0;
}
