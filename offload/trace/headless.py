"""A headless Chromium driven over the DevTools protocol, to check and measure reports.

Used by the report's browser tests, its render benchmark and the screenshot in
docs/: it loads a page, records every request the page makes and every console
error or uncaught exception, evaluates expressions in the page and takes
screenshots. Needs a Chromium binary (Debian: ``apt-get install chromium``)
and the ``websocket-client`` package (the ``dev`` extra); neither is needed to
write reports.

    with HeadlessChromium.start() as browser:
        page = browser.open(Path("run.report.html").absolute().as_uri())
        page.wait_for("document.documentElement.dataset.rendered === 'true'")
        assert not page.errors and page.foreign_requests() == []
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["BrowserError", "HeadlessChromium", "Page", "find_chromium"]

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class BrowserError(RuntimeError):
    """The browser could not be started, or a command to it failed or timed out."""


def find_chromium() -> str | None:
    """Path of a Chromium (or Chrome) binary: ``$OFFLOAD_CHROMIUM`` or one on PATH."""
    env = os.environ.get("OFFLOAD_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class HeadlessChromium:
    """One headless browser process and its DevTools connection (browser target)."""

    def __init__(self, proc: subprocess.Popen, profile: tempfile.TemporaryDirectory,
                 ws_url: str) -> None:
        import websocket  # websocket-client

        self._proc = proc
        self._profile = profile
        self._ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._pages: dict[str, Page] = {}

    @classmethod
    def start(cls, binary: str | None = None, *, width: int = 1400, height: int = 900,
              timeout: float = 30.0) -> "HeadlessChromium":
        """Starts Chromium headless with a fresh profile; raises :class:`BrowserError`."""
        binary = binary or find_chromium()
        if binary is None:
            raise BrowserError("no Chromium found (install it: apt-get install chromium)")
        profile = tempfile.TemporaryDirectory(prefix="offload-chromium-")
        args = [binary, "--headless=new", "--remote-debugging-port=0",
                f"--user-data-dir={profile.name}", f"--window-size={width},{height}",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps", "--mute-audio",
                "--disable-gpu", "--hide-scrollbars", "--force-color-profile=srgb",
                "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        # its own session: close() ends the renderer and helper processes with it, which
        # otherwise go on writing into the profile while it is removed
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        url = _await_devtools_url(proc, Path(profile.name), timeout)
        if url is None:
            proc.kill()
            err = proc.stderr.read() if proc.stderr else ""
            profile.cleanup()
            raise BrowserError(f"{binary} did not open its DevTools port within {timeout} s: "
                               f"{err.strip()[-400:]}")
        try:
            return cls(proc, profile, url)
        except Exception as e:
            proc.kill()
            profile.cleanup()
            raise BrowserError(f"cannot connect to {binary}'s DevTools at {url}: {e}") from e

    # -- protocol ---------------------------------------------------------------------------
    def send(self, method: str, params: dict[str, Any] | None = None, *,
             session: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """Sends one command and returns its result; events that arrive meanwhile are
        handed to their page."""
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        with self._lock:
            self._ws.send(json.dumps(msg))
            deadline = time.monotonic() + timeout
            while msg_id not in self._replies:
                if time.monotonic() > deadline:
                    raise BrowserError(f"{method}: no reply within {timeout} s")
                self._ws.settimeout(max(0.05, deadline - time.monotonic()))
                self._dispatch(json.loads(self._ws.recv()))
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "id" in msg:
            self._replies[msg["id"]] = msg
            return
        page = self._pages.get(msg.get("sessionId", ""))
        if page is not None:
            page._event(msg.get("method", ""), msg.get("params", {}))

    def pump(self, seconds: float) -> None:
        """Reads events for ``seconds`` (requests and console messages arrive as events)."""
        import websocket

        deadline = time.monotonic() + seconds
        with self._lock:
            while time.monotonic() < deadline:
                self._ws.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    self._dispatch(json.loads(self._ws.recv()))
                except websocket.WebSocketTimeoutException:
                    break

    # -- pages ------------------------------------------------------------------------------
    def open(self, url: str, *, width: int = 1400, height: int = 900,
             timeout: float = 30.0) -> "Page":
        """A new tab with every request and console message recorded, navigated to ``url``."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target,
                                                      "flatten": True})["sessionId"]
        page = Page(self, session, target)
        self._pages[session] = page
        for domain in ("Network", "Runtime", "Log", "Page"):
            page.send(f"{domain}.enable")
        page.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                         "deviceScaleFactor": 1,
                                                         "mobile": False})
        page.navigate(url, timeout=timeout)
        return page

    def close(self) -> None:
        try:
            self._ws.close()
        except Exception:
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the browser and all its helpers
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self._proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue
        if self._proc.stderr:
            self._proc.stderr.close()
        for _ in range(50):  # a helper that outlived the group's signal may still write
            shutil.rmtree(self._profile.name, ignore_errors=True)
            if not os.path.exists(self._profile.name):
                break
            time.sleep(0.1)
        self._profile.cleanup()

    def __enter__(self) -> "HeadlessChromium":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _await_devtools_url(proc: subprocess.Popen, profile: Path, timeout: float) -> str | None:
    """The browser's DevTools websocket URL, from the DevToolsActivePort file it writes."""
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        try:
            lines = port_file.read_text().split("\n")
        except OSError:
            lines = []
        if len(lines) >= 2 and lines[0].strip().isdigit() and lines[1].strip():
            return f"ws://127.0.0.1:{lines[0].strip()}{lines[1].strip()}"
        time.sleep(0.05)
    return None


