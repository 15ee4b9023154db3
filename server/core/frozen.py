"""`quick_init`: a frozen slots dataclass whose `__init__` stores fields through their slots.

A frozen dataclass's generated `__init__` stores every field with `object.__setattr__(self,
name, value)` (the class's own `__setattr__` refuses), several times the cost of a plain store.
A request builds about twenty of these values (100-170 fields: its sampling, the engine
request, events, result, reply parts), and that alone was 10-15 % of a non-streamed request's
work in the gateway. The `__init__` made here takes the same parameters (positional or
keyword-only, defaults, default factories) and writes each slot through its descriptor: about
half the cost. The class stays frozen: assigning or deleting a field still raises
`FrozenInstanceError`, and `replace()`, `==` and `hash()` are the dataclass's own.

`replaced(value, **changes)` is `dataclasses.replace` for such a class without its per-call walk
over the fields (which checks each field's kind and builds the keyword arguments of a new
`__init__` call): a copy of every slot, then the changes stored. 3-5x cheaper; the protocols'
sampling and the service's engine request are replaced on every request.
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
    setattr(cls, _REPLACE, _copier(cls, [f.name for f in fields]))
    return cls


_REPLACE = "_quick_replace"


def _copier(cls: type[T], names: list[str]) -> Any:
    """`copy(value, changes)`: a new instance holding `value`'s fields, then `changes`."""
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    setters = {name: cls.__dict__[name].__set__ for name in names}
    namespace["_setters"] = setters
    lines = ["def copy(self, changes):", "    new = _new(_cls)"]
    for name in names:
        namespace[f"_set_{name}"] = setters[name]
        lines.append(f"    _set_{name}(new, self.{name})")
    lines += [
        "    for name, value in changes.items():",
        "        _setters[name](new, value)",
        "    return new",
    ]
    exec("\n".join(lines), namespace)
    return namespace["copy"]


def replaced(value: T, /, **changes: Any) -> T:
    """`dataclasses.replace(value, **changes)`, faster for a `quick_init` class (the class
    itself: a subclass has fields of its own)."""
    copy = type(value).__dict__.get(_REPLACE)
    if copy is not None:
        try:
            return copy(value, changes)  # type: ignore[no-any-return]
        except KeyError:  # not a field: the dataclass's own error
            pass
    return dataclasses.replace(value, **changes)  # type: ignore[type-var]
