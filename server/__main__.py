"""`python -m server --config config.json`."""

from server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
