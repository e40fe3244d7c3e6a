"""The `macspec chat` Textual app: a conversation whose tokens are coloured by where they came from.

Generation runs on the app's one MLX thread (`MlxThread`), iterating `macspec.stream_generate` and
handing the UI one update per verification round; Esc sets a flag it checks each round and closes
the generator.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Input, Static

from ..api.mlx_thread import MlxThread
from ..api.options import DEFAULTS, NAMES
from ..base.errors import MacspecError, OptionError, PromptError
from .chart import AcceptChart
from .transcript import DRAFT, REJECTED, TARGET, Reply, finish_label, num, pct

# Okabe-Ito colours (safe for common colour-blindness) plus a style: origin never hangs on hue
STYLES = {
    DRAFT: "#56b4e9",
    TARGET: "bold #e69f00",
    REJECTED: "strike #cc79a7",
}
LEGEND = {
    DRAFT: "draft, accepted",
    TARGET: "target's own token",
    REJECTED: "draft, rejected",
}
UI_OPTIONS = ("system", "show_rejected", "rejected_linger", "timings", "title")
MAX_K = 16
REDRAW_INTERVAL = 1 / 30  # seconds; more redraws only take CPU from generation
CHART_ROUNDS = 200  # more than the panel is wide; the chart shows the latest


def create_app(engine_or_pair: Any, **options: Any) -> ChatApp:
    """Build the chat app around a loaded pair (`macspec.load()`).

    Options: the generation options of `macspec.generate` (macspec/api/options.py; None = their
    default) and the UI's own: `system` (system prompt), `show_rejected` (bool),
    `rejected_linger` (seconds, None keeps them), `timings` (False shows no timing numbers, for
    reproducible screenshots), `title`.
    """
    unknown = set(options) - set(NAMES) - set(UI_OPTIONS)
    if unknown:
        raise OptionError(f"unknown chat option(s): {', '.join(sorted(unknown))}")
    gen = {k: v for k, v in options.items() if k in NAMES and v is not None}
    ui = {k: v for k, v in options.items() if k in UI_OPTIONS}
    return ChatApp(engine_or_pair, gen, **ui)


class RoundReady(Message):
    """One verification round from the worker thread."""

    def __init__(self, event: Any, conversation: int) -> None:
        super().__init__()
        self.event, self.conversation = event, conversation


class GenerationDone(Message):
    """The worker finished: normally, stopped by Esc, or with an error."""

    def __init__(self, conversation: int, stopped: bool, error: BaseException | None) -> None:
        super().__init__()
        self.conversation, self.stopped, self.error = conversation, stopped, error


class ChatApp(App):
    CSS_PATH = "chat.tcss"
    TITLE = "macspec chat"

    BINDINGS = [
        # not a priority binding: dialogs such as the command palette still get their Esc
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat", priority=True),
        Binding("ctrl+r", "toggle_rejected", "Rejected", priority=True),
        Binding("f2", "num_draft(-1)", "K−"),
        Binding("f3", "num_draft(1)", "K+"),
        Binding("f4", "temperature(-0.1)", "T−"),
        Binding("f5", "temperature(0.1)", "T+"),
        # the same without function keys, whenever the message box does not have focus
        Binding("left_square_bracket", "num_draft(-1)", "K−", show=False),
        Binding("right_square_bracket", "num_draft(1)", "K+", show=False),
        Binding("minus", "temperature(-0.1)", "T−", show=False),
        Binding("plus", "temperature(0.1)", "T+", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        pair: Any,
        generation: dict[str, Any] | None = None,
        *,
        system: str | None = None,
        show_rejected: bool = True,
        rejected_linger: float | None = 0.8,
        timings: bool = True,
        title: str | None = None,
    ) -> None:
        super().__init__()
        self.pair = pair
        self.options = {**DEFAULTS.to_dict(), **(generation or {})}
        self.system = system
        self.show_rejected = show_rejected
        self.rejected_linger = rejected_linger
        self.timings = timings
        self.title = title or "macspec chat"
        self.sub_title = pair.describe()
        self.history: list[dict[str, str]] = []
        self.reply: Reply | None = None
        self.reply_view: Static | None = None
        self.busy = False
        self.conversation_id = 0
        self._stop = threading.Event()
        self._mlx = MlxThread()  # one thread: one generation at a time on the pair
        self._fading: tuple[Reply, Static | None] | None = None  # a finished reply still fading
        self._replies: list[tuple[Reply, Static]] = []  # every reply shown, for redraws
        self._redraw_pending = False
        self._last_redraw = 0.0
        self._reset_history()

    # layout ---------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield VerticalScroll(id="conversation")
            with VerticalScroll(id="side"):  # scrolls in short terminals
                yield Static(self._legend(), id="legend")
                yield Static(id="stats")
                yield Static("accepted drafts per round", id="chart-label")
                yield AcceptChart(id="chart", ceiling=max(1, self.options["num_draft"]))
                yield Static(id="settings")
        yield Static("", id="status")
        yield Input(placeholder="Message (Enter sends, Esc stops)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#legend").border_title = "tokens"
        self.query_one("#stats").border_title = "this answer"
        self.query_one("#settings").border_title = "next answer"
        if self.system:
            self._add_message(Text(f"system: {self.system}"), "system")
        self._show_stats(None)
        self._show_settings()
        if self.pair.calibration_time and self.timings:  # load() measured the machine: say so
            self._status(self.pair.calibration_note())
        self.query_one("#prompt", Input).focus()
        self.set_interval(0.2, self._expire_rejected)

    def _legend(self) -> Text:
        text = Text()
        for origin, label in LEGEND.items():
            text.append("word", style=STYLES[origin])
            text.append(f" {label}\n")
        text.append("(ctrl+r: " + ("shown" if self.show_rejected else "hidden") + ")", style="dim")
        return text

    def _show_settings(self) -> None:
        k, t = self.options.get("num_draft"), self.options.get("temperature")
        if k == 0:
            line = "K 0 (plain)"
        elif self.options.get("adaptive"):
            line = f"K ≤{k} adaptive"
        else:
            line = f"K {k}"
        line += f"   T {float(t or 0):.1f}"
        seed = self.options.get("seed")
        if seed is not None:
            line += f"   seed {seed}"
        self.query_one("#settings", Static).update(line)

    def _show_stats(self, reply: Reply | None) -> None:
        """The engine's running statistics of this answer (the latest RoundEvent's)."""
        stats = reply.stats if reply is not None else None
        hidden = "·"  # timing numbers change run to run; screenshots hide them

        def timing(text: str) -> str:
            return text if self.timings else hidden

        drafted = bool(stats and stats.drafted)
        plain = 1 / stats.plain_step_time if stats and stats.plain_step_time else None
        rows = [
            ("rounds", str(stats.rounds if stats else 0)),
            ("tokens", str(stats.generated_tokens if stats else 0)),
            ("round speedup", timing(f"{num(reply and reply.last_speedup)}x")),
            ("acceptance", pct(stats.acceptance_rate if drafted else None)),
            ("accept length", num(stats.mean_accepted_length if drafted else None)),
            ("last round", (reply.last_round if reply is not None else "") or "–"),
            ("tok/s", timing(num(stats.tokens_per_second if stats else None, 1))),
            ("plain tok/s", timing(num(plain, 1))),
            ("overall", timing(f"{num(stats.speedup if stats else None)}x")),
        ]
        text = Text()
        for i, (name, value) in enumerate(rows):
            text.append(f"{name:<14}", style="dim")
            text.append(value, style="bold")
            if i < len(rows) - 1:
                text.append("\n")
        self.query_one("#stats", Static).update(text)
        chart = self.query_one("#chart", AcceptChart)
        ceiling = reply.max_num_draft if reply is not None else 0
        chart.ceiling = max(1, ceiling or self.options["num_draft"])
        chart.data = reply.accepted_per_round[-CHART_ROUNDS:] if reply is not None else []

    def _status(self, message: str) -> None:
        self.query_one("#status", Static).update(message)

    # conversation ---------------------------------------------------------------------------
    def _reset_history(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def _add_message(self, content: Any, kind: str) -> Static:
        view = Static(content, classes=f"message {kind}")
        self.query_one("#conversation", VerticalScroll).mount(view)
        self._scroll_end()
        return view

    def _scroll_end(self) -> None:
        self.query_one("#conversation", VerticalScroll).anchor()  # to the end, and follow

    def _render_reply(self) -> None:
        self._draw(self.reply, self.reply_view)
        if self._fading is not None:
            self._draw(*self._fading)

    def _draw(self, reply: Reply | None, view: Static | None) -> None:
        if reply is None or view is None:
            return
        text = Text()
        for span in reply.spans:
            if span.origin == REJECTED and not self.show_rejected:
                continue
            text.append(span.text, style=STYLES[span.origin])
        view.update(text)

    def show_error(self, error: BaseException | str) -> None:
        """Put a readable error into the conversation (never a traceback)."""
        if isinstance(error, MacspecError):
            message = f"error: {error}"
        elif isinstance(error, BaseException):
            message = f"unexpected error: {type(error).__name__}: {error}"
        else:
            message = f"error: {error}"
        self._add_message(Text(message), "error")

    @on(Input.Submitted, "#prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        message = event.value.strip()
        if not message:
            return
        if self.busy:
            self._status("still answering: Esc stops it")
            return
        event.input.value = ""
        self.send(message)

    def send(self, message: str) -> None:
        """Add a user message and start answering it."""
        self._add_message(Text(message), "user")
        self.history.append({"role": "user", "content": message})
        self.reply = Reply(linger=self.rejected_linger)
        self.reply_view = self._add_message(Text(""), "assistant")
        self._replies.append((self.reply, self.reply_view))
        self._show_stats(self.reply)
        self.busy = True
        self._stop = threading.Event()
        self._status("answering… (Esc stops)")
        options = dict(self.options)
        if options.get("num_draft") == 0:  # K 0 is plain decoding, for comparison
            options.pop("num_draft")
            options["speculative"] = False
        self._generate(list(self.history), options, self._stop, self.conversation_id)

    @work(exclusive=False, exit_on_error=False, group="generate")
    async def _generate(
        self, messages: list, options: dict[str, Any], stop: threading.Event, conversation: int
    ) -> None:
        await self._mlx.run(self._answer, messages, options, stop, conversation)

    def _answer(
        self, messages: list, options: dict[str, Any], stop: threading.Event, conversation: int
    ) -> None:
        """Runs on the MLX thread: posts each round, then GenerationDone."""
        import macspec

        error: BaseException | None = None
        try:
            stream = macspec.stream_generate(self.pair, messages=messages, **options)
            try:
                for event in stream:
                    if stop.is_set():
                        break
                    # posting does not wait for the UI: drawing never slows generation down
                    self.post_message(RoundReady(event, conversation))
            finally:
                stream.close()
        except Exception as e:  # shown in the conversation; the app keeps running
            error = e
        self.post_message(GenerationDone(conversation, stop.is_set(), error))

    @on(RoundReady)
    def _on_round(self, message: RoundReady) -> None:
        if message.conversation != self.conversation_id or self.reply is None or self.reply.failed:
            return
        try:
            self.reply.add_round(message.event)
        except Exception as e:  # e.g. a tokenizer that cannot decode: say so, stop, keep running
            self.reply.failed = True
            self._stop.set()
            self.show_error(e)
            return
        if self._redraw_pending:  # rounds arriving faster than the screen redraws share one
            return
        self._redraw_pending = True
        wait = self._last_redraw + REDRAW_INTERVAL - time.monotonic()
        if wait > 0:
            self.set_timer(wait, self._redraw)
        else:
            self.call_later(self._redraw)

    def _redraw(self) -> None:
        self._redraw_pending = False
        self._last_redraw = time.monotonic()
        if self.reply is None:
            return
        # the conversation is anchored: it follows the answer unless the user scrolled up to read
        self._render_reply()
        self._show_stats(self.reply)

    @on(GenerationDone)
    def _on_done(self, message: GenerationDone) -> None:
        conversation, stopped, error = message.conversation, message.stopped, message.error
        self.busy = False
        if conversation != self.conversation_id:
            return
        self._redraw()
        reply, self.reply = self.reply, None
        view, self.reply_view = self.reply_view, None
        if error is not None:
            if view is not None and reply is not None and not reply.spans:
                view.remove()
                self._replies = [(r, v) for r, v in self._replies if v is not view]
            if isinstance(error, PromptError):  # e.g. too long: let the user try again
                self.history.pop()
            self.show_error(error)
            self._status("")
            return
        if reply is None:
            return
        if reply.failed:  # the error is already on screen; forget the unanswered message
            self.history.pop()
            self._status("stopped after an error")
            return
        self.history.append({"role": "assistant", "content": reply.text})
        stats = reply.stats
        line = finish_label(reply.finish_reason, stopped)
        if stats is not None:
            drafted = stats.acceptance_rate if stats.drafted else None
            line += f" · {stats.rounds} rounds · {stats.generated_tokens} tokens"
            line += f" · acceptance {pct(drafted)}"
            if stats.drafted:  # which drafter and K the rounds used
                line += f" · {stats.arms_line()}"
            if self.timings:
                line += f" · {num(stats.speedup)}x plain decoding"
        self._status(line)
        if reply.finish_reason == "context":
            self.show_error("the context is full: ctrl+n starts a new conversation")
        if reply.linger is not None and reply.pending_rejected():
            # let the last rejected drafts fade like the others, then draw the final text
            self._fading = (reply, view)
        else:
            self._draw(reply, view)

    def _expire_rejected(self) -> None:
        if self.reply is not None and self.reply.expire():
            self._draw(self.reply, self.reply_view)
        if self._fading is not None:
            reply, view = self._fading
            if reply.expire():
                self._draw(reply, view)
            if not reply.pending_rejected():
                self._fading = None

    # actions --------------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.busy:
            self._stop.set()
            self._status("stopping…")

    def action_new_chat(self) -> None:
        self._stop.set()
        self.conversation_id += 1
        self.reply, self.reply_view, self._fading = None, None, None
        self._replies = []
        self._reset_history()
        self.query_one("#conversation", VerticalScroll).remove_children()
        if self.system:
            self._add_message(Text(f"system: {self.system}"), "system")
        self._show_stats(None)
        self._status("new conversation")
        self.query_one("#prompt", Input).focus()

    def action_toggle_rejected(self) -> None:
        self.show_rejected = not self.show_rejected
        self.query_one("#legend", Static).update(self._legend())
        for reply, view in self._replies:
            self._draw(reply, view)

    def action_num_draft(self, delta: int) -> None:
        k = int(self.options.get("num_draft") or 0) + delta
        self.options["num_draft"] = max(0, min(MAX_K, k))
        self._show_settings()

    def action_temperature(self, delta: float) -> None:
        t = float(self.options.get("temperature") or 0.0) + delta
        self.options["temperature"] = round(max(0.0, min(2.0, t)), 2)
        self._show_settings()

    async def action_quit(self) -> None:
        self._stop.set()
        self.exit()

    def on_unmount(self) -> None:
        # the last thing the app does: the answer stops at its next round, then MLX's thread ends
        self._stop.set()
        self._mlx.close()
