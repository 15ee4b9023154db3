"""The house's rule that import-linter cannot see: `server/` knows no protocol by name.

Protocol knowledge lives in `protocols/`; the server reaches it only through the specs. Settings
are the exception (config.json's keys name MindIE's and DJL's options), and so are vLLM's own
names in the vLLM adapter (`vllm.entrypoints.openai`, `UsageContext.OPENAI_API_SERVER`).
"""

from __future__ import annotations

import re
import tokenize
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
PROTOCOL_WORD = re.compile(r"mindie|tgi|djl|sagemaker|triton|kserve|openai|anthropic|lmi", re.I)
VLLM_OWN_NAMES = {"openai", "OPENAI_API_SERVER"}


def _checked_modules() -> list[Path]:
    modules = sorted(SERVER.rglob("*.py"))
    return [p for p in modules if "settings" not in p.relative_to(SERVER).parts]


def _is_vllm_adapter(path: Path) -> bool:
    return "engines" in path.parts and "vllm" in path.relative_to(SERVER).as_posix()


def _protocol_names(path: Path) -> list[str]:
    allowed = VLLM_OWN_NAMES if _is_vllm_adapter(path) else set()
    with path.open("rb") as source:
        names = [t for t in tokenize.tokenize(source.readline) if t.type == tokenize.NAME]
    return [
        f"{path.relative_to(SERVER)}:{t.start[0]} {t.string}"
        for t in names
        if PROTOCOL_WORD.search(t.string) and t.string not in allowed
    ]


def test_no_identifier_in_server_names_a_protocol() -> None:
    found = [name for path in _checked_modules() for name in _protocol_names(path)]
    assert found == []


def test_no_module_in_server_is_named_after_a_protocol() -> None:
    named = [
        str(p.relative_to(SERVER)) for p in _checked_modules()
        if PROTOCOL_WORD.search(p.relative_to(SERVER).as_posix())
    ]
    assert named == []


def test_the_rule_sees_a_protocol_name() -> None:
    assert PROTOCOL_WORD.search("mindie_error") and PROTOCOL_WORD.search("tgi_compat")
    assert _checked_modules(), "the server package was not found"
