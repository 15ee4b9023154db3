"""DJL / SageMaker adapter selectors (server/http/sagemaker.py): DJL's precedence and its errors."""

from __future__ import annotations

import pytest

from server.core.errors import InvalidRequest
from server.http.sagemaker import COUNT_MISMATCH, Selectors, custom_attribute_adapter

# ---- precedence and errors (pure) ---------------------------------------------------------------

@pytest.mark.parametrize(
    ("selectors", "adapters", "expected"),
    [(Selectors(), None, None),
     (Selectors(), ["a1", ""], ["a1", ""]),
     (Selectors(), "a1", ["a1", "a1"]),
     (Selectors(workflow="wf"), ["a1", ""], ["wf", "wf"]),
     (Selectors(workflow="wf", query="q"), "a1", ["q", "q"]),
     (Selectors(workflow="wf", query="q", custom_attributes="c"), "a1", ["c", "c"]),
     (Selectors(workflow="wf", query="q", custom_attributes="c", header="h"), "a1", ["h", "h"]),
     (Selectors(query="q", header="h"), None, ["h", "h"]),
     (Selectors(header=""), ["a1", "a2"], ["", ""])],
    ids=["nothing", "body list", "body name", "workflow over body", "query over workflow",
         "attributes over query", "header over all", "header over query", "empty header = base"],
)
def test_later_selectors_win_as_djl_reads_them(
    selectors: Selectors, adapters: object, expected: list[str] | None
) -> None:
    assert selectors.names(2, adapters) == expected


def test_a_list_needs_one_adapter_per_input() -> None:
    with pytest.raises(InvalidRequest, match=COUNT_MISMATCH):
        Selectors().names(2, ["a1"])
    with pytest.raises(InvalidRequest, match=COUNT_MISMATCH):
        Selectors().names(1, ["a1", "a2"])


@pytest.mark.parametrize("adapters", [5, ["a1", 5], {"a": "b"}])
def test_adapters_of_another_type_are_refused(adapters: object) -> None:
    with pytest.raises(InvalidRequest, match="adapters must be a string or a list of strings"):
        Selectors(query="q").names(1, adapters)


@pytest.mark.parametrize(
    ("header", "expected"),
    [("adapter=a1", "a1"), ("x=1;adapter=a2", "a2"), (" Adapter = a3 ; x=1", "a3"),
     ("adapter=a1;adapter=a2", "a2"), ("adapter=a=b", "a=b"), ("x=1, adapter=a3", None),
     ("x=1", None), ("", None), (None, None)],
)
def test_custom_attributes_split_as_djls_request_parser(
    header: str | None, expected: str | None
) -> None:
    assert custom_attribute_adapter(header) == expected
