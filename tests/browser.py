"""Headless Chromium for the browser tests and bench/viewer.py: Debian's `chromium` driven by Playwright.

Playwright for Python drives the system's Chromium through `executable_path` (no `playwright install`
download). Each page opens in its own browser context, in which every request is routed to a handler
that lets through the few the page is allowed and records and aborts every other. An `OfflinePage` (an
offline context) is allowed only its own file:// load; a `LoopbackPage`, a page of a server on this
machine (http://127.0.0.1:PORT), the requests to that exact origin (scheme, host and port), so a test
proves the page fetched nothing from anywhere else. Console errors and uncaught exceptions are
collected beside the requests, so a test ends with `assert_clean()`.

Where Chromium or Playwright is missing the `chromium` fixture skips with the reason (`make test` installs
Debian's package when it runs as root with apt-get); under CI (CI=true), which installs both, it fails.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ENV_CHROMIUM = "JAXATTN_CHROMIUM"
NAMES = ("chromium", "chromium-browser")
READY = "() => document.body !== null && document.body.dataset.ready === '1'"
INSTALL = "apt-get install -y chromium as root (make test does it when it can), or set $" + ENV_CHROMIUM


def find_chromium() -> str | None:
    """$JAXATTN_CHROMIUM when set (None if it is not an executable file), else chromium on $PATH."""
    explicit = os.environ.get(ENV_CHROMIUM)
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    return next((found for name in NAMES if (found := shutil.which(name))), None)


def missing() -> str | None:
    """Why no browser can be started here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if find_chromium() is None:
        where = f"${ENV_CHROMIUM}={os.environ[ENV_CHROMIUM]!r} is not an executable file" \
            if os.environ.get(ENV_CHROMIUM) else f"no {' or '.join(NAMES)} on PATH"
        return f"{where}: {INSTALL}"
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def launch(playwright, executable: str | None = None):
    """A headless Chromium browser (Playwright `Browser`) from the system's executable."""
    return playwright.chromium.launch(executable_path=executable or find_chromium(), headless=True,
                                      args=["--disable-dev-shm-usage", "--disable-gpu"])


class GuardedPage:
    """One page in a fresh context whose requests, but those `_allowed`, are recorded and aborted.

    `requests` lists "METHOD URL" of every request not allowed (whether the route, the request event or a
    WebSocket saw it first); `errors` every console error and uncaught exception.
    """

    offline = True

    def __init__(self, browser, *, viewport=(1280, 900), device_scale_factor=1):
        self.url: str | None = None
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.context = browser.new_context(offline=self.offline, service_workers="block",
                                           viewport={"width": viewport[0], "height": viewport[1]},
                                           device_scale_factor=device_scale_factor)
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("request", lambda request: self._record(request.method, request.url))
        self.page.on("websocket", lambda ws: self._record("WEBSOCKET", ws.url))
        self.page.on("console", lambda msg: msg.type == "error" and self.errors.append(f"console: {msg.text}"))
        self.page.on("pageerror", lambda err: self.errors.append(f"pageerror: {err}"))
        self.page.on("popup", lambda popup: self._record("POPUP", popup.url))

    def _allowed(self, method: str, url: str) -> bool:
        raise NotImplementedError

    def _record(self, method: str, url: str) -> None:
        entry = f"{method} {url}"
        if not self._allowed(method, url) and entry not in self.requests:
            self.requests.append(entry)

    def _route(self, route) -> None:
        request = route.request
        if self._allowed(request.method, request.url):
            route.continue_()
        else:
            self._record(request.method, request.url)
            route.abort()

    def assert_clean(self) -> None:
        """No request but those allowed, and no console error or uncaught exception so far."""
        assert self.requests == [], f"network requests from the page: {self.requests}"
        assert self.errors == [], f"errors in the page: {self.errors}"

    def close(self) -> None:
        self.context.close()


class OfflinePage(GuardedPage):
    """One page in a fresh, offline context: every request but the page's own load is recorded and aborted.

    `requests` lists "METHOD URL" of every other request (whether the route, the request event or a
    WebSocket saw it first); `errors` every console error and uncaught exception.
    """

    def _is_page(self, url: str) -> bool:
        return self.url is not None and url.split("#")[0] == self.url

    def _allowed(self, method: str, url: str) -> bool:
        return self._is_page(url)

    def open(self, path: str | os.PathLike, *, wait_ready: bool = True, timeout_ms: float = 20_000):
        """Navigates to the file and waits for `document.body.dataset.ready == "1"`; returns the page."""
        self.url = Path(path).resolve().as_uri()
        self.page.goto(self.url, wait_until="load", timeout=timeout_ms)
        if wait_ready:
            self.page.wait_for_function(READY, timeout=timeout_ms)
        return self.page

    def open_html(self, html: str, directory: str | os.PathLike | None = None, **kwargs):
        """Writes `html` to a file (in `directory`, else a fresh temporary one) and opens it."""
        folder = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="jaxattn-page-"))
        path = folder / "page.html"
        path.write_text(html, encoding="utf-8")
        return self.open(path, **kwargs)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def origin_of(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of `url`, the port filled in for http and https."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a port number: no origin a page is allowed
        return parts.scheme, "", None
    port = port if port is not None else {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or ""), port


class LoopbackPage(GuardedPage):
    """One page of a server on this machine: requests to its origin go through, every other is recorded
    and aborted.

    `origin` is "http://127.0.0.1:PORT" (a loopback host; a path after it is ignored). `served` lists
    "METHOD URL" of the requests let through, in order; `requests` those to anywhere else (another port,
    another host, a popup) and every WebSocket (never connected), each recorded once; `errors`
    console errors and uncaught exceptions.
    """

    offline = False  # an offline context refuses loopback too

    def __init__(self, browser, origin: str, **kwargs):
        scheme, host, port = origin_of(origin)
        if scheme not in ("http", "https") or host not in LOOPBACK_HOSTS or port is None:
            raise ValueError(f"LoopbackPage serves http(s)://LOOPBACK:PORT, got {origin!r}")
        self.origin = (scheme, host, port)
        self.base = f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"
        self.served: list[str] = []
        super().__init__(browser, **kwargs)
        # Routes see no WebSocket: this handler takes every one and never connects it to its server.
        self.context.route_web_socket(lambda url: True, lambda ws: self._record("WEBSOCKET", ws.url))

    def _allowed(self, method: str, url: str) -> bool:
        return method != "WEBSOCKET" and method != "POPUP" and origin_of(url) == self.origin

    def _route(self, route) -> None:
        request = route.request
        if self._allowed(request.method, request.url):
            self.served.append(f"{request.method} {request.url}")
        super()._route(route)

    def open(self, path: str = "/", *, wait_ready: bool = True, timeout_ms: float = 20_000):
        """Navigates to `path` on the origin and waits for `document.body.dataset.ready == "1"`; the page."""
        self.url = self.base + "/" + path.lstrip("/")
        self.page.goto(self.url, wait_until="load", timeout=timeout_ms)
        if wait_ready:
            self.page.wait_for_function(READY, timeout=timeout_ms)
        return self.page


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for the module; skips (fails under CI=true) where there is none."""
    reason = missing()
    if reason is not None:
        if in_ci():
            pytest.fail(f"CI installs the browser, but {reason}", pytrace=False)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch(playwright)
        yield browser
        browser.close()


@pytest.fixture()
def offline_page(chromium):
    """A fresh `OfflinePage` of the module's browser, closed after the test."""
    page = OfflinePage(chromium)
    yield page
    page.close()
