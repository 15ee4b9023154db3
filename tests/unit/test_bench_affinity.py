"""Scenario H's two HAProxy configurations (bench/affinity.py): the shipped affinity file with this
run's addresses, and the same file balanced round robin, both accepted by HAProxy itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from unittest import mock

import pytest

from bench.affinity import HASH, arm_config
from bench.servers import Server


def replica(port: int) -> Server:
    return Server(name=f"r{port}", kind="gateway", process=mock.Mock(),
                  url=f"http://127.0.0.1:{port}", log_path=Path("/dev/null"))


@pytest.mark.parametrize("arm", ["affinity", "round-robin"])
def test_each_arm_differs_only_in_the_balance_line(tmp_path: Path, arm: str) -> None:
    text = arm_config(arm, 18080, tmp_path / "admin.sock", [replica(7001), replica(7002)])
    assert "bind 127.0.0.1:18080" in text
    assert "server r1 127.0.0.1:7001 check" in text
    assert "server r2 127.0.0.1:7002 check" in text
    assert str(tmp_path / "admin.sock") in text
    assert (HASH in text) == (arm == "affinity")
    assert ("balance roundrobin" in text) == (arm == "round-robin")
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("no haproxy here to check the syntax (the integration test installs it)")
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    check = subprocess.run([haproxy, "-c", "-f", str(config)], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0, check.stdout + check.stderr
