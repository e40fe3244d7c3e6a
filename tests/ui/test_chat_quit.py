"""Quitting `macspec chat` in a real pseudo-terminal: exit status 0 and nothing printed.

Each case runs the real command (`python -m macspec chat`, as a user would) on tiny models, asks a
question, and quits with ctrl+q: after the answer, after Esc mid-answer, after ctrl+n, and while an
answer streams. MLX's per-thread state (compile cache, random key) once outlived the interpreter in
the generation thread and aborted the process (`terminate called without an active exception`).
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time

import pytest
from support.tinymodels import make_tiny_model

from macspec.base import paths

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal"),
    pytest.mark.subprocess,
]

CTRL_Q, CTRL_N, ESC = "\x11", "\x0e", "\x1b"
WAIT_S = 120  # generous: the suite shares a busy machine; nothing here measures time
ANSI_SEQ = re.compile(rb"\x1b(\[[0-9;?<>=]*[ -/]*[@-~]|[PX^_].*?\x1b\\|\][^\x07]*\x07|.)", re.S)


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """Tiny models with room for a long answer, so that one is still streaming when we quit."""
    root = tmp_path_factory.mktemp("quit")
    kw = {"hidden": 48, "tie": False, "context": 8192}
    target = make_tiny_model(root / "target", seed=0, **kw)
    draft = make_tiny_model(root / "draft", seed=0, perturb=0.3, **kw)
    return target, draft


@pytest.fixture
def home(tmp_path):
    """A fresh store per case, sharing the suite's native build: otherwise every case's command
    compiles the CPU extension again before its first screen."""
    home = tmp_path / "home"
    home.mkdir()
    paths.native_dir().mkdir(parents=True, exist_ok=True)
    (home / "native").symlink_to(paths.native_dir(), target_is_directory=True)
    return home


class Terminal:
    """`macspec chat` in a pseudo-terminal: type keys, wait for text on the screen, read the end."""

    def __init__(self, args: list[str], home) -> None:
        env = dict(os.environ, TERM="xterm-256color", MACSPEC_HOME=str(home))
        env.pop("TEXTUAL", None)
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, on the pseudo-terminal
            try:
                os.execve(sys.executable, [sys.executable, "-m", "macspec", "chat", *args], env)
            finally:
                os._exit(127)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 36, 120, 0, 0))
        self.raw = b""

    @property
    def text(self) -> str:
        return ANSI_SEQ.sub(b"", self.raw).decode(errors="replace")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.raw += data
        return bool(data)

    def wait_for(self, needle: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while needle not in self.text:
            if time.monotonic() > deadline or not self._read(0.2):
                raise AssertionError(f"{needle!r} never appeared; the screen ends:\n{self.tail()}")

    def press(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def finish(self) -> int:
        """Read until the command exits; its exit status (killed by a signal: 128 + its number)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self._read(0.2) and select.select([self.fd], [], [], 0)[0]:
                    pass
                os.close(self.fd)
                code = os.waitstatus_to_exitcode(status)
                return 128 - code if code < 0 else code
            self._read(0.2)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError(f"macspec chat did not exit; the screen ends:\n{self.tail()}")

    def tail(self) -> str:
        return self.text[-1500:]


def after_answer(term: Terminal) -> None:
    term.wait_for("tokens · acceptance")  # the finish line: the answer is complete


def after_escape(term: Terminal) -> None:
    term.wait_for("answering")
    term.press(ESC)
    term.wait_for("stopped (Esc)")


def after_new_chat(term: Terminal) -> None:
    after_answer(term)
    term.press(CTRL_N)
    term.wait_for("new conversation")


def while_streaming(term: Terminal) -> None:
    term.wait_for("answering")


CASES = {
    "after_answer": (after_answer, 16),
    "after_escape": (after_escape, 6000),
    "after_new_chat": (after_new_chat, 16),
    "while_streaming": (while_streaming, 6000),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ctrl_q_quits_with_status_0_and_prints_nothing(case, long_pair, home):
    before_quit, max_tokens = CASES[case]
    target, draft = long_pair
    args = ["--target", str(target), "--draft", str(draft), "--max-tokens", str(max_tokens)]
    term = Terminal(args, home)
    term.wait_for("Message (Enter sends")
    term.press("hello there\r")
    before_quit(term)
    finished = "tokens · acceptance" in term.text
    term.press(CTRL_Q)
    status = term.finish()
    if case == "while_streaming":  # the case is only itself if the answer had not finished
        assert not finished, "the answer finished before ctrl+q: make it longer"
    left = term.raw.rsplit(b"\x1b[?1049l", 1)  # what came after the app left its screen
    assert len(left) == 2, f"the app never left its screen:\n{term.tail()}"
    for word in ("terminate", "Aborted", "Traceback"):
        assert word not in term.text, f"{word!r} in the output:\n{term.tail()}"
    assert ANSI_SEQ.sub(b"", left[1]).strip() == b""
    assert status == 0, f"exit status {status}; the screen ends:\n{term.tail()}"
