"""Every gradient-health step is kept by a plain ``tensorboard --logdir DIR``, with no flag.

TensorBoard's loaders keep 100 tensors per tag (Rust data server) or 10 (``--load_fast=false``) for a plugin without
a ``--samples_per_plugin`` entry; unless the user gave a value, the package's loader makes the plugin read the event
files itself (the data server keeps one record per tag, ``gradhealth=1``) or, when TensorBoard does not serve one
logdir, sets ``gradhealth=0``. Checked on a real ``tensorboard`` process started through the installed entry point,
with each loader: a NaN that starts at step 637 of 1,000 is reported at 637, a single Inf step at 500 is found, a
100-step run is not called sampled, and the user's own ``--samples_per_plugin=gradhealth=N`` still wins.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from tensorboard.plugins import base_plugin
from test_tensorboard_process import TensorBoardProcess, _installed_entry_point

from tb_gradhealth import (
    plugin,
    record,
    testing,
)

LAYERS = ["dense_0/kernel", "dense_0/bias", "dense_1/kernel"]
STEPS = 1000
NAN_STEP = 637
INF_STEP = 500


def _rows(rng: np.random.Generator, steps: int, nan_from: int | None = None, inf_at: int | None = None) -> np.ndarray:
    """Memory-form records of small Gaussian gradients; the last layer NaN from ``nan_from`` on, or +Inf at the
    single step ``inf_at``."""
    out = np.empty((steps, len(LAYERS), record.NUM_FIELDS))
    for s in range(steps):
        for j in range(len(LAYERS)):
            g = rng.normal(0.0, 1e-3, size=32)
            if j == len(LAYERS) - 1 and ((nan_from is not None and s >= nan_from) or s == inf_at):
                g[0] = np.nan if nan_from is not None else np.inf
            out[s, j] = record.compute(g, hist_sample=None)
    return out


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("default_sampling")
    rng = np.random.default_rng(0)
    steps = list(range(STEPS))
    testing.write_records(str(d / "nan637"), LAYERS, steps, _rows(rng, STEPS, nan_from=NAN_STEP))
    testing.write_records(str(d / "inf500"), LAYERS, steps, _rows(rng, STEPS, inf_at=INF_STEP))
    testing.write_records(str(d / "short100"), LAYERS, steps[:100], _rows(rng, 100))
    return str(d)


@pytest.fixture(scope="module", params=[(), ("--load_fast=false",)], ids=["rust_data_server", "python_loader"])
def tensorboard(request, logdir, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("default_sampling_cwd")
    _installed_entry_point(cwd)
    tb = TensorBoardProcess(logdir, tmp_path_factory.mktemp("default_sampling_log") / "tb.log", cwd,
                            flags=request.param)
    try:
        yield tb
    finally:
        tb.stop()


def _loaded(tb: TensorBoardProcess) -> dict:
    def check():
        runs = {r["run"]: r for r in tb.get_json("/data/plugin/gradhealth/runs")["runs"]}
        done = {"nan637": STEPS - 1, "inf500": STEPS - 1, "short100": 99}
        return runs if all(runs.get(k, {}).get("last_step") == v for k, v in done.items()) else None

    return tb.wait_until("every run to be loaded to its last step", check)


@pytest.mark.e2e
@pytest.mark.e2e
@pytest.mark.slow
def test_plain_tensorboard_keeps_every_step(tensorboard):
    runs = _loaded(tensorboard)
    for name, n in (("nan637", STEPS), ("inf500", STEPS), ("short100", 100)):
        assert runs[name]["num_steps"] == n, runs[name]
        assert runs[name]["sample_limit"] is None, runs[name]
        assert runs[name]["maybe_downsampled"] is False, runs[name]

    nan = tensorboard.get_json("/data/plugin/gradhealth/health?run=nan637")
    assert nan["summary"]["first_bad"] == {"layer": LAYERS[-1], "status": "nonfinite", "step": NAN_STEP}
    top = nan["layers"][0]
    assert (top["layer"], top["status"], top["first_step"]) == (LAYERS[-1], "nonfinite", NAN_STEP)

    inf = tensorboard.get_json("/data/plugin/gradhealth/health?run=inf500")
    layer = next(lh for lh in inf["layers"] if lh["layer"] == LAYERS[-1])
    assert any(f"first at step {INF_STEP}, last at step {INF_STEP}" in r for r in layer["reasons"]), layer
    series = tensorboard.get_json(f"/data/plugin/gradhealth/series?run=inf500&layer={LAYERS[-1]}")
    assert series["total_steps"] == STEPS
    inf_steps = [s for s, v in zip(series["steps"], series["fields"]["inf"], strict=True) if v]
    assert inf_steps == [INF_STEP], inf_steps


@pytest.mark.e2e
@pytest.mark.e2e
@pytest.mark.slow
def test_the_users_own_sample_limit_wins(logdir, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("user_limit_cwd")
    tb = TensorBoardProcess(logdir, tmp_path_factory.mktemp("user_limit_log") / "tb.log", cwd,
                            flags=("--samples_per_plugin", "gradhealth=50"))
    try:
        runs = _loaded(tb)
        assert runs["nan637"]["num_steps"] == 50 and runs["nan637"]["sample_limit"] == 50, runs["nan637"]
        assert runs["nan637"]["maybe_downsampled"] is True
    finally:
        tb.stop()


def _flags(samples, **more) -> argparse.Namespace:
    return argparse.Namespace(samples_per_plugin=samples, **more)


@pytest.mark.unit
@pytest.mark.parametrize("given, expected", [
    ({}, {"gradhealth": 0}),
    ("", {"gradhealth": 0}),
    ({"images": 5}, {"images": 5, "gradhealth": 0}),
    ({"gradhealth": 7}, {"gradhealth": 7}),
    ("gradhealth=3,scalars=9", {"gradhealth": 3, "scalars": 9}),
    (None, {"gradhealth": 0}),
])
@pytest.mark.unit
def test_fix_flags_sets_only_a_missing_value(given, expected):
    flags = _flags(given)
    plugin.GradHealthLoader().fix_flags(flags)
    assert flags.samples_per_plugin == expected
    assert not getattr(flags, plugin.READ_FILES, False)


@pytest.mark.unit
@pytest.mark.parametrize("more, expected, reads_files", [
    ({"logdir": "/some/logdir"}, {"gradhealth": 1}, True),
    ({"logdir": "", "logdir_spec": "a:/x,b:/y"}, {"gradhealth": 0}, False),
    ({"logdir": "/some/logdir", "grpc_data_provider": "localhost:6806"}, {"gradhealth": 0}, False),
])
def test_one_logdir_is_read_from_its_files_and_the_data_server_keeps_one_record(more, expected, reads_files):
    flags = _flags({}, **more)
    plugin.GradHealthLoader().fix_flags(flags)
    assert flags.samples_per_plugin == expected
    assert getattr(flags, plugin.READ_FILES) is reads_files
    given = _flags({"gradhealth": 0}, **more)  # the user's own value: the data server serves every record
    plugin.GradHealthLoader().fix_flags(given)
    assert given.samples_per_plugin == {"gradhealth": 0} and not getattr(given, plugin.READ_FILES, False)


@pytest.mark.unit
@pytest.mark.unit
def test_fix_flags_leaves_programs_without_the_flag_alone():
    flags = argparse.Namespace()
    plugin.GradHealthLoader().fix_flags(flags)
    assert not hasattr(flags, "samples_per_plugin")
    with pytest.raises(base_plugin.FlagsError, match="plugin=N"):
        plugin.GradHealthLoader().fix_flags(_flags("gradhealth=x"))


@pytest.mark.unit
@pytest.mark.unit
def test_tensorboard_program_applies_the_default_before_building_the_loader():
    """``program.TensorBoard.configure`` parses the real flag (a dict) and calls our fix_flags."""
    from tensorboard import default, program

    tb = program.TensorBoard(plugins=default.get_plugins() + [plugin.GradHealthLoader])
    tb.configure(argv=[None, "--logdir", "/nonexistent"])
    assert tb.flags.samples_per_plugin == {"gradhealth": 1}  # the plugin reads the event files itself
    assert getattr(tb.flags, plugin.READ_FILES) is True
    tb.configure(argv=[None, "--logdir", "/nonexistent", "--samples_per_plugin", "images=3,gradhealth=12"])
    assert tb.flags.samples_per_plugin == {"images": 3, "gradhealth": 12}
