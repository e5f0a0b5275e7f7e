"""Real write faults for the tests: a small tmpfs that a test can fill, free and remount read-only, and the
warnings the recorder logged."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["Tmpfs", "logged"]


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    """The messages logged so far that contain ``text``."""
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


class Tmpfs:
    """A tmpfs of ``size`` bytes mounted on a fresh directory (root only), that a test can fill, free and make
    read-only."""

    def __init__(self, where: Path, size: int) -> None:
        self.path = where / "mnt"
        self.path.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        self._filler = self.path / "filler"

    def fill(self) -> None:
        """Take every free byte (the writer's next write fails with ENOSPC)."""
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for chunk in (4096, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * chunk)
                except OSError:
                    pass
        finally:
            os.close(fd)

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)
