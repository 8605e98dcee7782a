"""The `bitserve` command line: one module per command group; `main.py` is the parser."""
