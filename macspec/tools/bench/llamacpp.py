"""llama.cpp as a peer in `macspec bench`: its plain, draft-model and n-gram decoding of the GGUF
file the target was converted from, on the same prompt ids, through xllamacpp (llama.cpp's server
in-process; an optional package, not a dependency of macspec).

Each run streams a /completion request and is timed as macspec's rows are, from outside: tokens
after the first over the time after it. The GGUF must have the target's vocabulary (checked).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...base.errors import MacspecError, OptionError
from .report import Recorder

LLAMACPP = ("llamacpp_plain", "llamacpp_draft", "llamacpp_ngram")


def unavailable(gguf: str | None, draft_gguf: str | None) -> dict[str, str]:
    """Why each llama.cpp method cannot run here ({} when all can)."""
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        why = "needs the optional package xllamacpp (pip install xllamacpp)"
        return dict.fromkeys(LLAMACPP, why)
    if gguf is None:
        return dict.fromkeys(LLAMACPP, "needs the target's GGUF file (--gguf FILE)")
    return {} if draft_gguf else {"llamacpp_draft": "needs the draft's GGUF file (--draft-gguf)"}


def check_vocabulary(gguf: Path, tokenizer: Any) -> None:
    """An OptionError unless the GGUF's tokens are the target tokenizer's, id for id (the runs
    send token ids)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(gguf).fields["tokenizer.ggml.tokens"]
        tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    except (OSError, KeyError, ValueError) as e:
        raise OptionError(f"--gguf {gguf}: cannot read its vocabulary ({e})") from None
    n = len(tokenizer)  # a GGUF may pad its list past the tokenizer's ids
    if len(tokens) < n or tokenizer.convert_ids_to_tokens(list(range(n))) != tokens[:n]:
        raise OptionError(f"--gguf {gguf} does not have the target's vocabulary")


class LlamaCpp:
    """One llama.cpp server per kind of run (plain, draft model, n-gram), made when first used.
    The GGUF is memory-mapped, so the servers share its pages."""

    def __init__(self, gguf: str, draft_gguf: str | None, max_tokens: int, context: int):
        self.gguf, self.draft_gguf = Path(gguf), Path(draft_gguf) if draft_gguf else None
        self.max_tokens, self.context = max_tokens, context
        self.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        self.servers: dict[str, Any] = {}

    def describe(self) -> dict[str, Any]:
        """What the rows ran: the files, threads, and llama.cpp's own draft settings (the
        "its defaults" row) as this build of xllamacpp sets them."""
        import xllamacpp

        d = xllamacpp.CommonParams().speculative.draft
        return {
            "xllamacpp": getattr(xllamacpp, "__version__", "?"),
            "gguf": str(self.gguf),
            "draft_gguf": str(self.draft_gguf) if self.draft_gguf else None,
            "threads": self.threads,
            "draft_defaults": {"n_max": d.n_max, "n_min": d.n_min, "p_min": round(d.p_min, 3)},
        }

    def _server(self, method: str, num_draft: int) -> Any:
        """The server for a method; the draft's K is a server setting (this build ignores the
        request's speculative.n_max), so each K has its own."""
        key = (method, num_draft if method == "llamacpp_draft" else 0)
        if key not in self.servers:
            import xllamacpp as xl

            p = xl.CommonParams()
            p.model.path = str(self.gguf)
            p.n_ctx, p.n_parallel, p.verbosity = self.context, 1, 0  # 0: errors only
            if self.threads:
                p.cpuparams.n_threads = p.cpuparams_batch.n_threads = self.threads
            kinds = xl.common_speculative_type
            if method == "llamacpp_draft":
                p.speculative.types = [kinds.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
                d = p.speculative.draft
                d.mparams.path = str(self.draft_gguf)
                if self.threads:
                    d.cpuparams.n_threads = d.cpuparams_batch.n_threads = self.threads
                if num_draft:  # 0: llama.cpp's own settings
                    d.n_max, d.n_min, d.p_min = num_draft, 0, 0.0
            elif method == "llamacpp_ngram":
                p.speculative.types = [kinds.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
            self.servers[key] = xl.Server(p)
        return self.servers[key]

    def request(self, ids: list[int], temperature: float, seed: int) -> dict[str, Any]:
        """The /completion request of one run: pure temperature sampling, as macspec's rows."""
        req: dict[str, Any] = {
            "prompt": ids,
            "n_predict": self.max_tokens,
            "temperature": temperature,
            "seed": seed,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "cache_prompt": False,
            "stream": True,
        }
        return req

    def run(
        self, method: str, num_draft: int, ids: list[int], temperature: float, seed: int,
        c: Recorder,
    ) -> Iterator[Recorder]:  # fmt: skip
        """Stream one run into `c`, yielding it after each chunk of tokens."""
        server = self._server(method, num_draft)
        chunks: queue.Queue = queue.Queue()
        req = self.request(ids, temperature, seed)

        def work() -> None:
            try:
                server.handle_completions(req, lambda ch: chunks.put((time.perf_counter(), ch)))
            finally:
                chunks.put(None)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        text, usage = [], None
        while (item := chunks.get()) is not None:
            now, chunk = item
            if "error" in chunk:
                raise MacspecError(f"llama.cpp refused the run: {chunk['error']}")
            choice = chunk["choices"][0]
            if choice.get("finish_reason") is None:  # the server streams one token a chunk
                text.append(choice.get("text", ""))
                c.round(1, 0, 0, now)
                yield c
            usage = chunk.get("usage", usage)
            if timings := chunk.get("timings"):
                c.rec.drafted = int(timings.get("draft_n", 0))
                c.rec.accepted = int(timings.get("draft_n_accepted", 0))
        thread.join()
        if usage is None or usage.get("completion_tokens") != c.rec.tokens:
            raise MacspecError(f"llama.cpp streamed {c.rec.tokens} tokens but counted {usage}")
        c.rec.text = "".join(text)
        if method != "llamacpp_plain":  # a chunk is not a pass: how many there were is unknown
            c.rec.passes = c.rec.rows = 0
