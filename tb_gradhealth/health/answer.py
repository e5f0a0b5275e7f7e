"""The run's answer, defined once: which layer is the cause, since when, what it turned into, what to do, and the
one headline every view prints (the tab, ``tb-gradhealth report``, the JSON; docs/API.md, ``summary.answer``).

The cause is chosen by :func:`tb_gradhealth.health.reasons.cause_first`; this module words it and keeps the rest of
the summary in step with it: rank 1, ``first_bad``, ``cause`` and ``timeline[0]`` all name the answer's layer, and
where several layers reach a status at one logged step the views name the answer's layer when it is one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tb_gradhealth.health.levels import layer_of
from tb_gradhealth.health.result import LayerHealth


def group_depth(layers: Sequence[str]) -> np.ndarray:
    """Per variable, the network index of the deepest variable of its layer (the name up to its last ``/`` or
    ``.``): ``conv1/kernel`` and ``conv1/bias`` receive one upstream gradient, so they are one layer deep."""
    top: dict[str, int] = {}
    for i, name in enumerate(layers):
        top[layer_of(name) or name] = i
    return np.array([top[layer_of(name) or name] for name in layers], dtype=np.int64)


def deepest_first(depth: np.ndarray, size: np.ndarray, index: int) -> tuple[int, float, int]:
    """Sort key (larger first) among variables tied at one step: the deepest layer (backprop reaches it first), then
    that layer's largest variable (a bias takes its layer's upstream gradient: it follows the kernel), then the
    deepest variable."""
    s = float(size[index])
    return int(depth[index]), s if np.isfinite(s) else 0.0, int(index)


def answer_chain(lh: LayerHealth, span: tuple[int, int]) -> list[dict[str, Any]]:
    """The layer's episodes from its chain's start on; the first begins at the chain's start (``first_step``), also
    where a small tensor took its layer's onset. A layer without any record is missing over the whole ``span``
    (the run's first and last logged step)."""
    if lh.first_step is None:
        return [{"status": lh.status, "from": span[0], "to": span[1]}]
    chain = [dict(e) for e in lh.episodes if e["to"] >= lh.first_step]
    if chain:
        chain[0]["from"] = lh.first_step
    else:
        chain = [{"status": lh.status, "from": lh.first_step, "to": lh.step}]
    return chain


def headline(layer: str, status: str, step: int, now: str, now_since: int | None) -> str:
    """``tanh_5/kernel: exploding since step 31, nonfinite since step 54``; one status: ``... vanishing since step
    12``; back to the first status after another: ``... exploding since step 3, exploding again since step 9``."""
    line = f"{layer}: {status} since step {step}"
    if now_since is None or (now == status and now_since == step):
        return line
    return line + f", {now}{' again' if now == status else ''} since step {now_since}"


def run_answer(ranked: list[LayerHealth], is_cause: bool, span: tuple[int, int]) -> dict[str, Any] | None:
    """The answer (``summary.answer``) from the ranking whose first row is the cause; None when nothing is flagged.
    ``span``: the run's first and last logged step."""
    if not is_cause or not ranked or not ranked[0].code.is_flag:
        return None
    top = ranked[0]
    chain = answer_chain(top, span)
    first = chain[0]
    story = " -> ".join(f"{e['status']} from step {e['from']}" for e in chain)
    since = top.status_since if top.status_since is not None else int(first["from"])
    return {
        "layer": top.layer, "index": top.index, "status": first["status"], "step": int(first["from"]),
        "now": top.status, "now_since": since, "chain": chain, "story": story, "fixes": list(top.fixes),
        "flagged": sum(1 for lh in ranked if lh.code.is_flag),
        "headline": headline(top.layer, first["status"], int(first["from"]), top.status, since),
    }


def legacy_fields(answer: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``summary.first_bad`` and ``summary.cause`` (kept for older clients), both taken from the answer."""
    if answer is None:
        return None, None
    first_bad = {"layer": answer["layer"], "status": answer["now"], "step": answer["step"]}
    cause = {"layer": answer["layer"], "status": answer["status"], "step": answer["step"], "now": answer["now"],
             "since": answer["now_since"], "story": answer["story"], "fixes": list(answer["fixes"])}
    return first_bad, cause


def assign_ranks(ranked: list[LayerHealth], answer: dict[str, Any] | None) -> list[LayerHealth]:
    """The layers in ``ranked`` order with their ``rank`` (1-based) and ``rank_reason``: "cause" for the answer's
    layer, "severity" for the others."""
    return [dataclasses.replace(lh, rank=k, rank_reason="cause" if answer is not None and k == 1 else "severity")
            for k, lh in enumerate(ranked, 1)]
