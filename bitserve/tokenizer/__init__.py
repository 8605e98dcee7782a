"""Tokenizers built from GGUF metadata (llama.cpp-exact ids), chat templates and incremental decoding.

Modules: base (Tokenizer protocol), gguf_vocab (tokenizer_from_gguf), chat_template (render_chat,
encode_chat), detokenizer (IncrementalDetokenizer). Nothing here imports torch or the engine.
"""
