"""`python -m aiayn` is the same as the `aiayn` command."""

from aiayn.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
