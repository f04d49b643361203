#!/usr/bin/env bash
# A local gpufaas cluster and a demo, from a fresh checkout: installs, brings the cluster up in the
# background (cuda where NVML finds GPUs, else cpu), creates two functions from templates, deploys
# them, invokes them, and shows hits, misses and where each call ran. `gpufaas down` stops it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
gpufaas() { .venv/bin/gpufaas "$@"; }
# Small caches (one of the two models per GPU), so the two functions land on different GPUs.
gpufaas up --nodes 2 --gpus-per-node 1 --gpu-memory-mb 1500
work=$(mktemp -d)
gpufaas new classifier --template pytorch-image-classifier --dir "$work"
gpufaas new sentiment --template pytorch-text-classifier --dir "$work"
gpufaas deploy -f "$work/stack.yml"
pixels=$(.venv/bin/python -c 'import json; print(json.dumps({"pixels": [[[0.5] * 32] * 32] * 3, "top_k": 3}))')
for round in 1 2 3; do
  echo "--- round $round"
  echo "$pixels" | gpufaas invoke classifier -v 2>&1 | grep -iE '^x-(gpu|cache|duration)|predictions' | cut -c1-160
  gpufaas invoke sentiment -v -d '{"text": "gpufaas keeps models warm"}' 2>&1 | grep -iE '^x-(gpu|cache|duration)|predictions' | cut -c1-160
done
gpufaas gpus
echo "the cluster keeps running: try \`gpufaas ls\`, \`gpufaas invoke sentiment -d '{\"text\": \"hi\"}' -v\`; stop it with \`gpufaas down\`"
