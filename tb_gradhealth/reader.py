"""Gradient-health summaries → one :class:`RunSeries` per run (its forward records beside, an
:class:`ActivationSeries`), from a TensorBoard data provider or a logdir.

Two sources share one assembly (:func:`assemble`): the plugin reads through ``context.data_provider`` (whichever
loader TensorBoard runs: the Rust data server or the Python multiplexer; :class:`ProviderReader`), and the CLI reads
event files directly (:func:`read_logdir`), so a CI job needs no server. Neither imports TensorFlow: the logdir
reader parses TFRecord framing itself, because TensorBoard's ``event_file_loader`` goes through
``tensorboard.compat.tf``, which imports TensorFlow whenever it is installed.

What can go wrong in a logdir is reported, never raised: an unreadable tag metadata, a record of a future format
version, a tensor of the wrong shape, a corrupt or truncated event file each become a line in ``problems`` and the
rest of the run is still read. A file that ends in a partial record (a writer mid-write, or a truncated copy) is
read up to that record.

This module is where users and the package import all of it from; each job lives in a module of its own: the
assembly (:mod:`tb_gradhealth._assembly`), the data-provider source and its cache
(:mod:`tb_gradhealth._providerreader`), the logdir source (:mod:`tb_gradhealth._logdirreader`), and the streams'
series names (:mod:`tb_gradhealth._streams`).
"""

from __future__ import annotations

from tb_gradhealth._assembly import (
    CHECK_CHUNK,
    ActivationSeries,
    RunSeries,
    TagData,
    TagPoint,
    assemble,
    new_records,
    supersede,
)
from tb_gradhealth._assembly import (
    _merge_order as _merge_order,
)
from tb_gradhealth._logdirreader import (
    LogdirData,
    add_event,
    find_runs,
    is_event_file,
    orphan_problems,
    read_logdir,
    read_run_dir,
)
from tb_gradhealth._providerreader import (
    LISTING_TTL_S,
    PROVIDER_ERRORS,
    PYTHON_LOADER_DEFAULT,
    READ_BUDGET_BYTES,
    RUST_LOADER_DEFAULT,
    SAMPLE_ALL,
    WORST_ROW_BYTES,
    ProviderError,
    ProviderReader,
    read_groups,
    sampling,
    tag_bytes,
)
from tb_gradhealth._streams import PRIMARY_STREAM, parse_series, run_of, series_name, split_streams, stream_of

__all__ = [
    "CHECK_CHUNK", "LISTING_TTL_S", "PRIMARY_STREAM", "PROVIDER_ERRORS", "PYTHON_LOADER_DEFAULT", "READ_BUDGET_BYTES",
    "RUST_LOADER_DEFAULT", "SAMPLE_ALL", "WORST_ROW_BYTES", "ActivationSeries", "LogdirData", "ProviderError",
    "ProviderReader", "RunSeries", "TagData", "TagPoint", "add_event", "assemble", "find_runs", "is_event_file",
    "new_records", "orphan_problems", "parse_series", "read_groups", "read_logdir", "read_run_dir", "run_of",
    "sampling", "series_name", "split_streams", "stream_of", "supersede", "tag_bytes",
]
