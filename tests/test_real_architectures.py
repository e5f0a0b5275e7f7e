"""Networks nobody here designed: one ``fit`` of each ``keras.applications`` family with the callback at every step.

The check is the recorder's promise, not the diagnosis: training completes, and every record written passes the
readers' checks (:func:`tb_gradhealth.record.check_disk`, through :func:`tb_gradhealth.reader.read_logdir`).
VGG16 at 32x32 is where a sparse gradient's sampled histogram once failed its own check and ended ``fit``: its
last blocks see a 2x2 feature map, and most of their gradient is exactly zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tb_gradhealth import reader, record

pytestmark = [pytest.mark.tf, pytest.mark.slow]
#: Bound by tests/conftest.py when a test here runs, never at collection: ``tf`` and these names.
TF_IMPORTS = {"keras": "keras", "GradientHealthCallback": "tb_gradhealth.keras:GradientHealthCallback"}
tf: Any = None
keras: Any = None
GradientHealthCallback: Any = None

#: ``(application, smallest input side it builds at)``: the smallest model of four families (VGG19 is VGG16 with
#: three more convolutions of the same kinds; DenseNet121 and ConvNeXtTiny pass too, but would take CI past its
#: time budget).
MODELS = [("VGG16", 32), ("ResNet50", 32), ("MobileNetV2", 32), ("EfficientNetB0", 32)]


@pytest.mark.parametrize(("name", "side"), MODELS, ids=[m for m, _ in MODELS])
def test_one_fit_of_a_real_architecture_writes_only_consistent_records(tmp_path, name, side):
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(side, side, 3), classes=4)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, side, side, 3)).astype("float32")
    y = rng.integers(0, 4, 32)
    cb = GradientHealthCallback(str(tmp_path), update_freq=1, seed=0)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    assert len(history.history["loss"]) == 1 and cb.dropped_records == 0
    (run,) = reader.read_logdir(str(tmp_path)).runs
    assert run.steps.tolist() == [1, 2]
    assert run.problems == (), run.problems
    assert len(run.layers) == len(model.trainable_variables)
    assert not np.isnan(run.records[..., record.INDEX["size"]]).any()
