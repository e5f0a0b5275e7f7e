"""``tb-gradhealth report LOGDIR``: the diagnosis of every run as text, JSON, JUnit XML or Markdown; a CI gate.

Reads event files directly (:func:`tb_gradhealth.reader.read_logdir`, no TensorBoard server, no TensorFlow) and
diagnoses with :mod:`tb_gradhealth.health`, so it agrees with the dashboard: the text gives each run one verdict line
(``FAIL``/``WARN``/``ok``, the answer's headline, the loss trend) and a ranked table, in the tab's words and numbers
(:mod:`tb_gradhealth._cliformat`). The JSON is the ``health`` route's answer per run (docs/API.md) plus the run's
read problems and ``nan_origin``: where its first NaN/Inf was made, when a writer replayed it
(:mod:`tb_gradhealth.origin`; the ``nan_origin`` route's ``origin``). Each failing run gets one line on stderr naming
its worst failing layer.

Exit status: 1 when a reported layer has a status named in ``--fail-on`` (default ``nonfinite``; ``none`` never
fails); else 3 when a run holds gradient-health data but none of it is readable (each such run and why is on stderr
and in the JSON's ``problems``); 2 on bad usage, or a logdir that is missing or holds no gradient-health data; 0
otherwise. Damage inside a readable run (a damaged record, a truncated file) is a warning on stderr and a line in
that run's ``problems``; it does not change the exit status.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from tb_gradhealth import __version__, _storage, health, origin, progress, reader
from tb_gradhealth._cliformat import Verdict, failing_line, junit, markdown, plain, run_label, run_text, verdict
from tb_gradhealth._payloads import RequestError, health_payload, parse_step, parse_thresholds

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_UNREADABLE = 0, 1, 2, 3
DEFAULT_FAIL_ON = "nonfinite"
FORMATS = ("text", "json", "junit", "markdown")


class UsageError(Exception):
    """Bad arguments or an unreadable/empty logdir: exit 2 with this message."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help_text(text: str) -> str:
    """Help text taken from elsewhere, with argparse's ``%`` escaped (it formats help strings with ``%``)."""
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tb-gradhealth", description="Gradient health of TensorBoard runs, without a server.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    rep = sub.add_parser(
        "report",
        help="rank the layers of every run worst first",
        description="Diagnose every run in LOGDIR (nonfinite, exploding, vanishing, dead, missing, healthy) and "
        "print a ranked table per run. Exit 1 if a layer has a status named in --fail-on; else 3 if a run's "
        "records are all unreadable (reasons on stderr); 2 on bad usage or a logdir without gradient-health data; "
        "0 otherwise.",
    )
    rep.add_argument("logdir", metavar="LOGDIR", help="directory of event files (runs are its subdirectories): a "
                     "local path, or a gs://, s3:// or other fsspec URL (needs the gcs / s3 extra)")
    rep.add_argument("--run", action="append", metavar="R", help="only this run (repeatable); default: all runs")
    rep.add_argument("--step", metavar="S", help="diagnose as of this step (default: each run's last step)")
    rep.add_argument("--format", choices=FORMATS, default=None, help="text: a verdict line and a ranked table per "
                     "run (default); json: {\"runs\": [...]}, each the health route's JSON; junit: JUnit XML, one "
                     "test case per run and per failing layer; markdown: GitHub-flavoured Markdown, a summary table "
                     "and each failing run's failing layers")
    rep.add_argument("--json", action="store_true", help="the same as --format json")
    rep.add_argument("--only-failing", action="store_true", help="only the runs with a layer whose status is in "
                     "--fail-on (and in the text table only those layers)")
    rep.add_argument("--fail-on", default=DEFAULT_FAIL_ON, metavar="STATUSES",
                     help=f"comma-separated statuses that make the exit status 1 (of {', '.join(health.STATUSES)}), "
                     f"or 'none' (default: {DEFAULT_FAIL_ON})")
    rep.add_argument("--top", type=int, default=0, metavar="N", help="table: only the N worst layers per run")
    group = rep.add_argument_group("thresholds (defaults and reasons in docs/DIAGNOSIS.md)")
    for spec in health.Thresholds.spec():
        spellings = dict.fromkeys([_flag(spec["name"]), "--" + spec["name"]])  # --vanish-decades, --vanish_decades
        group.add_argument(*spellings, dest="t_" + spec["name"], metavar="V", default=None,
                           help=_help_text(f"{spec['description']} (default {spec['default']})"))
    return parser


