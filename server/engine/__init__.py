"""Engine implementations of the `server.core.engine.Engine` port (vLLM, fake).

Importing this package imports no engine library: `vllm_engine` loads vLLM only when an engine
is created.
"""
