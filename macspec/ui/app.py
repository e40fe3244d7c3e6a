"""The `macspec chat` Textual app: a conversation whose tokens are coloured by where they came from.

The app composes the widgets (macspec/ui/widgets/) and sets their reactive state from the
generation's events. Generation runs on the app's one MLX thread (`MlxThread`), iterating
`macspec.stream_generate` and posting the UI one `RoundReady` per verification round (and a
`PromptRead` as a long prompt is read); Esc sets a flag it checks each round, and as the prompt
is read, and closes the generator.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Footer, Header, Static

from ..api.mlx_thread import MlxThread
from ..api.options import DEFAULTS, NAMES
from ..base.errors import MacspecError, OptionError, PromptError
from .transcript import Reply, finish_label, num, pct
from .widgets import (
    AcceptChart,
    Conversation,
    Legend,
    PromptBox,
    ReadingBar,
    ReplyView,
    SettingsPanel,
    StatsPanel,
    shortened,
)

if TYPE_CHECKING:
    from ..api.pair import Pair
    from ..api.stream import RoundEvent

UI_OPTIONS = ("system", "show_rejected", "rejected_linger", "timings", "title")
MAX_K = 16
CHART_ROUNDS = 200  # more than the panel is wide; the chart shows the latest


def create_app(pair: Pair, **options: Any) -> ChatApp:
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
    return ChatApp(pair, gen, **ui)


class RoundReady(Message):
    """One verification round from the worker thread."""

    def __init__(self, event: RoundEvent, conversation: int) -> None:
        super().__init__()
        self.event, self.conversation = event, conversation


class PromptRead(Message):
    """How much of the prompt the worker has read (`read` of `total` ids)."""

    def __init__(self, read: int, total: int, conversation: int) -> None:
        super().__init__()
        self.read, self.total, self.conversation = read, total, conversation


class _Stopped(Exception):
    """Esc while the prompt is read: raised from on_prefill, it ends the generation there."""


class GenerationDone(Message):
    """The worker finished: normally, stopped by Esc, or with an error."""

    def __init__(self, conversation: int, stopped: bool, error: BaseException | None) -> None:
        super().__init__()
        self.conversation, self.stopped, self.error = conversation, stopped, error


class ChatApp(App):
    """The conversation on the left, the side panel (legend, this answer's figures, the chart,
    the next answer's settings) on the right; `send()` answers a message on the MLX thread."""

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

    show_rejected: reactive[bool] = reactive(True)  # bound to the legend and the conversation

    # the widgets a round updates, found once on mount
    conversation: Conversation
    _stats: StatsPanel
    _chart: AcceptChart
    _settings: SettingsPanel

    def __init__(
        self,
        pair: Pair,
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
        self.set_reactive(ChatApp.show_rejected, show_rejected)
        self.rejected_linger = rejected_linger
        self.timings = timings
        self.title = title or "macspec chat"
        self.sub_title = pair.describe()
        self.history: list[dict[str, str]] = []
        self.reply: Reply | None = None  # the answer being written
        self.reply_view: ReplyView | None = None
        self.busy = False
        self.conversation_id = 0
        self._stop = threading.Event()
        self._mlx = MlxThread()  # one thread: one generation at a time on the pair
        self._reset_history()

    # layout ---------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield Conversation(id="conversation").data_bind(ChatApp.show_rejected)
            with VerticalScroll(id="side"):  # scrolls in short terminals
                yield Legend(id="legend").data_bind(ChatApp.show_rejected)
                yield StatsPanel(id="stats", timings=self.timings)
                yield Static("accepted drafts per round", id="chart-label")
                yield AcceptChart(id="chart", ceiling=max(1, self.options["num_draft"]))
                yield SettingsPanel(id="settings")
        yield ReadingBar(id="reading", eta=self.timings)
        yield Static("", id="status")
        yield PromptBox(
            placeholder="Message (Enter sends, ctrl+j a new line, Esc stops)", id="prompt"
        )
        yield Footer()

    def on_mount(self) -> None:
        # found once: a query for the side panel walks the whole conversation first
        self.conversation = self.query_one(Conversation)
        self._stats = self.query_one(StatsPanel)
        self._chart = self.query_one(AcceptChart)
        self._settings = self.query_one(SettingsPanel)
        self._reading_bar = self.query_one(ReadingBar)
        if self.system:
            self.conversation.add(Text(f"system: {self.system}"), "system")
        self._show_settings()
        if self.pair.calibration_time and self.timings:  # load() measured the machine: say so
            self._status(self.pair.calibration_note())
        self.query_one("#prompt", PromptBox).focus()

    def _show_settings(self) -> None:
        self._settings.options = dict(self.options)

    def _show_progress(self, reply: Reply | None) -> None:
        """The side panel follows `reply` (None: no answer yet)."""
        self._stats.reply = reply
        ceiling = reply.max_num_draft if reply is not None else 0
        self._chart.ceiling = max(1, ceiling or self.options["num_draft"])
        self._chart.data = reply.accepted_per_round[-CHART_ROUNDS:] if reply is not None else []

    def _status(self, message: str) -> None:
        self.query_one("#status", Static).update(message)

    # conversation ---------------------------------------------------------------------------
    def _reset_history(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def show_error(self, error: BaseException | str) -> None:
        """Put a readable error into the conversation (never a traceback)."""
        if isinstance(error, MacspecError):
            message = f"error: {error}"
        elif isinstance(error, BaseException):
            message = f"unexpected error: {type(error).__name__}: {error}"
        else:
            message = f"error: {error}"
        self.conversation.add(Text(message), "error")

    @on(PromptBox.Submitted, "#prompt")
    def _submitted(self, event: PromptBox.Submitted) -> None:
        message = event.value.strip()
        if not message:
            return
        if self.busy:
            self._status("still answering: Esc stops it")
            return
        event.box.clear()
        self.send(message)

    def send(self, message: str) -> None:
        """Add a user message and start answering it."""
        self.conversation.add(Text(shortened(message)), "user")
        self.history.append({"role": "user", "content": message})
        self.reply = Reply(linger=self.rejected_linger)
        self.reply_view = self.conversation.add_reply(self.reply)
        self._show_progress(self.reply)
        self.busy = True
        self._stop = threading.Event()
        self._status("answering… (Esc stops)")
        options = dict(self.options)
        if options.get("num_draft") == 0:  # K 0 is plain decoding, for comparison
            options.pop("num_draft")
            options["speculative"] = False
        self._generate(list(self.history), options, self._stop, self.conversation_id)

    # generation -----------------------------------------------------------------------------
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

        def read(done: int, total: int) -> None:  # a long prompt takes seconds to read
            if stop.is_set():
                raise _Stopped
            self.post_message(PromptRead(done, total, conversation))

        try:
            stream = macspec.stream_generate(
                self.pair, messages=messages, on_prefill=read, **options
            )
            try:
                for event in stream:
                    if stop.is_set():
                        break
                    # posting does not wait for the UI: drawing never slows generation down
                    self.post_message(RoundReady(event, conversation))
            finally:
                stream.close()
        except _Stopped:
            pass
        except Exception as e:  # shown in the conversation; the app keeps running
            error = e
        self.post_message(GenerationDone(conversation, stop.is_set(), error))

    @on(RoundReady)
    def _on_round(self, message: RoundReady) -> None:
        reply, view = self.reply, self.reply_view
        if message.conversation != self.conversation_id or reply is None or reply.failed:
            return
        try:
            reply.add_round(message.event)
        except Exception as e:  # e.g. a tokenizer that cannot decode: say so, stop, keep running
            reply.failed = True
            self._stop.set()
            self.show_error(e)
            return
        # the widgets redraw when Textual next paints: rounds that come faster share one frame
        if view is not None:
            view.changed()
        self._show_progress(reply)

    @on(PromptRead)
    def _on_read(self, message: PromptRead) -> None:
        if message.conversation != self.conversation_id or not self.busy:
            return
        counted = self._reading_bar.display  # the reading was shown: turns came before
        self._reading_bar.show(message.read, message.total)
        if message.read < message.total:
            read = f"{message.read:,} of {message.total:,} ids"
            self._status(f"reading the prompt: {read} (Esc stops)")
        elif counted:  # read in turns: the answer comes next
            self._status("answering… (Esc stops)")

    @on(GenerationDone)
    def _on_done(self, message: GenerationDone) -> None:
        self.busy = False
        self._reading_bar.hide()
        if message.conversation != self.conversation_id:
            return
        reply, self.reply = self.reply, None
        view, self.reply_view = self.reply_view, None
        if view is not None:
            view.done()
        if message.error is not None:
            if view is not None and reply is not None and not reply.spans:
                view.remove()
            if isinstance(message.error, PromptError):  # e.g. too long: let the user try again
                self.history.pop()
            self.show_error(message.error)
            self._status("")
        elif reply is not None and reply.failed:  # the error is on screen; forget the message
            self.history.pop()
            self._status("stopped after an error")
        elif message.stopped and reply is not None and not reply.spans:  # Esc before any token
            if view is not None:
                view.remove()
            self.history.pop()  # unanswered: the next message goes without it
            self._status("stopped (Esc) before the answer began")
        elif reply is not None:
            self.history.append({"role": "assistant", "content": reply.text})
            self._status(self._finish_line(reply, message.stopped))
            if reply.finish_reason == "context":
                self.show_error("the context is full: ctrl+n starts a new conversation")

    def _finish_line(self, reply: Reply, stopped: bool) -> str:
        """The status line once an answer is complete: why it ended and what it cost."""
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
        return line

    # actions --------------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.busy:
            self._stop.set()
            self._status("stopping…")

    def action_new_chat(self) -> None:
        self._stop.set()
        self.conversation_id += 1
        self.reply, self.reply_view = None, None
        self._reset_history()
        self.conversation.clear()
        if self.system:
            self.conversation.add(Text(f"system: {self.system}"), "system")
        self._show_progress(None)
        self._status("new conversation")
        self.query_one("#prompt", PromptBox).focus()

    def action_toggle_rejected(self) -> None:
        self.show_rejected = not self.show_rejected

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