class Page:
    """One tab: what it requested, what it logged as errors, and commands to it."""

    def __init__(self, browser: HeadlessChromium, session: str, target: str) -> None:
        self._browser = browser
        self.session = session
        self.target = target
        self.requests: list[str] = []       # every URL the page asked for, in order
        self.errors: list[str] = []         # console errors, uncaught exceptions, failed loads
        self.url = ""                        # the URL last navigated to
        self._loaded = False

    def send(self, method: str, params: dict[str, Any] | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
        return self._browser.send(method, params, session=self.session, timeout=timeout)

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Network.requestWillBeSent":
            self.requests.append(params.get("request", {}).get("url", ""))
        elif method == "Network.loadingFailed":
            self.errors.append(f"request failed: {params.get('errorText')} "
                               f"{params.get('blockedReason') or ''}".strip())
        elif method == "Runtime.exceptionThrown":
            d = params.get("exceptionDetails", {})
            text = d.get("exception", {}).get("description") or d.get("text")
            self.errors.append(f"exception: {text}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", "")))
                            for a in params.get("args", []))
            self.errors.append(f"console.{params.get('type')}: {args}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        elif method == "Page.loadEventFired":
            self._loaded = True

    def navigate(self, url: str, timeout: float = 30.0) -> None:
        self._loaded = False
        self.url = url
        result = self.send("Page.navigate", {"url": url}, timeout=timeout)
        if result.get("errorText"):
            raise BrowserError(f"cannot load {url}: {result['errorText']}")
        deadline = time.monotonic() + timeout
        while not self._loaded:
            if time.monotonic() > deadline:
                raise BrowserError(f"{url} did not finish loading within {timeout} s")
            self._browser.pump(0.05)

    def evaluate(self, expression: str, timeout: float = 30.0) -> Any:
        """The JSON value of ``expression`` in the page; raises on a JavaScript error."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, timeout=timeout)
        if "exceptionDetails" in result:
            d = result["exceptionDetails"]
            raise BrowserError(f"evaluating {expression[:80]!r}: "
                               f"{d.get('exception', {}).get('description') or d.get('text')}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Polls ``expression`` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"{expression!r} still false after {timeout} s; page errors: "
                                   f"{self.errors}")
            self._browser.pump(0.05)

    def settle(self, seconds: float = 0.3) -> None:
        """Lets late events (requests, console messages) arrive."""
        self._browser.pump(seconds)

    def foreign_requests(self) -> list[str]:
        """Requests other than for the page itself (its URL, ``about:blank``): any other
        URL, ``file://`` ones included, is one the page asked for."""
        return [u for u in self.requests if u not in (self.url, "about:blank")]

    def screenshot(self, path: Path, *, full_page: bool = True, clip_height: int | None = None,
                   fmt: str = "png") -> Path:
        """Writes a screenshot of the page (whole height, or the first ``clip_height`` px)."""
        params: dict[str, Any] = {"format": fmt, "captureBeyondViewport": full_page}
        if full_page or clip_height:
            width = self.evaluate("document.documentElement.scrollWidth")
            height = self.evaluate("document.documentElement.scrollHeight")
            if clip_height:
                height = min(height, clip_height)
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        data = self.send("Page.captureScreenshot", params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        self._browser._pages.pop(self.session, None)
        try:
            self._browser.send("Target.closeTarget", {"targetId": self.target})
        except BrowserError:
            pass

