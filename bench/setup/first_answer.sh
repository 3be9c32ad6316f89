#!/usr/bin/env bash
# Time a new user's set-up: a fresh clone, `make serve` from nothing, until the demo model answers.
#   bench/setup/first_answer.sh [cold|warm]
# cold: an empty pip cache (every wheel downloaded); warm: the cache this script filled before.
# ~/.cache/trioshed (the source-build cache) is not used: the bundled build must serve.
set -euo pipefail
mode=${1:-cold}
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/trioshed-setup.XXXXXX)
port=${PORT:-11434}
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-/tmp/trioshed-setup-pip-cache}
[ "$mode" = cold ] && rm -rf "$PIP_CACHE_DIR"
export XDG_CACHE_HOME="$work/xdg-cache"          # no source-build cache to fall back on
export TRIOSHED_MODELS="$work/store"             # an empty store: the demo model is assembled
export TRIOSHED_HOST="127.0.0.1:$port"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
t0=$(date +%s.%N)
git clone -q "$repo" "$work/trioshed"
cd "$work/trioshed"
make serve > "$work/serve.log" 2>&1 &
serve=$!
stamp() { printf '%-28s %6.1f s\n' "$1" "$(echo "$(date +%s.%N) - $t0" | bc)"; }
until [ -f .venv/.installed ]; do sleep 0.5; kill -0 $serve 2>/dev/null || { cat "$work/serve.log"; exit 1; }; done
stamp "make install done"
until curl -sf "http://$TRIOSHED_HOST/" >/dev/null; do sleep 0.2; kill -0 $serve 2>/dev/null || { cat "$work/serve.log"; exit 1; }; done
stamp "listening (demo model ready)"
answer=$(curl -s "http://$TRIOSHED_HOST/api/generate" \
  -d '{"model": "gemma3-270m", "prompt": "The capital of France is", "stream": false, "options": {"temperature": 0, "num_predict": 16}}')
stamp "first answer"
echo "$answer" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("answer:", repr(d["response"]), "load_duration", round(d["load_duration"]/1e9, 2), "s")'
grep -E '^\[provision\]|llama-server:' "$work/serve.log" | sed 's/^/log: /'
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
pkill -INT -P $serve || true   # make's child: trioshed serve (SIGINT stops and reaps its runners)
wait $serve || true
rm -rf "$work"
