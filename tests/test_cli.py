"""`tb-gradhealth report`: ranked tables, JSON, JUnit and Markdown, and the exit status a CI job relies on (0 ok,
1 sick, 2 bad usage); the words and numbers it prints: the verdict line per run, the failing line, exact counts,
wrapped reasons, the logdir-root run, `--only-failing`.

Every run is written with the numpy Writer (or the demo fixtures of tb_gradhealth.testing), so each expected number
is what the test planted: the NaN/Inf counts, the layer that turned NaN first, the step it did, the loss."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from tb_gradhealth import Writer, cli, health
from tb_gradhealth import testing as gl

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("demo")
    return logdir, gl.make_demo_logdir(str(logdir))


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("healthy")
    gl.make_healthy(str(logdir))
    gl.make_xss(str(logdir))
    return logdir


#: The planted counts of the "counts" run: more than a thousand, so the thousands separator shows.
NAN, INF, SIZE = 1024, 2048, 8192
NAN_FROM = 6
#: The widest the reasons may get on one line of the table.
WIDTH = 100
#: A table row: its rank, right-aligned in 4 after 2 spaces (wrapped reasons under it are indented by 8).
ROW = re.compile(r"^ {2,5}\d+  ")


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    """A run whose deepest layer holds NAN NaN and INF Inf values of SIZE from step NAN_FROM on, and a falling
    loss; a second, healthy run at the logdir's root."""
    logdir = tmp_path_factory.mktemp("counts_logdir")
    rng = np.random.default_rng(0)
    with Writer(str(logdir / "counts")) as w:
        for step in range(12):
            big = rng.normal(size=SIZE) * 1e-2
            if step >= NAN_FROM:
                big[:NAN] = np.nan
                big[NAN:NAN + INF] = np.inf
            w.add_gradients(step, {"dense/kernel": rng.normal(size=256) * 1e-2, "big/kernel": big})
            w.add_loss(step, 2.0 - 0.1 * step)
    with Writer(str(logdir)) as w:  # a run at the logdir's root: the reader names it "."
        for step in range(12):
            w.add_gradients(step, {f"layer_{i}/kernel": rng.normal(size=128) * 1e-2 for i in range(3)})
            w.add_loss(step, 1.0 / (step + 1))
    return logdir


def run(capsys, *argv):
    rc = cli.main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.unit
def test_nonfinite_fails_by_default_and_names_the_run(capsys, demo):
    logdir, facts = demo
    rc, out, err = run(capsys, logdir)
    assert rc == 1 and "nonfinite" in err
    for name in facts:
        assert f"run {name}:" in out
    exploding = out.split("run exploding:")[1].split("\n\n")[0].splitlines()
    header = next(i for i, line in enumerate(exploding) if line.split()[:2] == ["#", "status"])
    first_row = exploding[header + 1].split()
    layer, nan_step = facts["exploding"].first_nan_layer, facts["exploding"].nan_step
    assert first_row[:2] == ["1", "nonfinite"] and layer in first_row
    # Since when: the chain starts where the growth (x2 per step from step 10) began, before the NaN.
    since = int(re.search(rf"cause: {re.escape(layer)}: exploding from step (\d+) -> nonfinite from step "
                          rf"{nan_step}\n", out).group(1))
    assert 10 <= since < nan_step
    # The run's timeline, each entry saying what it is; the row's own onset beside the chain's start.
    assert f"nonfinite from {nan_step} (first layer to reach nonfinite: {layer}" in out
    assert f"exploding from {since} (first to go wrong: {layer}" in out
    assert first_row[3:5] == [str(nan_step), str(since)]
    assert "\x1b[" not in out  # colour-free


