"""llm-gateway: one server, many protocols, one vLLM engine with LoRA adapters."""

__version__ = "0.1.0"
