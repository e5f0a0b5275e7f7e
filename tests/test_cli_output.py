"""`tb-gradhealth report`'s words and numbers: the verdict line per run, the failing line, exact counts, wrapped
reasons, the logdir-root run, `--only-failing` and the JUnit / Markdown formats a CI job reads.

Every run is written with the numpy Writer (or the demo fixtures of tb_gradhealth.testing), so each expected number
is what the test planted: the NaN/Inf counts, the layer that turned NaN first, the step it did, the loss."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from tb_gradhealth import Writer, cli
from tb_gradhealth import testing as gl

pytestmark = pytest.mark.unit

#: The planted counts of the "counts" run: more than a thousand, so the thousands separator shows.
NAN, INF, SIZE = 1024, 2048, 8192
NAN_FROM = 6
#: The widest the reasons may get on one line of the table.
WIDTH = 100


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("demo")
    return logdir, gl.make_demo_logdir(str(logdir))


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


def _block(out: str, run: str) -> list[str]:
    return out.split(f"run {run}:", 1)[1].split("\n\n", 1)[0].splitlines()


def _rows(block: list[str]) -> dict[str, list[str]]:
    """Table rows by layer name: the row's whitespace-separated cells."""
    header = next(i for i, line in enumerate(block) if line.split()[:2] == ["#", "status"])
    rows = [ln.split() for ln in block[header + 1:] if re.match(r"^\s+\d+\s", ln)]
    return {r[4]: r for r in rows}


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


def test_loss_trend_and_exact_counts_with_thousands_separators(capsys, counts):
    rc, out, _ = run(capsys, counts)
    assert rc == 1
    head = next(ln for ln in out.splitlines() if ln.startswith("run counts:"))
    # planted: 2.0 falling by 0.1 a step over steps 0-11, so the loss fell, by about half
    m = re.search(r"; loss -(\d+)% \(steps 0-11\)$", head)
    assert m and 30 <= int(m.group(1)) <= 60, head
    row = _rows(_block(out, "counts"))["big/kernel"]
    assert row[1] == "nonfinite" and row[5:7] == ["1,024", "2,048"]
    assert re.fullmatch(r"\d{1,3}(,\d{3})*", row[2]), row[2]  # severity: an integer with separators
    body = json.loads(run(capsys, counts, "--json")[1])
    layer = next(x for x in next(r for r in body["runs"] if r["run"] == "counts")["layers"]
                 if x["layer"] == "big/kernel")
    assert layer["nan"] == NAN and layer["inf"] == INF
    assert int(row[2].replace(",", "")) == round(layer["severity"])
    assert int(row[3]) <= NAN_FROM


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
        if re.match(r"^\s+\d+\s", ln):
            layer = ln.split()[4]
            lines[layer] = [ln[start:]]
        elif not ln.strip().startswith(("episodes:", "*")):
            assert ln.startswith(" " * 8) and not ln.startswith(" " * 9), ln  # under the row, indented
            lines[layer].append(ln.strip())
    for name, parts in lines.items():
        assert all(len(p) <= WIDTH for p in parts), parts
        assert " ".join(parts) == " ".join(reasons[name].split())  # nothing lost, in order


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


def test_format_flags(capsys, demo):
    logdir, _ = demo
    assert json.loads(run(capsys, logdir, "--json")[1]) == json.loads(run(capsys, logdir, "--format", "json")[1])
    rc, _, err = run(capsys, logdir, "--json", "--format", "junit")
    assert rc == 2 and "--json" in err
    rc, _, err = run(capsys, logdir, "--format", "yaml")
    assert rc == 2 and "invalid choice" in err


def test_a_logdir_of_plain_tensorboard_runs_lists_them(capsys, tmp_path):
    for name in ("train", "validation"):
        gl.write_events(gl.event_file_path(str(tmp_path / name)), [gl.scalar_event(0, "loss", 1.0)])
    rc, _, err = run(capsys, tmp_path)
    assert rc == 2 and "no gradient-health records" in err
    assert "2 run(s) with event files but no records: 'train', 'validation'" in err