@pytest.mark.unit
def test_fail_on_none_and_other_statuses(capsys, demo, healthy):
    logdir, _ = demo
    assert run(capsys, logdir, "--fail-on", "none")[0] == 0
    assert run(capsys, logdir, "--run", "vanishing")[0] == 0  # default fails on nonfinite only
    assert run(capsys, logdir, "--run", "vanishing", "--fail-on", "vanishing")[0] == 1
    assert run(capsys, logdir, "--run", "vanishing", "--fail-on", "exploding,dead")[0] == 0
    assert run(capsys, healthy, "--fail-on", ",".join(s for s in health.STATUSES if s != "healthy"))[0] == 0
    rc, out, err = run(capsys, healthy, "--fail-on", "healthy")
    assert rc == 1 and "run healthy: FAIL healthy, 0 of 8 layers flagged" in out
    assert "tb-gradhealth: failing: run 'healthy': dense_0/kernel healthy and 7 more layers" in err


@pytest.mark.unit
def test_threshold_flags_change_the_verdict(capsys, demo):
    logdir, _ = demo
    args = (logdir, "--run", "vanishing", "--fail-on", "vanishing")
    assert run(capsys, *args)[0] == 1
    rc, out, _ = run(capsys, *args, "--vanish-decades", "10", "--vanish-rms-below", "0")
    assert rc == 0 and "vanishing" not in out.split("\n", 2)[1]
    assert run(capsys, *args, "--vanish_decades", "10", "--vanish-rms-below", "0")[0] == 0  # underscore spelling


@pytest.mark.unit
def test_table_ranks_worst_first_and_prints_names_literally(capsys, demo):
    logdir, facts = demo
    rc, out, _ = run(capsys, logdir, "--run", "vanishing", "--run", "xss")
    assert rc == 0
    lines = out.split("run vanishing:")[1].split("\n\n")[0].splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "status"])
    rows = [ln.split() for ln in lines[header + 1:] if ROW.match(ln)]  # reasons wrap under rows
    assert [r[0] for r in rows] == [str(i) for i in range(1, len(facts["vanishing"].layers) + 1)]
    assert {r[5] for r in rows[:3]} == set(facts["vanishing"].vanishing)
    assert all(r[1] == "vanishing" for r in rows[:3]) and all(r[1] == "healthy" for r in rows[3:])
    assert gl.XSS_LAYER in out
    rc, out, _ = run(capsys, logdir, "--run", "vanishing", "--top", "2")
    block = out.split("run vanishing:")[1].strip().splitlines()
    header = next(i for i, line in enumerate(block) if line.split()[:2] == ["#", "status"])
    assert "... 8 more layers" in out and block[-1].strip().startswith("... 8 more layers")
    assert [ln.split()[0] for ln in block[header + 1:] if ROW.match(ln)] == ["1", "2"]


@pytest.mark.unit
def test_json_has_the_health_shape_for_every_run(capsys, demo):
    logdir, facts = demo
    rc, out, _ = run(capsys, logdir, "--json", "--step", "20")
    assert rc == 0  # at step 20 nothing is NaN yet
    body = json.loads(out)
    assert [r["run"] for r in body["runs"]] == sorted(facts) and body["problems"] == []
    for r in body["runs"]:
        keys = {"run", "step", "thresholds", "threshold_spec", "summary", "layers", "history_steps", "problems"}
        assert keys <= set(r)
        expected = max(s for s in facts[r["run"]].steps if s <= 20)  # the latest logged step at or before 20
        assert r["step"] == expected and r["history_steps"][-1] == expected
        assert len(r["layers"]) == len(facts[r["run"]].layers)
        assert all("rms_history" in x and "status" in x and "reasons" in x for x in r["layers"])
    by_run = {r["run"]: r for r in body["runs"]}
    assert by_run["exploding"]["summary"]["counts"]["nonfinite"] == 0


