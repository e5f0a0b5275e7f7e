"""One story over time, and the loops people run every day: what the diagnosis says at each logged step (no look
ahead), recovery measured from the loss, a cause that stays the cause, statuses that mean their names, and parameters
used at some steps only.

Records are built with ``record.compute`` from numpy gradients, weights and updates whose magnitudes mimic the real
runs these shapes come from (the zoo, ``benchmarks/diagnosis_zoo.py``, trains them).
"""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import record
from tb_gradhealth.health import FLAGS, diagnose_run

pytestmark = pytest.mark.unit


def _records(grad: np.ndarray, weight: np.ndarray, update: np.ndarray, seed: int = 0,
             sizes: list[int] | None = None, missing: np.ndarray | None = None) -> np.ndarray:
    """``[S, L]`` records of Gaussian gradients, weights and updates of the given RMS (NaN: NaN values; ``missing``
    ``[S, L]``: no gradient there, a ``None`` .grad)."""
    rng = np.random.default_rng(seed)
    steps, layers = grad.shape
    sizes = sizes or [64] * layers
    out = np.full((steps, layers, record.NUM_FIELDS), np.nan)
    for s in range(steps):
        for i in range(layers):
            if missing is not None and missing[s, i]:
                out[s, i] = record.missing()
                continue
            n = sizes[i]
            out[s, i] = record.compute(rng.normal(size=n) * grad[s, i], rng.normal(size=n) * weight[s, i],
                                       rng.normal(size=n) * update[s, i], hist_sample=None)
    return out


def _names(n: int) -> list[str]:
    return [f"dense_{i:02d}/{k}" for i in range(n) for k in ("kernel", "bias")]


def _flagged(h) -> dict[str, str]:
    return {lh.layer: lh.status for lh in h.layers if lh.status in FLAGS}


