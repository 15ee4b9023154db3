"""Engines behind the core's `Engine` port: vLLM (the only importer of vllm) and the fake."""
