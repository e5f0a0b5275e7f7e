"""The diagnosis rules on small, fast versions of the classic failures (and non-failures) of real networks.

Each case builds records with ``record.compute`` from numpy gradients (plus weights and applied updates where the
rule reads them) whose magnitudes mimic what the real network produces, and asserts the statuses, the ranking and
the onsets. The full trainings these shapes come from are in ``benchmarks/diagnosis_zoo.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tb_gradhealth import record
from tb_gradhealth.health import FLAGS, Thresholds, diagnose_run, episodes

pytestmark = pytest.mark.unit


def _run(grad_rms: np.ndarray, names: list[str], *, weight_rms: np.ndarray | None = None,
         update_rms: np.ndarray | None = None, sizes: list[int] | None = None, seed: int = 0,
         zero_fraction: np.ndarray | None = None) -> np.ndarray:
    """Records ``[S, L]`` of Gaussian gradients of the given RMS (NaN: nonfinite; inf: Inf), optionally with
    weights and updates of the given RMS (update 0: the optimizer skipped the step)."""
    rng = np.random.default_rng(seed)
    s_count, l_count = grad_rms.shape
    sizes = sizes or [64] * l_count
    out = np.empty((s_count, l_count, record.NUM_FIELDS))
    for s in range(s_count):
        for i in range(l_count):
            n, r = sizes[i], grad_rms[s, i]
            g = np.full(n, np.nan) if np.isnan(r) else (np.full(n, np.inf) if np.isinf(r) else rng.normal(size=n) * r)
            if zero_fraction is not None:
                g[: int(round(zero_fraction[i] * n))] = 0.0
            w = None if weight_rms is None else rng.normal(size=n) * weight_rms[s, i]
            u = None if update_rms is None else rng.normal(size=n) * update_rms[s, i]
            out[s, i] = record.compute(g, w, u, hist_sample=None)
    return out


def _steady(steps: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradient, weight and update RMS of a steadily training network (``[steps, n]`` each), to be edited."""
    return np.full((steps, n), 1e-2), np.full((steps, n), 0.1), np.full((steps, n), 1e-4)


def _flagged(h) -> dict[str, str]:
    return {lh.layer: lh.status for lh in h.layers if lh.status in FLAGS}


def _layers(n: int, kinds: tuple[str, ...] = ("kernel", "bias")) -> list[str]:
    return [f"dense_{i:02d}/{k}" for i in range(n) for k in kinds]


def test_deep_decay_blames_the_input_end_not_the_healthy_head():
    # A deep sigmoid MLP: RMS decays 0.5 decades per layer from the output (1e-1) to the input (1e-8.5). Under a
    # median or upper-quartile reference the head looked "exploding"; the reference is the layers nearest the loss.
    depth, steps = 17, 8
    log_rms = -1.0 - 0.5 * np.arange(depth)[::-1]
    rms = np.repeat(10.0 ** log_rms, 2)[None, :] * np.ones((steps, 1))
    names = _layers(depth)
    h = diagnose_run(names, np.arange(steps), _run(rms, names))
    decades = np.repeat(log_rms - log_rms[-1], 2)
    status = h.statuses()
    assert all(status[i] == "vanishing" for i in np.flatnonzero(decades <= -3.5)), status
    assert all(status[i] == "healthy" for i in np.flatnonzero(decades >= -2.5)), status
    assert "exploding" not in status
    # #1 is where the flow is lowest, the input end (every layer is sick from step 0): one of the first two layers,
    # 7.5 decades or more below the head, not a borderline layer near the line.
    assert h.first_bad["layer"] == h.layers[0].layer and h.cause["layer"] == h.layers[0].layer
    assert h.layers[0].index < 4, h.layers[0].layer
    assert h.first_bad["step"] == 0 and h.onset["step"] == 0


def test_bias_before_batchnorm_is_inert_not_vanishing():
    # A conv bias feeding only BatchNorm gets float32 round-off: ~5 decades below its own kernel.
    depth, steps = 6, 8
    names = [f"conv_{i}/{k}" for i in range(depth) for k in ("kernel", "bias")] + ["dense/kernel", "dense/bias"]
    rms = np.full((steps, len(names)), 3e-3)
    rms[:, 1:-2:2] = 3e-8  # every conv bias: round-off
    h = diagnose_run(names, np.arange(steps), _run(rms, names))
    by = h.by_layer()
    assert _flagged(h) == {}
    assert all(by[f"conv_{i}/bias"].status == "inert" for i in range(depth))
    assert "use_bias=False" in by["conv_0/bias"].reasons[0] and h.first_bad is None
    assert h.counts["inert"] == depth and h.counts["healthy"] == depth + 2


def test_the_output_layers_bias_is_never_inert():
    # The same round-off-sized gap, but on the output layer's bias (its kernel's inputs are huge): nothing follows the
    # output layer that could cancel its bias' gradient, so it is used, not inert. A conv bias before BN still is.
    depth, steps = 6, 8
    names = [f"conv_{i}/{k}" for i in range(depth) for k in ("kernel", "bias")] + ["logits/kernel", "logits/bias"]
    rms = np.full((steps, len(names)), 3.0)  # a network whose gradients are all 1,000x (a too-wide init)
    rms[:, 1] = 3e-5  # conv_0/bias before BatchNorm: round-off
    rms[:, -2] = 3e3  # the logits kernel, its inputs huge
    rms[:, -1] = 1e-4  # the logits bias: the loss's own gradient, far below the rest
    adam = np.full_like(rms, 1e-3)  # Adam moves every variable by ~lr per element: the kernel is not exploding
    by = diagnose_run(names, np.arange(steps), _run(rms, names, weight_rms=np.full_like(rms, 0.1),
                                                    update_rms=adam)).by_layer()
    assert by["logits/kernel"].status == "healthy"
    assert by["logits/bias"].status != "inert" and by["conv_0/bias"].status == "inert"


def test_vanishing_layer_is_not_inert_when_kernel_and_bias_vanish_together():
    names = _layers(6)
    rms = np.full((8, 12), 1e-3)
    rms[:, 0:2] = [1e-9, 3e-9]  # the first layer: kernel and bias both 6 decades down
    rms[:, 5] = 3e-5  # a bias 1.5 decades below its kernel: a real, smaller gradient
    h = diagnose_run(names, np.arange(8), _run(rms, names))
    assert _flagged(h) == {"dense_00/kernel": "vanishing", "dense_00/bias": "vanishing"}
    assert h.by_layer()["dense_02/bias"].status == "healthy"


def test_adam_moves_a_small_gradient_layer_at_the_same_rate_it_is_not_vanishing():
    names = _layers(5)
    steps = 8
    rms = np.full((steps, 10), 1e-2)
    rms[:, 0:2] = 1e-6  # four decades below the head
    weight = np.full((steps, 10), 0.1)
    adam = np.full((steps, 10), 1e-3)  # Adam: every layer moves by ~lr per element
    h = diagnose_run(names, np.arange(steps), _run(rms, names, weight_rms=weight, update_rms=adam))
    assert _flagged(h) == {}
    assert "still learns" in h.by_layer()["dense_00/kernel"].reasons[0]
    sgd = rms * 0.1  # SGD: the update is the learning rate times the gradient
    h = diagnose_run(names, np.arange(steps), _run(rms, names, weight_rms=weight, update_rms=sgd))
    assert _flagged(h) == {"dense_00/kernel": "vanishing", "dense_00/bias": "vanishing"}
    assert "learns 4.0 decades slower" in " ".join(h.by_layer()["dense_00/kernel"].reasons)


def test_a_small_tensor_crossing_zero_is_not_a_divergence():
    names = ["dense/kernel", "dense/bias", "out/kernel", "out/bias"]
    steps = 16
    rms = np.full((steps, 4), 0.3)
    rms[:, 3] = 1.2
    rms[9, 3] = 0.011  # the one-element output bias crosses zero, then comes back
    rms[5, 0] = 0.003  # a 64-element kernel: one quiet minibatch, then back
    recs = _run(rms, names, sizes=[64, 64, 64, 1])
    for at in range(steps):
        assert _flagged(diagnose_run(names, np.arange(steps), recs, at_step=at)) == {}, at


def test_a_sparse_gradient_is_judged_on_the_rows_that_got_one():
    names = ["embedding/embeddings", "dense/kernel", "dense/bias", "out/kernel"]
    rms = np.full((6, 4), 1e-2)
    recs = _run(rms, names, sizes=[100_000, 64, 64, 64], zero_fraction=np.array([0.9999, 0, 0, 0]))
    # Over all elements its RMS is 2 decades lower; a 1.5-decade vanishing line would flag it on those.
    h = diagnose_run(names, np.arange(6), recs, Thresholds(vanish_decades=1.5))
    assert _flagged(h) == {}
    assert record.derived(recs[-1, 0])["rms"] < 10 ** -3.9


