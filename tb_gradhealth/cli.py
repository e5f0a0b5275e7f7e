"""``tb-gradhealth report LOGDIR``: the diagnosis of every run as a ranked text table or JSON; a CI gate.

Reads event files directly (:func:`tb_gradhealth.reader.read_logdir`, no TensorBoard server, no TensorFlow) and
diagnoses with :mod:`tb_gradhealth.health`, so it agrees with the dashboard. The JSON is the ``health`` route's
answer per run (docs/API.md) plus the run's read problems and ``nan_origin``: where its first NaN/Inf was made, when
a writer replayed it (:mod:`tb_gradhealth.origin`; the ``nan_origin`` route's ``origin``).

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
from tb_gradhealth._payloads import RequestError, health_payload, parse_step, parse_thresholds

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_UNREADABLE = 0, 1, 2, 3
DEFAULT_FAIL_ON = "nonfinite"


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
    rep.add_argument("--json", action="store_true", help='print {"runs": [...]}, each the health route\'s JSON')
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


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}"


def _text(s: str) -> str:
    """Names and reasons as plain, single-line text (control characters escaped)."""
    return s if s.isprintable() else s.encode("unicode_escape").decode("ascii")


def timeline_text(timeline: list[dict[str, Any]]) -> str:
    """``exploding from 38 (dense_3 +4) -> dead from 44 (...) -> nonfinite from 54 (...)``."""
    parts = []
    for e in timeline:
        more = f" +{e['layers'] - 1}" if e["layers"] > 1 else ""
        parts.append(f"{e['status']} from {e['step']} ({_text(e['layer'])}{more})")
    return " -> ".join(parts)


def _episodes_text(episodes: list[dict[str, Any]]) -> str:
    return " -> ".join(f"{e['status']} {e['from']}-{e['to']}" for e in episodes)


def format_run(body: dict[str, Any], series: reader.RunSeries, top: int = 0) -> str:
    """One run's ranked table (colour-free), with its summary line and read problems."""
    counts = body["summary"]["counts"]
    lines = [
        f"run {_text(series.run)}: {len(series.layers)} layers, steps {series.first_step}..{series.last_step} "
        f"({series.num_steps} logged), diagnosed at step {body['step']}",
        "  " + ", ".join(f"{counts[s]} {s}" for s in health.STATUSES if counts.get(s)),
    ]
    fb, cause = body["summary"]["first_bad"], body["summary"].get("cause")
    if fb:  # one story: the cause first, then what followed
        story = f": {_text(cause['story'])}" if cause and cause.get("story") else ""
        lines.append(f"  first bad: {_text(fb['layer'])} ({fb['status']}) since step {fb['step']}{story}")
        if cause and cause.get("fixes"):
            lines.append(f"  what to do: {_text(cause['fixes'][0])}")
    if body["summary"].get("timeline"):
        lines.append("  timeline: " + timeline_text(body["summary"]["timeline"]))
    if body.get("nan_origin"):
        lines.append(f"  {_text(body['nan_origin']['message'])}")
    for p in series.problems:
        lines.append(f"  problem: {_text(p)}")
    for p in series.notes:
        lines.append(f"  note: {_text(p)}")
    layers = body["layers"][:top] if top > 0 else body["layers"]
    width = max([len(_text(x["layer"])) for x in layers] + [5])
    lines.append(f"  {'#':>4}  {'status':<9}  {'severity':>8}  {'since':>7}  {'layer':<{width}}  {'rms':>9}  "
                 f"{'max|g|':>9}  {'norm':>9}  reasons")
    for rank, x in enumerate(layers, 1):
        since = "-" if x["first_step"] is None else str(x["first_step"])
        lines.append(
            f"  {rank:>4}  {x['status']:<9}  {x['severity']:>8.1f}  {since:>7}  {_text(x['layer']):<{width}}  "
            f"{_num(x['rms']):>9}  {_num(x['max_abs']):>9}  {_num(x['norm']):>9}  "
            f"{_text('; '.join(x['reasons']))}")
        if len(x.get("episodes", [])) > 1:
            lines.append(f"  {'':>4}  {'':<9}  {'':>8}  {'':>7}  episodes: {_episodes_text(x['episodes'])}")
    if top > 0 and len(body["layers"]) > top:
        lines.append(f"  ... {len(body['layers']) - top} more layers (--top 0 lists all)")
    return "\n".join(lines)


