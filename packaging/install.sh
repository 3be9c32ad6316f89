#!/usr/bin/env bash
# Install trioshed into a venv from the lock (what `make serve`, `make install` and `make test` run).
#   packaging/install.sh serve   the server: its dependencies, the bundled llama-server, the demo model
#   packaging/install.sh dev     every extra as well (tests, lint, bench)
#   packaging/install.sh lock    refresh uv.lock to the newest releases pyproject.toml allows and
#                                write the pip-readable copies in requirements/ (`make lock`);
#                                KEEP=1 keeps the pins there are (after adding a dependency)
# Environment: PYTHON (python3), VENV (.venv), INSTALLER:
#   auto (default)  uv where it runs: the `uv` on PATH, else uv $UV_VERSION installed from PyPI with
#                   this Python's pip into the user's cache, once; pip when neither works
#   uv | pip        that one, or fail
# Both install exactly the versions in uv.lock: uv reads it (`uv sync --locked`, which also fails
# when pyproject.toml changed and the lock did not), pip reads requirements/*.txt, exported from it
# with every file's hash (`--require-hashes`).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?usage: packaging/install.sh serve|dev|lock}
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
INSTALLER=${INSTALLER:-auto}
UV_VERSION=0.13.9
UV_HOME=${TRIOSHED_UV_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/trioshed/uv-$UV_VERSION}
export UV_PYTHON_DOWNLOADS=never     # the interpreter is $PYTHON, never one uv downloads
export UV_PROJECT_ENVIRONMENT=$VENV  # `uv sync` fills $VENV, not ./.venv
export UV_NO_PROGRESS=1

say() { echo "[install] $*"; }

find_uv() {  # prints a uv that runs, else nothing
  if command -v uv >/dev/null && uv --version >/dev/null 2>&1; then command -v uv; return; fi
  if [ -x "$UV_HOME/bin/uv" ] && "$UV_HOME/bin/uv" --version >/dev/null 2>&1; then echo "$UV_HOME/bin/uv"; return; fi
  say "no uv on PATH: installing uv $UV_VERSION from PyPI into $UV_HOME" >&2
  rm -rf "$UV_HOME.partial"
  if "$PYTHON" -m pip install -qq --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
      --only-binary uv --target "$UV_HOME.partial" "uv==$UV_VERSION" >&2 \
    && "$UV_HOME.partial/bin/uv" --version >/dev/null 2>&1; then
    rm -rf "$UV_HOME" && mv "$UV_HOME.partial" "$UV_HOME"
    echo "$UV_HOME/bin/uv"
  else
    rm -rf "$UV_HOME.partial"
  fi
}

extras() { if [ "$what" = dev ]; then echo --all-extras; else echo --extra bundled; fi; }

if [ "$what" = lock ]; then
  uv=$(find_uv); [ -n "$uv" ] || { echo "make lock needs uv (pip install uv==$UV_VERSION)" >&2; exit 1; }
  # shellcheck disable=SC2046
  "$uv" lock --python "$PYTHON" $([ "${KEEP:-0}" = 1 ] || echo --upgrade)
  mkdir -p requirements
  for w in serve dev; do
    what=$w
    # shellcheck disable=SC2046
    "$uv" export --quiet --frozen --no-emit-project --format requirements-txt $(extras) \
      --output-file "requirements/$w.txt"
  done
  say "uv.lock and requirements/{serve,dev}.txt refreshed; commit all three"
  exit 0
fi
case $what in serve|dev) ;; *) echo "usage: packaging/install.sh serve|dev|lock" >&2; exit 2;; esac

uv=
case $INSTALLER in
  pip) ;;
  uv) uv=$(find_uv); [ -n "$uv" ] || { echo "INSTALLER=uv: uv does not run here; use INSTALLER=pip" >&2; exit 1; } ;;
  auto) uv=$(find_uv); [ -n "$uv" ] || say "uv does not run here: installing with pip" ;;
  *) echo "INSTALLER=$INSTALLER: choose auto, uv or pip" >&2; exit 2 ;;
esac

if [ -n "$uv" ]; then
  say "$what: uv sync from uv.lock ($("$uv" --version))"
  # serve --inexact: a `make serve` after `make install` keeps the test tools.
  # shellcheck disable=SC2046
  "$uv" sync --quiet --locked --python "$PYTHON" $(extras) $([ "$what" = serve ] && echo --inexact)
else
  say "$what: pip install from requirements/$what.txt (exported from uv.lock)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes -r "requirements/$what.txt"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e .
fi
"$VENV/bin/python" -m trioshed.runner.provision
touch "$VENV/.installed-serve"
[ "$what" = dev ] && touch "$VENV/.installed"
exit 0