def _fail_on(raw: str) -> frozenset[str]:
    names = {s.strip() for s in raw.split(",") if s.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = sorted(names - set(health.STATUSES))
    if unknown or not names:
        raise UsageError(f"--fail-on: unknown status {', '.join(unknown) or repr(raw)} "
                         f"(choose from {', '.join(health.STATUSES)}, or none)")
    return frozenset(names)


def _step(raw: str | None) -> int | None:
    try:
        return parse_step(raw, "--step")
    except RequestError as e:
        raise UsageError(e.message) from e


def _thresholds(args: argparse.Namespace) -> health.Thresholds:
    given = {k[2:]: v for k, v in vars(args).items() if k.startswith("t_") and v is not None}
    try:
        return parse_thresholds(given)
    except RequestError as e:
        raise UsageError(f"threshold flag: {e.message}") from e


def _read(args: argparse.Namespace, err: TextIO) -> reader.LogdirData:
    """The logdir's runs (only ``--run`` ones when given); warnings on ``err``; a usage error when there is none."""
    try:
        data = reader.read_logdir(args.logdir, runs=args.run)
    except (FileNotFoundError, NotADirectoryError, PermissionError, _storage.StorageError) as e:
        raise UsageError(str(e)) from e
    for p in data.problems:
        print(f"tb-gradhealth: warning: {plain(p)}", file=err)
    found = {s.run for s in data.runs}
    missing = [r for r in (args.run or []) if r not in found]
    if missing:
        existing = sorted(reader.find_runs(args.logdir))
        listed = ", ".join(map(repr, existing)) if existing else "none"
        raise UsageError(f"--run: no gradient-health data for run(s) {', '.join(map(repr, missing))} in "
                         f"{args.logdir!r} (runs there: {listed})")
    if not data.runs:
        raise UsageError(_no_records(args.logdir))
    return data


#: How many runs without records the error message names.
LISTED_RUNS = 10


def _no_records(logdir: str) -> str:
    """The error for a logdir without gradient-health records: the runs found there (TensorBoard runs without
    records), so a wrong logdir or a run that never wrote records shows at once."""
    runs = sorted(reader.find_runs(logdir))
    found = "no event files found"
    if runs:
        more = f" and {len(runs) - LISTED_RUNS} more" if len(runs) > LISTED_RUNS else ""
        found = (f"{len(runs)} run(s) with event files but no records: "
                 f"{', '.join(map(repr, runs[:LISTED_RUNS]))}{more}")
    return (f"no gradient-health records in {logdir!r} ({found}; write them with tb_gradhealth's writers or "
            f"callbacks, e.g. GradientHealthCallback(log_dir) beside keras.callbacks.TensorBoard)")


def _diagnose(data: reader.LogdirData, thresholds: health.Thresholds, step: int | None, err: TextIO,
              event_files: Mapping[str, Sequence[str]] | None = None,
              origins: Mapping[str, origin.NanOrigin] | None = None
              ) -> tuple[list[tuple[reader.RunSeries, dict[str, Any]]], list[str], list[str]]:
    """``(bodies, unreadable runs, problems)``: the health JSON of each readable run; read problems on ``err``.
    ``event_files`` (:func:`reader.find_runs`): where each run's training loss and skipped steps are read, evidence
    beside the gradients (:mod:`tb_gradhealth.progress`) as the layers' kinds and the loop are (read with the
    records), and ``origins`` where a writer's replay found each run's first NaN/Inf made."""
    unreadable = [s.run for s in data.runs if not s.num_steps]
    problems = list(data.problems)
    for series in data.runs:
        prefix = f"run {series.run!r}: " + ("" if series.num_steps else "unreadable, no record can be read: ")
        for p in series.problems:
            print(f"tb-gradhealth: {'warning' if series.num_steps else 'error'}: {plain(prefix + p)}", file=err)
        if not series.num_steps:
            problems.extend(prefix + p for p in series.problems or ("no records",))
    bodies = []
    for series in (s for s in data.runs if s.num_steps):
        try:
            found = progress.read_progress(progress.run_paths(event_files, series.run)) if event_files else None
            found = (found or progress.Progress()).with_origin((origins or {}).get(series.run))
            body = health_payload(series, thresholds, step, progress=found)
        except RequestError as e:
            raise UsageError(f"--step: run {series.run!r}: {e.message}") from e
        except Exception as e:  # a bug must not hide the other runs: this one is reported as unreadable
            line = f"run {series.run!r}: unreadable, internal error {type(e).__name__}: {e}"
            print(f"tb-gradhealth: error: {plain(line)}", file=err)
            problems.append(line)
            unreadable.append(series.run)
            continue
        bodies.append((series, {**body, "problems": list(series.problems), "notes": list(series.notes)}))
    return bodies, unreadable, problems


def _format(args: argparse.Namespace) -> str:
    """The output format: ``--format``, or ``json`` for ``--json`` (the two must not disagree)."""
    if args.json and args.format not in (None, "json"):
        raise UsageError(f"--json is --format json: it cannot be combined with --format {args.format}")
    return "json" if args.json else (args.format or "text")


def _render(fmt: str, args: argparse.Namespace, shown: list[tuple[reader.RunSeries, dict[str, Any], Verdict]],
            unreadable: list[str], problems: list[str], fail_on: frozenset[str]) -> str:
    """The report in ``fmt`` of the runs ``shown`` (each with its verdict) and the unreadable runs."""
    labelled = [(run_label(s.run, args.logdir), b, v) for s, b, v in shown]
    if fmt == "json":
        return json.dumps({"runs": [b for _, b, _ in shown], "problems": problems}, allow_nan=False)
    if fmt == "junit":
        return junit(labelled, unreadable, args.logdir, args.fail_on)
    if fmt == "markdown":
        return markdown(labelled, unreadable, args.logdir)
    only = fail_on if args.only_failing else None
    blocks = [run_text(b, s, run_label(s.run, args.logdir), v, top=args.top, only=only) for s, b, v in shown]
    blocks += [f"run {plain(r)}: unreadable" for r in unreadable]
    if not blocks and args.only_failing:
        blocks = [f"no run has a layer with status {' or '.join(sorted(fail_on)) or '(none)'} (--fail-on "
                  f"{args.fail_on})"]
    return "\n\n".join(blocks)


def _write(out: TextIO, text: str) -> None:
    """``text`` on ``out``; a closed pipe (``report ... | head``) is not an error: the exit status still tells."""
    encoding = getattr(out, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):  # an ASCII-only terminal or log: the dash as ASCII
        text = text.replace("\u2014", "-").encode(encoding, "backslashreplace").decode(encoding)
    try:
        out.write(text + "\n")
        out.flush()
    except BrokenPipeError:
        pass


def report(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``tb-gradhealth report``: print the runs' diagnosis on ``out``, the failing runs on ``err``; returns the
    exit status."""
    fail_on = _fail_on(args.fail_on)
    step = _step(args.step)
    thresholds = _thresholds(args)
    fmt = _format(args)
    data = _read(args, err)
    origins = origin.read_logdir(args.logdir, [s.run for s in data.runs])  # where the first NaN/Inf was made
    bodies, unreadable, problems = _diagnose(data, thresholds, step, err, reader.find_runs(args.logdir), origins)
    for series, body in bodies:
        body["nan_origin"] = origins[series.run].to_json() if series.run in origins else None
    judged = [(s, b, verdict(b, fail_on)) for s, b in bodies]
    shown = [j for j in judged if j[2].failing] if args.only_failing else judged
    _write(out, _render(fmt, args, shown, unreadable, problems, fail_on))
    failing = [(s, v) for s, _, v in judged if v.failing]
    for series, v in failing:
        print(f"tb-gradhealth: {failing_line(run_label(series.run, args.logdir), v, args.fail_on)}", file=err)
    if failing:
        return EXIT_FAIL
    if unreadable:
        print(f"tb-gradhealth: {len(unreadable)} run(s) unreadable: {', '.join(map(repr, unreadable))} (exit "
              f"{EXIT_UNREADABLE})", file=err)
        return EXIT_UNREADABLE
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``tb-gradhealth``; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 on --help
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    try:
        return report(args, sys.stdout, sys.stderr)
    except UsageError as e:
        print(f"tb-gradhealth: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
