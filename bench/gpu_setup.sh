# Sourced from the repository root on a bare device machine (torch there, not pulp or
# highspy, autopar not installed): sets $py, installs the wheels carried in .whl/ into
# /tmp/autopar-site, and autopar editable without its dependencies (or, where that cannot
# build, links its folders in place); exits 2 where autopar still does not import.
py="${PYTHON:-python3}"
if ! "$py" -c "import autopar.passes, pulp, highspy" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/autopar-site \
            .whl/*.whl && export PYTHONPATH="/tmp/autopar-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if ! "$py" -m pip install -q --no-deps --no-build-isolation -e .; then
        # no setuptools to build with: the package's folders linked where autopar looks for them
        ln -sfn "$PWD/passes" autopar/passes && ln -sfn "$PWD/cost_models" autopar/cost_models
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$py" -c "import autopar.passes, pulp, highspy" || { echo "gpu_suite: could not set up autopar here" >&2; exit 2; }
fi
