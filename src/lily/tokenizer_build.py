"""Synthetic Qwen3.5/3.6-style tokenizer files (byte-level BPE + the 33 real specials).

Used by :mod:`lily.synthetic`.  Vocabulary layout (mirrors the real one: 248,044 BPE
ranks, then the 33 specials, then padding rows that no token maps to):

* ids ``[0, n_trained)``: a byte-level BPE trained with ``tokenizers``' BpeTrainer on
  a deterministic embedded corpus (English, code, several scripts, emoji) -- the 256
  byte symbols are always included, so any UTF-8 text round-trips;
* ids ``[n_trained, n_bpe)``: unreachable filler tokens (decodable pseudo-words; no
  merge produces them) when the corpus yields fewer merges than requested -- for the
  248,320-id scales this is most of the range;
* ids ``[n_bpe, n_bpe + 33)``: the specials, in the real order (``<|endoftext|>`` first);
* ids ``[n_bpe + 33, vocab_size)``: padding (no token).

Normaliser NFC, pre-tokeniser = the Qwen3.5 regex (spec section 7) + ByteLevel, decoder
ByteLevel -- the structure of the real tokenizer.json.  Deterministic for a given
``tokenizers`` version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

QWEN35_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
              r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]
REAL_N_BPE = 248044

SAMPLE_TEXT = r'''
The quick brown fox jumps over the lazy dog. A mixture-of-experts layer routes every token to
a few experts; the router is a linear layer followed by a softmax and a top-k selection.
Gated DeltaNet layers keep a recurrent state, while full attention layers keep a KV cache.
Hello, world! How are you today? I'm fine, thanks. We'll see what they've done; it's late.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 3.14159 2.71828 1,000,000 12:30 2024-06-01 $19.99 50%.
In 1905 Albert Einstein published four papers. The weather is nice and the sky is blue.
Machine learning models are trained on large amounts of text, code and images.
Please summarise the following document in three bullet points and explain your reasoning.

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Engine:
    def __init__(self, path, backend="reference"):
        self.path = path
        self.backend = backend

    def generate(self, messages, max_tokens=256, temperature=0.7):
        if not messages:
            raise ValueError("empty conversation")
        return [m["content"] for m in messages if m.get("role") == "user"]

import numpy as np
x = np.zeros((4, 8), dtype=np.float32)
print(f"shape={x.shape} sum={x.sum():.3f}")
for i in range(10):
    if i % 2 == 0:
        continue
    print(i, i ** 2)

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; ++i) printf("%s\n", argv[i]);
    return 0;
}
SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
<html><body><div class="main">Hello</div></body></html>
$ pip install lily && lily chat --model mlx-community/Qwen3.6-35B-A3B-4bit

你好，世界！今天天气很好。我们一起学习机器学习和自然语言处理。毕老师说：一加一等于二。
こんにちは世界。今日はいい天気ですね。日本語のテキストです。
안녕하세요 세계. 한국어 텍스트입니다.
Привет, мир! Как дела? Это пример русского текста.
Bonjour le monde ! Ça va ? C'est très bien, merci. Où est la bibliothèque ?
Hallo Welt! Größe, Straße, Übermäßig schön. Ärger über Öl.
¡Hola, mundo! ¿Cómo estás? El niño comió piña.
مرحبا بالعالم. هذا نص عربي قصير.
नमस्ते दुनिया, हिन्दी में एक छोटा वाक्य।
שלום עולם. Γειά σου κόσμε. Merhaba dünya. Xin chào thế giới.
Emoji: 🙂 😀 👍🏽 🇫🇷 ❤️ 🚀 🎉 👩‍💻 ✨ 🔥 ☕ 🤖
Combining marks: e\u0301 cafe\u0301 naïve résumé coöperate.
Math: ∑ᵢ xᵢ² ≤ ∞, α + β = γ, √2 ≈ 1.414, π r², ∫ f(x) dx, ∀x ∃y.
'''

_SYLL = ["ka", "lo", "mi", "ne", "ra", "to", "su", "vi", "de", "ba", "zo", "qu", "an", "er", "in", "on",
         "th", "st", "ch", "sh", "ing", "ed", "ly", "tion", "ment", "pre", "con", "pro", "ex", "re"]


def _corpus(seed: int = 0, n_words: int = 60000) -> List[str]:
    """Embedded sample + deterministic pseudo-words (so any vocab size can be reached)."""
    rng = np.random.default_rng(seed)
    out = [SAMPLE_TEXT] * 4
    lens = rng.integers(1, 5, n_words)
    idx = rng.integers(0, len(_SYLL), (n_words, 4))
    caps = rng.random(n_words) < 0.15
    words = []
    for i in range(n_words):
        w = "".join(_SYLL[j] for j in idx[i, :lens[i]])
        words.append(w.capitalize() if caps[i] else w)
    for i in range(0, n_words, 20):
        out.append(" ".join(words[i:i + 20]) + ".\n")
    return out


def _byte_unicode() -> Dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(n_bpe: int, max_trained: int = 32768, seed: int = 0):
    """tokenizers.Tokenizer with ``n_bpe`` BPE ids and the 33 specials at ``n_bpe ..``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    n_train = min(n_bpe, max_trained)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_train, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    n_words = 60000 if n_train <= 4096 else 400000
    tok.train_from_iterator(_corpus(seed, n_words), trainer=trainer)
    data = json.loads(tok.to_str())
    vocab: Dict[str, int] = data["model"]["vocab"]
    merges = data["model"]["merges"]
    # renumber densely 0..n-1 in the trainer's order, then fill up to n_bpe
    order = sorted(vocab.items(), key=lambda kv: kv[1])
    vocab = {t: i for i, (t, _) in enumerate(order[:n_bpe])}
    if len(order) > n_bpe:  # keep only merges whose result survives
        merges = [m for m in merges if ("".join(m) if isinstance(m, list) else m.replace(" ", "")) in vocab]
    b2u = _byte_unicode()
    i = 0
    while len(vocab) < n_bpe:  # unreachable, decodable filler tokens
        k, s = i, ""
        while True:
            s += "abcdefghijklmnopqrstuvwxyz"[k % 26]
            k //= 26
            if k == 0:
                break
        cand = "".join(b2u[c] for c in (" ~" + s).encode())
        if cand not in vocab:
            vocab[cand] = len(vocab)
        i += 1
    for j, sp in enumerate(SPECIALS):
        vocab[sp] = n_bpe + j
    data["model"]["vocab"] = vocab
    data["model"]["merges"] = merges
    data["model"]["ignore_merges"] = False
    data["added_tokens"] = [
        {"id": n_bpe + j, "content": sp, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for j, sp in enumerate(SPECIALS)]
    data["post_processor"] = None
    out = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    for j, sp in enumerate(SPECIALS):
        assert out.token_to_id(sp) == n_bpe + j, sp
    return out


# ----------------------------------------------------------------------------- chat template
CHAT_TEMPLATE = r"""{%- set ns = namespace(last_query_index=messages|length - 1, multi_step_tool=true) -%}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif item.type == 'video' or 'video' in item -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in item -%}
                {{- item.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- content -}}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' -}}
        {{- tool | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[::-1] -%}
    {%- set index = (messages|length - 1) - loop.index0 -%}
    {%- if ns.multi_step_tool and message.role == 'user' -%}
        {%- set c = render_content(message.content) -%}
        {%- if not (c.startswith('<tool_response>') and c.endswith('</tool_response>')) -%}
            {%- set ns.multi_step_tool = false -%}
            {%- set ns.last_query_index = index -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = render_content(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning_content = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning_content = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- set reasoning_content = reasoning_content | trim -%}
        {%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > ns.last_query_index -%}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content + '\n</think>\n\n' + content -}}
        {%- else -%}
            {{- '<|im_start|>assistant\n' + content -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- for tool_call in message.tool_calls -%}
                {%- if tool_call.function is defined -%}
                    {%- set tool_call = tool_call.function -%}
                {%- endif -%}
                {%- if loop.first -%}
                    {%- if content | trim -%}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' -}}
                    {%- else -%}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' -}}
                    {%- endif -%}
                {%- else -%}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' -}}
                {%- endif -%}
                {%- if tool_call.arguments is mapping -%}
                    {%- for args_name, args_value in tool_call.arguments | items -%}
                        {{- '<parameter=' + args_name + '>\n' -}}
                        {%- if args_value is string -%}
                            {{- args_value -}}
                        {%- else -%}
                            {{- args_value | tojson -}}
                        {%- endif -%}
                        {{- '\n</parameter>\n' -}}
                    {%- endfor -%}
                {%- elif tool_call.arguments is defined and tool_call.arguments -%}
                    {{- tool_call.arguments -}}
                    {{- '\n' -}}
                {%- endif -%}
                {{- '</function>\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def generation_config(n_bpe: int = REAL_N_BPE) -> dict:
    eot, im_end = n_bpe, n_bpe + 2
    return {"bos_token_id": eot, "pad_token_id": eot, "eos_token_id": [im_end, eot], "do_sample": True,
            "temperature": 1.0, "top_k": 20, "top_p": 0.95, "transformers_version": "5.24.0"}


def write_tokenizer_files(out_dir, n_bpe: int, model_max_length: int = 262144, seed: int = 0,
                          tokenizer=None) -> Path:
    """tokenizer.json, tokenizer_config.json (with chat_template), chat_template.jinja."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(n_bpe, seed=seed)
    tok.save(str(out / "tokenizer.json"))
    added = {str(n_bpe + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    cfg = {
        "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer", "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out
