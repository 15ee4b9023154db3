"""OpenAI API as vLLM serves it (with vLLM's extensions)."""
