#!/usr/bin/env bash
# hplab in one command.
#   ./lab.sh demo   set up .venv, then train a small GPT-2 on 4 processes with data parallel
#   ./lab.sh test   set up .venv, then run the test suite and re-execute the labs (nbval)
#   ./lab.sh setup  only set up .venv
# Needs Python 3.10+ (set PYTHON=python3.x to choose one). TORCH_SPEC picks the PyTorch build
# (default torch==2.13.0; on a Linux GPU machine pip's default build brings CUDA).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# Byte-compiled modules are cached inside .venv, nothing beside the sources, each compiled once
# by the first process that imports it. Where PYTHONDONTWRITEBYTECODE is set (as on CI) nothing
# would be cached, and every process would compile torch again (the suite took 906 s instead
# of ~600). Compiling all of site-packages ahead instead took 22 s of the setup on 2 cores for
# 9,000 files, most of which no process imports.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$PWD/.venv/pycache"

setup() {
    if [ ! -x .venv/bin/python ]; then
        "$PYTHON" -m venv .venv
    fi
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet --no-compile "$TORCH_SPEC" -e ".[lab,dev]"
}

case "${1:-}" in
    setup)
        setup ;;
    demo)
        setup
        mkdir -p runs
        exec .venv/bin/python -m hplab.train --nproc 4 --dp 4 --metrics runs/demo.json ;;
    test)
        setup
        # Two pytest workers, each file (a notebook's cells, a module's fixtures) on one of
        # them: the multi-process tests leave a core idle half the time. The labs, the longest
        # files, go first so that the short ones fill in at the end.
        exec .venv/bin/python -m pytest -p no:cacheprovider -n 2 --dist loadfile labs tests \
            --nbval-lax ;;
    *)
        echo "usage: ./lab.sh demo | test | setup" >&2
        exit 2 ;;
esac
