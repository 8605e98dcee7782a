"""Metrics: plain stats records (stats.py, importable anywhere) and the Prometheus sink (prometheus.py)."""
