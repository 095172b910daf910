"""Telemetry: plain engine stats, Prometheus collectors fed from them, and debug fault injection."""
