"""The one error-table mechanism (protocols/common/errors.py): MRO lookup, as Starlette's
exception handlers, and every protocol's table built on it."""

from __future__ import annotations

import pytest

from protocols.common.errors import ErrorTable
from server.core.errors import (
    AdapterNotFound,
    AdapterSourceMissing,
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
)


class _Custom(AdapterNotFound):
    """A subclass no table names: it takes its closest parent's row."""


def test_the_closest_class_in_the_mro_wins_whatever_the_order_of_the_rows() -> None:
    table = ErrorTable({ModelNotFound: "model", AdapterNotFound: "adapter"}, default="other")
    assert table[AdapterNotFound("x")] == "adapter"
    assert table[_Custom("x")] == "adapter"
    assert table[ModelNotFound("x")] == "model"
    assert table[InvalidRequest("x")] == "other"


def test_a_gateway_error_row_is_the_default_for_every_domain_error() -> None:
    table = ErrorTable({GatewayError: 500, InvalidRequest: 400}, default=0)
    assert table[ContextLengthExceeded("x")] == 400
    assert table[AdapterSourceMissing("x")] == 400
    assert table[ModelNotFound("x")] == 500


def test_a_row_may_be_none_and_is_still_found() -> None:
    table: ErrorTable[str | None] = ErrorTable({InvalidRequest: None}, default="default")
    assert table[InvalidRequest("x")] is None
    assert table[InvalidRequest("y")] is None  # resolved once, then cached
    assert table[ModelNotFound("x")] == "default"


@pytest.mark.parametrize(
    ("error", "status"),
    [(InvalidRequest("x"), 422), (AdapterNotFound("x"), 422), (_Custom("x"), 422),
     (GatewayError("x"), 424)],
)
def test_tgi_renders_through_the_table(error: GatewayError, status: int) -> None:
    from protocols.tgi import errors

    assert errors.classify(error)[0] == status
