"""Framework integrations: `common` (config, policy, errors, backends), `hf`
(HuggingFace transformers cache + attention function; imports torch and
transformers) and `vllm` (vLLM-compatible paged layer, recipes, hooks;
imports torch). Import the submodules explicitly."""
