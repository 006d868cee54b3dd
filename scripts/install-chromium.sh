#!/bin/sh
# Installs Chromium where it is missing: the report's browser tests load the HTML
# report in it headless. Without it those tests skip, saying why; set-up goes on.
for b in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$b" >/dev/null 2>&1; then
        exit 0
    fi
done
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
if command -v apt-get >/dev/null 2>&1; then
    if $SUDO apt-get install -y -q chromium >/dev/null 2>&1 ||
       { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q chromium >/dev/null 2>&1; }; then
        echo "installed chromium (for the report's browser tests)"
        exit 0
    fi
fi
echo "note: chromium is not installed and could not be installed here;" \
     "the report's browser tests will be skipped (install chromium to run them)" >&2
exit 0
