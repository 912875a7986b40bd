"""docs/python.md's session example runs as written, against the `kvtier serve` command line the
page gives, and prints what the page says it prints (timings aside)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from conftest import REPO
from sidecar import start_sidecar

DOC = REPO / "docs" / "python.md"


def _section() -> tuple[list[str], str, str]:
    """The example's serve flags, its code and the output the page shows."""
    text = DOC.read_text()
    start = text.index("## A session")
    cmd = re.search(r"Run against `kvtier serve (.*?)`:", text[start:], re.S)
    assert cmd, "the example names its kvtier serve command"
    code = re.search(r"```python\n(.*?)```", text[start:], re.S)
    out = re.search(r"prints\n\n```\n(.*?)```", text[start:], re.S)
    assert code and out
    return shlex.split(cmd.group(1).replace("\n", " ")), code.group(1), out.group(1)


def _without_timings(s: str) -> str:
    return re.sub(r"timing=Timing\([^)]*\)", "timing=Timing(...)", s)


def test_the_session_example_prints_what_the_page_says(tmp_path: Path) -> None:
    flags, code, expected = _section()
    doc_socket = flags[flags.index("--socket") + 1]
    # The page's own flags, but the socket (and host capacity) of this test's sidecar.
    geometry = tuple(f for i, f in enumerate(flags) if f == "--set" or (i and flags[i - 1] == "--set"))
    sc = start_sidecar(tmp_path, geometry=geometry, host_capacity=flags[flags.index("--host-capacity") + 1])
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace(f"unix://{doc_socket}", sc.target), str(DOC), "exec"), {})
    finally:
        sc.stop()
    assert _without_timings(out.getvalue()) == _without_timings(expected)
