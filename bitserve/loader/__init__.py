"""GGUF loading: own parser, structure validation, decoding, model spec and weight loading."""
