"""`python -m aiayn` is the same as the `aiayn` command."""

from aiayn.cli import entry_point

if __name__ == "__main__":
    entry_point()
