"""The record's layout is defined once: a copy of the package with a field added to ``record.VALUE_FIELDS`` (in
the middle, so every later field moves) computes the same records on every path, field by field and by name,
with the new field at its default. A writer that stacked values by position would put them in the wrong
columns here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_PROBE = textwrap.dedent('''
    import numpy as np
    import tensorflow as tf
    from tb_gradhealth import record, summary

    assert record.VALUE_FIELDS[3] == "scratch", record.VALUE_FIELDS
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(n).astype(np.float32) for n in (7, 5000, 300_000)]
    grads[1][[3, 9]] = [np.nan, np.inf]
    weights = [rng.standard_normal(g.shape).astype(np.float32) for g in grads]
    ref = np.stack([record.compute(g, w, hist_sample=None) for g, w in zip(grads, weights)])
    jit_step = tf.function(lambda g, w: summary.compute(g, w), jit_compile=True)
    paths = {
        "packed": lambda g, w: summary.compute(g, w),
        "per_layer": lambda g, w: summary.compute(g, w, jit=False),
        "packed_in_user_jit": jit_step,
    }
    for path, compute in paths.items():
        rec = compute([tf.constant(g) for g in grads], [tf.constant(w) for w in weights])
        rows = record.from_device(rec.counts.numpy(), rec.values.numpy())
        assert rows.shape == ref.shape, (path, rows.shape)
        assert np.all(rows[:, record.INDEX["scratch"]] == record.value_defaults()["scratch"]), path
        for name in record.COUNT_FIELDS + ("min", "max", "missing"):
            np.testing.assert_array_equal(rows[:, record.INDEX[name]], ref[:, record.INDEX[name]], err_msg=path + name)
        for name in ("mean", "ssq_rel", "weight_max_abs", "weight_ssq_rel"):
            np.testing.assert_allclose(rows[:, record.INDEX[name]], ref[:, record.INDEX[name]], rtol=1e-5,
                                       err_msg=path + name)
        for name in ("update_max_abs", "micro_batches", "noise_ssq_rel"):
            assert np.isnan(rows[:, record.INDEX[name]]).all(), path + name
        np.testing.assert_allclose(rows[:, record.HIST_START:].sum(1), ref[:, record.INDEX["hist_sample"]], rtol=1e-5)
        assert record.check_disk(record.to_disk(rows))[1] == {}, path
        print(path, "follows")
''')


_OTHER_PROBE = textwrap.dedent('''
    import sys
    import numpy as np
    from tb_gradhealth import record
    framework = sys.argv[1]
    rng = np.random.default_rng(0)
    grads = {f"l{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate((7, 5000, 300_000))}
    grads["l1"][[3, 9]] = [np.nan, np.inf]
    weights = {k: rng.standard_normal(g.shape).astype(np.float32) for k, g in grads.items()}
    ref = np.stack([record.compute(grads[k], weights[k], hist_sample=None) for k in grads])
    if framework == "torch":
        import torch
        from tb_gradhealth import torch as tgh
        rows = tgh.to_memory(tgh.compute({k: torch.from_numpy(g) for k, g in grads.items()},
                                         {k: torch.from_numpy(w) for k, w in weights.items()}))
    else:
        import jax.numpy as jnp
        from tb_gradhealth import jax as tgj
        rows = tgj.to_memory(tgj.compute({k: jnp.asarray(g) for k, g in grads.items()},
                                         {k: jnp.asarray(w) for k, w in weights.items()}))
    assert rows.shape == ref.shape, rows.shape
    assert np.all(rows[:, record.INDEX["scratch"]] == record.value_defaults()["scratch"])
    for name in record.COUNT_FIELDS + ("min", "max", "missing"):
        np.testing.assert_array_equal(rows[:, record.INDEX[name]], ref[:, record.INDEX[name]], err_msg=name)
    for name in ("mean", "ssq_rel", "weight_max_abs", "weight_ssq_rel"):
        np.testing.assert_allclose(rows[:, record.INDEX[name]], ref[:, record.INDEX[name]], rtol=1e-5, err_msg=name)
    for name in ("update_max_abs", "micro_batches", "noise_ssq_rel"):
        assert np.isnan(rows[:, record.INDEX[name]]).all(), name
    assert record.check_disk(record.to_disk(rows))[1] == {}
    print(framework, "follows")
''')


def _run_in_scratch_copy(tmp_path: Path, code: str, *args: str) -> str:
    """Run ``code`` in a fresh process against a copy of the package whose ``VALUE_FIELDS`` gained ``scratch``
    after ``mean``; its standard output."""
    pkg = tmp_path / "tb_gradhealth"
    shutil.copytree(ROOT / "tb_gradhealth", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    source = (pkg / "record.py").read_text()
    added = source.replace('    "mean",\n', '    "mean",\n    "scratch",\n', 1)
    assert added != source, "record.VALUE_FIELDS no longer lists one field per line"
    (pkg / "record.py").write_text(added)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.tf
@pytest.mark.e2e
def test_a_field_added_to_the_layout_moves_every_tf_path_with_it(tmp_path):
    out = _run_in_scratch_copy(tmp_path, _PROBE)
    assert out.split() == ["packed", "follows", "per_layer", "follows", "packed_in_user_jit", "follows"]


@pytest.mark.torch
@pytest.mark.e2e
def test_a_field_added_to_the_layout_moves_the_torch_path_with_it(tmp_path):
    pytest.importorskip("torch")
    assert _run_in_scratch_copy(tmp_path, _OTHER_PROBE, "torch").split() == ["torch", "follows"]


@pytest.mark.jax
@pytest.mark.e2e
def test_a_field_added_to_the_layout_moves_the_jax_path_with_it(tmp_path):
    pytest.importorskip("jax")
    assert _run_in_scratch_copy(tmp_path, _OTHER_PROBE, "jax").split() == ["jax", "follows"]
