"""``sparrowd top``: the swarm, live, in a terminal (Textual); ``--once`` prints it one time."""

from __future__ import annotations

import asyncio
import os
import time

from sparrowd.errors import SparrowError

from .checks import seconds
from .topview import COLUMNS, TopView, fit

STYLES = {"stale": "bold red", "error": "bold red", "lagging": "yellow", "trainer": "cyan", "": ""}


def register(sub) -> None:
    t = sub.add_parser(
        "top", help="watch the swarm live: versions, engines and their lag, transfers",
        description="A live view of the tracker's status snapshot, refreshed about once a second. Keys: s cycles "
                    "the sort (lag, region, rate), r cycles the region shown, q quits. Lagging engines are yellow, "
                    "stale nodes and nodes reporting an error red. While the tracker is unreachable the last "
                    "snapshot stays on screen with a notice.")
    from .daemon import add_tracker_args

    add_tracker_args(t)
    t.add_argument("--once", action="store_true", help="print the view once and exit (for scripts and logs)")
    t.add_argument("--sort", choices=("lag", "region", "rate"), default="lag", help="initial sort (default lag)")
    t.add_argument("--region", metavar="NAME", help="show only this region")
    t.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    t.set_defaults(func=cmd_top)


def render_once(view: TopView, width: int, now: float, *, color: bool) -> str:
    """The view as text (ANSI colours when ``color``), at most ``width`` columns wide."""
    from rich.console import Console
    from rich.text import Text

    console = Console(width=width, color_system="standard" if color else None, force_terminal=color,
                      highlight=False, record=True, file=open(os.devnull, "w"))
    def line(text: str, style: str = "") -> None:  # one screen line each: cropped, never wrapped
        console.print(Text(text[:width], style=style), no_wrap=True, overflow="crop")

    for h in view.header(now):
        line(h, "bold red" if h.startswith("!") else "")
    rows = view.rows()
    widths, cells = fit([r.cells for r in rows], width)
    line(" ".join(c.ljust(w)[:w] for c, w in zip(COLUMNS, widths)).rstrip(), "bold")
    for r, c in zip(rows, cells):
        line(" ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip(), STYLES[r.style])
    if not rows:
        line("(no live nodes)" if view.snapshot else "")
    for e in view.errors():
        line(e, "red")
    return console.export_text(styles=color).rstrip("\n")


def cmd_top(args) -> int:
    from .daemon import fetch_status

    seconds("--interval", args.interval, positive=True)
    view = TopView(args.tracker or "?", sort=args.sort, region=args.region)
    fetch = lambda: fetch_status(args.tracker, args.token_file)  # noqa: E731
    if args.once:
        view.update(fetch())
        width = os.get_terminal_size().columns if os.isatty(1) else 120
        print(render_once(view, width, time.time(), color=os.isatty(1)))
        return 0
    fetch()  # a wrong tracker or token is one clear error before the screen changes
    TopApp(view, fetch, args.interval).run()
    return 0


def _app_class():
    from rich.text import Text
    from textual.app import App, ComposeResult
    from textual.binding import Binding
    from textual.widgets import DataTable, Static

    class _TopApp(App):
        CSS = "#head { height: auto; } DataTable { height: 1fr; }"
        BINDINGS = [Binding("s", "sort", "sort"), Binding("r", "region", "region"), Binding("q", "quit", "quit")]
        TITLE = "sparrowd top"

        def __init__(self, view: TopView, fetch, interval: float):
            super().__init__()
            self.view, self.fetch, self.interval = view, fetch, interval

        def compose(self) -> ComposeResult:
            yield Static(id="head")
            yield DataTable(id="nodes", zebra_stripes=False, cursor_type="row")

        async def on_mount(self) -> None:
            self.query_one(DataTable).add_columns(*COLUMNS)
            await self.refresh_view()
            self.set_interval(self.interval, self.refresh_view)

        async def refresh_view(self) -> None:
            try:
                self.view.update(await asyncio.to_thread(self.fetch))
            except (SparrowError, OSError) as e:
                self.view.failed(str(e), time.time())
            self.draw()

        def draw(self) -> None:
            head = Text()
            for line in self.view.header(time.time()):
                head.append(line + "\n", style="bold red" if line.startswith("!") else "")
            for e in self.view.errors():
                head.append(e + "\n", style="red")
            self.query_one("#head", Static).update(head)
            table = self.query_one(DataTable)
            table.clear()
            for r in self.view.rows():
                table.add_row(*(Text(c, style=STYLES[r.style]) for c in r.cells), key=r.node_id)

        def action_sort(self) -> None:
            self.view.next_sort()
            self.draw()

        def action_region(self) -> None:
            self.view.next_region()
            self.draw()

    return _TopApp


def TopApp(view: TopView, fetch, interval: float = 1.0):
    """The live app (Textual is imported only when it runs)."""
    return _app_class()(view, fetch, interval)
