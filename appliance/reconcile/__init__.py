"""Desired (the config's adapters) against live (the server's /v1/adapters): diff, plan, apply."""
