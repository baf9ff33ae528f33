"""The ``streamflow`` command and the job API it loads: run, describe, --replace, readable load errors."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pytest

from operators import Aggregate, Count, Filter
from streamflow.cli import main
from streamflow.job import Job, JobLoadError, Task, load_job

ROOT = Path(__file__).resolve().parent.parent
IPV_JOB = ROOT / "jobs" / "ipv.py"
T = 1511848894
YEAR_2100 = 4102444800

SMALL_CSV = [
    f"1,10,7,pv,{T}",
    f"1,10,7,pv,{T + 5}",  # reload
    f"2,20,8,pv,{T + 1}",
    "1,10,7,pv",  # malformed: 4 fields
    f"1,11,7,cart,{T + 20}",  # leaves item 10, enters 11 implicitly
    f"2,20,8,buy,{T - 100}",  # backwards
    f"2,21,8,pv,{T + 3}",
    f"3,30,9,pv,{YEAR_2100}",  # absurd
]
# visits: user 1 item 10 (T..T+20, 1 reload), user 1 item 11 (T+20, 1 cart), user 2 item 20 (T+1..T+3),
# user 2 item 21 (T+3); events: 4 enters + 4 exits + 1 reload + 1 cart = 10; rejected lines 4, 6, 8
EXPECTED_IPV = sorted([
    ("1", float(T + 20), "10", "7", float(T), 20.0, 1, 0, 0, 0),
    ("1", float(T + 20), "11", "7", float(T + 20), 0.0, 0, 0, 1, 0),
    ("2", float(T + 3), "20", "8", float(T + 1), 2.0, 0, 0, 0, 0),
    ("2", float(T + 3), "21", "8", float(T + 3), 0.0, 0, 0, 0, 0),
])
IPV_SQL = ("SELECT user_id, trigger_ts, item_id, category_id, enter_ts, dwell_s, n_reload, n_fav, n_cart, n_buy "
           "FROM ipv ORDER BY ALL")


@pytest.fixture(autouse=True)
def _restore_sigterm():
    """`streamflow run` installs a SIGTERM handler; keep it out of the rest of the test session."""
    saved = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, saved)


@pytest.fixture
def small_csv(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text("\n".join(SMALL_CSV) + "\n")
    return path


def query(db: Path, sql: str):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def number(label: str, text: str) -> int:
    match = re.search(rf"^{label}\s+([\d,]+)", text, re.MULTILINE)
    assert match, f"no {label!r} line in:\n{text}"
    return int(match.group(1).replace(",", ""))


# --------------------------------------------------------------------------------------------------
# streamflow run

PLAIN_RUNS = [
    ["run", "j.py", "--events", "e.csv"],
    ["run", "--events=e.csv", "j.py", "--db", "x.duckdb", "--show", "0", "--mode", "streaming", "--replace"],
    ["run", "j.py", "--events", "e.jsonl", "--format", "jsonl", "--workers", "4", "--quarantine-after=-3",
     "--pace-ms", "2.5", "--state-ttl", "3600", "--max-users", "10", "--checkpoint-interval", "0.5",
     "--runner", "flink", "--parallelism", "2", "--sink", "duckdb:o.duckdb", "--checkpoint-dir", "d",
     "--cluster", "h:8081", "--tunnel", "kafka", "--device-id", "dev", "--key-registry", "k.json", "--topic", "t",
     "--compression", "zstd", "--spool", "s", "--tunnel-wait", "0"],
]
TYPER_RUNS = [  # what the plain parse leaves to Typer: help, usage errors, values it checks itself
    ["run", "--help"], ["-v", "run", "j.py", "--events", "e.csv"], ["run", "j.py"], ["run", "j.py", "k.py"],
    ["run", "j.py", "--events", "e.csv", "--events", "f.csv"], ["run", "j.py", "--events", "e.csv", "--mode", "fast"],
    ["run", "j.py", "--events", "e.csv", "--workers", "2.0"], ["run", "j.py", "--events", "e.csv", "--show", "007"],
    ["run", "j.py", "--events", "e.csv", "--metrics-port", "9"], ["run", "j.py", "--events", "e.csv", "--nope", "1"],
    ["run", "j.py", "--events", "e.csv", "--db"], ["run", "j.py", "--events", "-"], ["describe", "j.py"],
    ["run", "j.py", "--events", "e.csv", "--replace=1"], ["run", "j.py", "--events", "e.csv", "--pace-ms", "1e3"],
]


@pytest.mark.parametrize("argv", PLAIN_RUNS + TYPER_RUNS)
def test_plain_run_command_lines_parse_as_typer_parses_them(argv, monkeypatch):
    """`main` parses a plain `run` command line itself (no Typer: its start-up cost); the arguments `run` gets are
    Typer's, and anything else is left to Typer."""
    import streamflow.cli as cli

    plain = cli._plain_run(argv)
    assert (plain is not None) == (argv in PLAIN_RUNS)
    if plain is None:
        return
    seen = []
    monkeypatch.setattr(cli, "_run", lambda job, options, tunnel_options: seen.append((options, tunnel_options)) or 0)
    monkeypatch.setattr(cli, "load_job", lambda path: path)
    monkeypatch.setattr(cli, "_plain_run", lambda args: None)  # through Typer
    typer_code = cli.main(argv)
    monkeypatch.undo()
    monkeypatch.setattr(cli, "_run", lambda job, options, tunnel_options: seen.append((options, tunnel_options)) or 0)
    monkeypatch.setattr(cli, "load_job", lambda path: path)
    plain_code = cli.main(argv)
    assert typer_code == plain_code == 0
    assert len(seen) == 2 and seen[0] == seen[1]
    assert plain == {**plain, "job": "j.py"}



