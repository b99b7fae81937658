"""`python -m engines.training`: train a drafter for a target, end to end (see pipeline.py)."""

from engines.training.pipeline import main

if __name__ == "__main__":
    main()
