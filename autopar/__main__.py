"""`python -m autopar ...`: the command line (autopar/tools/cli.py)."""

from autopar.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
