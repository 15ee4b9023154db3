"""`quick_init`: the same constructor as the dataclass's own, and the class still frozen."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import Any

import pytest

from server.core.frozen import quick_init, replaced
from server.core.types import Delta, FinishReason, GenerationRequest, Sampling, TextPrompt


def _values() -> type[Any]:
    """One declaration with every kind of field: positional, defaults, factories, keyword-only."""

    @dataclass(frozen=True, slots=True)
    class Values:
        a: int
        b: str = "b"
        c: list[int] = field(default_factory=list)
        d: int = field(default=4, kw_only=True)
        e: tuple[int, ...] = field(default=(), kw_only=True)
        f: dict[str, int] = field(default_factory=dict, kw_only=True)

    return Values


Plain = _values()  # the dataclass's own __init__
Fast = quick_init(_values())


CALLS = [
    ((1,), {}),
    ((1, "x"), {}),
    ((1, "x", [2]), {"d": 5, "e": (6,), "f": {"g": 7}}),
    ((), {"a": 1, "c": [3], "f": {}}),
]


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_builds_what_the_dataclass_builds(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    fast, plain = Fast(*args, **kwargs), Plain(*args, **kwargs)
    assert dataclasses.astuple(fast) == dataclasses.astuple(plain)
    assert repr(fast) == repr(plain)


def test_factories_run_per_instance() -> None:
    first, second = Fast(1), Fast(1)
    assert first.c == [] and first.c is not second.c and first.f is not second.f


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((), {}), ((1, "x", [], 9), {}), ((1,), {"g": 1}), ((1,), {"a": 2})],
)
def test_refuses_the_calls_the_dataclass_refuses(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    with pytest.raises(TypeError):
        Plain(*args, **kwargs)
    with pytest.raises(TypeError):
        Fast(*args, **kwargs)


def test_stays_frozen_hashable_and_replaceable() -> None:
    value = Fast(1, e=(2,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.a = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        del value.a
    assert dataclasses.replace(value, a=3) == Fast(3, e=(2,))
    assert Fast.__init__.__qualname__ == "_values.<locals>.Values.__init__"


def test_core_values_keep_their_constructor() -> None:
    delta = Delta(choice=0, text="a", token_ids=(1,), finish=FinishReason.STOP)
    assert (delta.choice, delta.text, delta.token_ids, delta.logprobs) == (0, "a", (1,), ())
    request = GenerationRequest(request_id="r", model="m", prompt=TextPrompt(text="hi"),
                                sampling=Sampling(max_new_tokens=3))
    assert request.sampling.max_new_tokens == 3 and request.stream is False
    assert dataclasses.replace(request, model="n") == GenerationRequest(
        request_id="r", model="n", prompt=request.prompt, sampling=request.sampling
    )
    assert {delta: 1}[Delta(choice=0, text="a", token_ids=(1,), finish=FinishReason.STOP)] == 1


@pytest.mark.parametrize(
    "changes",
    [{}, {"a": 3}, {"b": "y", "f": {"h": 1}}, {"a": 2, "b": "z", "c": [], "d": 0, "e": (1,)}],
)
def test_replaced_is_the_dataclass_replace(changes: dict[str, object]) -> None:
    value = Fast(1, "x", [2], d=5, e=(6,), f={"g": 7})
    fast, plain = replaced(value, **changes), dataclasses.replace(value, **changes)
    assert type(fast) is Fast and fast == plain and fast is not value
    assert dataclasses.astuple(value) == (1, "x", [2], 5, (6,), {"g": 7})  # left as it was
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.a = 0


def test_replaced_refuses_what_replace_refuses_and_serves_other_classes() -> None:
    with pytest.raises(TypeError):
        replaced(Fast(1), g=1)
    assert replaced(Plain(1), a=2) == Plain(2)  # not a quick_init class: dataclasses.replace

    @dataclass(frozen=True, slots=True)
    class Wider(Fast):  # type: ignore[misc, valid-type]
        z: int = 0

    wider = replaced(Wider(1, z=3), a=2)  # a subclass is not copied as its base
    assert type(wider) is Wider and (wider.a, wider.z) == (2, 3)


def test_core_values_replace_alike() -> None:
    sampling = Sampling(max_new_tokens=3, stop=("x",))
    assert replaced(sampling, temperature=0.0, max_new_tokens=None) == dataclasses.replace(
        sampling, temperature=0.0, max_new_tokens=None
    )


@pytest.mark.parametrize("kind", ["post_init", "init_var", "no_init", "not_frozen", "no_slots"])
def test_refuses_classes_whose_init_does_more(kind: str) -> None:
    with pytest.raises(TypeError):
        quick_init(_made(kind))


def _made(kind: str) -> type:
    if kind == "post_init":
        @dataclass(frozen=True, slots=True)
        class WithPost:
            a: int

            def __post_init__(self) -> None:
                pass

        return WithPost
    if kind == "init_var":
        @dataclass(frozen=True, slots=True)
        class WithInitVar:
            a: int
            b: InitVar[int] = 0

        return WithInitVar
    if kind == "no_init":
        @dataclass(frozen=True, slots=True)
        class WithNoInit:
            a: int
            b: int = field(default=0, init=False)

        return WithNoInit
    if kind == "not_frozen":
        @dataclass(slots=True)
        class Mutable:
            a: int

        return Mutable

    @dataclass(frozen=True)
    class NoSlots:
        a: int

    return NoSlots
