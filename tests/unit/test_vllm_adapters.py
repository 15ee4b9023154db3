"""How the vLLM engine names adapters to vLLM, and its per-adapter request counts."""

from __future__ import annotations

from types import SimpleNamespace

from server.core.types import AdapterHandle, AdapterLoad
from server.engines.vllm import adapter_loads, engine_lora_name


def handle(name: str, int_id: int) -> AdapterHandle:
    return AdapterHandle(name=name, int_id=int_id, path=f"/adapters/{name}")


def test_each_engine_identity_of_a_name_has_its_own_engine_name() -> None:
    # vLLM's LoRARequest equals another by name alone: the old and the new weights of one
    # adapter, in one step, must not look like one adapter to its worker
    assert engine_lora_name(handle("hot", 15)) != engine_lora_name(handle("hot", 16))
    assert engine_lora_name(handle("hot", 15)) == engine_lora_name(handle("hot", 15))


def test_engine_names_never_collide_between_adapters() -> None:
    handles = [handle("x", 5), handle("x/5", 7), handle("x", 57), handle("x/", 57),
               handle("x/57", 1), handle("org/model", 5)]
    assert len({engine_lora_name(h) for h in handles}) == len(handles)


def test_loads_add_up_every_engine_identity_of_a_name() -> None:
    old, new, other = handle("hot", 15), handle("hot", 16), handle("a1", 3)
    known = {
        engine_lora_name(old): SimpleNamespace(running={"r1", "r2"}),
        engine_lora_name(new): SimpleNamespace(running={"r3"}),
    }
    loads = adapter_loads({old: 2, new: 3, other: 1}, known)
    assert loads == {"hot": AdapterLoad(running=3, waiting=2),
                     "a1": AdapterLoad(running=0, waiting=1)}


def test_loads_never_count_more_running_than_this_front_end_submitted() -> None:
    # the engine's states also hold other front ends' requests
    hot = handle("hot", 15)
    known = {engine_lora_name(hot): SimpleNamespace(running={"r1", "r2", "r3"})}
    assert adapter_loads({hot: 1}, known) == {"hot": AdapterLoad(running=1, waiting=0)}
