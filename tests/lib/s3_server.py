"""A real S3-compatible server for tests: moto's server mode, with credentials checked.

moto runs from its own environment (``make test`` builds ``.venv/s3-server``):
it needs botocore, which pins python-dateutil below 3 while the Kubernetes
client Tollgate uses needs 3 or later. Tollgate's own S3 client (minio) talks
to it over HTTP like to any store.

The server starts with IAM authentication on: its first three requests
(unauthenticated, as moto allows) create the user whose keys the tests use;
every later request must be signed with them.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.lib.net import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
MOTO_SERVER = Path(
    os.environ.get(
        "TOLLGATE_TEST_MOTO_SERVER", ROOT / ".venv" / "s3-server" / "bin" / "moto_server"
    )
)


class MotoServer:
    """moto's S3 server on a free loopback port, with one IAM user allowed everything."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.access_key = ""
        self.secret_key = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if not MOTO_SERVER.exists():
            raise RuntimeError(f"{MOTO_SERVER} is missing: run `make test` (it installs it)")
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
        log = open(self.workdir / "moto.log", "wb")
        self.proc = subprocess.Popen(
            [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            wait_for_port(self.port, 30)
        except TimeoutError:
            log.close()
            moto_log = (self.workdir / "moto.log").read_text()
            raise RuntimeError(f"moto did not start: {moto_log}") from None
        self._create_user()

    def _iam(self, **params: str) -> str:
        # unsigned: these are within moto's INITIAL_NO_AUTH_ACTION_COUNT
        fake_sig = (
            "AWS4-HMAC-SHA256 Credential=setup/20260101/us-east-1/iam/aws4_request, "
            "SignedHeaders=host, Signature=0"
        )
        reply = httpx.post(
            self.url, data={"Version": "2010-05-08", **params}, headers={"Authorization": fake_sig}
        )
        reply.raise_for_status()
        return reply.text

    def _create_user(self) -> None:
        self._iam(Action="CreateUser", UserName="tollgate")
        created = self._iam(Action="CreateAccessKey", UserName="tollgate")
        access = re.search(r"<AccessKeyId>(.*?)</AccessKeyId>", created)
        secret = re.search(r"<SecretAccessKey>(.*?)</SecretAccessKey>", created)
        assert access and secret, created
        self.access_key, self.secret_key = access[1], secret[1]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        self._iam(
            Action="PutUserPolicy",
            UserName="tollgate",
            PolicyName="all",
            PolicyDocument=json.dumps(policy),
        )

    def client(self) -> Any:
        from minio import Minio

        return Minio(
            f"127.0.0.1:{self.port}",
            access_key=self.access_key,
            secret_key=self.secret_key,
            secure=False,
            region="us-east-1",
        )

    def put(self, bucket: str, key: str, data: bytes, part_mb: int = 5) -> str:
        """Upload (as a multipart upload when larger than ``part_mb``); the ETag."""
        client = self.client()
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
        result = client.put_object(
            bucket, key, io.BytesIO(data), len(data), part_size=part_mb << 20
        )
        return str(result.etag)

    def put_file(self, bucket: str, key: str, path: Path, part_mb: int = 16) -> str:
        client = self.client()
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
        return str(client.fput_object(bucket, key, str(path), part_size=part_mb << 20).etag)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class CuttingProxy:
    """A TCP proxy that drops connections mid-response, like a flaky network.

    A connection is closed once ``after_bytes`` of response have gone through
    it, ``cuts`` times in all (every time with ``cuts=-1``). With
    ``bytes_per_s`` each connection's responses are also held to that rate,
    as an object store holds each connection to its own bandwidth.
    """

    def __init__(
        self, target_port: int, after_bytes: int = 0, cuts: int = 0, bytes_per_s: float = 0
    ) -> None:
        self.target_port = target_port
        self.after_bytes = after_bytes
        self.bytes_per_s = bytes_per_s
        self.cuts_left = cuts
        self.cut = 0  # connections cut so far
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _should_cut(self) -> bool:
        with self._lock:
            if self.cuts_left == 0:
                return False
            self.cuts_left -= 1
            self.cut += 1
            return True

    def _pump(self, src: socket.socket, dst: socket.socket, responses: bool) -> None:
        sent = 0
        limit = self.after_bytes if responses and self.cuts_left != 0 else None
        due = 0.0  # when the bytes sent so far may have arrived at the set rate
        try:
            while data := src.recv(65536):
                if responses and self.bytes_per_s:
                    now = time.monotonic()
                    due = max(due, now) + len(data) / self.bytes_per_s  # idle earns no credit
                    time.sleep(max(0.0, due - now - len(data) / self.bytes_per_s))
                if limit is not None and sent + len(data) > limit:
                    if self._should_cut():
                        dst.sendall(data[: limit - sent])
                        break
                    limit = None  # no cuts left: this connection goes through
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._server.close()


class ListingProxy:
    """An HTTP proxy to the S3 server whose listings name other keys: a malicious store.

    Requests go through unchanged (their signatures name this proxy's address,
    which moto checks as it would its own); in every answer ``renames`` maps
    an object key the store holds to the key the listing shows instead, such
    as one with ``..`` segments that no well-behaved store would hand out.
    """

    def __init__(self, target_port: int, renames: dict[str, str]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from xml.sax.saxutils import escape

        target = f"http://127.0.0.1:{target_port}"
        swaps = [
            (f"<Key>{escape(old)}</Key>".encode(), f"<Key>{escape(new)}</Key>".encode())
            for old, new in renames.items()
        ]
        hop = {"connection", "keep-alive", "transfer-encoding", "content-length"}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                reply = httpx.request(
                    self.command, target + self.path, headers=headers, content=body, timeout=30
                )
                data = reply.content
                for old, new in swaps:
                    data = data.replace(old, new)
                self.send_response(reply.status_code)
                for name, value in reply.headers.items():
                    if name.lower() not in hop | {"content-encoding"}:
                        self.send_header(name, value)
                if self.command == "HEAD":  # the object's length, and no body
                    self.send_header("Content-Length", reply.headers.get("Content-Length", "0"))
                    self.end_headers()
                    return
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
