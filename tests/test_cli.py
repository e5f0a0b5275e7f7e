"""`tb-gradhealth report`: ranked tables, JSON, and the exit status a CI job relies on (0 ok, 1 sick, 2 bad usage)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tb_gradhealth import cli, health
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
    assert f"nonfinite from {nan_step} ({layer}" in out  # the run's timeline
    assert "\x1b[" not in out  # colour-free


@pytest.mark.unit
def test_fail_on_none_and_other_statuses(capsys, demo, healthy):
    logdir, _ = demo
    assert run(capsys, logdir, "--fail-on", "none")[0] == 0
    assert run(capsys, logdir, "--run", "vanishing")[0] == 0  # default fails on nonfinite only
    assert run(capsys, logdir, "--run", "vanishing", "--fail-on", "vanishing")[0] == 1
    assert run(capsys, logdir, "--run", "vanishing", "--fail-on", "exploding,dead")[0] == 0
    assert run(capsys, healthy, "--fail-on", ",".join(s for s in health.STATUSES if s != "healthy"))[0] == 0
    assert run(capsys, healthy, "--fail-on", "healthy")[0] == 1


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
    rows = [ln.split() for ln in lines[header + 1:] if re.match(r"^\s+\d+\s", ln)]  # reasons wrap under rows
    assert [r[0] for r in rows] == [str(i) for i in range(1, len(facts["vanishing"].layers) + 1)]
    assert {r[4] for r in rows[:3]} == set(facts["vanishing"].vanishing)
    assert all(r[1] == "vanishing" for r in rows[:3]) and all(r[1] == "healthy" for r in rows[3:])
    assert gl.XSS_LAYER in out
    rc, out, _ = run(capsys, logdir, "--run", "vanishing", "--top", "2")
    block = out.split("run vanishing:")[1].strip().splitlines()
    header = next(i for i, line in enumerate(block) if line.split()[:2] == ["#", "status"])
    assert "... 8 more layers" in out and block[-1].strip().startswith("... 8 more layers")
    assert [ln.split()[0] for ln in block[header + 1:] if re.match(r"^\s+\d+\s", ln)] == ["1", "2"]


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
