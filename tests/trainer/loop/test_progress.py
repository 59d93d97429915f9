"""Progress displays: plain lines without ANSI codes when the output is a file or pipe, a bar on a terminal,
nothing from a disabled meter (other ranks); `memlm eval` shows its progress on stderr, the result on stdout."""

import io
import json
import re

from memlm.data_pipeline.progress import Meter

ANSI = re.compile(r"\x1b\[")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_say_done_tokens_and_eta_without_ansi():
    out = io.StringIO()
    meter = Meter("eval test", total=4, unit="batch", stream=out, every_s=0.0)
    for _ in range(4):
        meter.update(1, tokens=16)
    meter.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 and not ANSI.search(out.getvalue())
    assert lines[1].startswith("eval test: 2/4 batch, 32 tokens, ") and "eta " in lines[1], lines[1]
    assert lines[-1].startswith("eval test: 4/4 batch, 64 tokens, ") and "done in " in lines[-1], lines[-1]


def test_plain_lines_are_rate_limited():
    out = io.StringIO()
    meter = Meter("prepare train", unit="doc", stream=out, every_s=3600.0)
    for _ in range(1000):
        meter.update(1, tokens=10)
    meter.close(summary=False)
    assert out.getvalue() == ""  # a quick job: no line before the interval, and the caller prints the totals


def test_the_first_plain_line_comes_within_eight_seconds(monkeypatch):
    """A long job's log says it is working before 10 s have passed (issue 32), then every `every_s`."""
    from memlm.data_pipeline import progress

    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    meter = Meter("eval valid", total=100, unit="batch", stream=out, every_s=15.0)
    for advance in (7.9, 0.2, 14.0, 1.1):  # at 7.9 s none, at 8.1 s the first, at 22.1 s none, at 23.2 s the next
        now[0] += advance
        meter.update(1)
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["eval valid: 2/100 batch", "eval valid: 4/100 batch"], lines


def test_a_terminal_gets_a_bar_and_a_disabled_meter_prints_nothing():
    tty = FakeTerminal()
    with Meter("generate", total=3, unit="tok", stream=tty) as meter:
        meter.update(3, tokens=3)
    assert "3/3" in tty.getvalue() and "generate" in tty.getvalue()
    quiet = io.StringIO()
    with Meter("eval", total=3, stream=quiet, enabled=False, every_s=0.0) as meter:
        meter.update(3, tokens=3)
    assert quiet.getvalue() == ""


def test_eval_progress_goes_to_stderr_and_the_result_to_stdout(tmp_path, capsys):
    """A real `memlm eval` of a freshly trained tiny run, output redirected (not a terminal)."""
    from memlm.cli import main
    from support.training import make_data, train_in_process

    data = make_data(tmp_path)
    train_in_process("txl", data, tmp_path / "run", train__steps=2, train__save_every=0)
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--split", "test", "--lanes", "2"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # stdout: the JSON object alone
    done = [line for line in captured.err.splitlines() if line.startswith("eval test: ")]
    assert done and "done in" in done[-1] and f"{result['tokens']:,} scored tokens" in done[-1], captured.err
    assert not ANSI.search(captured.err)
