"""Reading the README and docs/ as a test must: code blocks with their markers, links, headings.

The markers (an HTML comment on the line just before a fenced block) are documented for writers
in docs/README.md, "Every code example is tested"; `plan()` is their one definition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "models" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SHELL = {"sh", "bash", "shell"}
DATA = {"json"}
INERT = {"text", ""}  # diagrams and output: never run
FIXTURES = {"gguf", "hf-dir", "fresh-store", "server", "sharded-pair"}
MIN_REASON_WORDS = 4

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE_CODE = re.compile(r"`[^`\n]+`")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # what follows "test:" in the comment just before the fence

    @property
    def name(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page.as_posix()}:{self.line}"


@dataclass(frozen=True)
class Plan:
    action: str  # "run", "launch", "skip", "parse" or "none"
    fixtures: tuple[str, ...] = ()
    ranks: int = 1
    reason: str = ""


def split(page: Path, text: str | None = None) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a page, and its prose lines (number, text) outside them."""
    lines = (page.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a code block that never closes")
        before = lines[i - 1].strip() if i > 0 else ""
        marker = _MARKER.match(before)
        code = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(page, i + 1, fence.group(1), code, marker and marker.group(1)))
        i = end + 1
    return blocks, prose


def plan(block: Block) -> Plan:
    """What the test does with a block; ValueError when its marker breaks the conventions."""
    marker, lang = block.marker, block.lang
    if lang not in SHELL | DATA | INERT | {"python"}:
        raise ValueError(f"{block.name}: no way to test a ```{lang} block: use python, sh or text")
    if marker is not None and marker.startswith("skip"):
        reason = marker.removeprefix("skip").lstrip(":").strip()
        if len(reason.split()) < MIN_REASON_WORDS:
            raise ValueError(
                f"{block.name}: a skip needs its reason (`skip: why and what tests it`)"
            )
        return Plan("skip", reason=reason)
    if lang in DATA | INERT:
        if marker is not None:
            raise ValueError(f"{block.name}: a ```{lang} block is never run; drop its marker")
        return Plan("parse" if lang in DATA else "none")
    if marker is None:
        if lang in SHELL:
            raise ValueError(f"{block.name}: a shell block needs `<!-- test: run -->` or a skip")
        return Plan("run")
    return _parse_marker(block, marker)


def _parse_marker(block: Block, marker: str) -> Plan:
    words = marker.split()
    action, options = words[0], dict(w.split("=", 1) for w in words[1:] if "=" in w)
    if action not in ("run", "launch") or len(options) != len(words) - 1:
        raise ValueError(f"{block.name}: unknown marker {marker!r}")
    fixtures = tuple(f for f in options.pop("with", "").split(",") if f)
    unknown = set(fixtures) - FIXTURES
    if unknown:
        raise ValueError(f"{block.name}: unknown fixtures {sorted(unknown)}")
    if action == "run":
        if options:
            raise ValueError(f"{block.name}: `run` takes only with=, not {sorted(options)}")
        return Plan("run", fixtures)
    if block.lang != "python" or set(options) != {"n"} or not options["n"].isdigit():
        raise ValueError(f"{block.name}: `launch n=RANKS` is for python blocks")
    return Plan("launch", fixtures, ranks=int(options["n"]))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(prose: list[tuple[int, str]]) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """Relative links (and #anchors) of a page that lead nowhere, as 'page:line: link'."""
    _, prose = split(page, text)
    found = []
    for number, line in prose:
        for link in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"[a-z]+:", link):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                found.append(f"{page.name}:{number}: {link}")
            elif anchor and target.suffix == ".md" and anchor not in anchors(split(target)[1]):
                found.append(f"{page.name}:{number}: {link} (no such heading)")
    return found


def named_paths(prose: list[tuple[int, str]]) -> set[str]:
    """Repository paths (`macspec/...`, `tests/...`, `scripts/...`) and dotted `macspec.x`
    names that a page's prose puts in backticks."""
    names = set()
    for _, line in prose:
        for span in _INLINE_CODE.findall(line):
            m = re.match(r"`((?:macspec|tests|scripts)/[\w./-]*|macspec(?:\.\w+)+)", span)
            if m:
                names.add(m.group(1))
    return names
