"""Where the first NaN/Inf was made, in Keras ``fit`` and custom TensorFlow loops (with and without XLA).

Every case injects one fault at a known place (tests/nan_cases_tf.py: the op, the layer, the direction and the
marked source line) into the samples of one batch; the answer must name exactly that, at that step, and be stored
in the run so that ``tb-gradhealth report`` shows it. Mixed precision with loss scaling handles a float16 overflow
itself: no origin is reported and the weights stay finite.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = [pytest.mark.tf]

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tb_gradhealth import cli, origin, summary  # noqa: E402
from tb_gradhealth.keras import GradientHealthCallback  # noqa: E402
from tb_gradhealth.tf_origin import OriginFinder, apply_if_finite  # noqa: E402
from tests import nan_cases_tf as cases  # noqa: E402


def check(found: origin.NanOrigin, case: cases.Case, line: int) -> None:
    where = __file__ if case.input_nan else cases.__file__
    cases.nan_faults.assert_names_the_fault(found, case, where, line)


def fit(case: cases.Case, log_dir: str, record_updates: bool = True, update_freq: int = 1,
        compile_statistics: bool | None = None, **kw) -> GradientHealthCallback:
    case.model.compile(optimizer=keras.optimizers.SGD(0.01), loss=case.loss, **kw)
    cb = GradientHealthCallback(log_dir, update_freq=update_freq, stop_on="nonfinite",
                                record_updates=record_updates, compile_statistics=compile_statistics)
    how = dict(batch_size=cases.BATCH, epochs=1, shuffle=False, verbose=0)
    case.model.fit(case.x, case.y, callbacks=[cb], **how)  # fault: fit
    return cb


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("name", list(cases.CASES))
def test_keras_fit_names_the_origin(name, jit, tmp_path):
    case = cases.CASES[name]()
    cb = fit(case, str(tmp_path), jit_compile=jit)
    line = (cases.fault_line(name) if not case.input_nan
            else next(i for i, t in enumerate(open(__file__).read().splitlines(), 1) if t.endswith("# fault: fit")))
    check(cb.origin, case, line)
    assert cb.stop_event is not None and cb.stop_event.step == cases.FAULT_STEP
    assert cb.stop_event.origin is cb.origin and cb.origin.message() in cb.stop_event.message()
    # the non-finite step's update was undone: the weights are finite and training stopped there
    assert all(np.isfinite(w).all() for w in case.model.get_weights())
    assert [o.to_json() for o in cases.nan_faults.stored(tmp_path / "train")] == [cb.origin.to_json()]
    assert "train_step" not in vars(case.model)  # the train step that returned its batch is gone after fit


@pytest.mark.parametrize("compiled", [None, False], ids=["xla_program", "plain_ops_in_blocks"])
def test_keras_fit_puts_the_weights_back_when_recording_after_the_step(tmp_path, compiled):
    """Logging every third step, the record is computed after the step from the weights read before it: those are
    what the step's non-finite update is undone with (whole-model XLA statistics, or plain ops block by block)."""
    case = cases.CASES["sqrt"]()
    cb = fit(case, str(tmp_path), update_freq=cases.FAULT_STEP, compile_statistics=compiled, jit_compile=False)
    assert cb._capture.after_step and cb._capture.compiled is (compiled is None)
    check(cb.origin, case, cases.fault_line("sqrt"))
    assert cb.stop_event is not None and cb.stop_event.step == cases.FAULT_STEP
    assert all(np.isfinite(w).all() for w in case.model.get_weights())


@pytest.mark.parametrize("setup", [dict(steps_per_execution=2), dict(record_updates=False)], ids=["spe2", "no-copy"])
def test_keras_fit_says_plainly_when_it_cannot_replay(setup, tmp_path):
    """Two steps a call (only the last one's batch could be returned), or no copy of the weights to put back."""
    case = cases.CASES["sqrt"]()
    cb = fit(case, str(tmp_path), jit_compile=False, **setup)
    assert cb.origin is not None and not cb.origin.found and cb.origin.step == cases.FAULT_STEP
    assert cb.origin.reason and cb.origin.message() in cb.stop_event.message()
    assert [o.to_json() for o in cases.nan_faults.stored(tmp_path / "train")] == [cb.origin.to_json()]


def test_report_shows_the_origin(tmp_path, capsys):
    case = cases.CASES["exp"]()
    fit(case, str(tmp_path))
    cli.main(["report", str(tmp_path)])
    text = capsys.readouterr().out
    assert "NaN/Inf made at step 3 in layer 'softmax' (Exp, forward) - nan_cases_tf.py:" in text
    cli.main(["report", str(tmp_path), "--json"])
    body = json.loads(capsys.readouterr().out)["runs"][0]["nan_origin"]
    assert (body["op"], body["layer"], body["direction"], body["line"]) == ("Exp", "softmax", "forward",
                                                                           cases.fault_line("exp"))


def custom_loop(case: cases.Case, log_dir: str, jit: bool) -> OriginFinder:
    model, loss = case.model, case.loss
    variables = model.trainable_variables
    opt = keras.optimizers.SGD(0.01)
    opt.build(variables)

    def loss_fn(x, y):
        return loss(y, model(x, training=True))  # fault: loop-forward

    @tf.function(jit_compile=jit)
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss_fn(x, y)
        grads = tape.gradient(value, variables)
        rec = summary.compute(list(zip(grads, variables, strict=True)))
        apply_if_finite(opt, zip(grads, variables, strict=True), rec)
        return rec

    finder = OriginFinder(loss_fn, variables, log_dir, root=model)
    for i, (x, y) in enumerate(cases.batches(case), 1):
        if finder.check(i, step(x, y), x, y) is not None:
            break
    return finder


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("name", list(cases.CASES))
def test_custom_loop_names_the_origin(name, jit, tmp_path):
    case = cases.CASES[name]()
    finder = custom_loop(case, str(tmp_path), jit)
    line = (cases.fault_line(name) if not case.input_nan
            else next(i for i, t in enumerate(open(__file__).read().splitlines(), 1)
                      if t.endswith("# fault: loop-forward")))
    check(finder.origin, case, line)
    assert all(np.isfinite(v.numpy()).all() for v in case.model.trainable_variables)
    assert [o.step for o in cases.nan_faults.stored(tmp_path)] == [cases.FAULT_STEP]


def test_mixed_precision_overflow_is_not_an_origin(tmp_path):
    """float16 gradients overflow under the initial loss scale (2**15): LossScaleOptimizer skips those steps and
    lowers the scale; no non-finite gradient is ever applied, so none is recorded and no origin is looked for."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = cases.nan_faults.data()
        model = cases._model([])
        y = y * 1e3  # a squared error of ~1e6, times the loss scale: far above float16's 65504
        model.compile(optimizer=keras.optimizers.SGD(1e-9), loss="mse", jit_compile=False)
        scale0 = float(model.optimizer.initial_scale)
        cb = GradientHealthCallback(str(tmp_path), update_freq=1, stop_on="nonfinite")
        model.fit(x, y, batch_size=cases.BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
        assert float(model.optimizer.dynamic_scale.numpy()) < scale0  # the overflow happened and was skipped
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert cb.origin is None and cb.stop_event is None
    assert cases.nan_faults.stored(tmp_path / "train") == []
    assert all(np.isfinite(w).all() for w in model.get_weights())
