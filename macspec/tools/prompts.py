"""Built-in prompt sets by kind (code, chat, grounded, creative), for benchmarks and evaluation.

The kinds differ in how predictable the answer is: grounded prompts copy from their input (n-gram
drafting shines), code is regular, chat is open but formulaic, creative writing is the hardest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..base.errors import OptionError, PromptError

KINDS = ("code", "chat", "grounded", "creative")

_ARTICLE = (
    "The city council voted on Tuesday to extend the river footpath by three kilometres, "
    "connecting the old harbour to the new railway station. Work will start in March and is "
    "expected to take eighteen months. The project costs 4.2 million euros, of which half comes "
    "from a regional transport fund. Local shop owners welcomed the plan, saying more walkers "
    "would bring more customers, while residents of the harbour district asked for better "
    "lighting and more benches along the way. The council promised a public meeting in February "
    "to present the final design."
)
_EMAIL = (
    "hi team, quick update: the release is moved from friday to next wednesday because the "
    "database migration failed on the staging server. john is fixing the script and will test it "
    "again tomorrow morning. please do not merge new features into the main branch until the "
    "release is out. if you have questions ask me or john. thanks, maria"
)
_RECIPE = (
    "Pancakes: mix 200 g of flour, 2 eggs, 300 ml of milk and a pinch of salt until smooth. Let "
    "the batter rest for 10 minutes. Heat a little butter in a pan, pour a ladle of batter, cook "
    "for one minute on each side until golden. Serve with lemon and sugar or with jam."
)

BUILTIN: dict[str, tuple[str, ...]] = {
    "code": (
        "Write a Python function `is_prime(n)` that returns True when n is a prime number, "
        "with a docstring and a few doctest examples.",
        "Write a Python function that reads a CSV file and returns the sum of the column "
        "named 'amount'. Use the csv module.",
        "Write a JavaScript function that debounces another function by a given number of "
        "milliseconds, and show how to use it.",
        "Write a SQL query that returns the ten customers with the highest total order value "
        "from tables customers(id, name) and orders(id, customer_id, total).",
    ),
    "chat": (
        "What are three good habits for getting better sleep?",
        "Explain in simple words why the sky is blue.",
        "What is the difference between a virus and a bacterium?",
        "Give me some tips for learning a new language as an adult.",
    ),
    "grounded": (
        f"Summarise the following article in three sentences.\n\n{_ARTICLE}",
        f"Rewrite this email so that it is polite and well formatted, keeping every fact.\n\n"
        f"{_EMAIL}",
        f"Rewrite this recipe as a numbered list of steps.\n\n{_RECIPE}",
        f"List every number mentioned in the following article, with what it refers to.\n\n"
        f"{_ARTICLE}",
    ),
    "creative": (
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Write a poem about the first snow of winter.",
        "Describe an imaginary city where it is always night.",
        "Write the opening paragraph of a mystery novel set on a train.",
    ),
}


@dataclass(frozen=True)
class Prompt:
    kind: str
    text: str  # the user's message
    name: str  # short, unique within a set, e.g. "code-1"

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as a conversation (the model's chat template makes its input)."""
        return [{"role": "user", "content": self.text}]


def builtin_prompts(
    kinds: list[str] | tuple[str, ...] | None = None, per_kind: int = 0
) -> list[Prompt]:
    """The built-in prompts of `kinds` (all by default); `per_kind` > 0 keeps that many of each."""
    kinds = list(kinds or KINDS)
    unknown = [k for k in kinds if k not in BUILTIN]
    if unknown:
        raise OptionError(
            f"unknown prompt kind(s) {', '.join(unknown)}: choose from {', '.join(KINDS)}"
        )
    out = []
    for kind in kinds:
        texts = BUILTIN[kind][:per_kind] if per_kind > 0 else BUILTIN[kind]
        out += [Prompt(kind, t, f"{kind}-{i + 1}") for i, t in enumerate(texts)]
    return out


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a file: JSON list / JSONL of {"kind", "prompt"} objects or strings, or plain
    text with one prompt per line (kind "custom")."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PromptError(f"cannot read the prompt file {path}: {e.strerror or e}") from None
    items: list = []
    stripped = text.strip()
    try:
        if stripped.startswith("["):
            items = json.loads(stripped)
        elif stripped.startswith("{"):
            items = [json.loads(line) for line in stripped.splitlines() if line.strip()]
        else:
            items = [line for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise PromptError(f"the prompt file {path} is not valid JSON: {e}") from None
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            kind, prompt = "custom", item
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            kind, prompt = str(item.get("kind") or "custom"), item["prompt"]
        else:
            raise PromptError(f"{path}: entry {i + 1} is neither a string nor {{'prompt': ...}}")
        if not prompt.strip():
            raise PromptError(f"{path}: entry {i + 1} is an empty prompt")
        prompts.append(Prompt(kind, prompt, f"{kind}-{i + 1}"))
    if not prompts:
        raise PromptError(f"the prompt file {path} holds no prompts")
    return prompts


def with_context(prompt: Prompt, length: Callable[[Prompt], int], tokens: int) -> Prompt:
    """`prompt` preceded by a numbered list of other questions, so that its input is at least
    `tokens` long (`length`: a prompt's input in tokens), as `llama-bench -d` decodes at a depth.

    The list is the distillation's training questions: varied text, so a draft cannot simply
    copy a repeated passage, and none of them is a benchmark prompt."""
    from .distill.train_prompts import TRAIN_TEXTS

    def preceded(n: int) -> Prompt:
        listed = "\n".join(f"{i + 1}. {q}" for i, q in enumerate(TRAIN_TEXTS[:n]))
        text = f"Questions people asked earlier:\n{listed}\n\nNow answer this one: {prompt.text}"
        return replace(prompt, text=text)

    if length(prompt) >= tokens:
        return prompt
    lo, hi = 0, 1  # the fewest questions that reach `tokens` lie in (lo, hi]
    while length(preceded(hi)) < tokens:
        if hi == len(TRAIN_TEXTS):
            raise OptionError(f"context={tokens} is longer than the filler questions reach")
        lo, hi = hi, min(2 * hi, len(TRAIN_TEXTS))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if length(preceded(mid)) >= tokens else (mid, hi)
    return preceded(hi)
