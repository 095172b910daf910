"""The pydantic models of the HTTP API: what the routes validate and what GET /openapi.json shows."""
