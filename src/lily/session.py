"""Sessions: one conversation's model state (KV cache, conv and recurrent state) that survives turns and restarts.

    s = engine.new_session()
    engine.generate(messages, session=s)          # prefills the prompt once
    engine.generate(messages + [...], session=s)  # prefills only what follows the longest cached prefix
    s.save("chat.lily"); s2 = lily.Session.load("chat.lily", engine)

Each request feeds only the tokens after the longest cached prefix of its prompt. The recurrent (GDN) state
cannot be trimmed back to an earlier position, so a session keeps snapshots (copies of the whole state,
Backend::clone_state) at turn boundaries: where the conversation's messages end (before the generation prompt),
where each prompt ends (with the logits of its last token, so regenerating an answer feeds nothing), and where
each answer ended. Regenerating the last answer, editing an earlier message or switching branch resumes from the
snapshot with the longest token history that is a prefix of the new prompt. Snapshots are bounded by a memory
budget and evicted least recently used. Snapshots are never modified: a request resumes on a copy.

Chat turns are matched as generated (GeneratedTurns, one per engine): when an answer ends, the engine renders the
conversation with that answer appended and remembers that this text stands for the ids the request ran (the
prompt, the generated ids, and the template's closing markup). The next prompt that starts with that text is
tokenised as those ids, so the live state is a prefix of it however the text would re-tokenise: with
`preserve_thinking` (earlier answers keep their reasoning) every turn prefills only the new messages. Where the
template normalises what the model wrote (whitespace around the reasoning, a thinking block closed after a
length cut) the rendered answer is still the message parsed from those ids; an edited message renders other
text and falls back to the nearest snapshot.

A request that fails or is cancelled (a stream closed early) leaves the session exactly as it was before the
request began: the live state it would have changed is restored from a copy taken when the request started.

Files (save/load): one safetensors file; tensors "live.<state name>" and "snap<j>.<state name>" (state names of
Backend::export_state: layers.{i}.k / .v / .conv / .rec) plus "snap<j>.logits"; the header's __metadata__ holds
"lily.session", a JSON manifest: format version, token ids of the live state and of each snapshot, a CRC-32 of
every tensor, and the fingerprint of the model (config, weight file names and sizes) and backend. A file of another
model or backend, or a corrupt one, raises SessionFileError naming what differs.
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import safetensors_io

if TYPE_CHECKING:
    from .engine import Engine

FORMAT = "lily.session/1"
DEFAULT_SNAPSHOT_BUDGET = 4 << 30  # bytes of snapshot state per session
MAX_SESSION_TURNS = 64  # answers a session keeps for GeneratedTurns (saved with it)


class SessionFileError(ValueError):
    """A session file that cannot be loaded into this engine: another model or backend, or a corrupt file."""


@dataclass
class Snapshot:
    """A frozen copy of a session's state after `tokens`; `logits` [V] of the last token when kept."""

    tokens: tuple[int, ...]
    core: object  # lily._core.Session, never modified
    kind: str     # "boundary" (messages end), "prompt" (prompt end, with logits), "turn" (an answer's end)
    nbytes: int
    logits: np.ndarray | None = None
    last_used: int = 0

    @property
    def position(self) -> int:
        return len(self.tokens)


