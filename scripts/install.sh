#!/usr/bin/env bash
# Creates ./.venv and installs memlm into it: torch==2.13.0 first (a local CPU wheel; an unpinned torch would
# pull a multi-GB CUDA build), then the package with its pinned dependencies. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MEMLM_SKIP_INSTALL:-0}" = 1 ]; then
  exit 0  # an environment is already in .venv (tests/cli/test_readme.py runs the README against the one under test)
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -m pip install -q --no-compile "torch==2.13.0"
.venv/bin/python -m pip install -q --no-compile -e ".[test,cluster,pretrained]"
# Bytecode for every installed module, on every core: pip compiles one file at a time (90 s of the install
# here), and without it each process would compile what it imports again wherever PYTHONDONTWRITEBYTECODE is
# set (10 s of imports became 26). The few files that do not compile are ones pip skips too (templates, tests).
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# Once per change of what is installed (the pins live in these two files): a pass over a compiled tree takes 8 s.
if [ ! .venv/.bytecode-compiled -nt pyproject.toml ] || [ ! .venv/.bytecode-compiled -nt scripts/install.sh ]; then
  .venv/bin/python -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
  touch .venv/.bytecode-compiled
fi
# memlm, torchrun, deepspeed, mlflow and ray are in .venv/bin: the README's commands expect them on the PATH.
case ":${PATH}:" in
  *":$PWD/.venv/bin:"*) ;;
  *) echo "memlm is installed in $PWD/.venv; put it (and torchrun, deepspeed) on your PATH with: source .venv/bin/activate" >&2 ;;
esac
