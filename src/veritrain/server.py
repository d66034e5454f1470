"""The prover over HTTP: ``veritrain serve RUN_DIR`` answers the verification game's queries.

    GET /manifest                     JSON manifest
    GET /node?lo=&hi=                 {"hash": hex}          subtree hash of leaves [lo, hi)
    GET /leaf?index=                  {"data": hex, "proof": [hex, ...]}
    GET /checkpoint|log|record?step=  the file's bytes (/log?step=&micro=: a micro-batch's log)
    GET /state_after?step=            {"state_sha256": hex}  (the prover replays the step)
    GET /op_count?step=               {"count": n}
    GET /op?step=&index=              {"op", "where", "args", "random_index", "inputs", "sources",
                                       "outputs", "chain"}
    GET /op_inputs?step=&index=       the operator's inputs (engine.dump_call format)

Errors are JSON {"error": message} with status 400 (bad query) or 404 (nothing to answer). Bound to
loopback unless told otherwise: the prover answers anyone who can reach it. ``HttpProver`` (the
challenger's side) gives each whole answer a deadline and reads at most a cap per route (CAPS).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .protocol import Prover, ProverError

# the most the challenger reads of one answer, by kind: a larger answer is refused unread
MAX_ANSWER = 1 << 30  # a checkpoint, a rounding log, an operator's inputs
MAX_JSON = 64 << 20  # the manifest (as store.load_manifest reads it), a leaf with its proof
MAX_SMALL = 1 << 20  # a data record, a node, a state hash, an op count, an op's trace entry
CAPS = {"manifest": MAX_JSON, "leaf": MAX_JSON, "record": MAX_SMALL, "node": MAX_SMALL, "state_after": MAX_SMALL,
        "op_count": MAX_SMALL, "op": MAX_SMALL}
MAX_PROOF = 64  # hashes in an inclusion proof (a tree of up to 2**64 leaves)


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
                    if route == "log" and "micro" in ints:  # a micro-batch's log (data-parallel runs)
                        return self._send(200, prover.log(ints["step"], ints["micro"]), "application/octet-stream")
                    if route in ("checkpoint", "log", "record"):
                        return self._send(200, getattr(prover, route)(ints["step"]), "application/octet-stream")
                    if route == "init_log":
                        return self._send(200, prover.init_log(), "application/octet-stream")
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
    """The challenger's view of a prover at http://HOST:PORT.

    ``timeout`` is the wall time one whole answer may take (connecting, headers and body together), not
    a per-read socket timeout: a prover that trickles bytes loses when it runs out. Every answer is read
    up to its route's cap (CAPS, else MAX_ANSWER) and refused beyond it."""

    def __init__(self, url: str, timeout: float = 120.0):
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        if not (math.isfinite(self.timeout) and 0 < self.timeout <= threading.TIMEOUT_MAX):
            # the auditor's own setting: a bad one is its error, not the prover's loss
            raise ValueError(f"the prover's timeout must be a positive number of seconds, got {timeout!r}")
        u = urllib.parse.urlsplit(self.url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ProverError(f"{url}: expected http://HOST:PORT")
        self._conn = (http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection,
                      u.hostname, u.port, u.path.rstrip("/"))

    def _get(self, route: str, **params) -> bytes:
        cls, host, port, base = self._conn
        cap = CAPS.get(route, MAX_ANSWER)
        conn = cls(host, port, timeout=self.timeout)
        expired = threading.Event()

        def expire():  # the deadline for the whole answer: cut the connection wherever it stands
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        t0 = time.monotonic()
        timer.start()
        r = None
        try:
            conn.request("GET", f"{base}/{route}?{urllib.parse.urlencode(params)}", headers={"Connection": "close"})
            r = conn.getresponse()
            if r.getheader("Transfer-Encoding") is not None:
                # http.client reads a chunk of negative size to the end of the stream, past every cap here;
                # veritrain serve always sends Content-Length, so a transfer coding is refused unread
                raise ProverError(f"/{route}: the answer has a Transfer-Encoding, which this challenger does not "
                                  f"read (a prover sends Content-Length)")
            if r.status != 200:
                try:
                    msg = json.loads(r.read(1 << 16)).get("error", "")
                except (ValueError, AttributeError, RecursionError, OSError, http.client.HTTPException):
                    msg = ""
                raise ProverError(f"refused /{route} (HTTP {r.status}{': ' + str(msg)[:500] if msg else ''})")
            length = r.getheader("Content-Length")
            if length is not None and (not length.strip().isdigit() or int(length) > cap):
                raise ProverError(f"/{route}: the answer announces {length[:40]} bytes, larger than the {cap} "
                                  f"this challenger reads")
            chunks, got = [], 0
            while True:
                b = r.read(min(1 << 20, cap + 1 - got))
                if not b:
                    break
                chunks.append(b)
                got += len(b)
                if got > cap:
                    raise ProverError(f"/{route}: the answer is larger than the {cap} bytes this challenger reads")
            if expired.is_set():
                raise TimeoutError
            return b"".join(chunks)
        except (TimeoutError, socket.timeout):
            raise ProverError(f"timed out on /{route} after {self.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set() or time.monotonic() - t0 >= self.timeout:
                raise ProverError(f"timed out on /{route} after {self.timeout:g} s") from None
            raise ProverError(f"cannot reach {self.url} ({getattr(e, 'reason', None) or e})") from None
        finally:
            timer.cancel()
            if r is not None:  # an answer refused before its end: with "Connection: close" it holds the socket
                r.close()
            conn.close()

    def _json(self, route, max_items=None, **params):
        raw = self._get(route, **params)  # its own failures keep their reasons
        # an answer of a fixed shape holds few JSON items, however long its strings (a leaf's data grows with its
        # interval): counted before parsing, as 64 MiB of small objects parse into ~1.5 GiB
        if max_items is not None and raw.count(b",") + raw.count(b"{") + raw.count(b"[") > max_items:
            raise ProverError(f"/{route}: the answer holds more JSON items than an answer of its kind")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise ProverError(f"/{route}: the answer is not JSON") from None

    def _obj(self, route, max_items=None, **params) -> dict:
        a = self._json(route, max_items, **params)
        if not isinstance(a, dict):
            raise ProverError(f"/{route}: the answer is not a JSON object")
        return a

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
        return self._hash(self._obj("node", lo=lo, hi=hi).get("hash"))

    def leaf(self, index):
        a = self._obj("leaf", MAX_PROOF + 8, index=index)
        try:
            if len(a["proof"]) > MAX_PROOF:
                raise ValueError
            return bytes.fromhex(a["data"]), [self._hash(p) for p in a["proof"]]
        except (KeyError, TypeError, ValueError):
            raise ProverError("/leaf: malformed answer") from None

    def checkpoint(self, step):
        return self._get("checkpoint", step=step)

    def log(self, step, micro=None):
        return self._get("log", step=step) if micro is None else self._get("log", step=step, micro=micro)

    def init_log(self):
        return self._get("init_log")

    def record(self, step):
        return self._get("record", step=step)

    def state_after(self, step):
        return self._hash(self._obj("state_after", step=step).get("state_sha256")).hex()

    def op_count(self, step):
        a = self._json("op_count", step=step)
        n = a.get("count") if isinstance(a, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ProverError("/op_count: malformed answer")
        return n

    def op(self, step, index):
        a = self._json("op", step=step, index=index)
        if not isinstance(a, dict) or not isinstance(a.get("chain"), str) or not all(
                isinstance(a.get(k), list) and all(isinstance(x, str) for x in a[k]) for k in ("inputs", "outputs")):
            raise ProverError("/op: malformed answer")
        return a

    def op_inputs(self, step, index):
        return self._get("op_inputs", step=step, index=index)
