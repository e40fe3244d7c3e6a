"""docs/architecture.md's tree of the package is the package: every module and package is listed
where it lives, and every listed one exists. The layers show as packages: no loose modules at the
root besides __init__ and __main__."""

from __future__ import annotations

import re
from pathlib import Path

import macspec

PACKAGE = Path(macspec.__file__).parent
PAGE = PACKAGE.parent / "docs" / "architecture.md"


def listed() -> set[str]:
    """Paths (relative to macspec/) the page's tree names: packages end in '/'."""
    text = PAGE.read_text(encoding="utf-8")
    block = re.search(r"```text\nmacspec/\n(.*?)```", text, re.S).group(1)
    stack: list[str] = []
    out = set()
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        name = line.strip().split("  ")[0].split(" ")[0]
        del stack[depth:]
        path = "/".join([*stack, name.rstrip("/")])
        if name.endswith("/"):
            out.add(path + "/")
            stack.append(name.rstrip("/"))
        else:
            out.add(path if name.endswith(".py") else path + ".py")
    return out


def present() -> set[str]:
    out = set()
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE)
        if "csrc" in rel.parts or "data" in rel.parts:
            continue
        if rel.name == "__init__.py" and len(rel.parts) > 1:
            out.add("/".join(rel.parts[:-1]) + "/")
        else:
            out.add(rel.as_posix())
    out.add("cpu/csrc/")
    return out


def test_the_tree_on_the_page_is_the_package():
    names, files = listed(), present()
    assert not names - files, f"listed in docs/architecture.md but absent: {sorted(names - files)}"
    assert not files - names, (
        f"in the package but not in docs/architecture.md: {sorted(files - names)}"
    )


def test_no_loose_modules_at_the_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"]
