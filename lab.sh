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

setup() {
    if [ ! -x .venv/bin/python ]; then
        "$PYTHON" -m venv .venv
    fi
    .venv/bin/python -m pip install --quiet --upgrade pip
    # One resolve for everything; byte-compiled afterwards on every core at once (pip compiles
    # one file after another: half of the setup's time on 2 cores). Not left to Python's first
    # import: where PYTHONDONTWRITEBYTECODE is set (as on CI), nothing would be cached and
    # every process would compile torch again (the suite took 906 s instead of ~600).
    # compileall reports the files it cannot compile (torch ships one for Python 3.12 only):
    # those are left as pip leaves them, so its exit status is not the setup's. Of the ~400
    # model families in transformers (a fifth of the files), only those hplab opens are compiled.
    .venv/bin/python -m pip install --quiet --no-compile "$TORCH_SPEC" -e ".[lab,dev]"
    .venv/bin/python -m compileall -q -j 0 \
        -x '/transformers/models/(?!(__init__|auto|gpt2|llama|qwen2|mixtral)\b)' \
        .venv/lib/python*/site-packages >/dev/null 2>&1 || true
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
