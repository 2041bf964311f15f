"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, serving one repository from a local
directory: what ``huggingface_hub.snapshot_download`` asks (the repo's revision, its file tree, each
file's headers and bytes), so a download runs end to end where the network does not reach the hub.
``with FakeHub(directory, "org/name") as hub:`` then point ``HF_ENDPOINT`` at ``hub.url``."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "c0ffee" + "0" * 34


class FakeHub:
    def __init__(self, root: Path, repo_id: str) -> None:
        self.root, self.repo_id = Path(root), repo_id
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _files(self) -> list[str]:
        return [p.relative_to(self.root).as_posix() for p in sorted(self.root.rglob("*")) if p.is_file()]

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = urlparse(handler.path).path
        self.requests.append((handler.command, path))
        api = f"/api/models/{self.repo_id}"
        if path.startswith(f"{api}/tree/"):
            data = json.dumps([{"type": "file", "path": name, "size": (self.root / name).stat().st_size,
                                "oid": hashlib.sha1((self.root / name).read_bytes()).hexdigest()}
                               for name in self._files()]).encode()
            return _send(handler, 200, data, {"Content-Type": "application/json"}, body)
        if path.startswith(api):
            data = json.dumps({"id": self.repo_id, "sha": COMMIT, "private": False,
                               "siblings": [{"rfilename": name} for name in self._files()]}).encode()
            return _send(handler, 200, data, {"Content-Type": "application/json"}, body)
        prefix = f"/{self.repo_id}/resolve/"
        name = unquote(path[len(prefix):].partition("/")[2]) if path.startswith(prefix) else ""
        file = self.root / name
        if not name or not file.is_file():
            return _send(handler, 404, b"", {"X-Error-Code": "EntryNotFound"}, body)
        data = file.read_bytes()
        _send(handler, 200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, body)


def _send(handler: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
    handler.send_response(status)
    for key, value in headers.items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if body:
        handler.wfile.write(data)
