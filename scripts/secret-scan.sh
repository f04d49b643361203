#!/usr/bin/env bash
# Fails when a file git tracks holds a secret that .secrets.baseline does not list (detect-secrets,
# with the baseline's plugins and filters). The baseline lists what was reviewed and kept: test
# fixtures, example values and names of secret files, never a real secret. Line numbers that moved
# do not fail it, and the baseline is not rewritten (the hook works on a copy).
#
#   bash scripts/secret-scan.sh          # needs .venv (bash scripts/setup.sh: the dev extra)
#
# A new finding that is not a secret: review it, then regenerate the baseline and commit it:
#   .venv/bin/detect-secrets scan --baseline .secrets.baseline
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
baseline=$(mktemp)
trap 'rm -f "$baseline"' EXIT
cp .secrets.baseline "$baseline"
files=()
while IFS= read -r -d '' path; do
  [ -f "$path" ] && [ "$path" != .secrets.baseline ] && files+=("$path")
done < <(git ls-files -z)
status=0
.venv/bin/detect-secrets-hook --baseline "$baseline" "${files[@]}" || status=$?
# 0: nothing new; 3: only the baseline's line numbers moved (on the copy); 1: a new secret.
if [ "$status" != 0 ] && [ "$status" != 3 ]; then
  echo "secret scan: a tracked file holds a secret .secrets.baseline does not list (see above);" \
    "remove it, or if it is no secret, review it and update the baseline" >&2
  exit 1
fi
echo "secret scan: nothing new in ${#files[@]} tracked files"
