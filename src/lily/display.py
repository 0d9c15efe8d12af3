"""How generations look to a person: the prefill progress bar (a tqdm bar in a terminal, a widget in Jupyter),
and the rich display of a Completion and of a live stream in Jupyter.

    engine.generate(msgs)                       # as a cell's value: the answer, the reasoning folded, usage
    engine.stream(msgs)                         # as a cell's value: the text appears as it is generated
    engine.generate(long_prompt, progress=lily.display.prefill_bar())   # a bar while the prompt runs

Called by engine.py (Completion / Stream reprs) and cli.py (the bar); IPython is imported only when a notebook
asks for a display.
"""
from __future__ import annotations

import html
import sys
import time


def prefill_bar(file=None, min_tokens: int = 1024):
    """A progress callback for Engine.stream / generate(progress=...) drawing a bar of the prompt's tokens (tqdm.auto:
    a widget in Jupyter, text on a terminal) for prompts of at least `min_tokens` tokens; the bar disappears when the
    first token is out."""
    from tqdm.auto import tqdm
    bar = None

    def report(p) -> None:
        nonlocal bar
        if bar is None and p.done < p.total and p.total >= min_tokens:
            bar = tqdm(total=p.total, unit="tok", desc="prompt", leave=False, file=file or sys.stderr,
                       dynamic_ncols=True)
        if bar is not None:
            bar.update(p.done - bar.n)
            bar.set_postfix_str(f"{p.tokens_per_s:.0f} tok/s", refresh=False)
            if p.done >= p.total:
                bar.close()

    return report


def completion_html(text: str, reasoning: str = "", tool_calls=(), footer: str = "", live: bool = False) -> str:
    """An answer as HTML: the reasoning folded (open while it is being written), the text, the tool calls."""
    parts = []
    if reasoning:
        parts.append(f"<details{' open' if live and not text else ''}><summary style='opacity:.6'>thinking</summary>"
                     f"<div style='white-space:pre-wrap;opacity:.6'>{html.escape(reasoning)}</div></details>")
    parts.append(f"<div style='white-space:pre-wrap'>{html.escape(text)}</div>")
    for c in tool_calls:
        f = c.get("function", c)
        parts.append(f"<div><code>{html.escape(str(f.get('name')))}({html.escape(str(f.get('arguments')))})"
                     "</code></div>")
    if footer:
        parts.append(f"<div style='opacity:.5;font-size:smaller'>{html.escape(footer)}</div>")
    return "<div class='lily-completion'>" + "".join(parts) + "</div>"


def usage_line(usage, timings, finish_reason) -> str:
    return (f"{usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached) + {usage.completion_tokens} "
            f"generated, {finish_reason}; ttft {timings.ttft_s * 1e3:.0f} ms, "
            f"decode {timings.decode_tokens_per_s:.1f} tok/s")


def show_stream(stream, interval_s: float = 0.1) -> None:
    """Consumes a Stream in a notebook, showing the text as it comes (one display updated at most every
    `interval_s`), then the finished answer with its usage."""
    from IPython.display import HTML, display
    text, reasoning, calls = [], [], []
    handle = display(HTML(completion_html("", live=True)), display_id=True)
    shown = time.monotonic()
    last = None
    for d in stream:
        text.append(d.text)
        reasoning.append(d.reasoning)
        calls.extend(d.tool_calls)
        last = d
        if time.monotonic() - shown >= interval_s:
            handle.update(HTML(completion_html("".join(text), "".join(reasoning), calls, live=True)))
            shown = time.monotonic()
    footer = usage_line(last.usage, last.timings, last.finish_reason) if last and last.usage else ""
    handle.update(HTML(completion_html("".join(text), "".join(reasoning), calls, footer)))