def test_update_larger_than_the_weight_is_exploding_before_the_gradient_grows():
    names = _layers(4)
    steps = 6
    rms, weight, update = _steady(steps, 8)
    update[4:, 0] = 5.0  # SGD(0.1) on conv1: the update is 50x the weight
    h = diagnose_run(names, np.arange(steps), _run(rms, names, weight_rms=weight, update_rms=update))
    lh = h.by_layer()["dense_00/kernel"]
    assert _flagged(h) == {"dense_00/kernel": "exploding"} and lh.first_step == 4
    ratio = float(re.search(r"the applied update is ([\d.]+)x the weight's norm", lh.reasons[0]).group(1))
    assert 30 < ratio < 80 and "weights are blowing up" in lh.reasons[0]


def test_overflow_steps_skipped_by_loss_scaling_are_not_a_disease():
    """A NaN/Inf step with no update is skipped on evidence only: the writer's word (``amp/step_skipped``), or a
    finite record after it. A live check at the skipped step itself has the writer's word or nothing."""
    names = _layers(3)
    steps = 12
    rms, weight, update = _steady(steps, 6)
    rms[0:3] = np.inf  # the first steps overflow float16 at the initial loss scale ...
    update[0:3] = 0.0  # ... and the optimizer skips them: nothing is applied
    recs = _run(rms, names, weight_rms=weight, update_rms=update)
    told = (np.arange(steps), (np.arange(steps) < 3).astype(float))
    for at in range(steps):  # stop_on reads every step: never a halt with the writer's word
        assert _flagged(diagnose_run(names, np.arange(steps), recs, at_step=at, skipped=told)) == {}, at
    for at in range(3, steps):  # without it, once a finite record shows the run went on
        assert _flagged(diagnose_run(names, np.arange(steps), recs, at_step=at)) == {}, at
    assert set(_flagged(diagnose_run(names, np.arange(steps), recs, at_step=2)).values()) == {"nonfinite"}
    note = diagnose_run(names, np.arange(steps), recs).layers[0].reasons[-1]
    assert "skipped" in note and "first at step 0, last at step 2" in note
    # The writer says the step was applied: a NaN update, whatever follows.
    applied = (np.arange(steps), np.zeros(steps))
    assert set(_flagged(diagnose_run(names, np.arange(steps), recs, at_step=2, skipped=applied)).values()) \
        == {"nonfinite"}
    # Skipped for as long as sustain_steps on the signature alone: training is stuck, that is nonfinite.
    rms[3:8], update[3:8] = np.inf, 0.0
    recs = _run(rms, names, weight_rms=weight, update_rms=update)
    h = diagnose_run(names, np.arange(steps), recs)  # finite again from step 8: a past episode, not a skip
    assert [(e["status"], e["from"], e["to"]) for e in h.layers[0].episodes] == [("nonfinite", 0, 7)]
    # Where the writer said each step was skipped, a scaler finding its scale: healthy up to 15 skips in a row (the
    # halvings from 2^16 to 2), nonfinite from the 16th (its scale would be below 1: the gradients overflow unscaled).
    steps = 24
    rms, weight, update = _steady(steps, 6)
    rms[:16], update[:16] = np.inf, 0.0
    recs = _run(rms, names, weight_rms=weight, update_rms=update)
    told = (np.arange(steps), (np.arange(steps) < 16).astype(float))
    assert _flagged(diagnose_run(names, np.arange(steps), recs, at_step=14, skipped=told)) == {}
    h = diagnose_run(names, np.arange(steps), recs, at_step=15, skipped=told)
    assert set(h.statuses()) == {"nonfinite"} and h.layers[0].first_step == 0


def test_a_run_that_ends_on_its_first_nan_is_not_healthy():
    """What stop_on="nonfinite", TerminateOnNaN or a crash leaves: healthy steps (or none), then one last step whose
    gradient is NaN and whose update has no finite value (a NaN update, or one undone to keep the weights): the run
    stopped on it, and nothing says the optimizer skipped it."""
    names = _layers(3)
    steps = 12
    rms, weight, update = _steady(steps, 6)
    rms[-1], update[-1] = np.nan, 0.0
    h = diagnose_run(names, np.arange(steps), _run(rms, names, weight_rms=weight, update_rms=update))
    assert set(_flagged(h).values()) == {"nonfinite"} and h.layers[0].status_since == steps - 1
    # NaN at the very first step and the run ends there (TerminateOnNaN): nonfinite, not "skipped".
    h = diagnose_run(names, np.arange(1), _run(rms[-1:], names, weight_rms=weight[:1], update_rms=update[-1:]))
    assert set(_flagged(h).values()) == {"nonfinite"}
    # The same NaN step at step 8, after which the optimizer went on (loss scaling): healthy.
    rms, weight, update = _steady(steps, 6)
    rms[8], update[8] = np.nan, 0.0
    assert _flagged(diagnose_run(names, np.arange(steps), _run(rms, names, weight_rms=weight, update_rms=update))) \
        == {}
    # A run with loss scaling (it skipped its first steps and went on) whose latest step is one more skip: healthy
    # when the writer says it skipped it, nonfinite when nothing does (the run may have stopped on a NaN update).
    rms, weight, update = _steady(steps, 6)
    rms[[0, 1, 11]], update[[0, 1, 11]] = np.inf, 0.0
    recs = _run(rms, names, weight_rms=weight, update_rms=update)
    told = (np.arange(steps), np.isin(np.arange(steps), [0, 1, 11]).astype(float))
    assert _flagged(diagnose_run(names, np.arange(steps), recs, skipped=told)) == {}
    assert set(_flagged(diagnose_run(names, np.arange(steps), recs)).values()) == {"nonfinite"}


def test_clipping_an_overflowed_norm_leaves_no_dead_episode():
    """AMP with ``unscale_`` and a global clip: on a step whose gradients overflowed, the infinite total norm makes
    the clip multiply every finite gradient by 0, and the scaler skips the step. Those zeros are no dead units."""
    names = _layers(3)
    steps = 16
    rms, weight, update = _steady(steps, 6)
    overflow = [2, 3, 4, 9]
    rms[overflow, 0:2] = np.inf  # the layers that overflowed
    rms[overflow, 2:] = 0.0  # every other gradient clipped to zero
    rms[5] = 0.0  # ... or every gradient: the Inf was in a layer not recorded, and the writer's word is the evidence
    overflow.append(5)
    update[overflow] = 0.0
    recs = _run(rms, names, weight_rms=weight, update_rms=update)
    told = (np.arange(steps), np.isin(np.arange(steps), overflow).astype(float))
    for at in range(steps):
        h = diagnose_run(names, np.arange(steps), recs, at_step=at, skipped=told)
        assert _flagged(h) == {} and not any(lh.episodes for lh in h.layers), at


def test_a_quiet_minibatch_inside_a_blow_up_holds_the_episode_open_as_of_its_own_step():
    """The bridge joins one quiet record to the blow-up around it once the layer flags again; read live at that
    record, the episode must already be open (not ended there and back a step later). More quiet records than the
    bridge spans end it where the layer last flagged."""
    names = _layers(4)
    steps = 24
    rms = np.full((steps, 8), 1e-2)
    rms[10:18, 0:2] = 1e-2 * 3.0 ** np.arange(1, 9)[:, None]  # grows 3x per step from step 10
    rms[15, 0:2] = 3e-2  # one quiet minibatch in the middle of it
    rms[18:, 0:2] = 1e-2  # then back where it stood, for good
    recs = _run(rms, names)
    final = diagnose_run(names, np.arange(steps), recs).by_layer()["dense_00/kernel"]
    assert final.status == "healthy" and len(final.episodes) == 1
    episode = final.episodes[0]
    assert episode["status"] == "exploding" and episode["from"] in (10, 11) and episode["to"] == 17
    live = {at: diagnose_run(names, np.arange(steps), recs, at_step=at).by_layer()["dense_00/kernel"]
            for at in range(steps)}
    flagged = min(at for at, lh in live.items() if lh.status != "healthy")
    assert flagged < 15
    for at in range(flagged, steps):
        if at <= 17 + episodes.CHAIN_GAP:
            assert live[at].status == "exploding" and live[at].first_step == live[flagged].first_step, at
        else:
            assert live[at].status == "healthy" and live[at].episodes == [episode], at
    assert "last record raised no flag" in live[15].reasons[0]


