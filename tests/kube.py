"""deploy/kubernetes rendered as `kubectl kustomize` renders it, for the manifest tests.

kubectl comes from the machine (this image ships Google's `kubectl` package, with kustomize
built in) or, where there is none, from Debian's `kubernetes-client` package, installed here as
the HAProxy tests install HAProxy."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.tools import debian_tool

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
Manifest = dict[str, Any]


def kubectl() -> str:
    return debian_tool("kubectl", "kubernetes-client")


@cache
def rendered() -> tuple[Manifest, ...]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(MANIFESTS)], capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def one(kind: str, name: str | None = None) -> Manifest:
    found = [m for m in rendered() if m["kind"] == kind
             and (name is None or m["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} rendered"
    return found[0]


def container(deployment: Manifest) -> Manifest:
    (gateway,) = deployment["spec"]["template"]["spec"]["containers"]
    return gateway  # type: ignore[no-any-return]


def port_number(gateway: Manifest, port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in gateway["ports"] if p["name"] == port]
    return int(number)


def config_json() -> dict[str, Any]:
    """The rendered ConfigMap's config.json."""
    data = one("ConfigMap")["data"]
    loaded: dict[str, Any] = yaml.safe_load(data["config.json"])
    return loaded
