"""What `offload demo` shows: the header, the live progress (rich, or a plain line
per step without a terminal, or JSON), and the closing summary table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import format_bytes
from .args import escape
from .gpt import ReversalTask, state_bytes_per_param

if TYPE_CHECKING:
    from .demo import DemoPlan, StepRecord

DIR_PREFIX = "offload-demo-"  # swap sub-directory of one run: <prefix><pid>


# -- output --------------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}M" if n >= 2**20 else f"{n / 2**10:.0f}K"


class Reporter:
    """What rank 0 shows: a live rich progress display on a terminal, one plain line
    per step otherwise, JSON objects with `--json`; nothing on other ranks."""

    def __init__(self, *, json_lines: bool, quiet: bool) -> None:
        from rich.console import Console

        self.json_lines, self.quiet = json_lines, quiet
        self.console = Console(stderr=json_lines, highlight=False)
        self.err = Console(stderr=True, highlight=False)
        self._progress: Any = None
        self._task: Any = None
        self._plan: DemoPlan | None = None

    def error(self, text: str) -> None:
        self._say(text, "red")

    def note(self, text: str) -> None:
        if not self.quiet:
            self._say(text, "yellow")

    def _say(self, text: str, style: str) -> None:
        """One line on stderr, however wide: the text is not markup (a path may hold
        brackets) and is not wrapped (a message is one line to grep or parse)."""
        from rich.text import Text
        self.err.print(Text(text, style=style), soft_wrap=True)

    def start(self, plan: DemoPlan) -> None:
        self._plan = plan
        if self.quiet or self.json_lines or not self.console.is_terminal:
            return
        self._progress = _progress(plan, self.console)
        self._task = self._progress.add_task("train", total=plan.steps, rec=None)
        self._progress.start()

    def step(self, rec: StepRecord) -> None:
        if self.quiet:
            return
        if self.json_lines:
            print(json.dumps(rec.as_json()), flush=True)
        elif self._progress is not None:
            self._progress.update(self._task, completed=rec.step, rec=rec)
        else:
            print(_plain_line(rec, self._plan), flush=True)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, plan: DemoPlan, summary: dict[str, Any]) -> None:
        if self.quiet:
            return
        if self.json_lines:
            print(json.dumps({"event": "summary", **summary}), flush=True)
            return
        if "steps" in summary:
            self.console.print(_summary_table(plan, summary))
        gone = "removed" if summary.get("swap_removed") else "[red]NOT removed[/red]"
        self.console.print(f"swap files: {gone} ({escape(summary.get('swap_dir'))})")
        if summary.get("trace"):
            self.console.print(f"trace of step {plan.trace_step}: "
                               f"{escape(summary['trace'])} (open it in "
                               "https://ui.perfetto.dev)")
        if summary.get("report"):
            self.console.print(f"report: {escape(summary['report'])} (open it in a "
                               "browser)")


def _plain_line(rec: StepRecord, plan: DemoPlan | None) -> str:
    total = f"/{plan.steps}" if plan else ""
    dev_cap = f"/{_mib(plan.device_budget)}" if plan else ""
    host_cap = f"/{_mib(plan.host_budget)}" if plan else ""
    return (f"step {rec.step}{total}  loss {rec.loss:.3f}  {rec.seconds:.2f} s  "
            f"{rec.tokens_per_s:.0f} tok/s  NVMe read {_mib(rec.read)} write "
            f"{_mib(rec.written)}  peak device {_mib(rec.device_peak)}{dev_cap} host "
            f"{_mib(rec.host_peak)}{host_cap}  nvme {_mib(rec.nvme_used)}")


def _progress(plan: DemoPlan, console: Any) -> Any:
    """The live display: step and bar, then a custom column of two lines: the last
    step's loss, time and tokens/s; the bytes it moved and each tier's peak."""
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    class StepColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            r = task.fields["rec"]
            if r is None:
                return Text("step 1 records the access trace...", style="dim")
            return Text.assemble(
                ("loss ", "dim"), (f"{r.loss:6.3f}", "bold cyan"),
                f"  {r.seconds:5.2f} s/step  {r.tokens_per_s:6.0f} tok/s\n",
                ("NVMe ", "dim"), f"read {_mib(r.read)} write {_mib(r.written)}",
                ("  peak device ", "dim"), f"{_mib(r.device_peak)}/{_mib(plan.device_budget)}",
                ("  host ", "dim"), f"{_mib(r.host_peak)}/{_mib(plan.host_budget)}",
                ("  nvme ", "dim"), _mib(r.nvme_used))

    return Progress(TextColumn("step {task.completed:>3.0f}/{task.total:.0f}"),
                    BarColumn(bar_width=20), StepColumn(), console=console,
                    refresh_per_second=4)


def print_header(reporter: Reporter, plan: DemoPlan) -> None:
    """Says what the run will do before it does it."""
    from rich.table import Table

    from ..store.copy import resolve_device

    m, p = plan.model, plan
    bpp = state_bytes_per_param(p.dtype)
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("task", f"reverse sequences of {p.length} tokens over {m.vocab - 1} symbols "
              f"(chance loss {ReversalTask(m.vocab - 1, p.length, 1).chance_loss:.2f})")
    t.add_row("model", f"GPT-style decoder, {m.n_layer} layers, d_model {m.d_model}, "
              f"{m.n_head} heads: {p.n_params / 1e6:.1f}M parameters ({p.size})")
    parts = ("4 fp32 weights (the master), 4 gradient" if p.dtype == "fp32" else
             f"{p.compute_bytes} {p.dtype} weights, 4 gradient, 4 master")
    t.add_row("state", f"{format_bytes(p.state_bytes)} = {bpp} B/parameter ({parts}, "
              "8 Adam moments)")
    dev = resolve_device("auto")
    t.add_row("budgets", f"device ({dev.type}) {format_bytes(p.device_budget)} (state is "
              f"{p.state_bytes / p.world / p.device_budget:.1f}x), host "
              f"{format_bytes(p.host_budget)} ({p.state_bytes / p.world / p.host_budget:.1f}x), "
              f"I/O staging {format_bytes(p.io_buffers)}" + (" - per rank" if p.world > 1 else ""))
    t.add_row("placement", f"weights: {p.params}, gradients: {p.grads}, master weights and "
              f"Adam moments: {p.optimizer}")
    t.add_row("swap", f"{escape(p.swap_root)}/{DIR_PREFIX}<pid> - about "
              f"{format_bytes(p.disk_needed())}"
              f", removed on exit ({format_bytes(_free_bytes(p.swap_root))} free)")
    t.add_row("run", f"{p.steps} step{'s' if p.steps > 1 else ''} of {p.batch} x "
              f"{2 * p.length} tokens, lr {p.lr:g}, "
              f"{p.world} process{'es' if p.world > 1 else ''}")
    if p.trace is not None:
        t.add_row("trace", f"step {p.trace_step} -> {escape(p.trace)}")
    reporter.console.print("[bold]offload demo[/bold]: train a model whose training state "
                           "does not fit its budgets")
    reporter.console.print(t)


def _free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _summary_table(plan: DemoPlan, s: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"offload demo: {s['steps']} steps"
              + (" (stopped by Ctrl-C)" if s["interrupted"] else ""))
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_column("note")
    t.add_row("loss", f"{s['loss_first']:.3f} -> {s['loss_last']:.3f}",
              f"chance {s['chance_loss']:.3f}; 0 is perfect reversal")
    t.add_row("step time", f"{s['step_seconds']:.2f} s", "mean after step 1")
    t.add_row("throughput", f"{s['tokens_per_s']:.0f} tokens/s",
              f"{plan.tokens_per_step} tokens a step")
    t.add_row("NVMe read", f"{format_bytes(s['read_per_step'])}/step", "store and optimizer")
    t.add_row("NVMe written", f"{format_bytes(s['written_per_step'])}/step", "store and optimizer")
    t.add_row("device peak", format_bytes(s["device_peak"]),
              f"budget {format_bytes(plan.device_budget)}")
    t.add_row("host peak", format_bytes(s["host_peak"]), f"budget {format_bytes(plan.host_budget)}")
    t.add_row("NVMe peak", format_bytes(s["nvme_peak"]), "swap files, rank 0")
    t.add_row("state", format_bytes(s["state_bytes"]), f"{s['params'] / 1e6:.1f}M parameters")
    t.add_row("start-up", f"{s['init_seconds']:.2f} s", "built on meta, placed group by group")
    return t


