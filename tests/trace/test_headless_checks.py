"""The browser tests' own checks: an uncaught exception in a page is an error, and a
request for another local file is foreign."""

from __future__ import annotations

from pathlib import Path

import pytest

from .browser import browser  # noqa: F401 (a fixture; skips without Chromium)

pytestmark = pytest.mark.browser


def test_an_uncaught_exception_is_an_error(browser, tmp_path: Path) -> None:
    page_file = tmp_path / "throws.html"
    page_file.write_text("<!DOCTYPE html><html><body><script>throw new Error('boom')"
                         "</script></body></html>")
    page = browser.open(page_file.as_uri())
    try:
        page.settle(0.5)
        assert any(e.startswith("exception:") and "boom" in e for e in page.errors), page.errors
    finally:
        page.close()


def test_a_request_for_another_local_file_is_foreign(browser, tmp_path: Path) -> None:
    """foreign_requests(): any URL but the page's, file:// ones included (its docstring)."""
    other = tmp_path / "pixel.png"
    other.write_bytes(b"\x89PNG\r\n\x1a\n")
    page_file = tmp_path / "loads.html"
    page_file.write_text(f'<!DOCTYPE html><html><body><img alt="" src="{other.as_uri()}">'
                         "</body></html>")
    page = browser.open(page_file.as_uri())
    try:
        page.settle(0.5)
        assert page.foreign_requests() == [other.as_uri()]
    finally:
        page.close()
