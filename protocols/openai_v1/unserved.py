"""vLLM 0.32 request fields the engine port here does not carry: each is accepted at vLLM's
default (what a client that never sets it sends) and refused otherwise, never dropped
(docs/protocols.md, "Request fields: applied or refused")."""

from __future__ import annotations

from protocols.common.unserved import Neutral

# field → the values that ask for nothing (vLLM's default, and null); the wire models keep
# unknown keys as extras, which `protocols.common.unserved.refuse_unserved` checks
_COMMON: Neutral = {
    "cache_salt": (None,),  # no prefix cache to isolate per tenant through the port
    "kv_transfer_params": (None,),  # disaggregated prefill
    "ec_transfer_params": (None,),
    "mm_payload": (None, "tensors"),  # multimodal: the model is text-only
    "media_io_kwargs": (None,),
    "mm_processor_kwargs": (None,),
    "return_mm_kwargs": (None, False),
    "vllm_xargs": (None,),  # custom logits processors
    "watermarking": (None, False),
}
COMPLETION: Neutral = {
    **_COMMON,
    "logprob_token_ids": (None,),
    "repetition_detection": (None,),
    "return_tokens_as_token_ids": (None, False),
    "routed_experts_prompt_start": (None, 0),
    "stream_interval": (None,),
    "truncation_side": (None, "left"),  # truncate_prompt_tokens keeps the last tokens
}
CHAT: Neutral = {
    **COMPLETION,
    "documents": (None,),
    "return_prompt_text": (None, False),
}
RESPONSES: Neutral = {
    **_COMMON,
    "enable_response_messages": (None, False),
    "previous_input_messages": (None,),
    "include_reasoning": (None, True),
}
