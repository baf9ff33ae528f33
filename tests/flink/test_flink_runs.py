"""ParseLines hands consecutive lines of one user on as one run (one record into the keyed operator),
without a JVM: what runs it makes, and that nothing is held back at the end of the input."""

from __future__ import annotations

import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)

from streamflow.flink.runner import ParseLines  # noqa: E402
from streamflow.sources import TaobaoBehaviorSource  # noqa: E402

LINES = ["a,1,7,pv,1511848894", "a,2,7,pv,1511848900", "b,1,7,pv,1511848901", "a,1,7,teleport,1511848902",
         "", "a,3,7,fav,1511848903", "a,4,7,pv,1511848904"]


def _runs(lines: list[str], **kwargs) -> tuple[list[tuple[str, list[int]]], ParseLines]:
    parse = ParseLines(TaobaoBehaviorSource("events.csv"), **kwargs)
    parse.open(None)
    runs = [(key, [line_no for line_no, _, _ in run])
            for line in lines for key, run in parse.process_element(line, None)]
    return runs, parse


def test_runs_end_when_the_user_changes_and_at_the_last_line():
    runs, parse = _runs(LINES, last_line=len(LINES))
    # the rejected line (key "") breaks a's run; the blank line 5 is no record and breaks nothing
    assert runs == [("a", [1, 2]), ("b", [3]), ("", [4]), ("a", [6, 7])]
    parse.close()


def test_a_blank_last_line_ends_the_input_too():
    runs, parse = _runs([*LINES[:2], ""], last_line=3)
    assert runs == [("a", [1, 2])]
    parse.close()


def test_runs_are_cut_at_max_run_lines():
    runs, _ = _runs(LINES[:2] + LINES[5:], last_line=4, max_run=3)
    assert runs == [("a", [1, 2, 3]), ("a", [4])]


def test_without_the_line_count_every_line_is_its_own_run():
    runs, parse = _runs(LINES)
    assert runs == [("a", [1]), ("a", [2]), ("b", [3]), ("", [4]), ("a", [6]), ("a", [7])]
    parse.close()


def test_lines_held_at_the_end_fail_loudly():
    runs, parse = _runs(LINES[:2], last_line=5)  # the input was shorter than counted
    assert runs == []
    with pytest.raises(RuntimeError, match="2 lines from line 1 on were still held at the end of the input"):
        parse.close()
