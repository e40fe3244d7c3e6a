"""The native module's build (cpu/native.py): every file of csrc/ is compiled or part of the
build's key, so an edit to any of them builds the module again."""

from macspec.cpu import native


def test_every_source_and_header_is_in_the_build_key():
    on_disk = {p.name for p in native.SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == {p.name for p in (*native.SOURCES, *native.HEADERS)}