def _read(args: argparse.Namespace, err: TextIO) -> reader.LogdirData:
    """The logdir's runs (only ``--run`` ones when given); warnings on ``err``; a usage error when there is none."""
    try:
        data = reader.read_logdir(args.logdir, runs=args.run)
    except (FileNotFoundError, NotADirectoryError, PermissionError, _storage.StorageError) as e:
        raise UsageError(str(e)) from e
    for p in data.problems:
        print(f"tb-gradhealth: warning: {_text(p)}", file=err)
    found = {s.run for s in data.runs}
    missing = [r for r in (args.run or []) if r not in found]
    if missing:
        existing = sorted(reader.find_runs(args.logdir))
        listed = ", ".join(map(repr, existing)) if existing else "none"
        raise UsageError(f"--run: no gradient-health data for run(s) {', '.join(map(repr, missing))} in "
                         f"{args.logdir!r} (runs there: {listed})")
    if not data.runs:
        raise UsageError(f"no gradient-health records in {args.logdir!r} (write them with tb_gradhealth's writers)")
    return data


def _diagnose(data: reader.LogdirData, thresholds: health.Thresholds, step: int | None, err: TextIO,
              event_files: Mapping[str, Sequence[str]] | None = None
              ) -> tuple[list[tuple[reader.RunSeries, dict[str, Any]]], list[str], list[str]]:
    """``(bodies, unreadable runs, problems)``: the health JSON of each readable run; read problems on ``err``.
    ``event_files`` (:func:`reader.find_runs`): where each run's training loss is read, evidence beside the
    gradients (:mod:`tb_gradhealth.progress`) as the layers' kinds are (read with the records)."""
    unreadable = [s.run for s in data.runs if not s.num_steps]
    problems = list(data.problems)
    for series in data.runs:
        prefix = f"run {series.run!r}: " + ("" if series.num_steps else "unreadable, no record can be read: ")
        for p in series.problems:
            print(f"tb-gradhealth: {'warning' if series.num_steps else 'error'}: {_text(prefix + p)}", file=err)
        if not series.num_steps:
            problems.extend(prefix + p for p in series.problems or ("no records",))
    bodies = []
    for series in (s for s in data.runs if s.num_steps):
        try:
            loss = progress.read_loss(progress.run_paths(event_files, series.run)) if event_files else None
            body = health_payload(series, thresholds, step, progress=loss)
        except RequestError as e:
            raise UsageError(f"--step: run {series.run!r}: {e.message}") from e
        except Exception as e:  # a bug must not hide the other runs: this one is reported as unreadable
            line = f"run {series.run!r}: unreadable, internal error {type(e).__name__}: {e}"
            print(f"tb-gradhealth: error: {_text(line)}", file=err)
            problems.append(line)
            unreadable.append(series.run)
            continue
        bodies.append((series, {**body, "problems": list(series.problems), "notes": list(series.notes)}))
    return bodies, unreadable, problems


def report(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``tb-gradhealth report``: print the runs' diagnosis on ``out``; returns the exit status."""
    fail_on = _fail_on(args.fail_on)
    step = _step(args.step)
    thresholds = _thresholds(args)
    bodies, unreadable, problems = _diagnose(_read(args, err), thresholds, step, err,
                                              reader.find_runs(args.logdir))
    failed = sorted({x["status"] for _, b in bodies for x in b["layers"]} & fail_on)
    origins = origin.read_logdir(args.logdir, [s.run for s, _ in bodies])  # where the first NaN/Inf was made
    for series, body in bodies:
        body["nan_origin"] = origins[series.run].to_json() if series.run in origins else None
    if args.json:
        text = json.dumps({"runs": [b for _, b in bodies], "problems": problems}, allow_nan=False)
    else:
        text = "\n\n".join([format_run(b, s, args.top) for s, b in bodies]
                            + [f"run {_text(r)}: unreadable" for r in unreadable])
    try:
        out.write(text + "\n")
        out.flush()
    except BrokenPipeError:  # `tb-gradhealth report ... | head`: the exit status still tells the verdict
        pass
    if failed:
        print(f"tb-gradhealth: failing: layers with status {', '.join(failed)} (--fail-on {args.fail_on})",
              file=err)
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