def test_the_story_of_a_divergence_exploding_then_dead_then_nonfinite():
    names = _layers(4)
    steps = 30
    rms = np.full((steps, 8), 1e-2)
    rms[10:16, 0:2] = 1e-2 * 3.0 ** np.arange(1, 7)[:, None]  # grows 3x per step from step 10
    rms[13, 0:2] = 3e-2  # one quiet minibatch in the middle of it
    rms[16:22, 0:2] = 0.0  # saturated: all-zero gradient
    rms[22:, 0:2] = np.nan  # then NaN
    h = diagnose_run(names, np.arange(steps), _run(rms, names))
    top = h.layers[0]
    assert top.layer == "dense_00/bias" and top.status == "nonfinite"  # the deepest of the two NaN at step 22
    assert [e["status"] for e in top.episodes] == ["exploding", "dead", "nonfinite"]
    assert top.first_step in (10, 11) and top.status_since == 22
    assert top.episodes[0]["to"] == 15 and top.episodes[1] == {"status": "dead", "from": 16, "to": 21}
    assert [e["status"] for e in h.timeline] == ["exploding", "dead", "nonfinite"]
    assert h.first_bad == {"layer": top.layer, "status": "nonfinite", "step": top.first_step}
    assert h.onset["step"] == top.first_step


def test_the_layer_where_nan_started_ranks_first_even_if_its_gradient_is_zero_now():
    names = _layers(4)
    steps = 20
    rms = np.full((steps, 8), 1e-2)
    rms[10:, 0:6] = np.nan  # injected in dense_02's backward pass: it and the shallower layers get NaN
    rms[11:, 4:6] = 0.0  # dense_02's own gradient is all-zero afterwards (its NaN weights kill its ReLUs)
    h = diagnose_run(names, np.arange(steps), _run(rms, names))
    assert h.layers[0].layer == "dense_02/bias" and h.layers[0].status == "dead"
    assert "NaN/Inf started here" in " ".join(h.layers[0].reasons)
    assert h.first_bad == {"layer": "dense_02/bias", "status": "dead", "step": 10}


def test_sum_and_mean_reduced_losses_get_the_same_verdict():
    names = _layers(8)
    log_rms = np.repeat(-2.0 - 0.7 * np.arange(8)[::-1], 2)
    rms = 10.0 ** log_rms[None, :] * np.ones((8, 1))
    mean = diagnose_run(names, np.arange(8), _run(rms, names))
    total = diagnose_run(names, np.arange(8), _run(rms * 256, names))  # sum over a batch of 256
    assert mean.statuses() == total.statuses() and "vanishing" in mean.statuses()
    assert mean.first_bad["layer"] == total.first_bad["layer"]


def test_an_early_convolution_with_a_large_gradient_that_learns_at_the_head_pace_is_not_exploding():
    # MobileNetV2 at 32x32 with Adam: the first conv and depthwise kernels sum over 16x16 positions and see raw
    # inputs, so their gradient RMS is ~3.2 decades above the classifier's, yet Adam moves them at the same rate.
    names = ["Conv1/kernel", "dw/depthwise_kernel", "block/kernel", "block/bias", "head/kernel", "head/bias"]
    steps = 8
    rms = np.full((steps, 6), 2e-2)
    rms[:, 0:2] = 30.0
    weight = np.full((steps, 6), 0.1)
    adam = np.full((steps, 6), 1e-3)
    h = diagnose_run(names, np.arange(steps), _run(rms, names, weight_rms=weight, update_rms=adam))
    assert _flagged(h) == {}
    assert "learns at their pace" in h.by_layer()["Conv1/kernel"].reasons[0]
    sgd = rms * 1e-3  # SGD: the early layers move 1,500x faster than the head
    h = diagnose_run(names, np.arange(steps), _run(rms, names, weight_rms=weight, update_rms=sgd))
    assert _flagged(h) == {"Conv1/kernel": "exploding", "dw/depthwise_kernel": "exploding"}
    assert "decades faster than the layers nearest the loss" in " ".join(h.by_layer()["Conv1/kernel"].reasons)


def test_a_nan_layer_reports_unknown_numbers_never_zero():
    names = ["a/kernel", "b/kernel", "c/kernel"]
    g = np.full(64, np.nan)
    rows = np.stack([record.compute(g, np.full(64, np.nan), np.full(64, np.nan)),  # NaN weights, NaN gradient
                     record.compute(np.r_[g[:32], np.ones(32)], np.ones(64)),  # half NaN: the finite half's numbers
                     record.compute(np.ones(64) * 1e-2, np.ones(64))])
    h = diagnose_run(names, np.array([3]), rows[None])
    by = {x["layer"]: x for x in h.to_json()["layers"]}
    assert by["a/kernel"]["status"] == "nonfinite"
    for key in ("norm", "rms", "max_abs", "mean", "weight_norm", "grad_to_weight", "update_to_weight"):
        assert by["a/kernel"][key] is None, key
    assert by["b/kernel"]["max_abs"] == 1.0 and by["b/kernel"]["norm"] == pytest.approx(np.sqrt(32))
    assert by["b/kernel"]["weight_norm"] == pytest.approx(8.0)


def test_a_one_element_bias_takes_the_onset_of_its_layers_explosion():
    names = ["hidden/kernel", "hidden/bias", "out/kernel", "out/bias"]
    steps = 24
    rms = np.full((steps, 4), 1e-2)
    rms[12:, 2] = 1e-2 * 3.0 ** np.arange(1, 13)  # the output kernel explodes from step 12
    rms[10:, 3] = 1e-2 * 3.0 ** np.arange(1, 15)  # its one-element bias: a noisy single number, 2 steps earlier
    recs = _run(rms, names, sizes=[64, 64, 64, 1])
    h = diagnose_run(names, np.arange(steps), recs).by_layer()
    # 3x at step 12 is at the edge of minibatch noise above the kernel's own range: 12 or the next step
    assert h["out/kernel"].status == "exploding" and h["out/kernel"].first_step in (12, 13)
    assert h["out/bias"].status == "exploding" and h["out/bias"].first_step == h["out/kernel"].first_step


def test_weights_blown_up_in_one_step_stay_exploding_until_undone():
    # SGD(0.1) on a fresh ResNet: one update multiplies conv1's weights by ~200; its gradient then looks normal
    # next to the (now huge) weights, but the blow-up is not undone.
    names = _layers(4)
    steps = 10
    rms, weight, update = _steady(steps, 8)
    update[1, 0] = 20.0  # the blow-up: the update is 200x the weight ...
    weight[2:, 0] = 20.0  # ... and the weight stays that large
    h = diagnose_run(names, np.arange(steps), _run(rms, names, weight_rms=weight, update_rms=update)).by_layer()
    lh = h["dense_00/kernel"]
    assert lh.status == "exploding" and lh.first_step == 1 and lh.episodes == [
        {"status": "exploding", "from": 1, "to": 9}]
    assert h["dense_01/kernel"].status == "healthy"


def test_a_bias_far_below_its_exploding_kernel_is_judged_by_its_own_trend():
    # A learning-rate divergence: every kernel's gradient grows 100x per logged step from step 10; a hidden layer's
    # bias stays put, then grows 10,000x at step 13 (still 4 decades below its kernel, which rules out round-off
    # only because the kernel explodes); every gradient is NaN from step 14.
    names = _layers(4)
    steps = 18
    rms = np.full((steps, 8), 1e-2)
    rms[10:14, 0::2] = 1e-2 * 100.0 ** np.arange(1, 5)[:, None]
    rms[13, 3] = 1e2  # dense_01/bias: grew 4 decades in one step
    rms[14:] = np.nan
    lh = diagnose_run(names, np.arange(steps), _run(rms, names)).by_layer()["dense_01/bias"]
    assert lh.status == "nonfinite"
    assert lh.episodes[0] == {"status": "exploding", "from": 13, "to": 13} and lh.first_step == 13


def test_a_small_bias_that_took_its_layers_onset_is_not_the_cause():
    # A recurrent gain that overflows in two steps: at step 0 the updates of the kernels replace their weights 50x
    # over (exploding), the small output bias's gradient is ordinary; from step 1 every gradient is NaN. The bias
    # takes its layer's onset (step 0), but the explosion is the kernels': the cause is the deepest of them.
    names = ["rnn/kernel", "rnn/recurrent_kernel", "rnn/bias", "logits/kernel", "logits/bias"]
    steps = 6
    rms, weight, update = _steady(steps, 5)
    update[0, [0, 1, 3]] = 5.0
    rms[1:], weight[1:], update[1:] = np.nan, np.nan, np.nan
    recs = _run(rms, names, weight_rms=weight, update_rms=update, sizes=[64, 64, 32, 64, 4])
    h = diagnose_run(names, np.arange(steps), recs)
    assert h.by_layer()["logits/bias"].first_step == 0  # its layer's onset
    assert h.layers[0].layer == "logits/kernel" and h.first_bad == {
        "layer": "logits/kernel", "status": "nonfinite", "step": 0}
    assert h.cause["story"] == "exploding from step 0 -> nonfinite from step 1"


