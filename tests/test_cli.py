"""`lily generate` / `lily chat` as a user meets them, run as subprocesses: the prompt from a file or standard
input, the prefill progress bar, Ctrl-C (SIGINT) stopping a long prompt at the next chunk with no traceback and
the chat session intact, and errors on a line of their own without tracebacks (an unusable backend, weights
holding NaN, a bad file)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import lily

# The subprocess imports the lily this test imported (an installed package in CI, src/ in a dev tree).
SRC = Path(lily.__file__).resolve().parents[1]
LONG = "ab" * 75_000  # 150 KB, 37,502 tokens: "Argument list too long" as an argument; a minute of prefill


def _sigint_default() -> None:
    # A shell's background job starts with SIGINT ignored, and Python then installs no KeyboardInterrupt handler:
    # the CLI runs as it would from a terminal whatever started the tests.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def lily_cli(*args, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "lily.cli", *args], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_default, **kw)


def interrupt_during_prefill(p: subprocess.Popen, stdin_text: str, total: int) -> tuple[str, str, float]:
    """Writes stdin, waits for the progress bar of a prompt of at least `total` tokens, sends SIGINT; returns
    (stdout, stderr, seconds from SIGINT to exit)."""
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: [err.append(b) for b in iter(lambda: os.read(fd, 4096), b"")],
                              daemon=True)
    fd = p.stderr.fileno()
    reader.start()
    p.stdin.write(stdin_text)
    p.stdin.close()
    deadline = time.time() + 120
    while not any(int(t) >= total for t in re.findall(rb"\| *\d+/(\d+) \[", b"".join(err))):
        assert p.poll() is None and time.time() < deadline, b"".join(err).decode()
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    t0 = time.time()
    out = p.stdout.read()
    p.wait(timeout=60)
    took = time.time() - t0
    reader.join(10)
    return out, b"".join(err).decode(), took


def test_generate_reads_a_long_prompt_from_stdin_shows_progress_and_stops_on_ctrl_c():
    total = len(lily.Engine.from_pretrained("synthetic:tiny").tokenizer.encode(LONG))
    p = lily_cli("generate", "--max-tokens", "4")
    out, err, took = interrupt_during_prefill(p, LONG, total)
    assert p.returncode == 130, err
    assert "[interrupted]" in err and "Traceback" not in err
    assert took < 20  # a chunk of 512 tokens, not the rest of a 37,502-token prompt


def test_generate_reads_the_prompt_from_a_file(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("Once upon a time")
    p = lily_cli("generate", "--json", "--max-tokens", "3", "-t", "0", "--file", str(f))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    got = json.loads(out)
    want = lily.Engine.from_pretrained("synthetic:tiny").generate("Once upon a time", max_tokens=3, temperature=0)
    assert got["token_ids"] == want.token_ids and got["usage"]["prompt_tokens"] == want.usage.prompt_tokens
    p = lily_cli("generate", "--file", str(f), "also an argument")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "not both" in err and "Traceback" not in err


def test_chat_ctrl_c_drops_the_message_and_keeps_the_session():
    total = len(lily.Engine.from_pretrained("synthetic:tiny").tokenizer.encode(LONG))
    p = lily_cli("chat", "--max-tokens", "4", "--no-thinking")
    out, err, _ = interrupt_during_prefill(p, "hello\n" + LONG + "\nhow are you?\n", total)
    assert p.returncode == 0, err
    assert "[interrupted]" in out and "Traceback" not in err
    # "[P prompt tokens, C cached; ...]" after each answer
    stats = [tuple(map(int, m)) for m in re.findall(r"\[(\d+) prompt tokens, (\d+) cached", err)]
    # two answers (hello, how are you?); the second reuses the first turn: the interrupted one left no trace
    assert len(stats) == 2 and stats[1][0] < 200 and stats[1][1] > 0, err


def _poison(src: Path, dst: Path, tensor: str) -> None:
    """A copy of the checkpoint `src` whose `tensor` (bf16) holds NaN at one random position."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    b, e = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    at = 8 + n + b + 2 * int(np.random.default_rng(0).integers((e - b) // 2))
    raw[at:at + 2] = (0x7FC0).to_bytes(2, "little")
    f.write_bytes(bytes(raw))


def test_weights_holding_nan_are_named_without_a_traceback(tmp_path):
    from lily.synthetic import ensure_synthetic
    _poison(ensure_synthetic("tiny"), tmp_path / "nan", "language_model.model.norm.weight")
    p = lily_cli("generate", "--model", str(tmp_path / "nan"), "--max-tokens", "2", "Hello")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "Traceback" not in err
    line = next(l for l in err.splitlines() if "error" in l)
    assert line.startswith("lily generate: error: ") and "language_model.model.norm.weight" in line, err
    assert "NaN or Inf" in line


def test_an_unusable_backend_is_one_line_before_loading(monkeypatch, capsys):
    from lily import cli, engine
    monkeypatch.setattr(engine._core.kernels, "available", lambda: False)
    assert cli.main(["generate", "--backend", "metal-emu", "Hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lily generate: error: backend metal-emu: the emulated kernel library") and \
        "loading" not in err and err.count("\n") == 1


def test_a_checkpoint_error_goes_on_its_own_line(tmp_path, capsys):
    from lily import cli
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["generate", "--model", str(tmp_path), "Hello"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("loading ") and err[1].startswith("lily generate: error: ") and len(err) == 2


def test_convert_of_an_mlx_checkpoint_says_so_and_writes_nothing(tmp_path, capsys):
    from lily import cli
    from lily.synthetic import ensure_synthetic
    out = tmp_path / "out"
    assert cli.main(["convert", str(ensure_synthetic("tiny")), str(out)]) == 2
    err = capsys.readouterr().err
    assert "already in the MLX layout" in err and "quantized" in err and not out.exists()


def test_preserve_thinking_defaults(monkeypatch):
    """lily chat preserves thinking unless told not to; lily serve only when told to (and passes it on)."""
    from lily import cli, server
    p = cli.build_parser()
    assert p.parse_args(["chat"]).preserve_thinking is True
    assert p.parse_args(["chat", "--no-preserve-thinking"]).preserve_thinking is False
    seen = {}
    monkeypatch.setattr(server, "serve", lambda engine, **kw: seen.update(kw))
    assert cli.main(["serve", "--preserve-thinking"]) == 0 and seen["preserve_thinking"] is True
    assert cli.main(["serve"]) == 0 and seen["preserve_thinking"] is False
