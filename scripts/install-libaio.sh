#!/bin/sh
# Installs the system libaio (libaio.so.1) where it is missing. Without it
# offload still works: the I/O layer says so and uses its thread engine.
if ldconfig -p 2>/dev/null | grep -q 'libaio\.so\.1'; then
    exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
if command -v apt-get >/dev/null 2>&1; then
    for pkg in libaio1 libaio1t64; do
        if $SUDO apt-get install -y -q "$pkg" >/dev/null 2>&1 ||
           { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q "$pkg" >/dev/null 2>&1; }; then
            echo "installed $pkg (libaio.so.1)"
            exit 0
        fi
    done
fi
echo "note: libaio.so.1 is not installed and could not be installed here;" \
     "offload will use its thread I/O engine (install libaio1 for Linux AIO)" >&2
exit 0