def _sgd(steps: int, n: int, lr: float = 0.1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    grad = np.full((steps, n), 1e-2)
    return grad, np.full((steps, n), 0.3), lr * grad


def test_a_loss_that_runs_away_is_a_divergence_even_where_the_units_died():
    """The loss jumps by decades at two logged steps, above where training started, while every hidden layer's
    gradient is exactly zero (its ReLUs died in the blow-up) and the output bias grows with the loss: the bias is
    exploding from where its rise began, the dead layers are part of its chain, never the answer."""
    names = _names(3)
    steps = 30
    grad, weight, update = _sgd(steps, 6)
    grad[20:, :4] = 0.0  # every hidden unit dead from step 20
    grad[20:, 5] = 1e-2 * 10.0 ** np.arange(1, steps - 19)  # the output bias chases the loss
    loss = np.concatenate([np.linspace(2.0, 1.0, 20), 30.0 * 10.0 ** np.arange(0, steps - 20)])
    recs = _records(grad, weight, update, sizes=[64, 64, 64, 64, 64, 1])
    progress = (np.arange(steps), loss)
    assert _flagged(diagnose_run(names, np.arange(steps), recs, at_step=19, progress=progress)) == {}
    h = diagnose_run(names, np.arange(steps), recs, at_step=21, progress=progress)
    assert h.by_layer()["dense_02/bias"].status == "exploding" and h.answer["layer"] == "dense_02/bias"
    for at in range(21, steps):
        h = diagnose_run(names, np.arange(steps), recs, at_step=at, progress=progress)
        assert h.answer["layer"] == "dense_02/bias" and h.answer["status"] == "exploding", at
    assert any("the loss jumped" in r for r in h.by_layer()["dense_02/bias"].reasons)


def test_one_batch_far_above_the_rest_is_a_hard_batch_not_a_divergence():
    """A converging classifier whose per-batch loss spikes once above where it started, then is back down."""
    names = _names(3)
    steps = 40
    grad, weight, update = _sgd(steps, 6)
    grad[25] *= 20.0  # the hard batch's gradient
    loss = np.linspace(1.4, 0.1, steps)
    loss[25] = 2.3
    h_all = [diagnose_run(names, np.arange(steps), _records(grad, weight, update), at_step=at,
                          progress=(np.arange(steps), loss)) for at in range(steps)]
    assert all(_flagged(h) == {} and not any(lh.episodes for lh in h.layers) for h in h_all)


def _jump(steps: int, after: float) -> tuple[list[str], np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """A learning rate that jumps at step 10 for two steps: the gradients blow up 1,000x, then look ordinary
    again; the loss afterwards sits at ``after`` times its level before."""
    names = _names(3)
    grad, weight, update = _sgd(steps, 6)
    grad[10:12] *= 1e3
    update[10:12] = 5.0  # each update replaces the weights many times over
    loss = np.full(steps, 1.0) + 0.05 * np.sin(np.arange(steps))
    loss[10:14] = [30.0, 80.0, 20.0, 10.0]
    loss[14:] *= after
    return names, _records(grad, weight, update), (np.arange(steps), loss)


def test_a_blow_up_the_loss_never_came_back_from_stays_the_runs_answer():
    names, recs, progress = _jump(60, after=2.4)
    h = diagnose_run(names, np.arange(60), recs, progress=progress)
    assert h.answer is not None and h.answer["status"] == "exploding" and h.answer["step"] <= 11
    lh = h.by_layer()[h.answer["layer"]]
    assert lh.status == "exploding" and lh.episodes[-1]["to"] == 59
    episode = h.loss_trend["episode"]
    assert episode["step"] == h.answer["step"] and 2.2 < episode["ratio"] < 2.6
    # the layer's reason and the run's loss line give one figure: the loss against its level before the episode
    assert any(f"has not recovered: the loss is {episode['ratio']:,.3g}x its level before step {episode['step']}" in r
               for r in lh.reasons), (lh.reasons, episode)


def test_a_blow_up_whose_loss_came_back_is_an_earlier_recovered_episode():
    names, recs, progress = _jump(60, after=0.9)
    h = diagnose_run(names, np.arange(60), recs, progress=progress)
    assert h.answer is None and _flagged(h) == {}
    assert h.earlier and h.earlier[0]["label"] == "earlier, recovered"
    assert h.loss_trend["episode"] is None


def test_without_a_loss_recovery_is_the_gradient_and_update_back_in_their_range():
    names, recs, _ = _jump(60, after=2.4)
    h = diagnose_run(names, np.arange(60), recs)
    assert h.answer is None and all(e["to"] < 20 for lh in h.layers for e in lh.episodes)


def test_the_cause_stays_the_layer_that_exploded_while_its_units_die_and_another_layer_explodes_later():
    names = _names(3)
    steps = 30
    grad, weight, update = _sgd(steps, 6)
    grad[10:14, 0:2] *= 10.0 ** np.arange(1, 5)[:, None]  # the first layer blows up from step 10 ...
    grad[14:, 0:2] = 0.0  # ... and its units die
    grad[20:, 2:4] *= 10.0 ** np.minimum(np.arange(1, 11), 4)[:, None]  # the second layer explodes from step 20
    loss = np.concatenate([np.linspace(2.0, 1.5, 10), np.full(steps - 10, 6.0)])
    recs = _records(grad, weight, update)
    answers = [diagnose_run(names, np.arange(steps), recs, at_step=at, progress=(np.arange(steps), loss)).answer
               for at in range(steps)]
    named = [(a["layer"], a["status"], a["step"]) for a in answers if a is not None]
    assert named and all(x[0].startswith("dense_00/") and x[1] == "exploding" for x in named), named
    assert answers[-1]["now"] == "dead" and answers[-1]["story"].startswith("exploding from step")


def test_huge_gradients_under_a_tiny_learning_rate_are_exploding_never_vanishing():
    """Plain SGD at lr 1e-9 on gradients 10-1,000 times their layer's weights: the loss does not move and nothing
    learns. The finding is a learning rate far too small for gradients that would blow the weights up at any usual
    one: exploding, the largest beside its weights named; a zero-initialised bias is measured against its kernel."""
    names = _names(4)
    steps = 16
    weight = np.full((steps, 8), 0.3)
    weight[:, 1::2] = 1e-9  # zero-initialised biases (they moved by 1e-9 of a gradient)
    grad = np.tile(np.array([300.0, 300.0, 30.0, 30.0, 6.0, 0.03, 0.3, 0.03]), (steps, 1))
    lr = 1e-9
    loss = 450.0 + np.sin(np.arange(steps))
    h = diagnose_run(names, np.arange(steps), _records(grad, weight, lr * grad), progress=(np.arange(steps), loss))
    flagged = _flagged(h)
    assert flagged == {"dense_00/kernel": "exploding", "dense_00/bias": "exploding", "dense_01/kernel": "exploding",
                       "dense_01/bias": "exploding", "dense_02/kernel": "exploding"}, flagged
    assert "vanishing" not in h.statuses()
    assert h.answer["layer"] == "dense_00/kernel"  # its gradient is the largest beside its weights
    assert "far too small for gradients this large" in h.by_layer()["dense_01/kernel"].reasons[0]
    # The same gradients under a usual learning rate, the loss falling: a network that learns, nothing flagged.
    loss = np.linspace(450.0, 200.0, steps)
    h = diagnose_run(names, np.arange(steps), _records(grad, weight, 1e-3 * grad), progress=(np.arange(steps), loss))
    assert "vanishing" not in h.statuses()


def test_a_parameter_used_at_some_steps_only_is_idle_not_missing():
    """An expert that gets no token at some logged steps (no gradient: a ``None`` .grad) is idle there, counted,
    never missing for one step; no episode covers a step at which it had a gradient. Used, then idle for 20 logged
    steps (4 x sustain_steps) and half its logged steps, it is missing: its router stopped picking it."""
    names = ["router/kernel", "expert_0/kernel", "expert_1/kernel", "head/kernel"]
    steps = 40
    grad = np.full((steps, 4), 1e-2)
    idle = np.zeros((steps, 4), dtype=bool)
    idle[[3, 9, 10, 17, 31, 38, 39], 2] = True  # expert_1 idle at 7 logged steps, never more than 2 in a row
    recs = _records(grad, np.full((steps, 4), 0.3), 0.1 * grad, missing=idle)
    for at in range(steps):
        h = diagnose_run(names, np.arange(steps), recs, at_step=at)
        assert _flagged(h) == {} and not any(lh.episodes for lh in h.layers), at
    lh = h.by_layer()["expert_1/kernel"]
    assert lh.idle_steps == 7 and lh.logged_steps == steps and "no gradient at 7 of 40 logged steps" in lh.reasons[-1]
    idle[20:, 2] = True  # from step 20 on it gets none at all
    h = diagnose_run(names, np.arange(steps), _records(grad, np.full((steps, 4), 0.3), 0.1 * grad, missing=idle))
    assert h.by_layer()["expert_1/kernel"].status == "missing"
    assert h.by_layer()["expert_1/kernel"].status_since == 20
    idle[20:, 2] = False
    idle[35:, 2] = True  # 5 logged steps without one: idle, not yet missing
    h = diagnose_run(names, np.arange(steps), _records(grad, np.full((steps, 4), 0.3), 0.1 * grad, missing=idle))
    assert _flagged(h) == {}


@pytest.mark.parametrize("zeroed", [False, True])
def test_an_expert_not_picked_for_its_first_thirty_steps_is_never_flagged(zeroed):
    """A router that picks an expert only from step 30 on, the others at some steps only: at no step is that
    expert missing, dead or vanishing, whether its unused gradient is ``None`` or a ``.grad`` zeroed and not
    refilled (``zero_grad(set_to_none=False)``); the loss flat meanwhile, its zero update is no "barely learns"."""
    names = ["router/kernel", "expert_0/kernel", "expert_1/kernel", "head/kernel"]
    steps = 60
    rng = np.random.default_rng(2)
    grad = np.full((steps, 4), 1e-2) * rng.uniform(0.8, 1.2, (steps, 4))
    idle = np.zeros((steps, 4), dtype=bool)
    idle[:30, 2] = True
    idle[[1, 4, 5, 11, 12, 20, 33, 47], 1] = True
    if zeroed:
        grad = np.where(idle, 0.0, grad)
        recs = _records(grad, np.full((steps, 4), 0.3), 0.1 * grad)
    else:
        recs = _records(grad, np.full((steps, 4), 0.3), 0.1 * grad, missing=idle)
    loss = 1.0 + 0.01 * rng.standard_normal(steps)
    for at in range(steps):
        h = diagnose_run(names, np.arange(steps), recs, at_step=at, progress=(np.arange(steps), loss))
        assert _flagged(h) == {} and not any(lh.episodes for lh in h.layers), (at, _flagged(h))
        if 5 <= at < 30:
            assert "idle so far, not missing" in h.by_layer()["expert_1/kernel"].reasons[-1]


def test_a_layer_all_zero_for_sustain_steps_and_back_is_a_recovered_dead_episode_not_routing():
    """A kernel whose gradient is all-zero from step 2 to 9 (8 logged steps, more than ``sustain_steps``) and then
    live again did die for a while: its dead episode is listed as earlier and recovered, not erased as a parameter
    that a router left idle. The same kernel all-zero at 2 logged steps now and then is what routing looks like."""
    names = _names(3)
    steps = 30
    grad, weight, update = _sgd(steps, len(names))
    grad[2:10, 0] = 0.0
    h = diagnose_run(names, np.arange(steps), _records(grad, weight, np.where(grad == 0, 0.0, update)))
    assert _flagged(h) == {} and h.answer is None
    assert [(e["layer"], e["status"], e["label"]) for e in h.earlier] == [("dense_00/kernel", "dead",
                                                                         "earlier, recovered")], h.earlier
    assert h.by_layer()["dense_00/kernel"].idle_steps == 0
    grad, weight, update = _sgd(steps, len(names))
    grad[[2, 3, 11, 12, 20, 21], 0] = 0.0
    h = diagnose_run(names, np.arange(steps), _records(grad, weight, np.where(grad == 0, 0.0, update)))
    assert _flagged(h) == {} and not h.earlier and h.by_layer()["dense_00/kernel"].idle_steps == 6


def test_momentum_growing_the_updates_is_not_a_forgotten_zero_grad():
    """SGD with momentum 0.9: the velocity grows the updates ~10x over the first steps while the gradients stay
    the same size, and the loss wobbles up a little: no accumulation. Gradients that grow with the updates are."""
    names = _names(3)
    steps = 40
    grad = np.full((steps, 6), 1e-2)
    velocity = np.array([sum(0.9 ** k for k in range(s + 1)) for s in range(steps)])
    loss = 1.0 + 0.08 * np.linspace(0.0, 1.0, steps)
    h = diagnose_run(names, np.arange(steps), _records(grad, np.full((steps, 6), 0.3), 1e-2 * grad * velocity[:, None]),
                     progress=(np.arange(steps), loss))
    assert _flagged(h) == {}
    grown = grad * np.arange(1, steps + 1)[:, None]  # nothing zeroes them: each step adds the next gradient
    h = diagnose_run(names, np.arange(steps), _records(grown, np.full((steps, 6), 0.3), 1e-2 * grown),
                     progress=(np.arange(steps), loss), source={"loop": "torch"})
    assert set(_flagged(h).values()) == {"exploding"} and "zero_grad" in h.answer["fixes"][0]
    h = diagnose_run(names, np.arange(steps), _records(grown, np.full((steps, 6), 0.3), 1e-2 * grown),
                     progress=(np.arange(steps), loss), source={"loop": "keras.fit"})
    assert "fit() zeroes the gradients itself" in h.answer["fixes"][0]


def test_growing_updates_beside_a_blow_up_the_gradient_rules_see_are_that_blow_up():
    """Gradients and updates growing with a rising loss (the accumulating reading) while one layer's gradient leaps
    a thousandfold at step 25: the gradient rules see the blow-up, so the run's trend is that blow-up seen from the
    loss, not a second cause begun at step 1; the answer is the leaping layer at every step from 25 on."""
    names = _names(3)
    steps = 40
    grown = np.full((steps, 6), 1e-2) * np.arange(1, steps + 1)[:, None]
    grown[25:, 2:4] *= 1e3
    loss = 1.0 + 0.08 * np.linspace(0.0, 1.0, steps)
    recs = _records(grown, np.full((steps, 6), 0.3), 1e-2 * grown, sizes=[64, 8] * 3)
    for at in range(25, steps):
        h = diagnose_run(names, np.arange(steps), recs, progress=(np.arange(steps), loss), at_step=at,
                         source={"loop": "torch"})
        assert (h.answer["layer"], h.answer["step"]) == ("dense_01/kernel", 25), (at, h.answer["headline"])
        assert not any("as when gradients accumulate" in r for lh in h.layers for r in lh.reasons), at


def test_a_replayed_nan_origin_names_the_layer_that_made_it():
    """NaN made on the way forward reaches every gradient at once; the writer's replay saw the layer."""
    names = _names(3)
    steps = 6
    grad, weight, update = _sgd(steps, 6)
    grad[4:] = np.nan
    recs = _records(grad, weight, update, sizes=[64, 8] * 3)
    assert diagnose_run(names, np.arange(steps), recs).answer["layer"] == "dense_02/kernel"  # backprop's order
    h = diagnose_run(names, np.arange(steps), recs, nan_origin=(4, "dense_01"))
    assert h.answer["layer"] == "dense_01/kernel" and h.answer["status"] == "nonfinite"
    assert any("NaN/Inf started here" in r for r in h.by_layer()["dense_01/kernel"].reasons)
    # A replay of another step, or of a NaN made outside any layer, leaves backprop's order.
    assert diagnose_run(names, np.arange(steps), recs, nan_origin=(3, "dense_01")).answer["layer"] == "dense_02/kernel"
    assert diagnose_run(names, np.arange(steps), recs, nan_origin=(4, None)).answer["layer"] == "dense_02/kernel"


def _twins(prefix: int, steps: int) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """A clipped and an unclipped run, bitwise one up to ``prefix``: every gradient rises together from its small
    initial size (a network getting going), one layer up to 2x ahead of the rest over the last steps before the
    clip bites (within minibatch noise, 0.4 decades); then the clipped run's stay put and the unclipped run's grow
    10x a step until they overflow."""
    names = _names(3)
    rng = np.random.default_rng(7)
    base = 1e-3 * 10.0 ** (0.5 * np.minimum(np.arange(steps), 3))[:, None] * np.ones((1, 6))
    base[prefix - 2:prefix + 1, 2:4] *= np.array([1.3, 1.6, 2.0])[:, None]  # one layer a little ahead of the rest
    clipped = base.copy()
    clipped[prefix + 1:] = clipped[prefix]
    unclipped = base.copy()
    unclipped[prefix + 1:] = unclipped[prefix] * 10.0 ** np.arange(1, steps - prefix)[:, None]
    weight = np.full((steps, 6), 0.3)
    recs = [_records(g, weight, 0.1 * g, seed=int(rng.integers(1 << 30))) for g in (clipped, unclipped)]
    recs[1][: prefix + 1] = recs[0][: prefix + 1]  # bitwise the same records up to the prefix
    return names, recs[0], recs[1], np.arange(steps)


def test_no_episode_begins_inside_a_clean_twins_identical_prefix():
    names, clipped, unclipped, steps = _twins(12, 24)
    for at in steps:
        h = diagnose_run(names, steps, clipped, at_step=int(at))
        assert _flagged(h) == {} and not any(lh.episodes for lh in h.layers), at
    starts = {e["from"] for at in steps for lh in diagnose_run(names, steps, unclipped, at_step=int(at)).layers
              for e in lh.episodes}
    assert starts and min(starts) > 12, starts
    assert set(_flagged(diagnose_run(names, steps, unclipped)).values()) == {"exploding"}


def test_a_layer_rising_alone_is_dated_where_it_left_the_rest_of_the_network():
    """Back-dating reads a layer against the rest of the network: one layer growing 3x a step from step 12 while
    the others hold is exploding from 12 (the trend flags it two steps later); the whole network rising together
    is dated where a rule first fires."""
    names = _names(3)
    steps = 24
    grad, weight, _ = _sgd(steps, 6)
    grad[12:, 2:4] *= 3.0 ** np.arange(1, 13)[:, None]
    h = diagnose_run(names, np.arange(steps), _records(grad, weight, 0.1 * grad))
    assert h.by_layer()["dense_01/kernel"].first_step in (12, 13)
    together = grad.copy()
    together[12:] = 1e-2 * 3.0 ** np.arange(1, 13)[:, None]
    h = diagnose_run(names, np.arange(steps), _records(together, weight, 0.1 * together))
    first = min(lh.first_step for lh in h.layers if lh.first_step is not None)
    flagged_at = min(int(at) for at in range(steps) if _flagged(diagnose_run(names, np.arange(steps),
                                                                         _records(together, weight, 0.1 * together),
                                                                         at_step=at)))
    assert first == flagged_at


def test_a_step_clipped_to_the_global_norm_the_loop_states_is_no_feedback():
    """SGD at a high learning rate: every gradient grows 3x at two logged steps in a row and each update moves the
    weights by more than their RMS, the feedback signature. In the loop that clips the global norm (the
    recorded gradient is the clipped one, as Hugging Face ``Trainer`` records it), the second growth is the clip's:
    the gradients' global norm is exactly the clip there, and the update is bounded by the learning rate times the clip.
    With that clip stated, the step is no evidence, nor is it under a clip twice above the gradients (any runaway
    would meet it within the next step); without a clip, or with one three decades above them (room for what the
    trend calls growth), the same records are a divergence."""
    rng = np.random.default_rng(5)
    names, n, steps, lr = _names(3), 256, 11, 5.0
    base = [rng.normal(size=n) for _ in names]
    weights = [rng.normal(size=n) * 0.3 for _ in names]
    scale = np.full(steps, 1e-2)
    scale[9], scale[10] = 3e-2, 1e-1
    grads = [[b * scale[s] * (1 + 0.01 * rng.normal(size=n)) for b in base] for s in range(steps)]
    clip = 0.9 * np.sqrt(sum(float(np.sum(g ** 2)) for g in grads[10]))
    grads[10] = [g * (clip / (clip / 0.9)) for g in grads[10]]  # clip_grad_norm_(clip) of a gradient 1.11x above
    records = np.stack([np.stack([record.compute(g, w, lr * g, hist_sample=None)
                                  for g, w in zip(grads[s], weights, strict=True)]) for s in range(steps)])
    stepnums = np.arange(steps)
    unclipped = diagnose_run(names, stepnums, records, source={"loop": "transformers", "optimizer": "SGD"})
    assert set(_flagged(unclipped).values()) == {"exploding"}  # the control: the signature alone flags
    clipped = diagnose_run(names, stepnums, records,
                           source={"loop": "transformers", "optimizer": "SGD", "clip_norm": repr(float(clip))})
    assert _flagged(clipped) == {} and clipped.answer is None
    near = diagnose_run(names, stepnums, records,
                        source={"loop": "transformers", "optimizer": "SGD", "clip_norm": repr(float(2 * clip))})
    assert _flagged(near) == {} and near.answer is None
    far = diagnose_run(names, stepnums, records,
                       source={"loop": "transformers", "optimizer": "SGD", "clip_norm": repr(float(1e3 * clip))})
    assert _flagged(far) == _flagged(unclipped)  # a clip far above the gradients leaves the runaway its room


def test_a_layers_growth_in_steps_clipped_to_the_global_norm_the_loop_states_is_no_trend():
    """One layer's gradient grows 2.5x a logged step for 7 steps, from two decades below the others to their level,
    while the minibatch loss rises 10%: the trend rule's blow-up. In a loop that clips the global norm (the recorded
    gradient the clipped one, as ``Trainer`` records it) those steps' gradients sit at the clip: the clip, not the
    gradient, sets each step's size, so the growth is the clip's business. With the clip stated there is no flag;
    without it, or with a clip the gradients never reached, the same records are a blow-up."""
    rng = np.random.default_rng(11)
    names, n, steps, lr = _names(3), 256, 20, 0.5
    base = [rng.normal(size=n) for _ in names]
    weights = [rng.normal(size=n) * 0.3 for _ in names]
    scale = np.full((steps, len(names)), 1e-2)
    scale[:, 2:4] = 1e-4 * 2.5 ** np.clip(np.arange(steps) - 7, 0, 7)[:, None]
    grads = [[b * scale[s, i] * (1 + 0.05 * rng.normal(size=n)) for i, b in enumerate(base)] for s in range(steps)]
    total = np.array([np.sqrt(sum(float(np.sum(g ** 2)) for g in gs)) for gs in grads])
    clip = float(total[8])
    grads = [[g * min(1.0, clip / t) for g in gs] for gs, t in zip(grads, total, strict=True)]
    records = np.stack([np.stack([record.compute(g, w, lr * g, hist_sample=None)
                                  for g, w in zip(grads[s], weights, strict=True)]) for s in range(steps)])
    stepnums = np.arange(steps)
    loss = (stepnums, np.where(stepnums < 8, 3.8, 4.2) * (1 + 0.01 * rng.normal(size=steps)))

    def flags(clip_norm: float | None) -> dict[str, str]:
        source = {"loop": "transformers", "optimizer": "SGD"}
        if clip_norm is not None:
            source["clip_norm"] = repr(clip_norm)
        return _flagged(diagnose_run(names, stepnums, records, source=source, progress=loss))

    assert flags(None) == {"dense_01/kernel": "exploding", "dense_01/bias": "exploding"}  # the control
    assert flags(clip) == {}
    assert flags(10 * clip) == flags(None)  # a clip the gradients never reached clipped nothing


def test_the_learning_rate_fix_fits_the_clip_the_loop_states():
    """Updates 100x the weights from step 10 on (a learning rate far too high). A loop that states no clip is told
    to clip the global norm as a guard; one whose stated clip the gradients reach (Trainer's ``max_grad_norm``) is
    told that its clip did not hold them, never to add one; one whose clip they never reach, that a lower clip
    would guard."""
    names = _names(3)
    steps = 20
    grad, weight, update = _sgd(steps, 6)
    update[10:] = 30.0
    records = _records(grad, weight, update)
    norm = float(np.sqrt(sum(record.derived(records[-1, i])["norm"] ** 2 for i in range(len(names)))))

    def advice(clip_norm: float | None) -> set[str]:
        source = {"loop": "transformers", "optimizer": "SGD"}
        if clip_norm is not None:
            source["clip_norm"] = repr(clip_norm)
        h = diagnose_run(names, np.arange(steps), records, source=source)
        assert set(_flagged(h).values()) == {"exploding"}
        return {f for lh in h.layers if lh.status == "exploding" for f in lh.fixes if "learning rate" in f}

    (unstated,) = advice(None)
    assert "clip the gradient norm" in unstated and "already" not in unstated
    (reached,) = advice(0.5 * norm)
    assert "already clips the global gradient norm at" in reached and "did not hold" in reached
    assert "as a guard" not in reached
    (loose,) = advice(100 * norm)
    assert "never reached" in loose and "a lower clip" in loose
