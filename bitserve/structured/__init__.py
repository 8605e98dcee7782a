"""Structured output: grammar-constrained decoding (guide.py: what a request asks for, torch-free;
grammars.py: the grammar engine, xgrammar; masks.py: per-step token masks in the runner) and the
tool-call convention built on it (tools.py)."""
