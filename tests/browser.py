"""A headless Chromium driven through the DevTools protocol over a pipe, with no Python dependency.

``chromium --remote-debugging-pipe`` reads protocol commands from its file descriptor 3 and writes replies and
events to its descriptor 4, each a JSON message ended by a NUL byte. That is all a test needs to load a page of
the built documentation site, set the window's width, run JavaScript in it and take a screenshot: no websocket
client and no browser-automation package (Playwright, Selenium) to install and lock.

The browser never reaches the network: names resolve to nothing (``--host-resolver-rules``), any other address
goes to a closed loopback port as its proxy, and Chromium's own background traffic (updates, sync, metrics) is
switched off. Pages are read from disk through ``file://``; the theme's scripts from a CDN simply fail to load,
as they do for a reader who opens the site offline.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: Debian's package installs ``chromium``; other distributions name it differently
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

_FLAGS = [
    "--headless",
    "--remote-debugging-pipe",
    "--no-sandbox",  # the tests run as root in containers, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--metrics-recording-only",
    "--mute-audio",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=socks5://127.0.0.1:9",
    "--proxy-bypass-list=<-loopback>",
]


def find_browser() -> str | None:
    """The path of an installed Chromium, or None."""
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    """The browser answered a command with an error, closed its pipe, or did not answer in time."""


class Browser:
    """One headless Chromium with one tab; use as a context manager (the browser is killed on exit).

    >>> with Browser(width=1280) as browser:  # doctest: +SKIP
    ...     browser.open(Path("site/index.html"))
    ...     browser.evaluate("document.title")
    """

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 30.0, executable: str | None = None):
        executable = executable or find_browser()
        if executable is None:
            raise BrowserError(f"no Chromium found (looked for {', '.join(BROWSER_NAMES)})")
        self.timeout = timeout
        self._next_id = 0
        self._buffer = b""
        self._events: list[dict[str, Any]] = []  # events that arrived while a command waited for its reply
        self._profile = tempfile.mkdtemp(prefix="distrib-browser-")
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()
        # the child's ends above 4, so that placing them at 3 and 4 overwrites neither
        for low in (to_browser_read, from_browser_write):
            moved = fcntl.fcntl(low, fcntl.F_DUPFD, 10)
            os.close(low)
            if low == to_browser_read:
                to_browser_read = moved
            else:
                from_browser_write = moved
        # a small Python puts the two pipe ends at the descriptors 3 and 4 the protocol uses, then becomes Chromium
        place = (
            "import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4); "
            "os.close(r); os.close(w); os.execv(sys.argv[3], sys.argv[3:])"
        )
        command = [sys.executable, "-c", place, str(to_browser_read), str(from_browser_write), executable]
        self._process = subprocess.Popen(
            [*command, *_FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
            pass_fds=(to_browser_read, from_browser_write),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(to_browser_read)
        os.close(from_browser_write)
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.call("Page.enable", session=True)
            self.call(
                "Emulation.setDeviceMetricsOverride",
                session=True,
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the browser and everything it started, and remove its profile."""
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    # -- the protocol ----------------------------------------------------------------------------------------

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; events that arrive meanwhile are kept for :meth:`open`."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def _read(self) -> dict[str, Any]:
        """The next message from the browser, waiting at most ``timeout`` seconds."""
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise BrowserError(f"the browser did not answer within {self.timeout} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError(f"the browser closed its pipe (exit code {self._process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    # -- what a test does with a page ------------------------------------------------------------------------

    def open(self, path: Path) -> None:
        """Load a file and wait until its load event (stylesheets, images and scripts done or failed)."""
        self._events.clear()
        self.call("Page.navigate", session=True, url=path.resolve().as_uri())
        deadline = time.monotonic() + self.timeout
        while True:
            message = self._events.pop(0) if self._events else self._read()
            if message.get("method") == "Page.loadEventFired" and message.get("sessionId") == self._session:
                return
            if time.monotonic() > deadline:
                raise BrowserError(f"{path} did not load within {self.timeout} s")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the open page (JSON-serialisable values only)."""
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, full_page: bool = True, max_height: int = 16000) -> None:
        """Save the open page as a PNG at the window's width: the whole page (up to ``max_height`` pixels) or
        only what the window shows."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics", session=True)["cssContentSize"]
            height = min(int(size["height"]), max_height)
            params.update(
                captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size["width"], "height": height, "scale": 1}
            )
        data = self.call("Page.captureScreenshot", session=True, **params)["data"]
        path.write_bytes(base64.b64decode(data))
