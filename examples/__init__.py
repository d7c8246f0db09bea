"""Examples a user can copy: run them with ``python -m examples.<name>`` from the repository root."""
