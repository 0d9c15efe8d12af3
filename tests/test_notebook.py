"""Jupyter: tests/notebooks/display.ipynb executed by nbclient in a fresh kernel. A Completion displays as HTML
(the answer escaped, the reasoning folded, the usage); a stream displays live, one display updated as tokens come,
and ends with the same text as the equivalent generate()."""
from __future__ import annotations

import html
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

import lily  # noqa: E402

HERE = Path(__file__).resolve().parent


def test_completion_and_stream_display_in_jupyter(monkeypatch):
    # The kernel imports the lily this test imported (an installed package in CI, src/ in a dev tree).
    monkeypatch.setenv("PYTHONPATH", str(Path(lily.__file__).resolve().parents[1]) + os.pathsep +
                       os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(HERE / "notebooks" / "display.ipynb", as_version=4)
    updates: dict[str, list[str]] = {}

    class Client(nbclient.NotebookClient):
        def _update_display_id(self, display_id, msg):  # records the live updates of the stream's display
            updates.setdefault(display_id, []).append(msg["content"]["data"].get("text/html", ""))
            return super()._update_display_id(display_id, msg)

    Client(nb, timeout=300, kernel_name="python3").execute()
    want = lily.Engine.from_pretrained("synthetic:tiny").generate(
        [{"role": "user", "content": "Tell me about tides <b>now</b>"}], max_tokens=24, seed=7)
    assert want.reasoning  # thinking is on by default: the display has something to fold

    completion = nb.cells[2].outputs[0]["data"]["text/html"]
    assert html.escape(want.reasoning) in completion and "<details" in completion
    assert html.escape(want.text) in completion and "24 generated" in completion

    stream = [o for o in nb.cells[3].outputs if o["output_type"] == "display_data"]
    assert len(stream) == 1  # one display, updated in place
    final = stream[0]["data"]["text/html"]
    assert html.escape(want.reasoning) in final and "24 generated" in final
    assert list(updates.values())[0][-1] == final  # the display ends on the finished answer
    # updated at every token when asked to (interval_s=0): the text grows, token by token
    live = list(updates.values())[1]
    assert len(live) >= 24 and html.escape(want.reasoning) in live[-1] and "24 generated" in live[-1]
    assert all(len(a) <= len(b) for a, b in zip(live[:-1], live[1:-1]))
