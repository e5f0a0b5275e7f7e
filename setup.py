"""Packaging for ``tb-gradhealth``: the writer library, the TensorBoard plugin and the ``tb-gradhealth`` CLI.

Why a plain setup.py: the dashboard is plain ES modules in top-level ``frontend/`` with no build step, so packaging
only has to copy them. ``package_dir`` maps the (data-only) package ``tb_gradhealth.static`` onto ``frontend/``,
so ``pip install .`` and a built wheel both carry the files as ``tb_gradhealth/static/**`` with no node, no npm and
no custom build command. An editable install (``pip install -e .``) has no ``static/`` folder; the plugin then serves
``frontend/`` straight from the checkout (``tb_gradhealth.plugin._static_dir``), so edits show without reinstalling.

TensorFlow is an extra: the plugin, the CLI and the numpy ``Writer`` never import it; so are PyTorch and JAX.
"""

import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def read_version() -> str:
    """The single source of the version is ``tb_gradhealth/__init__.py`` (read as text: importing it needs deps)."""
    text = (HERE / "tb_gradhealth" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    if not match:
        raise RuntimeError("no __version__ in tb_gradhealth/__init__.py")
    return match.group(1)


def read_long_description() -> str:
    readme = HERE / "README.md"
    return readme.read_text(encoding="utf-8") if readme.exists() else ""


#: The TensorFlow / Keras range the TF writers support: CI runs their tests on the oldest (tensorflow 2.16.2, keras
#: 3.0.5) and the newest of it; the private TF/Keras internals they use are listed in tb_gradhealth/_tf/compat.py.
TF_REQUIREMENTS = ["tensorflow>=2.16,<2.22", "keras>=3.0,<3.16"]
#: The same range with TensorFlow's CPU-only build (no CUDA libraries: a smaller, faster install where no GPU is used;
#: the README's first command and CI install this one).
#: tests/test_docs.py checks that both name the same range.
TF_CPU_REQUIREMENTS = ["tensorflow-cpu>=2.16,<2.22", "keras>=3.0,<3.16"]

#: (``junitparser``: the CLI's JUnit XML is read back as CI servers read it; ``build``: the wheel and sdist checks.)
TEST = ["pytest", "pytest-xdist", "playwright", "ruff", "hypothesis", "fsspec", "gcsfs", "s3fs", "moto[server]",
        "gcp-storage-emulator", "junitparser", "build"]

#: Test-only libraries of the torch and jax tiers: the loops the integrations plug into, the peers the overhead
#: benchmark compares with.
INTEGRATIONS = ["lightning>=2.2", "transformers>=4.46", "accelerate", "optax", "flax"]

#: Files of frontend/ that the browser may load; anything else there (notes, tests) stays out of the package.
STATIC_PATTERNS = [f"**/*.{ext}" for ext in ("js", "mjs", "css", "html", "svg", "png", "json")]

setup(
    name="tb-gradhealth",
    version=read_version(),
    description="Per-layer gradient health for TensorBoard: records, diagnosis (vanishing/exploding/NaN) and a tab",
    long_description=read_long_description(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["tb_gradhealth", "tb_gradhealth._tf", "tb_gradhealth.health", "tb_gradhealth.static"],
    package_dir={"tb_gradhealth": "tb_gradhealth", "tb_gradhealth.static": "frontend"},
    # The C source of the CPU statistics, compiled on first use by tb_gradhealth/_cpustats.py (the wheel stays pure).
    package_data={"tb_gradhealth": ["_cpustats.c"], "tb_gradhealth.static": STATIC_PATTERNS},
    include_package_data=False,
    zip_safe=False,
    install_requires=["tensorboard>=2.12", "numpy", "werkzeug", "google-crc32c"],
    extras_require={
        "tf": TF_REQUIREMENTS,
        "tf-cpu": TF_CPU_REQUIREMENTS,
        # Kept for old install commands: google-crc32c is now a dependency (the reader checks every data checksum).
        "fast": [],
        # Logdirs on object storage (tb_gradhealth/_storage.py): fsspec with its GCS or S3 backend, imported lazily.
        "gcs": ["fsspec", "gcsfs"],
        "s3": ["fsspec", "s3fs"],
        # Device-side records for PyTorch (tb_gradhealth.torch) and JAX (tb_gradhealth.jax); imported lazily.
        "torch": ["torch>=2.3"],
        "jax": ["jax>=0.4.30"],
        # The training-loop integrations (tb_gradhealth.lightning, tb_gradhealth.transformers) and the optax/flax
        # tests; each imported only by its own module.
        "lightning": ["lightning>=2.2"],
        "transformers": ["transformers>=4.46", "accelerate"],
        # The object-storage tests run real servers: moto's S3 server and a GCS emulator. "test" adds PyTorch and
        # JAX. "test-tf" is what the oldest-TensorFlow tier of .ci/run needs for its TensorFlow tests, no more: no
        # PyTorch or JAX (its numpy<2 pins exclude new JAX), no browser, no storage servers.
        "test": [*TEST, "torch>=2.3", "jax>=0.4.30", *INTEGRATIONS],
        "test-tf": ["pytest", "pytest-xdist", "hypothesis"],
    },
    entry_points={
        "tensorboard_plugins": ["gradhealth = tb_gradhealth.plugin:GradHealthLoader"],
        "console_scripts": ["tb-gradhealth = tb_gradhealth.cli:main"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Framework :: TensorFlow",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
