"""The request ids a client may choose for a request (MindIE's `id`, Triton/KServe's `id`) and
name again to stop it (`stopInfer`)."""

from __future__ import annotations

# The ids MindIE accepts for a request's `id` and for stopInfer (its std::regex, whole string).
CLIENT_REQUEST_ID = r"^[a-zA-Z0-9_-]{1,256}$"
