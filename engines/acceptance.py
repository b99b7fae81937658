"""`python -m engines.acceptance` forwards to engines/bench/acceptance.py (same flags and output)."""

from engines.bench.acceptance import main

if __name__ == "__main__":
    main()
