"""Tool calling on /v1/chat/completions: the request's tools and tool_choice (request.py), their place in
the prompt (prompt.py), and the calls read back out of the generated text (parser.py)."""
