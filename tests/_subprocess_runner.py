"""Run functions of a test module in fresh Python processes (not a test module itself).

JAX reads ``XLA_FLAGS`` (``--xla_force_host_platform_device_count``) once, when its CPU backend
starts; by the time a test runs, the pytest process has usually started it with one device. So
multi-device checks run in a child interpreter whose environment sets the device count before
jax is imported. The child imports the test module *by file path*, calls one of its functions
with JSON keyword arguments and writes the JSON result (or the traceback) to a file.

    python tests/_subprocess_runner.py TEST_FILE OUT_JSON BATCH_JSON

``BATCH_JSON`` is ``{case id: [function name, kwargs]}``; ``OUT_JSON`` receives
``{case id: {"ok": bool, "result": ..., "error": traceback text}}``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """This process's environment, with JAX on CPU with ``devices`` host devices."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    test_file: str | os.PathLike[str], calls: dict[str, tuple[str, dict[str, Any]]], out: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """Start one child running ``calls``; its stdout/stderr go to ``out`` + ``.log``. The child
    leads its own process group, so :func:`finish` can stop it and anything it started."""
    log = open(str(out) + ".log", "wb")
    try:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(test_file), str(out), json.dumps(calls)],
            cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    finally:
        log.close()


def finish(proc: subprocess.Popen[bytes], out: Path, timeout: float) -> dict[str, Any]:
    """Wait for a child started by :func:`spawn`; its per-case results, or an AssertionError
    carrying the tail of its output when it timed out or died without writing them."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group
        proc.wait()
        raise AssertionError(f"child timed out after {timeout}s; output tail:\n{_tail(out)}") from None
    if not out.exists():
        raise AssertionError(f"child exited with {proc.returncode} and no results; output tail:\n{_tail(out)}")
    return json.loads(out.read_text())


def distributed(here: Path, worker: str, path: Path, out_dir: Path, timeout: float, devices: int = 4) -> list[Any]:
    """Two ``jax.distributed`` processes running ``worker(process_id=, port=, path=)`` from the
    test module ``here``, ``devices`` CPU devices each; their results, or one failure listing
    every process's error."""
    port = free_port()
    procs = []
    for pid in (0, 1):
        out = out_dir / f"p{pid}.json"
        calls = {"w": (worker, {"process_id": pid, "port": port, "path": str(path)})}
        procs.append((spawn(here, calls, out, child_env(devices)), out))
    results, failures = [], []
    for proc, out in procs:
        try:
            got = finish(proc, out, timeout=timeout)["w"]
        except AssertionError as e:
            failures.append(str(e))
            continue
        if not got["ok"]:
            failures.append(got["error"])
        results.append(got["result"])
    assert not failures, "\n\n".join(failures)
    return results


def _tail(out: Path, chars: int = 6000) -> str:
    log = Path(str(out) + ".log")
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no output)"


class Cases:
    """Results of named cases run on ``devices`` JAX CPU devices: in this process when it
    already has that many devices, otherwise all in one child process (started on creation).
    ``check(case)`` re-raises a case's failure with the child's traceback."""

    def __init__(
        self, test_file: str, module_globals: dict[str, Any], calls: dict[str, tuple[str, dict[str, Any]]], *, devices: int, timeout: float
    ):
        import jax

        self.calls = calls
        self.globals = module_globals
        self.in_process = len(jax.devices()) >= devices
        self.results: dict[str, Any] = {}
        self.error: str | None = None
        if not self.in_process:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "results.json"
                try:
                    self.results = finish(spawn(test_file, calls, out, child_env(devices)), out, timeout)
                except AssertionError as e:
                    self.error = str(e)

    def check(self, case: str) -> Any:
        func, kwargs = self.calls[case]
        if self.in_process:
            return self.globals[func](**kwargs)
        if self.error is not None:
            raise AssertionError(self.error)
        got = self.results[case]
        if not got["ok"]:
            raise AssertionError(f"{case} failed in the {func} child process:\n{got['error']}")
        return got["result"]


def _load_module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_child", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    test_file, out, batch = argv[0], Path(argv[1]), json.loads(argv[2])
    module = _load_module(test_file)
    results: dict[str, Any] = {}
    for case, (func, kwargs) in batch.items():
        fn: Callable[..., Any] = getattr(module, func)
        try:
            results[case] = {"ok": True, "result": fn(**kwargs), "error": None}
        except BaseException:
            results[case] = {"ok": False, "result": None, "error": traceback.format_exc()}
        sys.stdout.flush()
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
