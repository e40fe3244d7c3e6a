"""A test model whose chat template takes tools, and `macspec serve` with a scheduler whose
answers are scripted: the calls a trained model would write, from a model that is not trained
(the HTTP side, the tool-call reader and real clients are what these tests check)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import macspec
from macspec.api import stream as api
from macspec.server.command import serving
from macspec.server.scheduler import END, Scheduler
from support.tinymodels import make_tiny_model

# Hermes' call format, in a template the character-level test model can read.
TOOL_TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}{{ '\\n' }}"
    "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    '<tool_call>{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}'
    "</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def tool_model(path: Path) -> Path:
    """The test model (2,048-token context) with TOOL_TEMPLATE as its chat template."""
    path = make_tiny_model(path, seed=0, context=2048)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


class Scripted(Scheduler):
    """Answers `script(prompt text)`, one piece a round."""

    def __init__(self, pair, script: Callable[[str], list[str]]) -> None:
        super().__init__(pair)
        self.script = script

    def _step(self, job) -> bool:
        if job.stream is None:
            job.stream = iter(self.script(self.pair.tokenizer.decode(job.ids)))
            job.stats = macspec.generate(self.pair, "ab", max_tokens=1).stats
        piece = next(job.stream, None)
        event = api.RoundEvent(
            (), (), (1,), 1, piece or "", (), 0, False, 0.0, 0.0, 0.0, 0.0,
            "stop" if piece is None else None, stats=job.stats,
        )  # fmt: skip
        job.put(event)
        if piece is None:
            job.put(END)
        return piece is not None


def scripted_serving(pair, script: Callable[[str], list[str]]):
    """`macspec serve` (in a thread) answering by `script`; a context giving its base URL."""
    return serving(pair, scheduler=Scripted(pair, script))
