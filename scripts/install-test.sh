#!/usr/bin/env bash
# gpufaas as a user installs it, outside this repository: builds the wheel from the working tree's
# files, installs it into a fresh virtualenv under /tmp, and follows the README's path from another
# directory with a home of its own (no GPUFAAS_* settings): first without the worker extra (`gpufaas
# new` must then say in one line what to install and leave nothing behind), then with
# `gpufaas[local,worker]`: `gpufaas up` (cpu backend), `gpufaas new` for every template, `gpufaas
# deploy`, `gpufaas login`, `gpufaas invoke` of each function (a PNG to the image classifier), a
# call with the invoke token as an application makes it, and `gpufaas down`. Any error fails it.
# Whatever it started is stopped by PID on the way out, failed or not; its folder is removed.
#
#   bash scripts/install-test.sh      # python3 with venv; PyPI or pip's cache (reused, not cleared)
#
# On this project's machines torch==2.13.0 is installed first (a local CPU build): an unpinned torch
# would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
TORCH_PIN=torch==2.13.0
STEP_TIMEOUT_S=240
started_s=$SECONDS

say() { echo "[install-test $((SECONDS - started_s))s] $*"; }
fail() { say "FAILED: $*" >&2; exit 1; }

work=$(mktemp -d /tmp/gpufaas-install-test.XXXXXX)
case "$work" in "$ROOT"/*) fail "the work folder $work is inside the repository" ;; esac
venv=$work/venv
user_home=$work/home  # the user's $HOME: ~/.local/state/gpufaas, ~/.config/gpufaas, ~/.cache
user_dir=$work/functions  # where the user runs the CLI
state=$user_home/.local/state/gpufaas

# Stops the processes the cluster recorded (gpufaas down, then by PID whatever of them still runs
# from this folder), shows the logs of a failed run, and removes the folder.
cleanup() {
  local status=$?
  set +e
  if [ -f "$state/pids.json" ]; then
    [ -x "$venv/bin/gpufaas" ] && [ "$status" != 0 ] && HOME=$user_home timeout 60 "$venv/bin/gpufaas" down >/dev/null 2>&1
    local pids pid
    pids=$(python3 -c 'import json, sys; print(" ".join(str(p) for p in json.load(open(sys.argv[1])).values() if isinstance(p, int)))' \
      "$state/pids.json" 2>/dev/null)
    for pid in $pids; do
      # Only a process of this run (its command line names this folder), never a reused PID.
      if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$work"; then
        say "still running after gpufaas down: $pid; killing its process group"
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
      fi
    done
  fi
  if [ "$status" != 0 ] && [ -d "$state/logs" ]; then
    for log in "$state"/logs/*.log; do
      echo "--- $log (last 25 lines)" >&2
      tail -n 25 "$log" >&2
    done
  fi
  rm -rf "$work"
  say "cleaned up (exit status $status)"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM  # cleanup runs when CI stops it too

# The CLI as the user runs it: from their own directory, with their own home and none of this
# shell's GPUFAAS_* settings (pip keeps the caller's home: its cache is reused).
gpufaas() {
  (cd "$user_dir" && env -u GPUFAAS_URL -u GPUFAAS_PASSWORD -u GPUFAAS_STATE_DIR -u GPUFAAS_CONFIG_DIR \
    HOME="$user_home" XDG_CACHE_HOME="$user_home/.cache" ${GATEWAY_URL:+GPUFAAS_URL=$GATEWAY_URL} \
    timeout "$STEP_TIMEOUT_S" "$venv/bin/gpufaas" "$@")
}
pip_install() {
  # --no-compile: no .pyc for all of torch's files (half a minute to write here, and as long to
  # remove); Python compiles what it imports as usual.
  "$venv/bin/pip" install -q --no-compile --disable-pip-version-check "$@" >"$work/pip.log" 2>&1 \
    || fail "pip install $* failed: $(grep -v '^WARNING: Location' "$work/pip.log" | tail -20)"
}

say "building the wheel from the working tree's files in $work/src"
mkdir -p "$work/src" "$work/dist" "$user_home" "$user_dir"
# Tracked and new (not ignored) files only: no build/, .venv or egg-info of this checkout.
git ls-files -z --cached --others --exclude-standard \
  | python3 -c 'import os, sys; sys.stdout.write("".join(p + "\0" for p in sys.stdin.read().split("\0") if p and os.path.isfile(p)))' \
  | tar --null -T - -cf - | tar -xf - -C "$work/src"
python3 -m pip wheel -q --no-deps --disable-pip-version-check -w "$work/dist" "$work/src" >"$work/wheel.log" 2>&1 \
  || fail "building the wheel failed: $(tail -20 "$work/wheel.log")"
wheel=$(ls "$work"/dist/gpufaas-*.whl)
rm -rf "$work/src"

say "installing $(basename "$wheel")[local] (no worker extra) into a fresh virtualenv"
python3 -m venv "$venv"
pip_install "$wheel[local]"
"$venv/bin/python" -c 'import gpufaas.cli' || fail "gpufaas[local] does not import"

say "gpufaas new without the worker extra: one line that says what to install, nothing left behind"
if out=$(gpufaas new hello --template pytorch-custom 2>&1); then fail "gpufaas new succeeded without torch: $out"; fi
echo "$out" | grep -q "Traceback" && fail "gpufaas new printed a traceback: $out"
echo "$out" | grep -qF "pip install 'gpufaas[worker]'" || fail "gpufaas new did not say what to install: $out"
[ -z "$(ls -A "$user_dir")" ] || fail "gpufaas new left $(ls -A "$user_dir") behind in $user_dir"
say "  $out"

say "installing $TORCH_PIN, then $(basename "$wheel")[local,worker]"
pip_install "$TORCH_PIN"
pip_install "$wheel[local,worker]"
"$venv/bin/python" -c 'import torch, numpy, PIL, safetensors' || fail "gpufaas[local,worker] lacks a module"
# torch is still the pinned build (the extras asked for no other).
"$venv/bin/python" - "$TORCH_PIN" <<'EOF' || fail "the worker extra replaced $TORCH_PIN"
import sys, torch
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1].split("==")[1] else 1)
EOF

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
say "gpufaas up --backend cpu --port $port"
gpufaas new --list
gpufaas up --backend cpu --nodes 1 --gpus-per-node 2 --gpu-memory-mb 4000 --port "$port"
GATEWAY_URL=http://127.0.0.1:$port  # as the README says: --gateway or $GPUFAAS_URL for a port of one's own

# Every template the installed package ships (what `gpufaas new --list` lists).
templates=$("$venv/bin/python" -c 'from gpufaas.cli.functions import _templates; print(*sorted(_templates()))')
[ -n "$templates" ] || fail "gpufaas new --list lists no template"
for template in $templates; do
  name=${template#pytorch-}
  say "gpufaas new $name --template $template"
  gpufaas new "$name" --template "$template"
  [ -f "$user_dir/$name/weights.safetensors" ] || fail "gpufaas new $name wrote no weights"
done
say "gpufaas deploy -f stack.yml"
gpufaas deploy -f stack.yml

say "gpufaas login (the admin password from the cluster's secrets, on stdin)"
gpufaas login --password-stdin <"$state/secrets/admin-password"
[ -f "$user_home/.config/gpufaas/credentials.json" ] || fail "gpufaas login kept no credentials"

# A tiny PNG (8 x 8, RGB), made with the standard library only.
python3 - "$work/tiny.png" <<'EOF'
import struct, sys, zlib
width = height = 8
raw = b"".join(b"\x00" + bytes((200, 40 * (y % 4), 10)) * width for y in range(height))
def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
png += chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
open(sys.argv[1], "wb").write(png)
EOF

for template in $templates; do
  name=${template#pytorch-}
  case "$template" in
    pytorch-custom) args=(--data '{"inputs": [[1, 2, 3, 4]]}'); expect='"outputs"' ;;
    pytorch-text-classifier) args=(--data '{"text": "gpufaas keeps models warm"}'); expect='"predictions"' ;;
    pytorch-image-classifier) args=(--file "$work/tiny.png"); expect='"predictions"' ;;
    *) fail "no request for the template $template: add one to scripts/install-test.sh" ;;
  esac
  say "gpufaas invoke $name ${args[0]}"
  answer=$(gpufaas invoke "$name" "${args[@]}") || fail "gpufaas invoke $name failed"
  echo "$answer" | grep -qF "$expect" || fail "gpufaas invoke $name answered: $answer"
  echo "  ${answer:0:150}"
done

say "a call as an application: the invoke token works, no credential is refused"
python3 - "$GATEWAY_URL" "$state/secrets/invoke-token" <<'EOF'
import sys, urllib.error, urllib.request
url, token = sys.argv[1], open(sys.argv[2]).read().strip()
def call(headers: dict[str, str]) -> int:
    request = urllib.request.Request(f"{url}/function/text-classifier", data=b'{"text": "hi"}', method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
with_token, without = call({"Authorization": f"Bearer {token}"}), call({})
print(f"  with the invoke token: {with_token}, without a credential: {without}")
sys.exit(0 if (with_token, without) == (200, 401) else 1)
EOF

say "gpufaas down"
pids=$(python3 -c 'import json, sys; print(" ".join(str(p) for p in json.load(open(sys.argv[1])).values() if isinstance(p, int)))' \
  "$state/pids.json")
gpufaas down
for pid in $pids; do
  if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "$work"; then
    fail "process $pid still runs after gpufaas down"
  fi
done
say "passed"