def _clipped_run(steps: int, ratio: np.ndarray, names: list[str], clip: float = 1.0) -> np.ndarray:
    """Records of SGD under per-variable ``clipnorm=clip`` whose raw gradient is always larger than the clip: every
    recorded gradient has norm ``clip`` (what the Keras callback records); each step's update moves the weights by
    ``ratio[s]`` of their norm."""
    rng = np.random.default_rng(3)
    out = np.empty((steps, len(names), record.NUM_FIELDS))
    for s in range(steps):
        for i in range(len(names)):
            g = rng.normal(size=64)
            g *= clip / np.linalg.norm(g)
            w = rng.normal(size=64) * 0.1
            out[s, i] = record.compute(g, w, g * ratio[s] * np.linalg.norm(w) / clip, hist_sample=None)
    return out


def test_an_explosion_held_back_by_per_variable_clipping_shows_in_the_steps_it_takes():
    # lr x1000 under clipnorm: the clip caps every recorded gradient at its norm, and every clipped step moves the
    # weights by half their norm; the same clipped gradients at a sane learning rate move them by 1e-3 a step.
    names = _layers(3)
    steps = 8
    recs = _clipped_run(steps, np.full(steps, 0.5), names)
    h = diagnose_run(names, np.arange(steps), recs)
    assert set(h.statuses()) == {"exploding"} and {lh.first_step for lh in h.layers} == {0}
    assert "sits at its clip (1.0e+00)" in h.layers[0].reasons[0]
    # flagged once it lasts sustain_steps (5) logged steps, dated from its first
    assert _flagged(diagnose_run(names, np.arange(steps), recs, at_step=3)) == {}
    assert set(_flagged(diagnose_run(names, np.arange(steps), recs, at_step=4)).values()) == {"exploding"}
    assert _flagged(diagnose_run(names, np.arange(steps), _clipped_run(steps, np.full(steps, 1e-3), names))) == {}


def test_a_few_large_clipped_steps_that_calm_down_are_not_an_explosion():
    # lr x100 under clipnorm: the first 3 steps are clipped and move the weights by a quarter of their norm, then the
    # loss falls, the gradient drops below the clip and the steps shrink with it.
    names = _layers(3)
    steps = 12
    recs = _clipped_run(steps, np.r_[np.full(3, 0.25), np.full(steps - 3, 0.01)], names)
    recs[3:] = _run(np.full((steps - 3, 6), 0.05), names, weight_rms=np.full((steps - 3, 6), 0.1),
                    update_rms=np.full((steps - 3, 6), 1e-3))
    assert _flagged(diagnose_run(names, np.arange(steps), recs)) == {}


def test_a_clipped_gradient_with_zeros_is_read_at_its_norm():
    # Behind ReLUs half of a kernel's gradient is exactly zero; clipnorm=1 caps the norm of all its values.
    names = _layers(3)
    steps = 6
    recs = _clipped_run(steps, np.full(steps, 1e-3), names)
    rng = np.random.default_rng(4)
    for s in range(steps):
        g = rng.normal(size=64) * (np.arange(64) % 2)
        recs[s, 0] = record.compute(g / np.linalg.norm(g), rng.normal(size=64) * 0.1, g * 1e-4, hist_sample=None)
    lh = diagnose_run(names, np.arange(steps), recs).by_layer()["dense_00/kernel"]
    assert lh.status == "healthy" and any(r.startswith("note: its gradient norm is 1 at several") for r in lh.reasons)


# --- growth towards a scale, and the loss as evidence both ways -------------------------------------------------


def _episodes_at_every_step(names: list[str], steps: np.ndarray, records: np.ndarray, progress=None) -> set[str]:
    """Layers with a flagged episode in the diagnosis at any logged step (what a healthy run must not have)."""
    out = set()
    for s in steps:
        for lh in diagnose_run(names, steps, records, at_step=int(s), progress=progress).layers:
            if any(e["status"] in FLAGS for e in lh.episodes):
                out.add(lh.layer)
    return out


