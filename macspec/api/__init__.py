"""The generation API: the options, `load()` and the `Pair`, the stream of round events and
`generate()` (stream.py), the text layer, the chat template, grammars and tool calls. The public
names are re-exported by `macspec` itself."""
