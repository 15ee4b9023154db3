"""`quick_init`: a frozen slots dataclass whose `__init__` stores fields through their slots.

A frozen dataclass's generated `__init__` stores every field with `object.__setattr__(self,
name, value)` (the class's own `__setattr__` refuses), several times the cost of a plain store.
A request builds about twenty of these values (100-170 fields: its sampling, the engine
request, events, result, reply parts), and that alone was 10-15 % of a non-streamed request's
work in the gateway. The `__init__` made here takes the same parameters (positional or
keyword-only, defaults, default factories) and writes each slot through its descriptor: about
half the cost. The class stays frozen: assigning or deleting a field still raises
`FrozenInstanceError`, and `replace()`, `==` and `hash()` are the dataclass's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")
_UNSET = object()  # a field with a default factory was not passed


def quick_init(cls: type[T]) -> type[T]:
    """Apply above `@dataclass(frozen=True, slots=True, ...)`; a class with `__post_init__`,
    init-only or `init=False` fields is refused (its `__init__` does more than store)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: quick_init needs a frozen slots dataclass")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    code = cls.__init__.__code__
    parameters = code.co_argcount + code.co_kwonlyargcount - 1  # InitVars are parameters too
    stores_only = all(f.init for f in fields) and parameters == len(fields)
    if hasattr(cls, "__post_init__") or not stores_only:
        raise TypeError(f"{cls.__name__}: quick_init only stores fields")
    namespace: dict[str, Any] = {"_UNSET": _UNSET}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for f in fields:
        name = f.name
        namespace[f"_set_{name}"] = cls.__dict__[name].__set__  # the slot's member descriptor
        if f.default is not dataclasses.MISSING:
            namespace[f"_default_{name}"] = f.default
            param = f"{name}=_default_{name}"
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory_{name}"] = f.default_factory
            param = f"{name}=_UNSET"
            body.append(f"    if {name} is _UNSET:\n        {name} = _factory_{name}()")
        else:
            param = name
        (keyword if f.kw_only else positional).append(param)
        body.append(f"    _set_{name}(self, {name})")
    star = ["*", *keyword] if keyword else []
    source = f"def __init__(self, {', '.join([*positional, *star])}):\n" + "\n".join(
        body or ["    pass"]
    )
    exec(source, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = {f.name: f.type for f in fields} | {"return": None}
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
