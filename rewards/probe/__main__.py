"""`python -m rewards.probe train ...` and `python -m rewards.probe eval ...` (rewards/probe/cli.py)."""

from rewards.probe.cli import main

if __name__ == "__main__":
    main()
