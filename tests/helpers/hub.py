"""A Hugging Face hub cache written in the hub's own layout, and a loopback stand-in for the Hub's
HTTP API (the endpoints huggingface_hub's snapshot_download calls), so the tests resolve and
download `org/name` repo ids with the real huggingface_hub and nothing leaves the machine.

    <cache>/models--org--name/blobs/<sha256>               the files' bytes
    <cache>/models--org--name/snapshots/<commit>/<file>    relative symlinks to the blobs
    <cache>/models--org--name/refs/main                    the commit
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def write_cache(cache: Path, repo_id: str, model_dir: Path, commit: str = "c" * 40) -> Path:
    """Put the files of `model_dir` into `cache` as repo `repo_id` at `commit` (refs/main);
    returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(model_dir.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


class FakeHub:
    """The Hub's repo-info, tree and resolve endpoints for local model directories, on
    127.0.0.1 (a thread); `requests` counts the files served."""

    def __init__(self, repos: dict[str, Path], commit: str = "d" * 40):
        self.repos, self.commit, self.files_served = repos, commit, 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def do_GET(self, head=False):
                path = self.path.split("?", 1)[0]
                for rid, d in hub.repos.items():
                    files = sorted(p for p in d.iterdir() if p.is_file())
                    if path.startswith(f"/api/models/{rid}/revision/"):
                        info = {"id": rid, "sha": hub.commit}
                        info["siblings"] = [{"rfilename": p.name} for p in files]
                        return self._send(200, json.dumps(info).encode(), head=head)
                    if path.startswith(f"/api/models/{rid}/tree/"):
                        tree = [
                            {
                                "type": "file",
                                "path": p.name,
                                "size": p.stat().st_size,
                                "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                            }
                            for p in files
                        ]
                        return self._send(200, json.dumps(tree).encode(), head=head)
                    prefix = f"/{rid}/resolve/"
                    if path.startswith(prefix):
                        name = path[len(prefix) :].split("/", 1)[-1]
                        f = d / name
                        if f.is_file():
                            data = f.read_bytes()
                            tag = '"' + hashlib.sha256(data).hexdigest() + '"'
                            if not head:
                                hub.files_served += 1
                            headers = {"X-Repo-Commit": hub.commit, "ETag": tag}
                            return self._send(200, data, headers, head=head)
                self._send(404, headers={"X-Error-Code": "RepoNotFound"}, head=head)

            def do_HEAD(self):
                self.do_GET(head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
