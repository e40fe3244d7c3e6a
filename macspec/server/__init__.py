"""`macspec serve`: an OpenAI-compatible HTTP server (app.py: the endpoints; protocol.py: the
request and response shapes; scheduler.py: the generations on the one MLX thread)."""
