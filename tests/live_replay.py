"""The live diagnosis against the replay: what each ``stop_on`` check diagnosed while a run trained, and what
``tb-gradhealth report --step S --json`` says on the finished logdir (in-process, the CLI's own code path).

Shared by the live tests of every framework; imports no framework.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

from tb_gradhealth import cli, health, live


def as_json(value: Any) -> Any:
    """``value`` as it comes back from JSON (tuples become lists, NaN is already null in the diagnosis' JSON)."""
    return json.loads(json.dumps(value, allow_nan=False))


def record_checks(monkeypatch) -> dict[int, dict]:
    """``{step: RunHealth.to_json()}`` of every check any :class:`tb_gradhealth.live.StopCheck` makes from now on
    (the test's own view of what the writer decided on)."""
    seen: dict[int, dict] = {}
    check = live.StopCheck.check

    def recording(self, step, origin=None):
        before = self.checks
        event = check(self, step, origin)
        if self.checks > before:
            seen[int(step)] = as_json(self.last.to_json())
        return event

    monkeypatch.setattr(live.StopCheck, "check", recording)
    return seen


def spy_diagnose_run(monkeypatch) -> list[dict]:
    """The keyword arguments of every call of ``health.diagnose_run`` from now on (it still diagnoses)."""
    calls: list[dict] = []
    diagnose_run = health.diagnose_run

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return diagnose_run(*args, **kwargs)

    monkeypatch.setattr(health, "diagnose_run", spy)
    return calls


def report(logdir: str, step: int | None = None, run: str | None = None) -> dict:
    """The run's body of ``tb-gradhealth report LOGDIR [--step S] --json --fail-on none`` (the only run, or
    ``run``)."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["report", str(logdir), "--json", "--fail-on", "none"] + (["--step", str(step)] if step is not None
                                                                     else [])
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv + (["--run", run] if run is not None else []))
    assert rc == 0, err.getvalue()
    runs = json.loads(out.getvalue())["runs"]
    assert len(runs) == 1, [r["run"] for r in runs]
    return runs[0]


def diagnosis_of(body: dict, like: dict) -> dict:
    """The report's body reduced to the diagnosis' own JSON (the keys of ``like``, a ``RunHealth.to_json()``; each
    layer to a ``LayerHealth.to_json()``'s keys): what the live check and the report must agree on."""
    out = {k: body[k] for k in like}
    keys = like["layers"][0].keys() if like["layers"] else ()
    out["layers"] = [{k: layer[k] for k in keys} for layer in body["layers"]]
    return out


def assert_live_is_replay(seen: dict[int, dict], logdir: str, run: str | None = None) -> None:
    """Every check's diagnosis equals the report at its step on the finished logdir."""
    assert seen, "no step was checked"
    for step, diagnosed in sorted(seen.items()):
        replay = diagnosis_of(report(logdir, step, run), diagnosed)
        assert replay == diagnosed, f"step {step}: the live diagnosis differs from report --step {step}"
