"""Real adapter sources on loopback for the tests: moto's standalone S3 server (behind a TCP
proxy that can slow or cut transfers), an HTTPS file server with a test CA, and a Hub cache."""

from __future__ import annotations

import contextlib
import http.server
import io
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import trustme

from tests.serverproc import free_port

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoServer:
    """moto's standalone S3-compatible server in its own process (state lives in memory)."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.folder = folder
        self.process: subprocess.Popen[bytes] | None = None
        self.runs = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.folder / f"moto-{self.runs}.log"

    def start(self) -> None:
        self.runs += 1
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(self.url + "/moto-api/", timeout=2)
                return
            time.sleep(0.2)
        raise RuntimeError(f"moto did not start: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)

    def gets(self, key_part: str) -> int:
        """GET requests this run's server answered for object keys containing `key_part`."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return sum(1 for line in lines if '"GET /' in line and key_part in line
                   and "list-type" not in line)

    def reads(self) -> tuple[int, int]:
        """(object GETs, LISTs) this run's server answered so far."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        lists = sum(1 for line in lines if "list-type" in line)
        return sum(1 for line in lines if '"GET /' in line) - lists, lists

    def client(self) -> Any:
        return boto3.session.Session(**{
            "aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": S3_ENV["AWS_DEFAULT_REGION"],
        }).client("s3", endpoint_url=self.url)

    def upload(self, bucket: str, prefix: str, folder: Path) -> None:
        s3 = self.client()
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=bucket)
        for file in sorted(folder.iterdir()):
            s3.upload_file(str(file), bucket, f"{prefix}/{file.name}")


class Proxy:
    """A TCP proxy in front of moto: `rate` bytes/s from the server (None: unlimited);
    `cut()` resets every open connection, as a server that stops mid-transfer."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.rate: float | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        with self._lock:
            for sock in list(self._open):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.close()
            self._open.clear()

    def close(self) -> None:
        self._listener.close()
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, slow: bool | None) -> None:
        try:
            while chunk := source.recv(1024):
                if slow and self.rate:
                    time.sleep(len(chunk) / self.rate)
                target.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.close()


class FileServer:
    """HTTPS on 127.0.0.1 with a test CA: files from `root`; /hang/* never answers (until the
    server stops), /forbidden/* answers 403."""

    def __init__(self, root: Path, ca: trustme.CA) -> None:
        self.root = root
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        stopping = threading.Event()
        self.stopping = stopping
        served = root

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(served), **kwargs)

            def do_GET(self) -> None:
                if self.path.startswith("/hang/"):
                    stopping.wait(60)
                    return
                if self.path.startswith("/forbidden/"):
                    self.send_error(403)
                    return
                super().do_GET()

            def log_message(self, *args: Any) -> None:
                return None

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.port}/{path}"

    def close(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()


def tar_gz(folder: Path, target: Path, top: str | None = None) -> Path:
    with tarfile.open(target, "w:gz") as tar:
        for file in sorted(folder.iterdir()):
            tar.add(file, arcname=f"{top}/{file.name}" if top else file.name)
    return target


def zip_of(folder: Path, target: Path) -> Path:
    with zipfile.ZipFile(target, "w") as zipped:
        for file in sorted(folder.iterdir()):
            zipped.write(file, file.name)
    return target


def evil_tar(target: Path, name: str, *, link: bool = False) -> Path:
    with tarfile.open(target, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        if link:
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
    return target


def hub_cache(home: Path, repo: str, folder: Path) -> None:
    """A Hugging Face cache (HF_HOME) holding `repo` at main, as huggingface_hub lays it out."""
    commit = "0" * 39 + "1"
    base = home / "hub" / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snapshot = base / "snapshots" / commit
    shutil.copytree(folder, snapshot)


@contextlib.contextmanager
def sources_running(folder: Path) -> Iterator[tuple[MotoServer, Proxy, FileServer, Path]]:
    ca = trustme.CA()
    ca_file = folder / "source-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    moto = MotoServer(folder)
    moto.start()
    proxy = Proxy(moto.port)
    files = FileServer(folder / "www", ca)
    try:
        yield moto, proxy, files, ca_file
    finally:
        files.close()
        proxy.close()
        moto.stop()
