"""The headless Chromium the report's browser tests drive: importing this module
skips the importing test module, saying why, where there is none (`make test`
installs it: scripts/install-chromium.sh); `browser` is a module-scoped fixture."""

import pytest

from offload.trace.headless import BrowserError, HeadlessChromium, find_chromium

CHROMIUM = find_chromium()
try:
    import websocket  # noqa: F401
    WS_WHY = None
except ImportError as e:
    WS_WHY = f"the websocket-client package is missing ({e}); pip install -e '.[dev]'"

if CHROMIUM is None:
    pytest.skip("no Chromium here and scripts/install-chromium.sh could not install it "
                "(apt-get install chromium); the report's browser tests need one",
                allow_module_level=True)
if WS_WHY:
    pytest.skip(WS_WHY, allow_module_level=True)

RENDERED = "document.documentElement.dataset.rendered === 'true'"


def start_browser() -> HeadlessChromium:
    """A started Chromium; skips the test, saying why, where it does not start."""
    try:
        return HeadlessChromium.start(CHROMIUM)
    except BrowserError as e:
        pytest.skip(f"Chromium is installed but does not start here: {e}")


@pytest.fixture(scope="module")
def browser():
    b = start_browser()
    yield b
    b.close()
