"""The prover over HTTP: ``veritrain serve RUN_DIR`` answers the verification game's queries.

    GET /manifest                     JSON manifest
    GET /node?lo=&hi=                 {"hash": hex}          subtree hash of leaves [lo, hi)
    GET /leaf?index=                  {"data": hex, "proof": [hex, ...]}
    GET /checkpoint|log|record?step=  the file's bytes
    GET /state_after?step=            {"state_sha256": hex}  (the prover replays the step)
    GET /op_count?step=               {"count": n}
    GET /op?step=&index=              {"op", "where", "inputs", "sources", "outputs"}
    GET /op_inputs?step=&index=       the operator's inputs (engine.dump_call format)

Errors are JSON {"error": message} with status 400 (bad query) or 404 (nothing to answer). Bound to
loopback unless told otherwise: the prover answers anyone who can reach it.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .protocol import Prover, ProverError

MAX_ANSWER = 1 << 30


def make_server(prover: Prover, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    lock = threading.Lock()  # replays share one model: answer one query at a time

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet: the CLI prints what matters
            pass

        def _send(self, status: int, body: bytes, ctype: str):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status, obj):
            self._send(status, json.dumps(obj).encode(), "application/json")

        def do_GET(self):  # noqa: N802 - http.server's name
            url = urllib.parse.urlparse(self.path)
            q = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
            try:
                ints = {k: int(v) for k, v in q.items()}
            except ValueError:
                return self._json(400, {"error": "query parameters must be integers"})
            route = url.path.strip("/")
            try:
                with lock:
                    if route == "manifest":
                        return self._json(200, prover.manifest())
                    if route == "node":
                        return self._json(200, {"hash": prover.node(ints["lo"], ints["hi"]).hex()})
                    if route == "leaf":
                        data, proof = prover.leaf(ints["index"])
                        return self._json(200, {"data": data.hex(), "proof": [p.hex() for p in proof]})
                    if route in ("checkpoint", "log", "record"):
                        return self._send(200, getattr(prover, route)(ints["step"]), "application/octet-stream")
                    if route == "state_after":
                        return self._json(200, {"state_sha256": prover.state_after(ints["step"])})
                    if route == "op_count":
                        return self._json(200, {"count": prover.op_count(ints["step"])})
                    if route == "op":
                        return self._json(200, prover.op(ints["step"], ints["index"]))
                    if route == "op_inputs":
                        return self._send(200, prover.op_inputs(ints["step"], ints["index"]), "application/octet-stream")
                return self._json(404, {"error": f"unknown query /{route}"})
            except KeyError as e:
                return self._json(400, {"error": f"missing query parameter {e}"})
            except (ProverError, IndexError, ValueError) as e:
                return self._json(404, {"error": str(e)})

    return ThreadingHTTPServer((host, port), Handler)


class HttpProver(Prover):
    """The challenger's view of a prover at http://HOST:PORT."""

    def __init__(self, url: str, timeout: float = 120.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, route: str, **params) -> bytes:
        url = f"{self.url}/{route}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as r:
                return r.read(MAX_ANSWER)
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read(1 << 16)).get("error", "")
            except (ValueError, AttributeError):
                msg = ""
            raise ProverError(f"refused /{route} (HTTP {e.code}{': ' + msg if msg else ''})") from None
        except TimeoutError:
            raise ProverError(f"timed out on /{route} after {self.timeout:g} s") from None
        except (urllib.error.URLError, OSError) as e:
            raise ProverError(f"cannot reach {self.url} ({getattr(e, 'reason', e)})") from None

    def _json(self, route, **params):
        try:
            return json.loads(self._get(route, **params))
        except ValueError:
            raise ProverError(f"/{route}: the answer is not JSON") from None

    @staticmethod
    def _hash(x) -> bytes:
        try:
            h = bytes.fromhex(x)
        except (TypeError, ValueError):
            raise ProverError("an answer holds a malformed hash") from None
        if len(h) != 32:
            raise ProverError("an answer holds a hash that is not 32 bytes")
        return h

    def manifest(self):
        m = self._json("manifest")
        if not isinstance(m, dict):
            raise ProverError("the manifest is not a JSON object")
        return m

    def node(self, lo, hi):
        return self._hash(self._json("node", lo=lo, hi=hi).get("hash"))

    def leaf(self, index):
        a = self._json("leaf", index=index)
        try:
            return bytes.fromhex(a["data"]), [self._hash(p) for p in a["proof"]]
        except (KeyError, TypeError, ValueError):
            raise ProverError("/leaf: malformed answer") from None

    def checkpoint(self, step):
        return self._get("checkpoint", step=step)

    def log(self, step):
        return self._get("log", step=step)

    def record(self, step):
        return self._get("record", step=step)

    def state_after(self, step):
        return self._hash(self._json("state_after", step=step).get("state_sha256")).hex()

    def op_count(self, step):
        n = self._json("op_count", step=step).get("count")
        if not isinstance(n, int) or n < 0:
            raise ProverError("/op_count: malformed answer")
        return n

    def op(self, step, index):
        a = self._json("op", step=step, index=index)
        if not isinstance(a, dict) or not isinstance(a.get("outputs"), list):
            raise ProverError("/op: malformed answer")
        return a

    def op_inputs(self, step, index):
        return self._get("op_inputs", step=step, index=index)
