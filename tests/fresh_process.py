"""A new interpreter for the tests' "a fresh process loads it" checks, at the cost of a fork.

``python -c SCRIPT`` pays torch's and transformers' imports at every check (about 5 s of the
2-core development machine's CPU each). Here a small server
process per test process imports torch and transformers' base once, and forks a child per check:
a process that has imported those two packages and nothing of the tests' (not revtriton, no model
family's module, no class a conversion made, no state a test set), which runs SCRIPT as
``python -c SCRIPT ARGS...`` would, in the caller's working directory and environment. What a
fresh process must find by itself (the swapped classes by name, revtriton's own imports) it still
finds by itself.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

PRELOADED = ("torch", "transformers.modeling_utils")  # what every check here would import anyway

# The server: reads one request a line, forks, the child runs the script; the server answers with the
# child's pid, then its exit code. It imports nothing of this file's: its own imports are the preloaded
# (those installed: a check that needs one that is not fails in the child, as it would in python -c).
_SERVER = f"""
import importlib, json, os, sys, traceback
for name in {PRELOADED!r}:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
requests, answers = sys.stdin, sys.stdout
for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
                target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(target, fd)
                os.close(target)
            sys.argv = ["-c", *request["argv"]]
            exec(compile(request["code"], "<string>", "exec"), {{"__name__": "__main__"}})
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    answers.write(json.dumps(pid) + "\\n")  # (the caller kills a child that runs past its timeout)
    answers.flush()
    _, status = os.waitpid(pid, 0)
    answers.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\\n")
    answers.flush()
"""

_server = None


def _stop_server():
    global _server
    if _server is not None:
        try:
            os.killpg(_server.pid, signal.SIGKILL)  # the server and a child still running
        except ProcessLookupError:
            pass
        _server.wait()
        _server = None


def _running_server() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   bufsize=0, start_new_session=True)
        atexit.register(_stop_server)
    return _server


def _answer(server) -> int:
    """The server's next answer line (the pipe is unbuffered: select sees every line not read yet)."""
    line = server.stdout.readline()
    if not line:  # the server died: the next call starts another
        _stop_server()
        raise RuntimeError("the fresh-process server exited")
    return json.loads(line)


def run_python(code: str, *argv, env: dict | None = None, timeout: float = 300,
               check: bool = False) -> subprocess.CompletedProcess:
    """What ``subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
    env=env, timeout=timeout)`` returns, run in a child of the server (``env`` defaults to this
    process's environment); ``check``: raise AssertionError with its stderr on a non-zero exit."""
    server = _running_server()
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = dict(code=code, argv=[str(a) for a in argv], env=dict(os.environ if env is None else env),
                       cwd=os.getcwd(), stdout=out_path, stderr=err_path)
        server.stdin.write(json.dumps(request).encode() + b"\n")
        child = _answer(server)
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        if not ready:  # the child is killed; the server goes on (its answer: the kill's exit code)
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:  # (it ended just now)
                pass
            _answer(server)
            raise subprocess.TimeoutExpired(["<fresh process>", "-c", code], timeout)
        returncode = _answer(server)
        with open(out_path) as out, open(err_path) as err:
            done = subprocess.CompletedProcess(["<fresh process>", "-c", code, *argv], returncode, out.read(),
                                               err.read())
    if check and done.returncode:
        raise AssertionError(f"the fresh process exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return done
