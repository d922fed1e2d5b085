// Subcommands of the tq tool. Each Register* adds its subcommand to the app.
#ifndef TQ_TOOLS_COMMANDS_H_
#define TQ_TOOLS_COMMANDS_H_

#include <CLI/CLI.hpp>

namespace tq::tools {

void RegisterDemo(CLI::App& app);
void RegisterDistortion(CLI::App& app);
void RegisterBenchCodec(CLI::App& bench);
void RegisterBenchKv(CLI::App& bench);
void RegisterBenchKvQuality(CLI::App& bench);
void RegisterBenchAttention(CLI::App& bench);
void RegisterBenchAttentionQuality(CLI::App& bench);
void RegisterSearch(CLI::App& app);
void RegisterEval(CLI::App& app);
void RegisterKv(CLI::App& app);

}  // namespace tq::tools

#endif  // TQ_TOOLS_COMMANDS_H_
