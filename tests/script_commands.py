"""Several command lines of one absl script (experiments/, or another package's), run one
after another in one child process: the imports, the eager programs and the compiled steps
are paid once, and each command parses its own flags (the flags reset between commands).

    code, said, stderr = run_commands("movielens", "main", [["a", [...flags]], ...], cwd=ROOT)

said: {command name: the stdout that command printed}. child_argv gives the same child's
command line for a caller that starts the process itself (to signal it or read it live).

A command may carry a third item, {"env": {...}, "copy": [src, dst], "go_on": bool}: the
environment variables set for that command alone, a directory copied (shutil.copytree)
before it, and whether a SystemExit it raises (a signal's 128 + N) is printed as
"[test] exit CODE" and the next command runs, instead of ending the child with that code
(an absl app.UsageError, which app.run turns into exit 1 with its message on stderr, is
printed as "[test] usage error: MESSAGE" on stdout, then "[test] exit 1").
Each command that returns prints "[test] finished NAME". A `prelude` (Python source) runs in
the child before the script is imported (e.g. work that must come first in a fresh process).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

_CHILD = """
import gc
import json
import os
import shutil
import sys
gc.set_threshold(*{gc_threshold})                       # the starting process's
{prelude}
from absl import app, flags
from {package} import {module}
getattr({module}, "define_flags", lambda: None)()      # else its flags are defined on import
own_env = []
for name, argv, *more in json.loads(sys.argv[1]):
    opts = more[0] if more else {{}}
    print(f"[test] command {{name}}", flush=True)
    for key in own_env:                                # the previous command's variables
        os.environ.pop(key, None)
    own_env = list(opts.get("env", {{}}))
    os.environ.update(opts.get("env", {{}}))
    if opts.get("copy"):
        shutil.copytree(*opts["copy"])
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["{package}/{module}.py", *argv])
    try:
        {module}.{entry}(["{package}/{module}.py"])
    except SystemExit as e:
        if not opts.get("go_on"):
            raise
        print(f"[test] exit {{e.code}}", flush=True)
        continue
    except app.UsageError as e:
        if not opts.get("go_on"):
            raise
        print(f"[test] usage error: {{e}}", flush=True)
        print("[test] exit 1", flush=True)
        continue
    print(f"[test] finished {{name}}", flush=True)
"""


def child_argv(module: str, entry: str, spec: list, package: str = "experiments",
               prelude: str = "") -> list[str]:
    """The command line of one child running <package>.<module>'s commands
    [[name, argv], ...] (or [name, argv, opts]: module docstring) in order through
    <entry>(argv), after `prelude`; each prints "[test] command NAME" before its own
    output. The child's garbage collector runs as often as this process's (tests/conftest.py)."""
    code = _CHILD.format(package=package, module=module, entry=entry, prelude=prelude,
                         gc_threshold=gc.get_threshold())
    return [sys.executable, "-c", code, json.dumps(spec)]


def said_of(stdout: str) -> dict[str, str]:
    """{command name: the stdout that command printed} of a child's stdout."""
    return {part.split("\n", 1)[0]: part for part in stdout.split("[test] command ")[1:]}


def run_commands(module: str, entry: str, spec: list, *, cwd: str, env: dict | None = None,
                 timeout: float = 900,
                 package: str = "experiments") -> tuple[int, dict[str, str], str]:
    """<package>.<module>'s commands [[name, argv], ...] in order in one child (the module
    defines its flags in define_flags() or on import, and runs through <entry>(argv)): (the
    child's exit code, {name: that command's stdout}, the child's stderr). The child stops at
    the first command that raises or exits; the commands after it have no stdout entry."""
    r = subprocess.run(child_argv(module, entry, spec, package), cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r.returncode, said_of(r.stdout), r.stderr
