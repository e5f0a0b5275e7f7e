"""Run code blocks as ``python -c`` would, each in a child forked from one interpreter that has imported TensorFlow
and Keras, so a block does not pay those imports again (about 5 s each on the CI machine).

Reads one JSON request a line on standard input, ``{"code", "cwd", "stdout", "stderr"}``, and answers one JSON line
``{"rc": exit status}`` when the child has ended. The child changes to ``cwd``, writes its output to the two files,
runs the code as ``__main__`` and ends as an interpreter does (its ``atexit`` handlers, then the status). This
process imports modules and never runs a TensorFlow op, so each child starts from the state a fresh interpreter
has after the same imports, and nothing one block does reaches the next.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import traceback

PRELOAD = ("tensorflow", "keras", "tb_gradhealth", "tb_gradhealth.keras", "tb_gradhealth.summary")


def _redirect(fd: int, path: str) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _exit_status(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def run_child(request: dict) -> None:
    """In the forked child: run the block, then end the process (never returns)."""
    status = 1
    try:
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)  # the requests' pipe is not the block's
        _redirect(1, request["stdout"])
        _redirect(2, request["stderr"])
        os.chdir(request["cwd"])
        sys.argv = ["-c"]
        sys.path[0] = ""  # as `python -c`: the working directory first
        try:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            status = 0
        except SystemExit as e:
            status = _exit_status(e)
        except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the exit status
            traceback.print_exc()
        try:
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            status = status or 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
