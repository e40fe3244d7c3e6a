"""`macspec bench` (command.py): what to run (plan), running it (runner, progress), llama.cpp's
rows (llamacpp), the tables and bench.json (report); `bench --serve` (serve) and the server's
clients at once (clients)."""
