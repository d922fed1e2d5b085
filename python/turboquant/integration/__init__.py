"""Framework integrations: `common` (config, policy, errors, backends), `hf`
(HuggingFace transformers cache + attention function; imports torch and
transformers; its CUDA side in `hf_cuda`, the masks it accepts in
`hf_masks`) and `vllm` (vLLM-compatible paged layer, recipes, hooks;
imports torch). Import the submodules explicitly."""
