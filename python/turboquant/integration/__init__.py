"""Framework integration helpers (HuggingFace / vLLM layers are not built yet)."""
