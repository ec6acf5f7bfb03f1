"""One HTTP exchange with a deadline for all of it, and no redirect followed: what the judge clients send.

Standard library only (http.client), so nanogrpo needs no HTTP package. The deadline covers connecting,
sending and the whole response: each socket read waits at most the time left, so a server that drips a
byte a second is cut off at the deadline, not kept alive by every byte. A 3xx comes back as it is: the
caller's Authorization header goes to the URL it gave and nowhere else. Proxies named by http_proxy /
https_proxy (and no_proxy) are used as urllib would.
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import time
import urllib.parse
import urllib.request
from typing import Any

MAX_BODY_BYTES = 64 << 20
"""Largest response body read (a reply with the log-probs of a long group is a few MB at most)."""


class _DeadlineIO(io.RawIOBase):
    """The read side of a socket that gives up at a deadline: each read waits at most the time left.

    A socket timeout bounds one read; a server that sends a byte every second never trips it. Reading
    through this, the status line, the headers and the body together end at the deadline.
    """

    def __init__(self, sock: Any, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.raw = sock.makefile("rb", buffering=0)  # holds the socket open as http.client expects

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no complete response before the deadline (--reward.judge.timeout-s)")
        self.sock.settimeout(left)
        return self.raw.readinto(b)

    def close(self) -> None:
        self.raw.close()
        super().close()


class _DeadlineSock:
    """What http.client's response reads from: `makefile` of the socket, through _DeadlineIO."""

    def __init__(self, sock: Any, deadline: float):
        self.sock, self.deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineIO(self.sock, self.deadline))


def _proxy(scheme: str, host: str) -> urllib.parse.SplitResult | None:
    """The proxy the environment names for this scheme and host (http_proxy, https_proxy, no_proxy)."""
    url = urllib.request.getproxies().get(scheme)
    if not url or urllib.request.proxy_bypass(host):
        return None
    return urllib.parse.urlsplit(url if "://" in url else "http://" + url)


def http_request(
    method: str, url: str, body: bytes | None, headers: dict[str, str], timeout_s: float
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP exchange, all of it (connect, send, the whole response) within timeout_s.

    Redirects are not followed: a 3xx comes back as it is, so the Authorization header goes only to
    the URL given. Raises OSError (TimeoutError past the deadline), http.client.HTTPException or
    ValueError (a URL that is not http(s), a body over MAX_BODY_BYTES).
    """
    deadline = time.monotonic() + timeout_s
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url}")
    target = (u.path or "/") + (f"?{u.query}" if u.query else "")
    host, port, headers = u.hostname, u.port, dict(headers)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    proxy = _proxy(u.scheme, host)
    if proxy is None:
        conn = cls(host, port, timeout=timeout_s)
    else:
        auth = {}
        if proxy.username:
            cred = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
            auth["Proxy-Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        conn = cls(proxy.hostname, proxy.port, timeout=timeout_s)
        if u.scheme == "https":
            conn.set_tunnel(host, port, headers=auth)  # CONNECT: the proxy sees no header of ours
        else:
            target, headers = url, headers | auth  # a plain-HTTP proxy gets the absolute URL
    conn.response_class = functools.partial(_deadline_response, deadline=deadline)
    try:
        conn.connect()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("connected after the deadline (--reward.judge.timeout-s)")
        conn.sock.settimeout(left)  # the send as a whole
        conn.request(method, target, body, headers)
        resp = conn.getresponse()
        data = resp.read(MAX_BODY_BYTES + 1)
        if len(data) > MAX_BODY_BYTES:
            raise ValueError(f"a response body over {MAX_BODY_BYTES >> 20} MiB")
        return resp.status, dict(resp.headers), data
    finally:
        conn.close()


def _deadline_response(sock: Any, *args: Any, deadline: float, **kw: Any) -> http.client.HTTPResponse:
    return http.client.HTTPResponse(_DeadlineSock(sock, deadline), *args, **kw)  # type: ignore[arg-type]
