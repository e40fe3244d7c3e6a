"""What the tests share: tiny and architecture models, exactness checks, GGUF writers, the docs'
page parser, a scripted server, a stand-in policy. Imported as `support.<module>` (pytest puts
tests/ on sys.path)."""
