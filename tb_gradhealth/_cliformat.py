"""What ``tb-gradhealth report`` prints: each run's verdict and answer as text, JUnit XML or GitHub Markdown.

The words come from the diagnosis' own fields (``summary.answer``: the cause layer, its chain and its headline;
``summary.loss_trend``; each layer's status, severity, ``first_step`` and reasons), so the CLI tells the story the
tab tells; numbers are printed as the tab prints them (exact counts and severities with thousands separators,
magnitudes to 3 significant figures). Pure functions of the ``health`` route's JSON: no reading, no diagnosis.
"""

from __future__ import annotations

import posixpath
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tb_gradhealth import health
from tb_gradhealth.numbers import format_change, format_count, format_magnitude, format_ratio, format_severity

#: Statuses that count as "flagged" (the others: a layer that is fine, a parameter that only gets round-off, one
#: frozen by the user).
FLAGGED = health.FLAGS
#: The widest the reasons of one table row get before they wrap under it.
REASONS_WIDTH = 100
#: How far the wrapped reasons are indented under their row.
REASONS_INDENT = 8


def plain(s: str) -> str:
    """Names and reasons as plain, single-line text (control characters escaped)."""
    return s if s.isprintable() else s.encode("unicode_escape").decode("ascii")


def run_label(run: str, logdir: str) -> str:
    """The run's name as the CLI shows it: the reader names a run at the logdir's root ``.``; it is shown with the
    logdir's own name (the reader's, the plugin's and TensorBoard's name stays ``.``)."""
    if run != ".":
        return plain(run)
    name = posixpath.basename(str(logdir).replace("\\", "/").rstrip("/")) or str(logdir)
    return f". (logdir root: {plain(name)})"


def loss_text(summary: dict[str, Any]) -> str | None:
    """``loss +1,105% (steps 0-99)`` from ``summary.loss_trend``, or ``loss NaN/Inf from step 54 (last finite 3.1e+03
    at step 53, 1.23e+03x its early level)`` from ``summary.loss_nonfinite``; None when the writer recorded no loss."""
    blowup = summary.get("loss_nonfinite")
    if blowup:
        return f"loss NaN/Inf from step {blowup['step']}" + _last_finite_loss(blowup) + _gradients_later(blowup)
    trend = summary.get("loss_trend")
    if not trend or trend.get("change") is None:
        return None
    episode = trend.get("episode")
    if episode:
        return (f"loss {format_ratio(episode['ratio'])} its level before step {episode['step']} "
                f"(for {format_count(episode['since'])} logged steps since)")
    return f"loss {format_change(trend['change'])} (steps {trend['first_step']}-{trend['last_step']})"


def _gradients_later(blowup: dict[str, Any]) -> str:
    """Why the loss's first NaN/Inf step and the gradients' differ, in one clause; empty when they agree."""
    grads = blowup.get("gradients_step")
    if grads is None or grads == blowup["step"]:
        return ""
    if grads > blowup["step"]:
        return (f", before the gradients (NaN/Inf from step {grads}): the forward pass overflowed first, and a loss "
                f"of Inf can still have finite gradients")
    return f", after the gradients (NaN/Inf from step {grads})"


def _last_finite_loss(blowup: dict[str, Any]) -> str:
    if blowup.get("last_finite") is None:
        return ""
    ratio = f", {format_ratio(blowup['ratio'])} its early level" if blowup.get("ratio") else ""
    return f" (last finite {format_magnitude(blowup['last_finite'])} at step {blowup['last_finite_step']}{ratio})"


@dataclass(frozen=True)
class Verdict:
    """A run's verdict under ``--fail-on``: ``FAIL`` (a layer's status is in it), ``WARN`` (layers are flagged,
    none with such a status) or ``ok``; ``status``: the worst status of that kind; ``failing``: the layers whose
    status is in ``--fail-on``, in the diagnosis' rank order."""

    word: str
    status: str | None
    failing: tuple[dict[str, Any], ...]
    flagged: int
    layers: int


def verdict(body: dict[str, Any], fail_on: frozenset[str]) -> Verdict:
    """The run's verdict (:class:`Verdict`) from its health JSON."""
    failing = tuple(x for x in body["layers"] if x["status"] in fail_on)
    present = {x["status"] for x in body["layers"]}
    flagged = sum(1 for x in body["layers"] if x["status"] in FLAGGED)
    if failing:
        worst = next(s for s in health.STATUSES if s in {x["status"] for x in failing})
        return Verdict("FAIL", worst, failing, flagged, len(body["layers"]))
    worst_flagged = next((s for s in FLAGGED if s in present), None)
    return Verdict("WARN" if worst_flagged else "ok", worst_flagged, (), flagged, len(body["layers"]))