@pytest.mark.unit
def test_usage_errors_exit_2(capsys, demo, tmp_path):
    logdir, _ = demo
    (tmp_path / "empty").mkdir()
    gl.write_events(gl.event_file_path(str(tmp_path / "scalars" / "r")), [gl.scalar_event(0, "loss", 1.0)])
    cases = [
        ((tmp_path / "missing",), "does not exist"),
        ((tmp_path / "empty",), "no gradient-health records"),
        ((tmp_path / "scalars",), "no gradient-health records"),
        ((logdir, "--run", "nope"), "'nope'"),
        ((logdir, "--run", "nope"), "runs there: 'exploding', 'healthy', 'vanishing', 'xss'"),
        ((logdir, "--fail-on", "sick"), "--fail-on"),
        ((logdir, "--fail-on", ""), "--fail-on"),
        ((logdir, "--step", "abc"), "--step"),
        ((logdir, "--step", "-4"), "--step"),
        ((logdir, "--run", "healthy", "--step", "3"), "before the first logged step"),
        ((logdir, "--vanish-decades", "many"), "vanish_decades"),
        ((logdir, "--sustain-steps", "0"), "sustain_steps"),
    ]
    for argv, message in cases:
        rc, _, err = run(capsys, *argv)
        assert rc == 2, argv
        assert message in err, (argv, err)
    file_logdir = next((logdir / "xss").iterdir())
    assert run(capsys, file_logdir)[0] == 2
    assert cli.main([]) == 2 and cli.main(["report"]) == 2 and cli.main(["nope", str(logdir)]) == 2
    capsys.readouterr()
    assert cli.main(["report", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "--vanish-decades" in help_text and "option_strings" not in help_text
    for spec in cli.health.Thresholds.spec():  # every threshold's own description, "%" and all
        assert " ".join(spec["description"].split()[:3]) in " ".join(help_text.split()), spec["name"]


@pytest.mark.unit
def test_version(capsys):
    from tb_gradhealth import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tb-gradhealth {__version__}"


@pytest.mark.unit
def test_truncated_file_is_a_warning_not_a_failure(capsys, tmp_path):
    gl.make_healthy(str(tmp_path))
    (path,) = (tmp_path / "healthy").iterdir()
    path.write_bytes(path.read_bytes()[:-40])
    rc, out, _ = run(capsys, tmp_path)
    assert rc == 0 and "problem:" in out and "partial record" in out


@pytest.mark.e2e
def test_console_process_exit_status_without_tensorflow(demo):
    """The real process: exit status 1 on NaN, and neither the CLI nor the reader imports TensorFlow."""
    logdir, _ = demo
    code = ("import sys; from tb_gradhealth import cli; rc = cli.main(sys.argv[1:]); "
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "report", str(logdir), "--run", "exploding"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "run exploding:" in proc.stdout


def _block(out: str, run: str) -> list[str]:
    return out.split(f"run {run}:", 1)[1].split("\n\n", 1)[0].splitlines()


def _rows(block: list[str]) -> dict[str, list[str]]:
    """Table rows by layer name: the row's whitespace-separated cells."""
    header = next(i for i, line in enumerate(block) if line.split()[:2] == ["#", "status"])
    rows = [ln.split() for ln in block[header + 1:] if ROW.match(ln)]
    return {r[5]: r for r in rows}


@pytest.mark.unit
def test_one_verdict_line_per_run_tells_the_cause_and_its_chain(capsys, demo):
    logdir, facts = demo
    rc, out, _ = run(capsys, logdir)
    assert rc == 1
    line = next(ln for ln in out.splitlines() if ln.startswith("run exploding:"))
    layer, nan_step = facts["exploding"].first_nan_layer, facts["exploding"].nan_step
    m = re.fullmatch(rf"run exploding: FAIL nonfinite — {re.escape(layer)}: exploding since step (\d+), "
                     rf"nonfinite since step (\d+)", line)
    assert m, line
    assert 10 <= int(m.group(1)) < nan_step and int(m.group(2)) == nan_step  # growth from step 10; the NaN step
    vanishing = next(ln for ln in out.splitlines() if ln.startswith("run vanishing:"))
    assert re.fullmatch(r"run vanishing: WARN vanishing — sigmoid_\d/kernel: vanishing since step \d+", vanishing)
    assert re.search(r"^run healthy: ok, 0 of 8 layers flagged; loss -\d+% \(steps 10-300\)$", out, re.M)


@pytest.mark.unit
def test_loss_trend_and_exact_counts_with_thousands_separators(capsys, counts):
    rc, out, _ = run(capsys, counts)
    assert rc == 1
    head = next(ln for ln in out.splitlines() if ln.startswith("run counts:"))
    # planted: 2.0 falling by 0.1 a step over steps 0-11, so the loss fell, by about half
    m = re.search(r"; loss -(\d+)% \(steps 0-11\)$", head)
    assert m and 30 <= int(m.group(1)) <= 60, head
    row = _rows(_block(out, "counts"))["big/kernel"]
    assert row[1] == "nonfinite" and row[6:8] == ["1,024", "2,048"]
    assert re.fullmatch(r"\d{1,3}(,\d{3})*", row[2]), row[2]  # severity: an integer with separators
    body = json.loads(run(capsys, counts, "--json")[1])
    layer = next(x for x in next(r for r in body["runs"] if r["run"] == "counts")["layers"]
                 if x["layer"] == "big/kernel")
    assert layer["nan"] == NAN and layer["inf"] == INF
    assert int(row[2].replace(",", "")) == round(layer["severity"])
    assert int(row[3]) == layer["status_since"] and int(row[4]) <= NAN_FROM


@pytest.mark.unit
def test_failing_line_names_the_run_its_worst_layer_and_how_many_more(capsys, demo, counts):
    logdir, facts = demo
    _, _, err = run(capsys, logdir)
    layer = facts["exploding"].first_nan_layer
    more = len(facts["exploding"].layers) - 1  # every layer is NaN after the first NaN step
    assert (f"tb-gradhealth: failing: run 'exploding': {layer} nonfinite and {more} more layers "
            f"(--fail-on nonfinite)") in err.splitlines()
    _, _, err = run(capsys, logdir, "--fail-on", "vanishing,nonfinite")
    failing = [ln for ln in err.splitlines() if ln.startswith("tb-gradhealth: failing:")]
    assert len(failing) == 2 and re.match(r"tb-gradhealth: failing: run 'vanishing': sigmoid_\d/kernel vanishing "
                                          r"and 2 more layers \(--fail-on vanishing,nonfinite\)", failing[1])
    _, _, err = run(capsys, counts)
    assert ("tb-gradhealth: failing: run 'counts': big/kernel nonfinite (--fail-on nonfinite)"
            in err.splitlines())


@pytest.mark.unit
def test_only_failing_keeps_the_failing_runs_and_layers(capsys, demo):
    logdir, _ = demo
    rc, out, _ = run(capsys, logdir, "--only-failing", "--fail-on", "vanishing")
    assert rc == 1
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("run ")] == ["run vanishing"]
    rows = _rows(_block(out, "vanishing"))
    assert len(rows) == 3 and {r[1] for r in rows.values()} == {"vanishing"}
    rc, out, _ = run(capsys, logdir, "--only-failing", "--fail-on", "dead")
    assert rc == 0 and out == "no run has a layer with status dead (--fail-on dead)\n"
    body = json.loads(run(capsys, logdir, "--only-failing", "--json")[1])
    assert [r["run"] for r in body["runs"]] == ["exploding"]


@pytest.mark.unit
def test_long_reasons_wrap_under_their_row(capsys, demo):
    logdir, _ = demo
    out = run(capsys, logdir, "--run", "exploding")[1]
    body = json.loads(run(capsys, logdir, "--run", "exploding", "--json")[1])
    reasons = {x["layer"]: "; ".join(x["reasons"]) for x in body["runs"][0]["layers"]}
    assert max(map(len, reasons.values())) > 2 * WIDTH  # the case: longer than one line
    block = _block(out, "exploding")
    header = next(i for i, line in enumerate(block) if line.split()[:2] == ["#", "status"])
    start = block[header].index("reasons")
    lines, layer = {}, None
    for ln in block[header + 1:]:
        if ROW.match(ln):
            layer = ln.split()[5]
            lines[layer] = [ln[start:]]
        elif not ln.strip().startswith(("episodes:", "*")):
            assert ln.startswith(" " * 8) and not ln.startswith(" " * 9), ln  # under the row, indented
            lines[layer].append(ln.strip())
    for name, parts in lines.items():
        assert all(len(p) <= WIDTH for p in parts), parts
        assert " ".join(parts) == " ".join(reasons[name].split())  # nothing lost, in order


@pytest.mark.unit
def test_the_logdir_root_run_is_shown_with_the_logdir_name(capsys, counts):
    rc, out, err = run(capsys, counts)
    name = counts.name
    assert re.search(rf"^run \. \(logdir root: {re.escape(name)}\): ok, 0 of 3 layers flagged; loss -\d+%", out,
                     re.M), out
    body = json.loads(run(capsys, counts, "--json")[1])
    assert sorted(r["run"] for r in body["runs"]) == [".", "counts"]  # the reader's names are unchanged
    md = run(capsys, counts, "--format", "markdown")[1]
    assert f"| . (logdir root: {name}) | ok |" in md


def _junit(capsys, *argv) -> tuple[int, ET.Element]:
    rc, out, _ = run(capsys, *argv, "--format", "junit")
    return rc, ET.fromstring(out.encode())


@pytest.mark.unit
def test_junit_has_a_case_per_run_and_per_failing_layer(capsys, demo):
    logdir, facts = demo
    rc, root = _junit(capsys, logdir)
    assert rc == 1 and root.tag == "testsuites"
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert set(suites) == {f"gradhealth {r}" for r in facts}
    exploding = suites["gradhealth exploding"].findall("testcase")
    assert [c.get("name") for c in exploding][0] == "run exploding"
    assert sorted(c.get("name") for c in exploding[1:]) == sorted(facts["exploding"].layers)
    assert exploding[1].get("name") == facts["exploding"].first_nan_layer  # the cause first
    assert all(c.find("failure").get("type") == "nonfinite" for c in exploding)
    for run_name in ("healthy", "vanishing", "xss"):
        (case,) = suites[f"gradhealth {run_name}"].findall("testcase")
        assert case.find("failure") is None and case.get("name") == f"run {run_name}"
    total = len(root.findall(".//testcase"))
    assert root.get("tests") == str(total) == str(len(facts) + len(facts["exploding"].layers))
    assert root.get("failures") == str(1 + len(facts["exploding"].layers))
    rc, root = _junit(capsys, logdir, "--fail-on", "vanishing", "--only-failing")
    assert rc == 1 and [s.get("name") for s in root.findall("testsuite")] == ["gradhealth vanishing"]
    assert len(root.findall(".//failure")) == 1 + len(facts["vanishing"].vanishing)


@pytest.mark.unit
def test_junit_reads_back_with_junitparser(capsys, demo):
    junitparser = pytest.importorskip("junitparser")
    logdir, facts = demo
    xml = junitparser.JUnitXml.fromstring(run(capsys, logdir, "--format", "junit")[1])
    suites = {s.name: s for s in xml}
    suite = suites["gradhealth exploding"]
    assert suite.tests == 1 + len(facts["exploding"].layers) and suite.failures == suite.tests
    for case in suite:
        (result,) = case.result
        assert isinstance(result, junitparser.Failure) and result.type == "nonfinite"
    assert suites["gradhealth healthy"].failures == 0


def _tables(md: str) -> list[list[list[str]]]:
    """The Markdown tables: rows of cells (the separator row dropped)."""
    tables, current = [], None
    for line in md.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if current is None:
                current = []
                tables.append(current)
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                current.append(cells)
        else:
            current = None
    return tables


@pytest.mark.unit
def test_markdown_summary_table_then_the_failing_layers(capsys, demo):
    logdir, facts = demo
    rc, md, _ = run(capsys, logdir, "--format", "markdown", "--fail-on", "nonfinite,vanishing")
    assert rc == 1
    summary, *failing = _tables(md)
    assert summary[0] == ["run", "verdict", "cause", "since", "loss"]
    by_run = {r[0]: r for r in summary[1:]}
    assert set(by_run) == set(facts) and all(len(r) == 5 for r in summary)
    layer = facts["exploding"].first_nan_layer
    assert by_run["exploding"][1] == "**FAIL** nonfinite" and by_run["exploding"][2].startswith(f"`{layer}` ")
    assert 10 <= int(by_run["exploding"][3]) < facts["exploding"].nan_step
    assert by_run["healthy"][1:4] == ["ok", "-", "-"]
    assert len(failing) == 2  # exploding, vanishing: each a header and its failing layers
    assert [r[1].strip("`") for r in failing[0][1:]][0] == layer
    assert len(failing[0]) == 1 + len(facts["exploding"].layers)
    assert {r[1].strip("`") for r in failing[1][1:]} == set(facts["vanishing"].vanishing)
    assert re.findall(r"^### Failing layers: (\S+)$", md, re.M) == ["exploding", "vanishing"]


@pytest.mark.unit
def test_a_pipe_in_a_layer_name_stays_inside_its_markdown_cell(capsys, tmp_path):
    rng = np.random.default_rng(1)
    with Writer(str(tmp_path / "piped")) as w:
        for step in range(8):
            g = rng.normal(size=64)
            if step >= 4:
                g[:3] = np.nan
            w.add_gradients(step, {"a|b/kernel": g})
    md = run(capsys, tmp_path, "--format", "markdown")[1]
    failing = _tables(md)[1]
    assert len(failing[1]) == len(failing[0]) and failing[1][1] == "`a\\|b/kernel`"


@pytest.mark.unit
def test_format_flags(capsys, demo):
    logdir, _ = demo
    assert json.loads(run(capsys, logdir, "--json")[1]) == json.loads(run(capsys, logdir, "--format", "json")[1])
    rc, _, err = run(capsys, logdir, "--json", "--format", "junit")
    assert rc == 2 and "--json" in err
    rc, _, err = run(capsys, logdir, "--format", "yaml")
    assert rc == 2 and "invalid choice" in err


@pytest.mark.unit
def test_a_logdir_of_plain_tensorboard_runs_lists_them(capsys, tmp_path):
    for name in ("train", "validation"):
        gl.write_events(gl.event_file_path(str(tmp_path / name)), [gl.scalar_event(0, "loss", 1.0)])
    rc, _, err = run(capsys, tmp_path)
    assert rc == 2 and "no gradient-health records" in err
    assert "2 run(s) with event files but no records: 'train', 'validation'" in err


@pytest.mark.unit
def test_a_loss_that_went_nan_is_printed_with_its_step_and_last_finite_value(capsys, tmp_path):
    # Planted: the loss doubles each step from 1.0 over steps 0-9 (the last finite 512 at step 9), NaN from step 10;
    # its early level is the median of the first quarter of its 10 finite values (1 and 2): 512 / 1.5 = 341.3, printed
    # to 3 significant figures as every magnitude is.
    rng = np.random.default_rng(3)
    with Writer(str(tmp_path / "diverged")) as w:
        for step in range(14):
            w.add_gradients(step, {f"layer_{i}/kernel": rng.normal(size=128) * 1e-2 for i in range(3)})
            w.add_loss(step, 2.0 ** step if step < 10 else float("nan"))
    rc, out, _ = run(capsys, tmp_path)
    head = out.splitlines()[0]
    assert head.endswith("; loss NaN/Inf from step 10 (last finite 512 at step 9, x340 its early level)"), head