@dataclass
class _Plan:
    """One request's resume point and how to undo it."""

    core: object             # the state the request works on
    cached: int              # prompt tokens already in `core`
    first_logits: np.ndarray | None  # when cached == len(prompt): logits of the last prompt token
    source: Snapshot | None  # the snapshot resumed from (None: the live state)
    backup: Snapshot | None  # a copy of the live state taken before a request that changes it in place
    added: list = field(default_factory=list)  # snapshots taken during the request


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class Session:
    """One conversation's model state and the tokens it has seen; see the module docstring."""

    def __init__(self, engine: "Engine", core=None, *, snapshot_budget: int = DEFAULT_SNAPSHOT_BUDGET):
        self.engine = engine
        self._core = core if core is not None else engine._core.new_session()
        self.snapshot_budget = snapshot_budget
        self.snapshots: list[Snapshot] = []
        self._clock = 0
        self._prefilled = 0  # tokens this session ran through prefill / decode, over every request
        self._decoded = 0
        self.turns: list[tuple[tuple[int, bytes], list[int]]] = []  # its answers, as GeneratedTurns keys and ids

    # ------------------------------------------------------------------ state
    @property
    def position(self) -> int:
        """Tokens the live state has processed."""
        return self._core.position

    @property
    def tokens(self) -> list[int]:
        return self._core.tokens

    @property
    def prefilled_tokens(self) -> int:
        """Tokens that went through the prefill schedule for this session (a cost counter, all requests)."""
        return self._prefilled

    @property
    def decoded_tokens(self) -> int:
        """Tokens that went through the decode schedule for this session (all requests)."""
        return self._decoded

    def _count(self, core, before: tuple[int, int]) -> None:
        self._prefilled += core.prefilled - before[0]
        self._decoded += core.decoded - before[1]

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    @property
    def state_bytes(self) -> int:
        """Bytes of the live state (KV cache as allocated, conv and recurrent state)."""
        return int(self.engine._core.state_bytes(self._core))

    def fork(self) -> "Session":
        """An independent copy: the live state is copied, snapshots (immutable) are shared."""
        f = Session(self.engine, self.engine._core.clone_session(self._core), snapshot_budget=self.snapshot_budget)
        f.snapshots, f.turns = list(self.snapshots), list(self.turns)
        return f

    def reset(self) -> None:
        """Forget everything: an empty state, no snapshots."""
        self._core = self.engine._core.new_session()
        self.snapshots, self.turns = [], []

    def _remember(self, key: tuple[int, bytes], ids: list[int]) -> None:
        """Keeps an answer's GeneratedTurns entry, so that a saved session matches its turns after a restart."""
        self.turns = [t for t in self.turns if t[0] != key][-(MAX_SESSION_TURNS - 1):] + [(key, list(ids))]

    # ------------------------------------------------------------------ snapshots
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _snapshot_of(self, core, kind: str, logits=None, *, copy: bool = True) -> Snapshot:
        c = self.engine._core.clone_session(core) if copy else core
        return Snapshot(tuple(c.tokens), c, kind, int(self.engine._core.state_bytes(c)),
                        None if logits is None else np.array(logits, dtype=np.float32).reshape(-1),
                        self._tick())

    def _add(self, snap: Snapshot, pinned=()) -> None:
        for i, s in enumerate(self.snapshots):
            if s.tokens == snap.tokens:  # one snapshot per token history; keep the one with logits
                if s.logits is None or snap.logits is not None:
                    self.snapshots[i] = snap
                else:
                    s.last_used = snap.last_used
                self._evict(pinned)
                return
        self.snapshots.append(snap)
        self._evict(pinned)

    def _evict(self, pinned=()) -> None:
        while self.snapshot_bytes > self.snapshot_budget and self.snapshots:
            victims = [s for s in self.snapshots if all(s is not p for p in pinned)]
            if not victims:
                return
            self.snapshots.remove(min(victims, key=lambda s: s.last_used))

    def resume_point(self, ids) -> tuple[int, Snapshot | None]:
        """Where a prompt would resume: (prompt tokens already held, the snapshot holding them or None for the
        live state); the live state or the snapshot whose tokens are the longest prefix of `ids`, leaving at
        least one token to feed unless the snapshot kept the logits of the whole prompt. (-1, None): neither
        is a prefix of `ids` (a fresh state)."""
        n = len(ids)
        live = self._core.tokens
        best_len, best = -1, None
        if len(live) < n and _common_prefix(live, ids) == len(live):
            best_len = len(live)
        for s in self.snapshots:
            k = len(s.tokens)
            usable = k < n or (k == n and s.logits is not None)
            if usable and k > best_len and _common_prefix(s.tokens, ids) == k:
                best_len, best = k, s
        return best_len, best

    def _plan(self, ids: list[int]) -> _Plan:
        """The resume point for a prompt (resume_point) and how to undo the request."""
        n = len(ids)
        live = self._core.tokens
        best_len, best = self.resume_point(ids)
        if best is None and best_len >= 0:
            # Extend the live state in place; a copy taken now restores it if the request fails.
            backup = self._snapshot_of(self._core, "turn") if len(live) else None
            return _Plan(self._core, best_len, None, None, backup)
        if best is None:  # nothing reusable: a fresh state; the live one is untouched until commit
            return _Plan(self.engine._core.new_session(), 0, None, None, None)
        best.last_used = self._tick()
        logits = best.logits if best_len == n else None
        return _Plan(self.engine._core.clone_session(best.core), best_len, logits, best, None)

    def _commit(self, plan: _Plan) -> None:
        if plan.core is not self._core:
            # Switching branch: the old live state stays reachable as a snapshot (no copy: it is not used again).
            if len(self._core.tokens):
                self._add(self._snapshot_of(self._core, "turn", copy=False))
            self._core = plan.core
        if plan.backup is not None:
            self._add(plan.backup)

    def _rollback(self, plan: _Plan) -> None:
        for s in plan.added:
            if s in self.snapshots:
                self.snapshots.remove(s)
        if plan.core is self._core and plan.backup is not None:
            self._core = plan.backup.core  # the copy taken at the start (the changed state is dropped)
        elif plan.core is self._core:
            self._core = self.engine._core.new_session()  # it was empty before the request

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike, *, snapshots: bool = True) -> Path:
        """Writes the live state (and the snapshots) to one safetensors file with a JSON manifest."""
        e = self.engine
        path = Path(path)
        tensors: list[tuple[str, str, list[int], bytes]] = []
        entries = []
        for j, (tag, core, logits, kind) in enumerate(
                [("live", self._core, None, "live")] +
                [(f"snap{i}", s.core, s.logits, s.kind) for i, s in enumerate(self.snapshots if snapshots else [])]):
            for name, dtype, shape, data in e._core.export_session(core):
                tensors.append((f"{tag}.{name}", dtype, list(shape), data))
            if logits is not None:
                tensors.append((f"{tag}.logits", "f32", [int(logits.size)], np.ascontiguousarray(logits, np.float32).tobytes()))
            entries.append({"tag": tag, "kind": kind, "tokens": [int(t) for t in core.tokens],
                            "logits": logits is not None})
        manifest = {"format": FORMAT, "fingerprint": fingerprint(e), "entries": entries,
                    "turns": [_turn_entry(key, ids, self._core.tokens) for key, ids in self.turns],
                    "crc32": {name: zlib.crc32(data) for name, _, _, data in tensors}}
        safetensors_io.write_file(path, [(name, _DTYPE[dt], shape, data) for name, dt, shape, data in tensors],
                                  {"lily.session": json.dumps(manifest)})
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, engine: "Engine", **kwargs) -> "Session":
        """A session saved by save(), for an engine of the same model and backend."""
        path = Path(path)
        try:
            entries, metadata = safetensors_io.read_header(path, SessionFileError)
            blob = path.read_bytes()
        except OSError as e:
            raise SessionFileError(f"{path}: cannot be read ({e.strerror or e})") from None
        try:
            manifest = json.loads(metadata["lily.session"])
        except (KeyError, TypeError, json.JSONDecodeError):
            raise SessionFileError(f"{path}: not a lily session file (no lily.session manifest)") from None
        if manifest.get("format") != FORMAT:
            raise SessionFileError(f"{path}: session format {manifest.get('format')!r}, this lily reads {FORMAT}")
        want, got = fingerprint(engine), manifest.get("fingerprint", {})
        if want != got:
            diff = [k for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
            detail = "; ".join(f"{k}: file {_short(got.get(k))} vs engine {_short(want.get(k))}" for k in diff[:4])
            raise SessionFileError(f"{path}: saved for another model or backend ({detail})")
        crc = manifest.get("crc32", {})

        def tensors_of(tag):
            out = []
            for name, t in entries.items():
                if not name.startswith(tag + "."):
                    continue
                data = blob[t.offset:t.offset + t.nbytes]
                if zlib.crc32(data) != crc.get(name) or t.dtype not in _DTYPE_BACK:
                    raise SessionFileError(f"{path}: tensor {name} is corrupt (CRC-32 mismatch or dtype {t.dtype})")
                out.append((name[len(tag) + 1:], _DTYPE_BACK[t.dtype], list(t.shape), data))
            return out

        s = cls(engine, **kwargs)
        for entry in manifest["entries"]:
            ts = tensors_of(entry["tag"])
            logits = None
            if entry.get("logits"):
                lt = [t for t in ts if t[0] == "logits"]
                if not lt:
                    raise SessionFileError(f"{path}: {entry['tag']}.logits is missing")
                logits = np.frombuffer(lt[0][3], dtype=np.float32).copy()
                ts = [t for t in ts if t[0] != "logits"]
            try:
                core = engine._core.import_session(ts, [int(t) for t in entry["tokens"]])
            except (ValueError, IndexError, RuntimeError) as err:
                raise SessionFileError(f"{path}: {entry['tag']}: {err}") from None
            if entry["tag"] == "live":
                s._core = core
            else:
                s.snapshots.append(Snapshot(tuple(core.tokens), core, entry["kind"],
                                            int(engine._core.state_bytes(core)), logits, s._tick()))
        s._evict()
        live = s._core.tokens
        for t in manifest.get("turns", []):  # files written before turns were kept have none
            key, ids = (int(t["chars"]), bytes.fromhex(t["sha256"])), list(live[:int(t["shared"])]) + t["tail"]
            s._remember(key, ids)
            engine._turns.put(key, ids)
        return s


# ---------------------------------------------------------------------------------------------- generated turns

class GeneratedTurns:
    """Rendered conversations through a generated answer -> the token ids the model ran for them (see the module
    docstring); at most `max_tokens` ids in all, least recently used dropped first."""

    def __init__(self, max_tokens: int = 8 << 20):
        self.max_tokens = max_tokens
        self._ids: OrderedDict[tuple[int, bytes], np.ndarray] = OrderedDict()  # (chars, sha256 of text) -> int32
        self._held = 0

    def __len__(self) -> int:
        return len(self._ids)

    @staticmethod
    def key(text: str) -> tuple[int, bytes]:
        """(characters, sha256 of the UTF-8): what identifies a rendered conversation."""
        return len(text), hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def put(self, key: tuple[int, bytes], ids) -> None:
        if key in self._ids:
            self._held -= self._ids.pop(key).size
        self._ids[key] = np.asarray(ids, dtype=np.int32)
        self._held += self._ids[key].size
        while self._held > self.max_tokens and len(self._ids) > 1:
            self._held -= self._ids.popitem(last=False)[1].size

    def longest(self, text: str) -> tuple[int, list[int]]:
        """The longest remembered conversation that `text` starts with: (its length in characters, its ids), or
        (0, []) when none."""
        for n in sorted({n for n, _ in self._ids if n <= len(text)}, reverse=True):
            key = self.key(text[:n])
            if key in self._ids:
                self._ids.move_to_end(key)
                return n, self._ids[key].tolist()
        return 0, []

    def encode(self, tokenizer, text: str) -> list[int]:
        """`text` tokenised with its remembered head as generated and the rest by the tokenizer."""
        n, head = self.longest(text)
        return head + (tokenizer.encode(text[n:]) if n < len(text) else [])


def answer_ids(tokenizer, answer: str, generated: list[int], stop_ids, ended_in_reasoning: bool) -> list[int] | None:
    """The ids that stand for `answer` (an assistant turn as the chat template renders it, from the text after the
    prompt to the end of the turn's markup) given the ids the model generated for it: `generated`, then the markup
    the template writes after them. None when `answer` is not a rendering of what was generated.

    The generated text is a prefix of the answer when the template wrote it back unchanged; otherwise the template
    normalised it (whitespace next to the reasoning), and the markup that follows is the end of the turn after a
    stop id, or the closing of the thinking block and the turn after a length cut."""
    from .chat import THINK_END
    text = tokenizer.decode(generated)
    if answer.startswith(text):
        rest = answer[len(text):]
    elif generated and generated[-1] in stop_ids:
        # the stop id stands for the end-of-turn marker; what follows it is the template's
        marker = tokenizer.decode(generated[-1:])
        i = answer.rfind(marker)
        if i < 0:
            return None
        rest = answer[i + len(marker):]
    else:
        markup = answer.rfind("\n" + THINK_END) if ended_in_reasoning else -1
        ends = [tokenizer.decode([t]) for t in stop_ids]
        end = max(answer.rfind(e) for e in ends) if ends else -1
        i = markup if markup >= 0 else end
        if i < 0:
            return None
        rest = answer[i:]
    return list(generated) + (tokenizer.encode(rest) if rest else [])


# ---------------------------------------------------------------------------------------------- helpers

def _turn_entry(key: tuple[int, bytes], ids: list[int], live) -> dict:
    """A GeneratedTurns entry for the manifest: the ids as the length shared with the live tokens plus the rest
    (an earlier answer's ids are mostly a prefix of the live state: the file does not repeat them)."""
    shared = _common_prefix(ids, live)
    return {"chars": key[0], "sha256": key[1].hex(), "shared": shared, "tail": [int(t) for t in ids[shared:]]}


def fingerprint(engine: "Engine") -> dict:
    """What a saved state depends on: the model config, the weight files (names and sizes) and the backend."""
    from dataclasses import asdict
    cfg = asdict(engine.config)
    cfg.pop("eos_token_id", None)
    files = [[Path(f).name, os.path.getsize(f)] for f in engine.checkpoint.files]
    return {"config": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16],
            "weights": files, "backend": engine.backend, "vocab_size": engine.config.vocab_size,
            "layers": engine.config.num_hidden_layers, "hidden_size": engine.config.hidden_size}


def _short(v) -> str:
    s = json.dumps(v, default=str)
    return s if len(s) <= 60 else s[:57] + "..."


_DTYPE = {"f32": "F32", "bf16": "BF16", "f16": "F16"}  # Backend::export_state's names -> safetensors'
_DTYPE_BACK = {v: k for k, v in _DTYPE.items()}