def _attention(overshoot: float) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A query kernel alone in its layer, initialised at 1e-5 next to layers at 0.1, under Adam (every update 1e-3
    of the layer's scale): its gradient rises from 1e-6 by 4 decades in 4 logged steps (its partner key kernel
    grows, and the query's gradient is proportional to it) to the reference's 1e-2 times ``overshoot``, then stays.
    """
    names = ["embed/kernel", "embed/bias", "query/kernel", "value/kernel", "head/kernel", "head/bias", "out/kernel"]
    steps = 30
    rms, weight, update = np.full((steps, 7), 1e-2), np.full((steps, 7), 0.1), np.full((steps, 7), 1e-4)
    weight[:, 1], weight[:, 5] = 0.05, 0.05
    rise = np.minimum(np.arange(steps), 4) / 4.0
    rms[:, 2] = 10.0 ** (-6.0 + rise * (4.0 + np.log10(overshoot)))
    weight[:, 2] = 1e-5 + 1e-4 * np.arange(steps)  # Adam's steps of 1e-4 move it out of its tiny init
    return names, np.arange(1, steps + 1), _run(rms, names, weight_rms=weight, update_rms=update)


def test_a_gradient_rising_from_1e_6_to_the_reference_is_a_layer_starting_to_learn():
    # Built to rise *to* the reference (overshoot 1) while the loss falls: no flag and no episode at any step.
    names, steps, records = _attention(1.0)
    falling = (steps, 2.0 * 0.97 ** steps)
    assert _episodes_at_every_step(names, steps, records, falling) == set()
    assert _episodes_at_every_step(names, steps, records) == set()  # the gradients alone say the same
    # The same rise carried 3 decades past the reference is a blow-up while it grows, whatever the loss does.
    names, steps, records = _attention(1e3)
    assert _episodes_at_every_step(names, steps, records, falling) == {"query/kernel"}
    h = diagnose_run(names, steps, records, at_step=6, progress=falling).by_layer()
    assert h["query/kernel"].status == "exploding"


def _zero_init_beta(kernel: bool) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A LayerNorm whose beta starts at exactly 0 next to its gamma at 1, in a network whose weights sit at 0.03
    (so the beta is only one decade below them after its first steps): its first Adam-like steps of 1e-2 move it by
    20x its own size at step 2, then it grows to 0.2, below its gamma. ``kernel``: the same updates on a kernel
    that is the largest variable of its layer (nothing about it starts near zero)."""
    names = ["dense_0/kernel", "dense_0/bias", "ln/gamma", "ln/beta", "dense_1/kernel", "dense_1/bias", "out/kernel"]
    steps = 20
    rms, weight, update = np.full((steps, 7), 1e-2), np.full((steps, 7), 0.03), np.full((steps, 7), 3e-4)
    weight[:, 2] = 1.0
    beta = np.minimum(5e-4 + 1e-2 * np.maximum(np.arange(steps) - 1, 0), 0.2)
    beta[0] = 0.0
    col = 4 if kernel else 3
    weight[:, col], update[1:, col] = (beta if not kernel else np.maximum(beta, 5e-4)), 1e-2
    return names, np.arange(1, steps + 1), _run(rms, names, weight_rms=weight, update_rms=update)


def test_a_zero_initialised_beta_growing_towards_its_gamma_is_growth_by_design():
    names, steps, records = _zero_init_beta(kernel=False)
    assert _episodes_at_every_step(names, steps, records) == set()
    # The same update/weight of 20 on a kernel, its layer's largest variable: the weights are blowing up.
    names, steps, records = _zero_init_beta(kernel=True)
    assert "dense_1/kernel" in _episodes_at_every_step(names, steps, records)


def _accumulating(accumulate: bool, loss_slope: float) -> tuple[list[str], np.ndarray, np.ndarray, tuple]:
    """SGD(0.1) records of a 4-layer network whose per-batch gradients share a mean direction (RMS 1e-2, half of
    it common to every batch); ``accumulate``: the recorded and applied gradient is the sum of every batch's so far
    (nothing zeroes it). The loss is built to change by ``loss_slope`` per logged step, with 1% noise."""
    names = _layers(4)
    steps, n = 40, 64
    rng = np.random.default_rng(5)
    mean = rng.standard_normal((len(names), n)) * 0.5e-2
    acc = np.zeros((len(names), n))
    out = np.empty((steps, len(names), record.NUM_FIELDS))
    for s in range(steps):
        g = mean + rng.standard_normal((len(names), n)) * 0.5e-2
        acc = acc + g if accumulate else g
        for i in range(len(names)):
            out[s, i] = record.compute(acc[i], rng.standard_normal(n) * 0.1, 0.1 * acc[i], hist_sample=None)
    st = np.arange(1, steps + 1)
    loss = (1.0 + loss_slope * st) * np.exp(np.random.default_rng(6).normal(0, 0.01, steps))
    return names, st, out, (st, loss)


def test_gradients_that_accumulate_while_the_loss_rises_are_exploding_with_the_fix():
    names, steps, records, rising = _accumulating(True, 0.03)
    h = diagnose_run(names, steps, records, progress=rising)
    assert {lh.layer for lh in h.layers if lh.status == "exploding"} == set(names)
    lh = h.by_layer()["dense_00/kernel"]
    assert "zero_grad" in lh.fixes[0] and "the loss rose" in lh.reasons[0]
    assert lh.episodes and lh.episodes[-1]["status"] == "exploding" and lh.first_step == 2
    assert h.timeline and h.timeline[0]["status"] == "exploding"


@pytest.mark.parametrize(("accumulate", "slope"), [(False, 0.03), (True, -0.01)])
def test_the_loss_is_evidence_both_ways_for_growing_updates(accumulate, slope):
    # Batches zeroed as they should be under the same rising loss: the updates do not grow. Accumulating gradients
    # while the loss falls: the loss says the network learns.
    names, steps, records, loss = _accumulating(accumulate, slope)
    assert _flagged(diagnose_run(names, steps, records, progress=loss)) == {}


def _adam_rnn() -> tuple[list[str], np.ndarray, np.ndarray]:
    """Adam records (every update 1e-3 of its layer's weights) of a recurrent body whose gradients sit 4.4
    decades above the head's, at every step."""
    names = ["rnn/kernel", "rnn/recurrent_kernel", "rnn/bias", "head/kernel", "head/bias", "out/kernel",
             "out/bias"]
    steps = 30
    rms, weight, update = np.full((steps, 7), 1e-2), np.full((steps, 7), 0.1), np.full((steps, 7), 1e-4)
    rms[:, :3] = 1e-2 * 10.0 ** 4.4
    return names, np.arange(1, steps + 1), _run(rms, names, weight_rms=weight, update_rms=update)


def test_a_loss_swinging_by_orders_of_magnitude_under_adam_is_evidence_of_a_blow_up():
    names, steps, records = _adam_rnn()
    swinging = (steps, np.where(steps % 2 == 0, 200.0, 1.0) * 2.0)  # the per-batch loss jumps 200x and back
    h = diagnose_run(names, steps, records, progress=swinging).by_layer()
    assert {n for n in names if h[n].status == "exploding"} == {"rnn/kernel", "rnn/recurrent_kernel", "rnn/bias"}
    # The same gradients with a loss that falls smoothly: Adam moves the body at the head's pace and it learns.
    falling = (steps, 2.0 * 0.97 ** steps)
    assert _flagged(diagnose_run(names, steps, records, progress=falling)) == {}


def _adam_body_then_swing(high_from: int, below_before: float) -> tuple[list[str], np.ndarray, np.ndarray, tuple]:
    """Adam records (every update 1e-3 of its layer's weights) of a recurrent body whose gradients sit 4.4 decades
    above the head's from step ``high_from`` (``below_before`` decades above it before), and a loss that falls
    smoothly until it starts jumping 200x and back at step ``SWING_FROM``."""
    names = ["rnn/kernel", "rnn/recurrent_kernel", "rnn/bias", "head/kernel", "head/bias", "out/kernel",
             "out/bias"]
    steps = np.arange(1, 31)
    rms, weight, update = np.full((30, 7), 1e-2), np.full((30, 7), 0.1), np.full((30, 7), 1e-4)
    rms[:, :3] = 1e-2 * 10.0 ** np.where(steps >= high_from, 4.4, below_before)[:, None]
    loss = 2.0 * 0.99 ** steps * np.where((steps >= SWING_FROM) & (steps % 2 == 0), 200.0, 1.0)
    return names, steps, _run(rms, names, weight_rms=weight, update_rms=update), (steps, loss)


SWING_FROM = 16


@pytest.mark.parametrize(("high_from", "below_before"), [(5, 0.0), (SWING_FROM, 2.0)])
def test_a_blow_up_confirmed_by_a_later_swinging_loss_starts_where_the_gradients_went_decades_above(
        high_from, below_before):
    # Adam keeps the body's steps at the head's pace, so its gradients 4.4 decades above the head are excused until
    # the loss starts swinging (step 16): that evidence condemns the state the body has been in since it went
    # decades above, step 5. The control sits 2 decades above (within the relative line) until the swing begins,
    # and jumps to 4.4 decades with it: its episode starts at the swing, not where it first rose.
    names, steps, records, loss = _adam_body_then_swing(high_from, below_before)
    calm = diagnose_run(names, steps, records, progress=loss, at_step=SWING_FROM - 1).by_layer()
    h = diagnose_run(names, steps, records, progress=loss).by_layer()
    for n in ("rnn/kernel", "rnn/recurrent_kernel", "rnn/bias"):
        assert calm[n].status == "healthy"
        assert h[n].status == "exploding" and h[n].first_step == high_from
    assert {n for n in names if h[n].status == "exploding"} == {"rnn/kernel", "rnn/recurrent_kernel", "rnn/bias"}


def _adam_body_kernel_later(kernel_from: int) -> tuple[list[str], np.ndarray, np.ndarray, tuple]:
    """Adam records of a recurrent body whose recurrent kernel and bias sit 4.4 decades above the head from step 1
    and whose input kernel sits 3 decades above until ``kernel_from``, 4.4 from there; the per-batch loss jumps
    200x and back from step 1 (the shape of a ReLU recurrence at orthogonal gain 3 under Adam, every variable of
    the recurrent layer measured 4 or more decades above its healthy twin from step 1)."""
    names = ["rnn/kernel", "rnn/recurrent_kernel", "rnn/bias", "head/kernel", "head/bias", "out/kernel",
             "out/bias"]
    steps = np.arange(1, 31)
    rms, weight, update = np.full((30, 7), 1e-2), np.full((30, 7), 0.1), np.full((30, 7), 1e-4)
    rms[:, 1:3] = 1e-2 * 10.0**4.4
    rms[:, 0] = 1e-2 * 10.0 ** np.where(steps >= kernel_from, 4.4, 3.0)
    loss = 2.0 * 0.99**steps * np.where(steps % 2 == 0, 200.0, 1.0)
    return names, steps, _run(rms, names, weight_rms=weight, update_rms=update), (steps, loss)


def test_a_variable_flagged_by_the_swinging_loss_starts_where_its_layer_did():
    # The swinging loss condemns the layer's blow-up; which of its variables crossed the relative line first is not
    # evidence of when it began: the input kernel's chain starts with its layer's (step 1), not where its own
    # level crossed.
    names, steps, records, loss = _adam_body_kernel_later(4)
    h = diagnose_run(names, steps, records, progress=loss)
    by = h.by_layer()
    assert {n for n in names if by[n].status == "exploding"} == {"rnn/kernel", "rnn/recurrent_kernel", "rnn/bias"}
    assert {by[n].first_step for n in ("rnn/kernel", "rnn/recurrent_kernel", "rnn/bias")} == {1}
    assert h.answer["layer"] != "rnn/kernel"  # a borrowed onset is not the cause


def test_a_variable_flagged_by_its_own_level_keeps_its_own_onset():
    # The same kernel under a smooth loss: no later evidence, nothing borrowed (here the body is not flagged at all,
    # as under Adam its steps keep the head's pace), and the head is not pulled to the body's onset.
    names, steps, records, _ = _adam_body_kernel_later(4)
    falling = (steps, 2.0 * 0.97**steps)
    assert _flagged(diagnose_run(names, steps, records, progress=falling)) == {}


def _uniform_blow_up(swinging: bool) -> tuple[list[str], np.ndarray, np.ndarray, tuple]:
    """Adam records (every update 1e-3 of its layer's weights) of a network whose every layer, the head's included,
    sits 10 decades above a healthy twin from step 1 and, with ``swinging``, jumps 3-6 decades from batch to batch
    with a loss that jumps alike (the shape of a ReLU recurrence at orthogonal gain 3 under RMSprop); without, both
    hold still and the loss falls: a network whose loss is multiplied by a constant."""
    names = ["rnn/kernel", "rnn/recurrent_kernel", "rnn/bias", "out/kernel", "out/bias"]
    steps = np.arange(1, 31)
    jump = np.random.default_rng(3).uniform(3.0, 6.0, 30) * (steps % 2 == 1) if swinging else np.zeros(30)
    rms, weight, update = np.full((30, 5), 1e8), np.full((30, 5), 0.1), np.full((30, 5), 1e-4)
    rms[:, :4] *= 10.0 ** jump[:, None]
    # the output bias's gradient is bounded (softmax minus one-hot): it holds still when the network blows up, and a
    # constant factor on the loss multiplies it with the rest
    rms[:, 4] = 0.4 if swinging else 0.4e8
    loss = 1e10 * 0.99**steps * 10.0**jump
    return names, steps, _run(rms, names, weight_rms=weight, update_rms=update), (steps, loss)


def test_gradients_swinging_by_decades_with_the_loss_under_adam_are_exploding_from_the_first_step():
    # No layer stands above the others (the head's kernel swings too) and Adam keeps every step at 1e-3: only the
    # swings say the gradients are out of control, and they began with the run.
    names, steps, records, loss = _uniform_blow_up(True)
    h = diagnose_run(names, steps, records, progress=loss).by_layer()
    assert {n for n in names if h[n].status == "exploding"} == set(names[:4])
    assert all(h[n].first_step <= 2 for n in names[:4])
    high = diagnose_run(names, steps, records, progress=loss, at_step=29).by_layer()  # a batch where they jumped
    assert any("swung by" in r for r in high["out/kernel"].reasons)


def test_uniformly_large_gradients_that_hold_still_are_not_a_blow_up():
    names, steps, records, loss = _uniform_blow_up(False)
    assert _flagged(diagnose_run(names, steps, records, progress=loss)) == {}
    # the same swinging gradients without the loss: nothing says the network is out of control
    names, steps, records, _ = _uniform_blow_up(True)
    assert _flagged(diagnose_run(names, steps, records)) == {}


def _adversarial(excursion: float) -> tuple[list[str], np.ndarray, np.ndarray, tuple]:
    """Adam records (every update 1e-3 of its layer's weights) of a generator-like network whose loss rises 40x over
    its first 10 steps (its adversary learning), then holds near 30; at step 12 every gradient and the loss move
    by ``excursion`` decades for one batch (negative: the adversary fooled, the loss near zero) and come back."""
    names = ["g0/kernel", "g0/bias", "g1/kernel", "g1/bias", "out/kernel", "out/bias"]
    steps = np.arange(1, 41)
    rms, weight, update = np.full((40, 6), 1.0), np.full((40, 6), 0.1), np.full((40, 6), 1e-4)
    rms *= 10.0 ** np.array([-2.0, -1.5, -1.5, -1.0, -0.5, 0.0])  # a GAN generator's layers, 2 decades apart
    rise = np.minimum(steps, 10) / 10.0 * np.log10(40.0)
    rms *= 10.0 ** (0.5 * rise)[:, None]
    rms[steps == 12] *= 10.0 ** excursion
    loss = 10.0 ** rise * np.where(steps == 12, 10.0 ** excursion, 1.0) * (1.0 + 0.1 * np.sin(steps))
    return names, steps, _run(rms, names, weight_rms=weight, update_rms=update), (steps, loss)


def _converged_then_rising(floor_decades: float) -> tuple[list[str], np.ndarray, np.ndarray, tuple]:
    """SGD records (update 0.05x the gradient) of a classifier whose gradients fall ``floor_decades`` below where they
    started over 30 steps, its loss with them, then rise 3 decades over the last 4 steps (the loss 100x)."""
    names = _layers(3)
    steps = np.arange(1, 41)
    fall = np.minimum(steps - 1, 30) / 30.0 * floor_decades
    rise = np.clip(steps - 36, 0, 4) * 0.75
    log_g = -1.0 - fall + rise
    rms = 10.0 ** log_g[:, None] * np.ones((1, 6)) * 10.0 ** np.array([0.0, 0.2, -0.3, -0.1, 0.3, 0.1])
    weight = np.full(rms.shape, 0.1)
    loss = 1.4 * 10.0 ** (-fall + rise * 2.0 / 3.0)
    return names, steps, _run(rms, names, weight_rms=weight, update_rms=0.05 * rms), (steps, loss)


def test_gradients_that_rise_out_of_round_off_are_no_growth():
    # A model trained to its loss's floor: every gradient 8 decades below where it started (round-off of it, as a
    # float32 loss of 1e-8 leaves), then a batch or two with a harder example lifts them 3 decades, still 5 below
    # where they started: measured from round-off, that is no blow-up.
    names, steps, records, loss = _converged_then_rising(8.0)
    for at in steps:
        assert _flagged(diagnose_run(names, steps, records, progress=loss, at_step=int(at))) == {}, at
    # The same rise from a floor well above round-off (2 decades below the start) is growth.
    names, steps, records, loss = _converged_then_rising(2.0)
    assert set(_flagged(diagnose_run(names, steps, records, progress=loss)).values()) == {"exploding"}


def test_a_batch_whose_gradients_and_loss_drop_by_decades_and_come_back_is_no_blow_up():
    # A drop is a swing too (max over min), but no gradient is out of control: neither the batch that dropped nor
    # the return to where the gradients stood is a blow-up, at any step.
    names, steps, records, loss = _adversarial(-3.0)
    for at in steps:
        h = diagnose_run(names, steps, records, progress=loss, at_step=int(at))
        assert _flagged(h) == {} and not any(lh.episodes for lh in h.layers), at
    # The twin whose batch jumps by the same decades upwards is out of control from that batch.
    names, steps, records, loss = _adversarial(3.0)
    h = diagnose_run(names, steps, records, progress=loss, at_step=12)
    assert set(_flagged(h).values()) == {"exploding"}


HEAD_NAMES = ["rnn/kernel", "rnn/recurrent_kernel", "rnn/bias", "out/kernel", "out/bias"]
HEAD_SIZES = [8 * 64, 64 * 64, 64, 64 * 5, 5]  # a 64-unit recurrence over 8 features, 5 classes


def _head_inputs(inputs: float, *, loss_factor: float = 1.0, steps: int = 20, lasting: int = 20) -> np.ndarray:
    """Adam records (every update 1e-3 of its layer's weights) of a recurrence whose activations sit at ``inputs``
    for the first ``lasting`` logged steps (1 after): every gradient behind the output bias carries them (a weight's
    gradient is its bias's times the layer's inputs), the output bias's is the loss's own (softmax minus one-hot,
    0.1); ``loss_factor`` multiplies every gradient."""
    rms = np.full((steps, 5), 1e-2) * np.where(np.arange(steps) < lasting, inputs, 1.0)[:, None]
    rms[:, 4] = 0.1
    weight, update = np.full((steps, 5), 0.1), np.full((steps, 5), 1e-4)
    return _run(rms * loss_factor, HEAD_NAMES, weight_rms=weight, update_rms=update, sizes=HEAD_SIZES)


def test_an_output_weight_gradient_decades_above_its_own_bias_is_activations_blown_up():
    # Every layer the head's kernel included sits 10 decades above a healthy twin from the first step and Adam keeps
    # each step at 1e-3: no layer stands above the reference and nothing swings, but the output kernel's gradient is
    # 1e10 times its own bias's, which only inputs of that size make.
    steps = np.arange(1, 21)
    h = diagnose_run(HEAD_NAMES, steps, _head_inputs(1e12)).by_layer()
    assert {n for n in HEAD_NAMES if h[n].status == "exploding"} == set(HEAD_NAMES[:4])
    assert all(h[n].first_step == 1 for n in HEAD_NAMES[:4])
    assert any("on their way forward" in r for r in h["out/kernel"].reasons)
    assert "on their way forward" in h["rnn/recurrent_kernel"].fixes[0]
    # the streaming view waits for the gap to last: one step of it proves nothing
    assert _flagged(diagnose_run(HEAD_NAMES, steps, _head_inputs(1e12), at_step=3)) == {}


def test_activations_blown_up_on_their_way_forward_are_blamed_where_the_forward_pass_starts():
    # Built with the recurrence's activations at 1e12: the output kernel's gradient is huge only because its inputs
    # are. Backprop reaches the output layer first, but the blow-up came from the layer before it: the answer, rank 1
    # and the timeline name the recurrence (by its largest variable), not the output kernel.
    h = diagnose_run(HEAD_NAMES, np.arange(1, 21), _head_inputs(1e12))
    assert h.answer["layer"] == h.layers[0].layer == h.timeline[0]["layer"] == "rnn/recurrent_kernel"
    assert h.layers[0].rank_reason == "cause"


@pytest.mark.parametrize("factor", [1e-6, 1e9])
def test_a_constant_loss_factor_moves_the_output_bias_with_its_weight(factor):
    steps = np.arange(1, 21)
    assert _flagged(diagnose_run(HEAD_NAMES, steps, _head_inputs(1.0, loss_factor=factor))) == {}


def test_a_few_steps_of_large_inputs_to_the_output_layer_are_not_a_blow_up():
    steps = np.arange(1, 21)
    assert _flagged(diagnose_run(HEAD_NAMES, steps, _head_inputs(1e12, lasting=3))) == {}


def test_a_model_that_is_only_its_output_layer_reads_its_data_not_activations():
    # softmax regression on raw features in the 1e5s: the weight's gradient is 1e5 times the bias's
    names, steps = ["out/kernel", "out/bias"], np.arange(1, 21)
    rms = np.tile([1e4, 0.1], (20, 1))
    records = _run(rms, names, weight_rms=np.full((20, 2), 0.1), update_rms=np.full((20, 2), 1e-4), sizes=[320, 5])
    assert _flagged(diagnose_run(names, steps, records)) == {}


def test_the_nan_origin_among_a_layers_variables_is_the_one_that_went_wrong_first():
    # The output layer's bias blows up 3 logged steps before its kernel; both (and the layer below) turn NaN at one
    # step. The answer, the timeline and every layer's origin note name one variable: the bias.
    names, steps = ["hidden/kernel", "hidden/bias", "out/kernel", "out/bias"], np.arange(1, 21)
    rms = np.full((20, 4), 1e-2)
    rms[5:, 3] *= 10.0 ** np.arange(1, 16)
    rms[8:, 2] *= 10.0 ** np.arange(1, 13)
    rms[13:] = np.nan
    records = _run(rms, names, sizes=[64 * 64, 64, 64 * 64, 64])
    h = diagnose_run(names, steps, records)
    answer = h.answer
    assert (answer["layer"], answer["now"]) == ("out/bias", "nonfinite")
    named = {m.group(1) for lh in h.layers for r in lh.reasons
             for m in [re.search(r"first layer to reach nonfinite was (\S+),", r)] if m}
    assert named == {"out/bias"}
    assert any("NaN/Inf started here" in r for r in h.by_layer()["out/bias"].reasons)


def test_an_output_bias_that_fitted_the_targets_mean_is_not_huge_inputs():
    # A regression on large targets: once the output bias has fitted their mean its gradient (the mean residual)
    # falls 4.5 decades below its kernel's, from step 8 on; the inputs did not change.
    steps = np.arange(1, 21)
    rms = np.full((20, 5), 1e-2)
    rms[:, 4] = np.where(steps < 8, 1e-2, 3e-7)  # above round-off of its own peak
    records = _run(rms, HEAD_NAMES, weight_rms=np.full((20, 5), 0.1), update_rms=np.full((20, 5), 1e-4),
                   sizes=HEAD_SIZES)
    assert _flagged(diagnose_run(HEAD_NAMES, steps, records)) == {}


#: log10 gradient RMS over the first 8 logged steps of a ReLU MLP regression (three hidden layers of 32), as measured
#: in its training, and its per-batch losses at those steps. "3e4": targets of the order of 3e4 under Adam(0.5):
#: every layer's gradient grows 2-3 decades over three steps while the weights grow to put the output on the
#: targets' scale, and the loss is flat within minibatch noise. "1e5": targets of 1e5 under Adam(1.0): the layers
#: nearest the loss grow by 1.6 decades too (the whole network grows), while the loss moves by at most 0.16 decades.
_FITS = {
    "3e4": ([[3.26, 3.21, 3.25, 3.26, 3.20, 3.34, 3.94, 4.01], [4.74, 4.87, 4.79, 4.24, 4.65, 3.54, 5.47, 3.80],
             [5.74, 5.92, 5.58, 4.93, 5.53, 3.95, 6.66, 4.13], [6.17, 5.96, 5.64, 5.35, 5.01, 4.27, 5.94, 4.36],
             [6.46, 6.87, 6.26, 5.69, 6.28, 4.55, 7.50, 4.63], [5.79, 5.97, 5.65, 5.11, 5.74, 4.26, 6.80, 4.47],
             [5.87, 6.03, 5.76, 4.96, 5.79, 3.94, 6.81, 3.94], [5.95, 6.16, 5.82, 5.08, 5.83, 4.01, 6.83, 3.64]],
            [9.26e8, 7.28e8, 9.91e8, 9.38e8, 8.06e8, 9.24e8, 4.94e8, 3.53e8]),
    "1e5": ([[3.55, 3.49, 3.66, 3.61, 3.73, 3.69, 4.37, 3.76], [6.19, 6.20, 5.96, 5.11, 5.69, 3.79, 6.70, 3.71],
             [6.91, 7.11, 6.69, 5.83, 6.60, 4.47, 7.75, 4.18], [7.50, 7.97, 7.36, 6.69, 7.37, 5.30, 8.56, 5.11],
             [6.78, 6.78, 6.47, 5.47, 6.34, 4.57, 7.46, 4.74], [6.86, 7.12, 6.79, 5.87, 6.72, 4.71, 7.82, 4.03],
             [6.74, 6.91, 6.72, 5.74, 6.65, 4.64, 7.81, 4.13], [6.76, 6.83, 6.64, 5.76, 6.67, 4.61, 7.83, 4.21]],
            [5.81e9, 7.35e9, 7.33e9, 8.41e9, 5.18e9, 7.80e9, 5.25e9, 4.25e9]),
}


def _fit_scaling_up(flat_before: int, steps: int = 30, fit: str = "3e4") -> tuple[list[str], np.ndarray, np.ndarray]:
    """Records of that regression: ``flat_before`` logged steps at its first step's scale, then the measured rise
    (``fit``), then its last measured scale held; weights grow from He's 0.24 to 1 over the rise, Adam's steps of
    0.5 then 0.2."""
    names = [f"mlp/{layer}/{k}" for layer in ("relu_0", "relu_1", "relu_2", "logits") for k in ("kernel", "bias")]
    table = np.array(_FITS[fit][0])
    rows = np.concatenate([np.repeat(table[:1], flat_before, axis=0), table])
    rows = np.concatenate([rows, np.repeat(rows[-1:], steps - len(rows), axis=0)])
    ramp = np.clip((np.arange(steps) - flat_before) / 4.0, 0.0, 1.0)[:, None]
    weight = 0.24 + 0.76 * ramp * np.ones((1, 8))
    update = np.where(ramp < 1.0, 0.5, 0.2) * np.ones((1, 8))
    sizes = [1024, 32, 1024, 32, 1024, 32, 32, 1]
    return names, np.arange(1, steps + 1), _run(10.0 ** rows, names, weight_rms=weight, update_rms=update,
                                               sizes=sizes)


def test_a_fit_scaling_up_to_large_targets_over_its_first_steps_is_not_a_blow_up():
    # Four minibatch losses whose later two sit 17% above the first two are no evidence the loss rises: the whole
    # network's gradient grows 800x with the weights that carry the output to the targets, and the loss then falls.
    names, steps, records = _fit_scaling_up(0)
    loss = (steps, np.concatenate([_FITS["3e4"][1], 3.53e8 * 0.9 ** np.arange(1, steps.size - 7)]))
    assert _episodes_at_every_step(names, steps, records, loss) == set()
    assert _episodes_at_every_step(names, steps, records) == set()


def test_a_rise_to_the_reference_while_the_loss_rises_is_flagged_once_eight_losses_say_so():
    # The query kernel rising from 1e-6 to the reference over its first 4 logged steps, the loss rising 10% per
    # logged step (1% noise): the network does not learn. Fewer than eight losses are no evidence of a trend
    # (minibatch noise moves two against two by more than 5%), so the flag comes at step 8, not before.
    names, steps, records = _attention(1.0)
    rising = (steps, 1.1 ** steps * np.exp(np.random.default_rng(3).normal(0, 0.01, steps.size)))
    flagged = [int(s) for s in steps
               if "exploding" in diagnose_run(names, steps, records, at_step=int(s), progress=rising).statuses()]
    assert flagged[0] == 8 and flagged == list(range(8, flagged[-1] + 1))


def test_a_whole_network_growing_while_its_loss_holds_is_the_fit_scaling_up():
    # Every gradient, the layers nearest the loss included, grows by decades over three steps; the loss holds (then
    # falls): no episode. The same growth while the loss jumps 30x at the step it peaks is a blow-up, and so is it
    # where no loss is recorded (the gradients alone cannot tell the two apart).
    names, steps, records = _fit_scaling_up(0, fit="1e5")
    losses = _FITS["1e5"][1]
    tail = 4.25e9 * 0.9 ** np.arange(1, steps.size - 7)
    holds = (steps, np.concatenate([losses, tail]))
    assert _episodes_at_every_step(names, steps, records, holds) == set()
    jumps = (steps, np.concatenate([losses[:3], [30 * losses[3]], losses[4:], tail]))
    assert "exploding" in diagnose_run(names, steps, records, at_step=4, progress=jumps).statuses()
    assert "exploding" in diagnose_run(names, steps, records, at_step=4).statuses()



def _swinging_recurrence(head_bias_rms: float | None) -> tuple[list[str], np.ndarray, np.ndarray, tuple]:
    """Adam records (every update 1e-3 of its layer's weights) of a recurrence whose variables and output kernel
    share one gradient size that swings over 3.5 decades from batch to batch (the signal starts at a step drawn per
    batch), the output bias at ``head_bias_rms`` (None: swinging with them); the loss swings with the gradients."""
    names = ["rnn/kernel", "rnn/recurrent_kernel", "rnn/bias", "out/kernel", "out/bias"]
    steps = np.arange(1, 61)
    swing = 10.0 ** np.random.default_rng(11).uniform(0.0, 3.5, steps.size)
    rms = np.ones((steps.size, 5)) * swing[:, None]
    if head_bias_rms is not None:
        rms[:, 4] = head_bias_rms
    weight, update = np.full((steps.size, 5), 0.1), np.full((steps.size, 5), 1e-4)
    records = _run(rms, names, weight_rms=weight, update_rms=update, sizes=[8 * 32, 32 * 32, 32, 32 * 4, 4])
    return names, steps, records, (steps, 2.0 * swing ** 1.2)


def test_gradients_of_one_size_swinging_under_adam_are_one_blow_up_from_its_start():
    # Every variable's gradient is of one size, so the spread across them cannot show that Adam rescales them; over
    # time it does: the gradients swing by decades, the updates do not. The swinging loss then carries the flag
    # over the quiet batches: one episode from the first flag to the end, not one per burst.
    # Its onset is where its swings first left the range they had before (steps 1-3 of 60).
    names, steps, records, loss = _swinging_recurrence(0.3)
    h = diagnose_run(names, steps, records, progress=loss).by_layer()
    for n in names[:4]:
        assert [(e["status"], e["to"]) for e in h[n].episodes] == [("exploding", 60)], h[n].episodes
        assert h[n].first_step <= 3


@pytest.mark.parametrize(("head_bias_rms", "answer"), [(0.3, "rnn/recurrent_kernel"), (None, "out/kernel")])
def test_an_output_kernel_exploding_beside_a_calm_bias_is_not_the_cause(head_bias_rms, answer):
    # The output kernel's gradient is its bias's times its inputs. Beside a calm bias (the loss's own gradient) it
    # is large because the recurrence's outputs are: the answer is the recurrence. With the bias swinging as well
    # (the loss's gradient itself is huge), the layer backprop reaches first is.
    names, steps, records, loss = _swinging_recurrence(head_bias_rms)
    h = diagnose_run(names, steps, records, progress=loss)
    assert h.answer["layer"] == h.layers[0].layer == answer


#: log10 gradient RMS of a ReLU MLP regression (four hidden layers of 32, targets of the order of 1e4, Adam(0.2)) at
#: its logged steps 61-80, as measured in its training, and its per-batch losses there: the output bias has fitted
#: the targets' mean (its gradient, the mean residual, sits ~3 decades below its kernel's) and the loss swings 10x
#: from batch to batch around a falling trend. Weight and update RMS per variable are the run's medians there.
_FITTED_HEAD = (
    [[4.52, 4.76, 4.61, 3.93, 4.86, 3.31, 4.78, 2.61, 6.02, 3.10],
     [4.41, 4.78, 4.58, 3.93, 4.75, 3.31, 4.63, 2.55, 5.85, 3.15],
     [4.64, 4.87, 4.82, 4.01, 5.07, 3.38, 4.99, 2.69, 6.23, 3.25],
     [4.50, 4.74, 4.70, 3.87, 4.95, 3.21, 4.88, 2.50, 6.11, 2.97],
     [4.44, 4.66, 4.48, 3.81, 4.57, 3.17, 4.41, 2.37, 5.61, 2.88],
     [4.64, 4.98, 4.76, 4.09, 4.95, 3.47, 4.87, 2.68, 6.10, 3.25],
     [4.79, 5.05, 4.85, 4.21, 5.06, 3.53, 4.96, 2.74, 6.18, 2.93],
     [4.76, 5.16, 4.99, 4.23, 5.23, 3.56, 5.17, 2.82, 6.39, 3.28],
     [4.36, 4.24, 3.97, 3.33, 3.72, 2.73, 3.60, 1.99, 4.82, 2.40],
     [4.52, 4.80, 4.64, 3.97, 4.86, 3.39, 4.77, 2.65, 5.98, 2.93],
     [4.78, 5.08, 5.07, 4.19, 5.33, 3.57, 5.26, 2.88, 6.48, 3.38],
     [4.45, 4.88, 4.69, 3.97, 4.94, 3.35, 4.86, 2.63, 6.09, 3.22],
     [4.40, 4.60, 4.37, 3.76, 4.51, 3.11, 4.34, 2.33, 5.56, 2.84],
     [4.67, 5.00, 4.83, 4.07, 5.06, 3.39, 5.01, 2.65, 6.22, 3.19],
     [4.96, 5.29, 5.25, 4.37, 5.49, 3.70, 5.43, 2.95, 6.65, 3.40],
     [4.46, 4.63, 4.47, 3.72, 4.66, 3.08, 4.57, 2.35, 5.78, 2.68],
     [4.59, 4.98, 4.74, 4.09, 4.98, 3.48, 4.91, 2.76, 6.13, 3.35],
     [4.71, 5.00, 4.92, 4.11, 5.14, 3.49, 5.08, 2.80, 6.30, 3.38],
     [4.51, 4.91, 4.67, 4.06, 4.89, 3.43, 4.82, 2.74, 6.03, 3.21],
     [4.43, 4.67, 4.50, 3.76, 4.73, 3.13, 4.67, 2.44, 5.89, 3.00]],
    [2.28e6, 1.42e6, 3.94e6, 1.81e6, 8.92e5, 2.27e6, 2.81e6, 3.37e6, 6.98e5, 1.97e6, 7.01e6, 1.53e6, 9.93e5, 2.17e6,
     6.29e6, 1.15e6, 2.70e6, 5.26e6, 2.69e6, 1.33e6],
)


def test_an_output_kernel_far_above_its_fitted_bias_is_not_a_gradient_grown_on_its_way_back():
    # The output kernel sits about 3 decades above its bias (the layers nearest the loss) while the loss swings: the
    # relative rule would read a gradient grown on its way back from the loss, but nothing lies between the output
    # layer and the loss. Its gap to its bias is its inputs' scale, read by the rule for huge inputs (silent here:
    # the bias has fitted the targets' mean). No episode at any step.
    names = [f"mlp/{layer}/{k}" for layer in ("relu_0", "relu_1", "relu_2", "relu_3", "logits")
             for k in ("kernel", "bias")]
    weight = 10.0 ** np.array([0.11, 0.12, 0.13, 0.02, 0.07, 0.16, 0.03, 0.18, -0.13, -0.64])
    update = weight * 10.0 ** np.array([-1.78, -2.06, -2.12, -2.23, -2.01, -2.05, -1.90, -1.96, -1.60, -1.24])
    rows = np.array(_FITTED_HEAD[0])
    sizes = [1024, 32, 1024, 32, 1024, 32, 1024, 32, 32, 1]
    records = _run(10.0 ** rows, names, weight_rms=np.tile(weight, (len(rows), 1)),
                   update_rms=np.tile(update, (len(rows), 1)), sizes=sizes)
    steps = np.arange(61, 81)
    assert _episodes_at_every_step(names, steps, records, (steps, np.array(_FITTED_HEAD[1]))) == set()


def _output_kernel_growing_alone(factor: float) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Two dense layers at 1e-3 for 24 logged steps, except the output kernel, whose gradient is multiplied by
    ``factor`` a step from step 14 on while its bias stays where it was."""
    names = ["dense_0/kernel", "dense_0/bias", "dense_1/kernel", "dense_1/bias"]
    rms = np.full((24, 4), 1e-3)
    rms[14:, 2] *= factor ** np.arange(1, 11)
    return names, np.arange(24), _run(rms, names, sizes=[64, 8, 64, 8])


def test_an_output_kernel_whose_gradient_grows_alone_is_exploding_from_where_it_began():
    # Grown a million-fold in ten steps beside its calm bias, with nothing else moving: the output kernel is one of
    # the layers nearest the loss, but it has outgrown the others and the network. The same run with the kernel held
    # where it was has no episode.
    names, steps, records = _output_kernel_growing_alone(4.0)
    h = diagnose_run(names, steps, records)
    assert _flagged(h) == {"dense_1/kernel": "exploding"}
    assert h.onset["layer"] == "dense_1/kernel" and h.onset["step"] == 14
    names, steps, records = _output_kernel_growing_alone(1.0)
    assert _episodes_at_every_step(names, steps, records) == set()


def test_an_output_bias_that_joins_a_blow_up_later_does_not_move_the_cause_to_the_head():
    # A learning-rate divergence: the hidden and output kernels blow up together at step 20 while the output bias
    # (the loss's own gradient) is calm; it joins a step later. At every step the answer names the hidden layer:
    # the head's weight was large because its inputs were, and its bias joining later says nothing of step 20.
    names = ["hidden/kernel", "hidden/bias", "out/kernel", "out/bias"]
    steps = 26
    rms = np.full((steps, 4), 1e-2)
    rms[20:, :3] *= 1e3 * 10.0 ** np.arange(0, 6)[:, None]
    rms[21:, 3] *= 1e3 * 10.0 ** np.arange(0, 5)
    recs = _run(rms, names, sizes=[64, 8, 64, 8])
    answers = {at: diagnose_run(names, np.arange(steps), recs, at_step=at).answer for at in range(20, steps)}
    assert {a["layer"] for a in answers.values()} == {"hidden/kernel"}, answers
    assert {a["step"] for a in answers.values()} == {20}