def headline(body: dict[str, Any], v: Verdict) -> str:
    """``FAIL nonfinite — tanh_5/kernel: exploding since step 31, nonfinite since step 54; loss +1,105% (steps
    0-99)``, or ``ok, 0 of 14 layers flagged; loss -62% (steps 0-99)``."""
    answer = body["summary"].get("answer")
    loss = loss_text(body["summary"])
    if v.word == "ok" or answer is None:  # nothing flagged (a FAIL then fails on healthy or inert layers)
        word = v.word if v.word == "ok" else f"{v.word} {v.status}"
        text = f"{word}, {format_count(v.flagged)} of {format_count(v.layers)} layers flagged"
        frozen = body["summary"]["counts"].get("frozen", 0)
        text += f" ({format_count(frozen)} frozen)" if frozen else ""
    else:
        text = f"{v.word} {v.status} — {plain(answer['headline'])}"
    return text + (f"; {loss}" if loss else "")


def failing_line(label: str, v: Verdict, fail_on_arg: str) -> str:
    """``failing: run 'exploding': tanh_5/kernel nonfinite and 7 more layers (--fail-on nonfinite)``: the run's
    worst failing layer (the first in rank order) and how many more fail."""
    first = v.failing[0]
    more = len(v.failing) - 1
    extra = f" and {format_count(more)} more layer{'s' if more > 1 else ''}" if more else ""
    return f"failing: run {label!r}: {plain(first['layer'])} {first['status']}{extra} (--fail-on {fail_on_arg})"


def timeline_text(timeline: list[dict[str, Any]]) -> str:
    """``exploding from 38 (first to go wrong: dense_3 +4) -> nonfinite from 54 (first layer to reach nonfinite:
    ...)``: each entry with the label that says what it is."""
    parts = []
    for e in timeline:
        more = f" +{format_count(e['layers'] - 1)}" if e["layers"] > 1 else ""
        label = f"{plain(e['label'])}: " if e.get("label") else ""
        parts.append(f"{e['status']} from {e['step']} ({label}{plain(e['layer'])}{more})")
    return " -> ".join(parts)


def _episodes_text(episodes: list[dict[str, Any]]) -> str:
    return " -> ".join(f"{e['status']} {e['from']}-{e['to']}" for e in episodes)


def _magnitudes(x: dict[str, Any]) -> tuple[list[str], str | None]:
    """The row's rms, max|g|, norm; a layer whose last record holds NaN/Inf shows its last finite record's values,
    marked ``*``, and the note that says which step they are from."""
    last = x.get("last_finite")
    if last:
        return [format_magnitude(last[k]) + "*" for k in ("rms", "max_abs", "norm")], \
            f"* last finite, step {last['step']}"
    return [format_magnitude(x.get(k)) for k in ("rms", "max_abs", "norm")], None


def table_lines(layers: Sequence[dict[str, Any]]) -> list[str]:
    """The ranked table: one row per layer, reasons wrapped under it past :data:`REASONS_WIDTH` characters; ``since``
    is the onset of the layer's current status, ``trouble`` the start of its chain of episodes."""
    width = max([len(plain(x["layer"])) for x in layers] + [5])
    pad = " " * REASONS_INDENT
    lines = [f"  {'#':>4}  {'status':<9}  {'severity':>9}  {'since':>7}  {'trouble':>7}  {'layer':<{width}}  "
             f"{'nan':>7}  {'inf':>7}  {'rms':>10}  {'max|g|':>10}  {'norm':>10}  reasons"]
    for x in layers:
        since = "-" if x.get("status_since") is None else str(x["status_since"])
        trouble = "-" if x["first_step"] is None else str(x["first_step"])
        mags, note = _magnitudes(x)
        reasons = textwrap.wrap(plain("; ".join(x["reasons"])), REASONS_WIDTH) or [""]
        lines.append(
            f"  {x['rank']:>4}  {x['status']:<9}  {format_severity(x['severity']):>9}  {since:>7}  "
            f"{trouble:>7}  {plain(x['layer']):<{width}}  {format_count(x.get('nan')):>7}  "
            f"{format_count(x.get('inf')):>7}  "
            f"{mags[0]:>10}  {mags[1]:>10}  {mags[2]:>10}  {reasons[0]}".rstrip())
        lines.extend(pad + r for r in reasons[1:])
        if len(x.get("episodes", [])) > 1:
            lines.append(f"{pad}episodes: {_episodes_text(x['episodes'])}")
        if note:
            lines.append(pad + note)
    return lines


