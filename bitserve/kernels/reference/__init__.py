"""Pure-torch reference backend, any device: the oracle every fast backend is tested against (format decoders
in `dequant`, exact ternary matmul, dense matmul, attention)."""
