"""`python -m engines.bench`: the decoding benchmark (engines/bench/cli.py)."""

from engines.bench.cli import main

if __name__ == "__main__":
    main()