def run_text(body: dict[str, Any], series: Any, label: str, v: Verdict, *, top: int = 0,
             only: frozenset[str] | None = None) -> str:
    """One run: its verdict line, what it is, the answer's story and fixes, and the ranked table (only the layers
    whose status is in ``only`` when given; the ``top`` first when ``top > 0``)."""
    summary = body["summary"]
    counts = summary["counts"]
    lines = [
        f"run {label}: {headline(body, v)}",
        f"  {format_count(len(series.layers))} layers, steps {series.first_step}..{series.last_step} "
        f"({format_count(series.num_steps)} logged), diagnosed at step {body['step']}; "
        + ", ".join(f"{format_count(counts[s])} {s}" for s in health.STATUSES if counts.get(s)),
    ]
    answer = summary.get("answer")
    if answer:
        lines.append(f"  cause: {plain(answer['layer'])}: {plain(answer['story'])}")
        if answer.get("fixes"):
            lines.append(f"  what to do: {plain(answer['fixes'][0])}")
    if summary.get("timeline"):
        lines.append("  timeline: " + timeline_text(summary["timeline"]))
    if body.get("nan_origin"):
        lines.append(f"  {plain(body['nan_origin']['message'])}")
    lines += [f"  problem: {plain(p)}" for p in series.problems]
    lines += [f"  note: {plain(p)}" for p in series.notes]
    layers = body["layers"]
    if only is not None:
        layers = [x for x in layers if x["status"] in only]
    shown = layers[:top] if top > 0 else layers
    if shown:
        lines += table_lines(shown)
    if top > 0 and len(layers) > top:
        lines.append(f"  ... {format_count(len(layers) - top)} more layers (--top 0 lists all)")
    return "\n".join(lines)


# --- JUnit XML ----------------------------------------------------------------------------------------------------


def _case(suite: ET.Element, classname: str, name: str) -> ET.Element:
    return ET.SubElement(suite, "testcase", classname=classname, name=name, time="0")


def junit(runs: Iterable[tuple[str, dict[str, Any], Verdict]], unreadable: Sequence[str], logdir: str,
          fail_on_arg: str) -> str:
    """JUnit XML: one test suite per run, one test case for the run (a ``failure`` when its verdict is FAIL) and
    one per failing layer (each a ``failure`` naming its status, since when and why); an unreadable run is an
    ``error``."""
    root = ET.Element("testsuites", name=f"tb-gradhealth report {logdir}")
    for label, body, v in runs:
        suite = ET.SubElement(root, "testsuite", name=f"gradhealth {label}")
        classname = f"gradhealth.{label}"
        case = _case(suite, classname, f"run {label}")
        text = headline(body, v)
        if v.word == "FAIL":
            ET.SubElement(case, "failure", message=text, type=v.status or "").text = failing_line(
                label, v, fail_on_arg)
        else:
            ET.SubElement(case, "system-out").text = text
        for x in v.failing:
            layer = _case(suite, classname, plain(x["layer"]))
            since = "" if x["first_step"] is None else f" since step {x['first_step']}"
            ET.SubElement(layer, "failure", message=f"{plain(x['layer'])}: {x['status']}{since}, severity "
                          f"{format_severity(x['severity'])}", type=x["status"]).text = plain("; ".join(x["reasons"]))
        _counts(suite)
    for run in unreadable:
        suite = ET.SubElement(root, "testsuite", name=f"gradhealth {run}")
        ET.SubElement(_case(suite, f"gradhealth.{run}", f"run {run}"), "error", message="unreadable",
                      type="unreadable").text = f"run {run!r}: no gradient-health record can be read"
        _counts(suite)
    _counts(root)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def _counts(node: ET.Element) -> None:
    """The ``tests``/``failures``/``errors`` attributes JUnit readers show, counted from the cases under it."""
    cases = list(node.iter("testcase"))
    node.set("tests", str(len(cases)))
    node.set("failures", str(sum(1 for c in cases if c.find("failure") is not None)))
    node.set("errors", str(sum(1 for c in cases if c.find("error") is not None)))


# --- GitHub-flavoured Markdown ------------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    """A Markdown table cell: pipes escaped, no line breaks."""
    return plain(str(text)).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_cell(text).replace('`', '')}`"


def markdown(runs: Sequence[tuple[str, dict[str, Any], Verdict]], unreadable: Sequence[str], logdir: str) -> str:
    """A summary table (run, verdict, cause, since, loss) and, for each failing run, its failing layers."""
    lines = [f"## Gradient health: {_cell(logdir)}", "", "| run | verdict | cause | since | loss |",
             "| --- | --- | --- | --- | --- |"]
    for label, body, v in runs:
        answer = body["summary"].get("answer")
        word = f"**{v.word}** {v.status}" if v.status else v.word
        cause = "-" if answer is None else f"{_code(answer['layer'])} {_cell(answer['story'])}"
        since = "-" if answer is None else str(answer["step"])
        lines.append(f"| {_cell(label)} | {word} | {cause} | {since} | {_cell(loss_text(body['summary']) or '-')} |")
    for run in unreadable:
        lines.append(f"| {_cell(run)} | **unreadable** | - | - | - |")
    for label, _body, v in runs:
        if not v.failing:
            continue
        lines += ["", f"### Failing layers: {_cell(label)}", "",
                  "| # | layer | status | severity | since | nan | inf | reasons |",
                  "| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |"]
        for x in v.failing:
            since = "-" if x["first_step"] is None else str(x["first_step"])
            lines.append(f"| {x['rank']} | {_code(x['layer'])} | {x['status']} | {format_severity(x['severity'])} | "
                         f"{since} | {format_count(x.get('nan'))} | {format_count(x.get('inf'))} | "
                         f"{_cell('; '.join(x['reasons']))} |")
    return "\n".join(lines)
