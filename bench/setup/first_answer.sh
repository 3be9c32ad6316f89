#!/usr/bin/env bash
# Time a new user's set-up: a fresh clone, `make serve` from nothing, until the demo model answers.
#   bench/setup/first_answer.sh [cold|warm] [more make variables, e.g. INSTALLER=pip PYTHON=python3.13]
# cold: empty caches (pip's, uv's, and trioshed's own, where the uv that make installs lives), so
# every package is downloaded; warm: the caches the previous run of this script filled.
# Every line make prints is shown with the seconds since the clone began, so the phases show
# (uv installed, packages synced, llama-server probed, demo model assembled, listening).
set -euo pipefail
mode=${1:-cold}
shift || true
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/trioshed-setup.XXXXXX)
port=${PORT:-11434}
caches=${SETUP_CACHES:-/tmp/trioshed-setup-cache}
[ "$mode" = cold ] && rm -rf "$caches"
mkdir -p "$caches"
export PIP_CACHE_DIR=$caches/pip UV_CACHE_DIR=$caches/uv
export XDG_CACHE_HOME=$caches/xdg                # trioshed's cache: the uv make installs (no source build in it)
export TRIOSHED_MODELS="$work/store"             # an empty store: the demo model is assembled
export TRIOSHED_HOST="127.0.0.1:$port"
unset VIRTUAL_ENV
echo "mode: $mode; $(nproc) cores; load before: $(cut -d' ' -f1-3 /proc/loadavg); uv on PATH: $(command -v uv || echo none)"
t0=$(date +%s.%N)
since() { echo "$(date +%s.%N) - $t0" | bc; }
stamp() { printf '%6.2f s  %s\n' "$(since)" "$1"; }
git clone -q "$repo" "$work/trioshed"
stamp "cloned"
cd "$work/trioshed"
make serve "$@" > >(while IFS= read -r line; do printf '%6.2f s  | %s\n' "$(since)" "$line"; done > "$work/serve.log") 2>&1 &
serve=$!
until curl -sf "http://$TRIOSHED_HOST/" >/dev/null; do
  sleep 0.05; kill -0 $serve 2>/dev/null || { cat "$work/serve.log"; exit 1; }
done
stamp "listening"
answer=$(curl -s "http://$TRIOSHED_HOST/api/generate" \
  -d '{"model": "gemma3-270m", "prompt": "The capital of France is", "stream": false, "options": {"temperature": 0, "num_predict": 16}}')
total=$(since)
stamp "first answer"
grep -vE 'INFO trioshed\.(devices|scheduler\.events)' "$work/serve.log" | cut -c1-200 | sed 's/^/log: /'
echo "$answer" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("answer:", repr(d["response"]), "load_duration", round(d["load_duration"]/1e9, 2), "s")'
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
printf 'clone to first answer: %.2f s (%s)\n' "$total" "$mode"
pkill -INT -P $serve || true   # make's child: trioshed serve (SIGINT stops and reaps its runners)
wait $serve || true
rm -rf "$work"
