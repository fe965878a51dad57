"""``python -m onceonly``: the same as the ``onceonly`` command."""

from onceonly.cli import main

if __name__ == "__main__":
    main()