def test_run_writes_rows_and_prints_the_summary(small_csv, tmp_path, capsys):
    db = tmp_path / "out" / "features.duckdb"
    assert main(["run", str(IPV_JOB), "--events", str(small_csv), "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert number("events in", out) == 10
    assert number("tasks fired", out) == 4
    assert number("rows written", out) == 4
    assert number("rejected records", out) == 3
    assert str(db) in out and "dead_letter" in out
    assert query(db, IPV_SQL) == EXPECTED_IPV
    dead = query(db, "SELECT source, line, reason, raw FROM dead_letter ORDER BY line")
    assert [(d[0], d[1], d[3]) for d in dead] == [(str(small_csv), 4, SMALL_CSV[3]), (str(small_csv), 6, SMALL_CSV[5]),
                                                  (str(small_csv), 8, SMALL_CSV[7])]
    assert dead[0][2].startswith("malformed CSV line")
    assert dead[1][2].startswith("timestamp goes backwards")
    assert dead[2][2].startswith("absurd timestamp")


def test_rerun_appends_and_replace_does_not_duplicate(small_csv, tmp_path, capsys):
    db = tmp_path / "features.duckdb"
    args = ["run", str(IPV_JOB), "--events", str(small_csv), "--db", str(db)]
    assert main(args) == 0
    assert main(args) == 0  # without --replace a rerun appends
    assert len(query(db, IPV_SQL)) == 2 * len(EXPECTED_IPV)
    assert query(db, "SELECT count(*) FROM dead_letter") == [(6,)]
    assert main([*args, "--replace"]) == 0
    assert query(db, IPV_SQL) == EXPECTED_IPV
    assert query(db, "SELECT count(*) FROM dead_letter") == [(3,)]
    assert main([*args, "--replace"]) == 0
    assert query(db, IPV_SQL) == EXPECTED_IPV
    capsys.readouterr()


def test_run_with_jsonl_events(tmp_path, capsys):
    job = tmp_path / "favs.py"
    job.write_text(textwrap.dedent("""
        from operators import Aggregate, Count
        from streamflow import Job, Task
        job = Job("favs", [Task("fav_count", ["fav"], [Aggregate(n=Count())], input="recent")])
    """))
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join([
        f'{{"user_id": "u", "event_id": "fav", "page_id": "item", "ts": {T}}}',
        '{"user_id": "u", "event_id": ',
        f'{{"user_id": "u", "event_id": "fav", "page_id": "item", "ts": {T + 1}}}',
    ]) + "\n")
    db = tmp_path / "f.duckdb"
    assert main(["run", str(job), "--events", str(events), "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert number("events in", out) == 2 and number("rejected records", out) == 1
    assert query(db, "SELECT user_id, n FROM fav_count ORDER BY trigger_ts") == [("u", 1), ("u", 2)]
    assert query(db, "SELECT line, reason FROM dead_letter")[0][0] == 2


def test_run_uses_streamflow_db_from_the_environment(small_csv, tmp_path, monkeypatch, capsys):
    db = tmp_path / "from_env.duckdb"
    monkeypatch.setenv("STREAMFLOW_DB", str(db))
    assert main(["run", str(IPV_JOB), "--events", str(small_csv)]) == 0
    assert str(db) in capsys.readouterr().out
    assert query(db, IPV_SQL) == EXPECTED_IPV


def test_run_on_the_bundled_sample(tmp_path, capsys):
    db = tmp_path / "f.duckdb"
    assert main(["run", str(IPV_JOB), "--events", str(ROOT / "jobs/data/taobao_user_behavior_10k.csv"),
                 "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert number("events in", out) == 20_954 and number("rejected records", out) == 0
    assert number("rows written", out) == number("tasks fired", out) == query(db, "SELECT count(*) FROM ipv")[0][0]


@pytest.mark.parametrize(("events", "message"), [
    ("missing.csv", "events file not found"),
    ("events.txt", "cannot tell the format"),
])
def test_run_with_bad_events_file_exits_2(events, message, tmp_path, capsys):
    (tmp_path / "events.txt").write_text("")
    code = main(["run", str(IPV_JOB), "--events", str(tmp_path / events), "--db", str(tmp_path / "f.duckdb")])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and events in err


# --------------------------------------------------------------------------------------------------
# streamflow describe


def test_describe_ipv(capsys):
    assert main(["describe", str(IPV_JOB)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job ipv")
    assert "ipv: trigger ['item'], input page, sink table ipv" in out
    assert "| Aggregate(" in out and "| Map(" in out
    assert "trigger trie:" in out and "static pending list: item" in out
    assert re.search(r"^\s+item\s+-> fires ipv$", out, re.MULTILINE)


@pytest.mark.parametrize("path", sorted((ROOT / "jobs").glob("*.py")), ids=lambda p: p.name)
def test_describe_every_project_job(path, capsys):
    """Issue 23: describe refused every job with a stream task ("trigger condition [] has no trigger id")."""
    assert main(["describe", str(path)]) == 0
    out = capsys.readouterr().out
    job = load_job(path, f"describe_{path.stem}")
    for task in job.tasks:
        kind = "input stream" if task.input == "stream" else f"trigger {list(task.trigger)}"
        assert re.search(rf"^  {task.name}: {re.escape(kind)}.*, sink table {task.sink}$", out, re.MULTILINE), out
    assert " at 0x" not in out  # functions by name, not by address


def test_describe_a_stream_task_shows_its_pipeline_and_rows(capsys):
    assert main(["describe", str(ROOT / "jobs" / "sessions.py")]) == 0
    out = capsys.readouterr().out
    tasks = out.split("tasks:\n", 1)[1].split("\n\n", 1)[0]
    assert tasks.splitlines()[:7] == [
        "  sessions: input stream (every event, no trigger), key user_id, SessionWindow + Aggregate, "
        "sink table sessions",
        "    | Filter(predicate=<lambda>)",
        "    | KeyBy(key='user_id', name='user_id')",
        "    | SessionWindow(gap=30.0, ts='ts', allowed_lateness=0.0, out_of_orderness=5.0)",
        "    | Aggregate(aggregations={'events': Count(), 'buys': Count(where=...), 'first_ts': Min('ts'), "
        "'last_ts': Max('ts')})",
        "    rows: user_id, window_start, window_end, events, buys, first_ts, last_ts; late items to table "
        "late_events",
        "  every_3_items: input stream (every event, no trigger), key user_id, CountWindow + Aggregate, "
        "sink table every_3_items",
    ]
    assert "    rows: user_id, buys, last_ts\n" in tasks  # a count window has no time bounds
    assert "    | Process(function=CartAbandoned, out_of_orderness=5.0)" in tasks
    assert "    rows: what CartAbandoned emits (ctx.emit); its side outputs to their own tables" in tasks
    assert out.split("trigger trie:\n", 1)[1] == "(no trigger tasks)\n"


def test_describe_shows_the_trie_of_all_tasks(tmp_path, capsys):
    job = tmp_path / "multi.py"
    job.write_text(textwrap.dedent("""
        from operators import Aggregate, Count
        from streamflow import Job, Task
        job = Job("multi", description="three triggers")
        job.task("after_enter", ["page_enter", "*", "buy"], [Aggregate(n=Count())])
        job.task("enter_fav", ["page_enter", "fav"], [Aggregate(n=Count())])
        job.task("favs", ["fav"], [Aggregate(n=Count())], input="recent", history_s=60)
    """))
    assert main(["describe", str(job)]) == 0
    out = capsys.readouterr().out
    assert "job multi: three triggers" in out
    assert "favs: trigger ['fav'], input recent, history 256 events / 60s, sink table favs" in out
    trie = out.split("trigger trie:\n", 1)[1].splitlines()
    assert trie == [
        "(root)  static pending list: fav, page_enter",
        "  fav  -> fires favs",
        "  page_enter",
        "    fav  -> fires enter_fav",
        "    * (gap)",
        "      buy  -> fires after_enter",
    ]


# --------------------------------------------------------------------------------------------------
# job files that do not load: exit 2, the file and the reason


BAD_JOBS = {
    "syntax.py": ("from streamflow import Job\njob = Job(\n", r"syntax error at line \d+"),
    "raises.py": ("from streamflow import Job\n\nraise RuntimeError('boom in the job')\n",
                  "RuntimeError at line 3: boom in the job"),
    "imports.py": ("import no_such_module_for_streamflow_tests\n", "ModuleNotFoundError at line 1"),
    "nojob.py": ("x = 1\n", r"must define `job = Job\(...\)` \(found 0 Job objects\)"),
    "twojobs.py": ("from streamflow import Job\na = Job('a')\nb = Job('b')\n", r"found 2 Job objects"),
    "notajob.py": ("job = 'ipv'\n", r"must define `job = Job"),
    "badtask.py": ("from streamflow import Job, Task\njob = Job('j', [Task('t', ['fav'], [len])])\n",
                   "TypeError at line 2: task 't': pipeline step"),
    "job.txt": ("job = None\n", "not a Python file"),
}


@pytest.mark.parametrize("command", ["run", "describe"])
@pytest.mark.parametrize("name", sorted(BAD_JOBS))
def test_job_file_that_does_not_load_exits_2_with_file_and_reason(name, command, tmp_path, small_csv, capsys):
    text, reason = BAD_JOBS[name]
    path = tmp_path / name
    path.write_text(text)
    extra = ["--events", str(small_csv), "--db", str(tmp_path / "f.duckdb")] if command == "run" else []
    assert main([command, str(path), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("streamflow: error:")
    assert str(path) in err
    assert re.search(reason, err), err
    assert "Traceback" not in err
    assert not (tmp_path / "f.duckdb").exists()


@pytest.mark.parametrize("command", ["run", "describe"])
def test_missing_job_file_exits_2(command, tmp_path, small_csv, capsys):
    path = tmp_path / "nowhere" / "job.py"
    extra = ["--events", str(small_csv), "--db", str(tmp_path / "f.duckdb")] if command == "run" else []
    assert main([command, str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert f"job file not found: {path}" in err


def test_load_job_errors_are_job_load_errors(tmp_path):
    for name, (text, reason) in BAD_JOBS.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(JobLoadError, match=reason):
            load_job(path)
    with pytest.raises(JobLoadError, match="job file not found"):
        load_job(tmp_path / "missing.py")


def test_load_job_prefers_job_and_accepts_a_single_other_name(tmp_path):
    path = tmp_path / "named.py"
    path.write_text("from streamflow import Job\nother = Job('other')\njob = Job('main')\n")
    assert load_job(path).name == "main"
    path = tmp_path / "single.py"
    path.write_text("from streamflow import Job\nmy_job = Job('solo')\n")
    assert load_job(path).name == "solo"


# --------------------------------------------------------------------------------------------------
# Task / Job validation


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"name": "has space"}, ValueError, "task name"),
    ({"name": "1starts_with_digit"}, ValueError, "task name"),
    ({"name": ""}, ValueError, "task name"),
    ({"pipeline": [Aggregate(n=Count()), "not an operator"]}, TypeError, "is not an operator"),
    ({"input": "everything"}, ValueError, "input must be one of page, recent, pages"),
    ({"history_events": 0}, ValueError, "history_events"),
    ({"sink": "drop table"}, ValueError, "sink"),
    ({"trigger": "fav"}, ValueError, "not the string"),
    ({"trigger": []}, ValueError, "no trigger id"),
    ({"trigger": ["fav", "*"]}, ValueError, "ends with"),
    ({"trigger": ["fav", ""]}, ValueError, "non-empty"),
])
def test_task_validation(kwargs, error, match):
    args = {"name": "t", "trigger": ["fav"], "pipeline": [Aggregate(n=Count())], **kwargs}
    with pytest.raises(error, match=match):
        Task(**args)


def test_task_defaults_and_normalised_trigger():
    task = Task("t", ["*", "page_enter", "*", "*", "buy"], (Filter(lambda e: True), Aggregate(n=Count())))
    assert tuple(task.trigger) == ("page_enter", "*", "buy")
    assert task.sink == "t" and task.input == "page" and isinstance(task.pipeline, list)


def test_job_refuses_duplicate_task_names():
    job = Job("j", [Task("t", ["fav"], [Aggregate(n=Count())])])
    with pytest.raises(ValueError, match="already has a task named 't'"):
        job.task("t", ["buy"], [Aggregate(n=Count())])
    job.task("u", ["buy"], [Aggregate(n=Count())], input="recent")
    assert job.task_names() == ["t", "u"]


# --------------------------------------------------------------------------------------------------
# the installed entry point


def test_streamflow_entry_point_is_installed(small_csv, tmp_path):
    exe = Path(sys.executable).parent / "streamflow"
    assert exe.exists(), f"{exe} missing: is the package installed (pip install -e .)?"
    db = tmp_path / "f.duckdb"
    done = subprocess.run([str(exe), "run", str(IPV_JOB), "--events", str(small_csv), "--db", str(db)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert number("rows written", done.stdout) == 4 and number("rejected records", done.stdout) == 3
    assert query(db, IPV_SQL) == EXPECTED_IPV
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    done = subprocess.run([str(exe), "describe", str(bad)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and str(bad) in done.stderr and "Traceback" not in done.stderr
