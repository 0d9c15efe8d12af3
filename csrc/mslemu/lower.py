#!/usr/bin/env python3
"""Lower genuine .metal compute kernels to clang C++ for the mslemu CPU emulator, and drive clang.

The .metal source is never edited: its own macros and #if __METAL_VERSION__ blocks are expanded by `clang -E`
against empty <metal_*> headers (MSLEMU_SCAN), keeping line markers so diagnostics point into the .metal
file. A token pass then rewrites what is not C++:

  * function-scope `threadgroup T x[N];`  -> a reference into the threadgroup's memory (mslemu::TgDecl)
  * kernel declarations (`kernel`, `[[kernel]]`, `[[host_name]]`, parameter attributes) -> plain functions,
    their parameter attributes recorded for binding
  * `template [[host_name("x")]] [[kernel]] ... f<...>;` -> the instantiation, registered as "x"
  * `constant T c [[function_constant(i)]];` -> mslemu::FunctionConstant<T, i>, set per dispatch
  * unsuffixed floating literals -> float (MSL has no double); `1.5h` -> half

and rejects what Metal rejects but C++ would accept: `double`, an initialised threadgroup variable, a by-value
kernel parameter without an attribute, more than 1024 threads in max_total_threads_per_threadgroup.
Registration code (mslemu/exec.h Entry<...>) is appended; the result includes <mslemu/msl.h>.

  lower.py check   FILE.metal [-I DIR] [-D X] [--metal-version N]     type-check only; clang's errors on failure
  lower.py lower   FILE.metal -o OUT.cpp                              emit the lowered translation unit
  lower.py compile FILE.metal -o OUT.o [--depfile OUT.o.d]            lower + clang -c (writes OUT.cpp too)
  lower.py runtime -o runtime.o [--depfile D]                          compile runtime.cpp
  lower.py link    -o LIB.so OBJ...                                     link a kernel library (C ABI: mslemu.h)

clang is $MSLEMU_CLANG, else --clang, else clang++-19 / clang++ on PATH.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(HERE, "include")
RUNTIME = os.path.join(HERE, "runtime.cpp")
MAX_THREADS = 1024
MAX_TG_MEMORY = 32768

# Flags every mslemu object is built with. half/bfloat arithmetic rounds after each operation as on the GPU
# (clang otherwise keeps float excess precision); no FMA contraction, so results do not depend on the host
# CPU; kernels cast pointers freely, hence no strict aliasing.
COMMON_FLAGS = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing", "-ffp-contract=off",
                "-Xclang", "-ffloat16-excess-precision=none", "-Xclang", "-fbfloat16-excess-precision=none",
                "-ferror-limit=20"]
# MSL has no exceptions or RTTI: using them is a compile error here too. Stack clash protection probes every
# page of a large frame, so a thread-private array bigger than the fiber stack hits its guard page.
KERNEL_FLAGS = COMMON_FLAGS + ["-fno-exceptions", "-fno-rtti", "-fstack-clash-protection", "-Wall", "-Wextra", "-Wno-unused-parameter",
                               "-Wno-unused-function", "-Wno-gnu-line-marker"]

BINDINGS = {
    "buffer": "buffer",
    "threadgroup": "threadgroup_memory",
    "thread_position_in_grid": "thread_position_in_grid",
    "thread_position_in_threadgroup": "thread_position_in_threadgroup",
    "threadgroup_position_in_grid": "threadgroup_position_in_grid",
    "threads_per_threadgroup": "threads_per_threadgroup",
    "threadgroups_per_grid": "threadgroups_per_grid",
    "threads_per_grid": "threads_per_grid",
    "dispatch_threads_per_threadgroup": "dispatch_threads_per_threadgroup",
    "thread_index_in_threadgroup": "thread_index_in_threadgroup",
    "thread_index_in_simdgroup": "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup": "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup": "threads_per_simdgroup",
    "thread_execution_width": "threads_per_simdgroup",
    "simdgroups_per_threadgroup": "simdgroups_per_threadgroup",
    "thread_index_in_quadgroup": "thread_index_in_quadgroup",
    "quadgroup_index_in_threadgroup": "quadgroup_index_in_threadgroup",
}
UNSUPPORTED_PARAMS = ("stage_in", "texture", "sampler", "imageblock", "color", "raster_order_group",
                      "visible_function_table", "intersection_function_table", "instance_acceleration_structure")

TOKEN_RE = re.compile(r"""
  (?P<nl>\n)
 |(?P<ws>[ \t\r\f\v]+|\\\n)
 |(?P<marker>(?<![^\n])\#[^\n]*)
 |(?P<comment>//[^\n]*|/\*.*?\*/)
 |(?P<str>(?:u8|u|U|L)?"(?:\\.|[^"\\\n])*")
 |(?P<chr>(?:u8|u|U|L)?'(?:\\.|[^'\\\n])*')
 |(?P<num>\.?[0-9](?:[eEpP][+-]|[A-Za-z0-9_.']|)*)
 |(?P<id>[A-Za-z_][A-Za-z0-9_]*)
 |(?P<punct>::|->|.)
""", re.S | re.X)
MARKER_RE = re.compile(r'#\s*(?:line\s+)?(\d+)\s+"((?:\\.|[^"\\])*)"')
IDENT_RE = re.compile(r"[A-Za-z_]\w*$")


class LowerError(Exception):
    pass


class Tok:
    __slots__ = ("kind", "text", "file", "line")

    def __init__(self, kind, text, file, line):
        self.kind, self.text, self.file, self.line = kind, text, file, line


def tokenize(src, fname):
    toks, file, line = [], fname, 1
    for m in TOKEN_RE.finditer(src):
        kind, text = m.lastgroup, m.group()
        toks.append(Tok(kind, text, file, line))
        if kind == "marker":
            mm = MARKER_RE.match(text)
            if mm:  # the marker's own newline follows, so the next line is N
                file, line = mm.group(2), int(mm.group(1)) - 1
        line += text.count("\n")
    return toks


def float_literal(text):
    """MSL floating literals are float (there is no double); an `h` suffix makes a half."""
    low = text.lower().replace("'", "")
    if not (("p" in low) if low.startswith("0x") else ("." in low or "e" in low)):
        return text  # an integer
    if low.endswith("h"):
        return f"((half){text[:-1]}f)"
    if low.endswith(("f", "l")):
        return text
    return text + "f"


def top_level(texts):
    """Token texts not nested in (), [], {} or <> (the brackets themselves included)."""
    out, depth = [], 0
    for t in texts:
        if t in ")]}>":
            depth -= 1
        if depth == 0:
            out.append(t)
        if t in "([{<":
            depth += 1
    return out


def split_top(items, sep=","):
    """Split token texts at top-level separators (outside (), [], {}, <>)."""
    parts, cur, depth = [], [], 0
    for x in items:
        t = x if isinstance(x, str) else x[1]
        if t in "([{<":
            depth += 1
        elif t in ")]}>":
            depth -= 1
        if t == sep and depth == 0:
            parts.append(cur)
            cur = []
        else:
            cur.append(x)
    if cur:
        parts.append(cur)
    return parts


class Lowering:
    def __init__(self, src, fname):
        self.toks = tokenize(src, fname)
        self.sig = [i for i, t in enumerate(self.toks) if t.kind not in ("ws", "nl", "comment", "marker")]
        self.replace = {}    # token index -> replacement text
        self.kernels = {}    # qualified name -> definition info
        self.hosts = []      # host kernels: dict(name, fexpr, base, ns, where)
        self.fc_names = set()
        self.scopes = []     # ("ns", name) | ("class",) | ("code", tg_sizes) | ("other",)

    # ---- helpers over significant tokens ----
    def t(self, k):
        return self.toks[self.sig[k]].text if 0 <= k < len(self.sig) else ""

    def tok(self, k):
        return self.toks[self.sig[min(k, len(self.sig) - 1)]]

    def where(self, k):
        tk = self.tok(k)
        return f"{tk.file}:{tk.line}"

    def error(self, k, msg):
        raise LowerError(f"{self.where(k)}: error: {msg}")

    def set(self, k, text):
        self.replace[self.sig[k]] = text

    def blank(self, a, b):
        for k in range(a, b):
            self.set(k, "")

    def close_of(self, k, open_, close):
        depth = 0
        for j in range(k, len(self.sig)):
            x = self.t(j)
            if x == open_:
                depth += 1
            elif x == close:
                depth -= 1
                if depth == 0:
                    return j
        self.error(k, f"unbalanced '{open_}'")

    def attr_end(self, k):
        """self.t(k) == '[' == self.t(k+1): index after the closing ']]'."""
        return self.close_of(k, "[", "]") + 1

    def parse_attrs(self, k):
        """Attributes of the [[...]] starting at k -> [(name, [arg token indices])], end index."""
        end = self.attr_end(k)
        out = []
        for part in split_top([(j, self.t(j)) for j in range(k + 2, end - 2)]):
            if not part:
                continue
            name = part[0][1]
            j = 1
            while j + 1 < len(part) and part[j][1] == "::":
                name += "::" + part[j + 1][1]
                j += 2
            args = [i for i, _ in part[j + 1:-1]] if j < len(part) and part[j][1] == "(" else []
            out.append((name, args))
        return out, end

    def text(self, ks):
        return " ".join(self.t(k) for k in ks)

    def in_code(self):
        return any(s[0] == "code" for s in self.scopes)

    def namespaces(self):
        return [s[1] for s in self.scopes if s[0] == "ns"]

    def ns_prefix(self):
        return "".join(n + "::" for n in self.namespaces() if n)

    def at_statement_start(self, k):
        return self.t(k - 1) in (";", "{", "}", ":", "")

    # ---- main pass ----
    def run(self):
        k, n = 0, len(self.sig)
        while k < n:
            x = self.t(k)
            kind = self.tok(k).kind
            if kind == "num":
                new = float_literal(x)
                if new != x:
                    self.set(k, new)
            elif x == "double":
                self.error(k, "'double' is not supported in MSL (use float)")
            elif x == "{":
                self.open_scope(k)
            elif x == "}":
                if self.scopes:
                    self.scopes.pop()
            elif self.in_code():
                if x in ("threadgroup", "const", "volatile") and self.at_statement_start(k):
                    k = self.threadgroup_decl(k)
                    continue
            elif x == "template" and (self.t(k + 1) == "kernel" or self.t(k + 1) == "[" == self.t(k + 2)):
                k = self.instantiation(k)
                continue
            elif x == "kernel" or (x == "[" == self.t(k + 1) and self.t(k - 1) != "["):
                end = self.kernel_decl(k)
                if end is not None:
                    k = end
                    continue
            elif x == "constant" and self.at_statement_start(k):
                k = self.program_constant(k)
                continue
            k += 1
        if self.scopes:
            raise LowerError("error: unbalanced braces at end of file")

    def open_scope(self, k):
        if self.in_code():
            self.scopes.append(("code", None))
            return
        j = k - 1
        while j >= 0 and self.t(j) not in (";", "{", "}"):
            j -= 1
        head = [self.t(i) for i in range(j + 1, k)]
        top, depth = [], 0
        for h in head:
            if h in "([<":
                depth += 1
            elif h in ")]>":
                depth -= 1
            elif depth == 0:
                top.append(h)
        if head[:1] == ["namespace"] or head[:2] == ["inline", "namespace"]:
            self.scopes.append(("ns", head[-1] if head[-1] != "namespace" else ""))
        elif "=" in top:
            self.scopes.append(("other",))
        elif any(h in ("struct", "class", "union", "enum") for h in top):
            self.scopes.append(("class",))
        elif "(" in head:
            self.scopes.append(("code", []))  # a function body: collects its threadgroup declarations
        else:
            self.scopes.append(("other",))

    def function_scope(self):
        for s in reversed(self.scopes):
            if s[0] == "code" and s[1] is not None:
                return s
        return None

    # ---- function-scope threadgroup variables ----
    def threadgroup_decl(self, k):
        j = k
        while self.t(j) in ("const", "volatile"):
            j += 1
        if self.t(j) != "threadgroup" or self.t(j + 1) == "(":
            return k + 1
        e, depth = j, 0
        while e < len(self.sig):
            x = self.t(e)
            if x in "([{":
                depth += 1
            elif x in ")]}":
                depth -= 1
            elif x == ";" and depth == 0:
                break
            e += 1
        body = list(range(j + 1, e))
        decls = split_top([(i, self.t(i)) for i in body])
        if {"*", "&"} & set(top_level(t for _, t in decls[0])):
            return e + 1  # a pointer or reference to threadgroup memory is ordinary C++
        for d in decls:
            if {"=", "{"} & set(top_level(t for _, t in d)):
                self.error(k, "a threadgroup variable cannot have an initializer in MSL")
        # The type is everything before the first declarator's name (the last identifier before '[').
        name_at = None
        for idx, (_, t) in enumerate(decls[0]):
            if t == "[":
                break
            if IDENT_RE.match(t):
                name_at = idx
        if name_at is None or name_at == 0:
            self.error(k, "cannot parse this threadgroup declaration")
        qual = " ".join(self.t(i) for i in range(k, j) if self.t(i) != "threadgroup")
        ty = (qual + " " + " ".join(t for _, t in decls[0][:name_at])).strip()
        declarators = [(decls[0][name_at][1], " ".join(t for _, t in decls[0][name_at + 1:]))]
        for d in decls[1:]:
            declarators.append((d[0][1], " ".join(t for _, t in d[1:])))
        scope = self.function_scope()
        out = []
        for name, dims in declarators:
            size = f"sizeof({ty} {dims})"
            scope[1].append(size)
            total = " + ".join(scope[1])
            out.append(
                f"static ::mslemu::TgDecl _mslemu_tg_{name}{{(uint32_t){size}, (uint32_t)alignof({ty}), \"{name}\"}}; "
                f"static_assert({total} <= {MAX_TG_MEMORY}, \"threadgroup memory declared in this function exceeds "
                f"the {MAX_TG_MEMORY}-byte limit\"); "
                f"threadgroup {ty} (&{name}) {dims} = "
                f"*(threadgroup {ty} (*) {dims})::mslemu::threadgroup_static(&_mslemu_tg_{name});")
        self.blank(k, e + 1)
        self.set(k, " ".join(out))
        return e + 1

    # ---- kernels ----
    def kernel_decl(self, k):
        """k starts `kernel ...` or an attribute list of a declaration; None if it is not a kernel."""
        j, attrs, spans = k, [], []
        while True:
            if self.t(j) == "kernel":
                attrs.append(("kernel", []))
                spans.append((j, j + 1))
                j += 1
            elif self.t(j) == "[" == self.t(j + 1):
                a, end = self.parse_attrs(j)
                attrs += a
                spans.append((j, end))
                j = end
            else:
                break
        names = [a for a, _ in attrs]
        if "kernel" not in names:
            return None
        for a, b in spans:
            self.blank(a, b)
        # return type and name: the identifier before the first '(' at this level
        p = j
        while p < len(self.sig) and self.t(p) != "(":
            if self.t(p) in (";", "{"):
                self.error(k, "cannot parse this kernel declaration")
            p += 1
        name = self.t(p - 1)
        close = self.close_of(p, "(", ")")
        params = self.kernel_params(k, name, p, close)
        if self.t(close + 1) != "{":
            return close + 1  # a declaration; the definition registers
        host, max_threads = name, None
        for a, args in attrs:
            if a == "host_name":
                host = "".join(re.findall(r'"((?:\\.|[^"\\])*)"', self.text(args)))
            elif a == "max_total_threads_per_threadgroup":
                max_threads = self.text(args)
                if max_threads.isdigit() and int(max_threads) > MAX_THREADS:
                    self.error(k, f"max_total_threads_per_threadgroup({max_threads}) exceeds the limit of "
                                  f"{MAX_THREADS} threads per threadgroup")
        qual = self.ns_prefix() + name
        template = self.is_template(k)
        if template and host != name:
            self.error(k, "[[host_name]] on a kernel template: name its explicit instantiations instead")
        self.kernels[qual] = dict(params=params, max_threads=max_threads, where=self.tok(k), name=name)
        if not template:
            self.hosts.append(dict(name=host, fexpr=qual, base=qual, ns=self.namespaces(), where=self.tok(k)))
        return close + 1

    def is_template(self, k):
        b = k - 1
        if self.t(b) != ">":
            return False
        depth = 0
        while b >= 0:
            if self.t(b) == ">":
                depth += 1
            elif self.t(b) == "<":
                depth -= 1
                if depth == 0:
                    return self.t(b - 1) == "template"
            b -= 1
        return False

    def kernel_params(self, k, name, p, close):
        params = []
        for part in split_top([(i, self.t(i)) for i in range(p + 1, close)]):
            idx = [i for i, _ in part]
            bind, rest = None, []
            i = 0
            while i < len(idx):
                q = idx[i]
                if self.t(q) == "[" == self.t(q + 1):
                    attrs, end = self.parse_attrs(q)
                    for a, args in attrs:
                        if a in BINDINGS:
                            bind = (BINDINGS[a], self.text(args) if args else "0")
                        elif a in UNSUPPORTED_PARAMS:
                            self.error(k, f"kernel '{name}': [[{a}]] parameters are not supported by mslemu")
                    self.blank(q, end)
                    while i < len(idx) and idx[i] < end:
                        i += 1
                    continue
                rest.append(self.t(q))
                i += 1
            if "sampler" in rest or any(t.startswith(("texture", "depth")) and nxt == "<" for t, nxt in zip(rest, rest[1:])):
                self.error(k, f"kernel '{name}': texture and sampler parameters are not supported by mslemu")
            if bind is None:
                if "*" in rest or "&" in rest:
                    bind = ("auto", None)  # MSL numbers unattributed buffers by position
                else:
                    self.error(k, f"kernel '{name}': parameter '{' '.join(rest)}' is passed by value without an "
                                  f"attribute; use a [[buffer(n)]] reference (e.g. constant Args& args [[buffer(0)]])")
            params.append(bind)
        return params

    def instantiation(self, k):
        e = k
        while self.t(e) != ";":
            e += 1
        host = None
        j = k + 1
        while j < e:
            if self.t(j) == "[" == self.t(j + 1):
                attrs, end = self.parse_attrs(j)
                for a, args in attrs:
                    if a == "host_name":
                        host = "".join(re.findall(r'"((?:\\.|[^"\\])*)"', self.text(args)))
                self.blank(j, end)
                j = end
                continue
            if self.t(j) == "kernel":
                self.set(j, "")
            j += 1
        depth, j = 0, k + 1
        while j < e:
            x = self.t(j)
            if x == "(":
                depth += 1
            elif x == ")":
                depth -= 1
            elif depth == 0 and IDENT_RE.match(x) and self.t(j + 1) == "<":
                c = self.close_of(j + 1, "<", ">")
                if self.t(c + 1) in (";", "("):
                    q = j
                    while self.t(q - 1) == "::" and IDENT_RE.match(self.t(q - 2)):
                        q -= 2
                    base = "".join(self.t(i) for i in range(q, j + 1))
                    fexpr = base + " ".join(self.t(i) for i in range(j + 1, c + 1))
                    if host is None:
                        self.error(k, "explicit kernel instantiation without [[host_name(\"...\")]]")
                    self.hosts.append(dict(name=host, fexpr=fexpr, base=base, ns=self.namespaces(), where=self.tok(k)))
                    return e + 1
            j += 1
        self.error(k, "cannot find the instantiated kernel in this explicit instantiation")

    # ---- program-scope constants ----
    def program_constant(self, k):
        e = k
        while self.t(e) != ";":
            e += 1
        items = [self.t(i) for i in range(k + 1, e)]
        if "[" in items and items[items.index("[") + 1:items.index("[") + 2] == ["["]:
            a = k + 1 + items.index("[")
            attrs, end = self.parse_attrs(a)
            fc = [args for name, args in attrs if name == "function_constant"]
            if not fc:
                return k + 1
            name = self.t(a - 1)
            ty = self.text(range(k + 1, a - 1))
            self.fc_names.add(name)
            self.blank(k, e + 1)
            self.set(k, f"static const ::mslemu::FunctionConstant<{ty}, (uint32_t)({self.text(fc[0])})> "
                        f"{name}{{\"{name}\"}};")
            return e + 1
        if "=" in items:
            eq = k + 1 + items.index("=")
            if any(self.t(i) in self.fc_names for i in range(eq + 1, e)):
                name = self.t(eq - 1)
                ty = self.text(range(k + 1, eq - 1))
                expr = self.text(range(eq + 1, e))
                self.blank(k, e + 1)
                self.set(k, f"static const ::mslemu::DerivedConstant<{ty}> {name}{{[]() -> {ty} {{ return {expr}; }}}};")
                return e + 1
        return k + 1

    # ---- output ----
    def output(self):
        return "".join(self.replace.get(i, tk.text) for i, tk in enumerate(self.toks))

    def find_kernel(self, host):
        base, ns = host["base"], host["ns"]
        prefix = "".join(n + "::" for n in ns if n)
        for cand in (prefix + base, base.lstrip(":")):
            if cand in self.kernels:
                return self.kernels[cand]
        for qual, info in self.kernels.items():
            if qual.endswith("::" + base):
                return info
        w = host["where"]
        raise LowerError(f"{w.file}:{w.line}: error: host_name \"{host['name']}\" instantiates '{base}', "
                         f"which is not a kernel defined in this file")

    def registration(self):
        lines = ['#line 1 "<mslemu registration>"']
        for i, h in enumerate(self.hosts):
            info = self.find_kernel(h)
            explicit = [idx for b, idx in info["params"] if b == "buffer"]
            claimed = "{" + ", ".join(f"(int)({x})" for x in explicit) + "}"
            ps, auto = [], 0
            for b, idx in info["params"]:
                if b == "auto":
                    ps.append(f"::mslemu::P<::mslemu::Bind::buffer, ::mslemu::auto_buffer_index({auto}, {claimed})>")
                    auto += 1
                else:
                    ps.append(f"::mslemu::P<::mslemu::Bind::{b}, (int)({idx})>")
            tg = [idx for b, idx in info["params"] if b == "threadgroup_memory"]
            max_threads = f"(uint32_t)({info['max_threads']})" if info["max_threads"] else str(MAX_THREADS)
            w = info["where"]
            kname = info["name"]
            opens = "".join(f"namespace {n} {{ " for n in h["ns"]) + "namespace { "
            closes = "} " * (len(h["ns"]) + 1)
            entry = f"_mslemu_entry_{i}"
            lines.append(
                f"{opens}\n"
                f"static_assert(::mslemu::all_distinct({claimed}), \"kernel '{kname}': two parameters use the same "
                f"[[buffer(n)]] index\");\n"
                f"static_assert(::mslemu::all_distinct({{{', '.join(f'(int)({x})' for x in tg)}}}), \"kernel "
                f"'{kname}': two parameters use the same [[threadgroup(n)]] index\");\n"
                f"static_assert({max_threads} <= {MAX_THREADS}, \"kernel '{kname}': "
                f"max_total_threads_per_threadgroup exceeds {MAX_THREADS}\");\n"
                f"using {entry} = ::mslemu::Entry<&{h['fexpr']}{''.join(', ' + p for p in ps)}>;\n"
                f"const ::mslemu::KernelInfo _mslemu_info_{i}{{\"{h['name']}\", &{entry}::invoke, {entry}::uses.data(), "
                f"(int){entry}::uses.size(), {max_threads}, {cstr(w.file)}, {w.line}}};\n"
                f"const ::mslemu::Registrar _mslemu_registrar_{i}(&_mslemu_info_{i});\n"
                f"{closes}")
        return "\n".join(lines) + "\n"


def cstr(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---------------------------------------------------------------------------------------------------------
# clang driver
# ---------------------------------------------------------------------------------------------------------
def find_clang(explicit):
    for c in (os.environ.get("MSLEMU_CLANG"), explicit, "clang++-19", "clang++"):
        if c and shutil.which(c):
            return c
    sys.exit("mslemu: error: clang++ not found (set MSLEMU_CLANG)")


def preprocess(clang, metal, args):
    cmd = [clang, "-E", "-x", "c++", "-std=c++17", "-nostdinc", "-nostdinc++", "-DMSLEMU_SCAN=1",
           f"-D__METAL_VERSION__={args.metal_version}", "-D__METAL__=1", "-DMSLEMU=1", "-I", INCLUDE]
    if args.metal_version >= 310:
        cmd.append("-D__HAVE_BFLOAT__=1")
    if args.metal_version >= 400:
        cmd.append("-D__HAVE_TENSOR__=1")
    cmd += [f"-D{d}" for d in args.define]
    for i in args.include:
        cmd += ["-I", i]
    r = subprocess.run(cmd + [metal], capture_output=True, text=True)
    if r.returncode:
        sys.stderr.write(r.stderr)
        sys.exit(r.returncode)
    return r.stdout


TENSOR_HEADERS = {os.path.join(INCLUDE, "metal_tensor"),
                  os.path.join(INCLUDE, "MetalPerformancePrimitives", "MetalPerformancePrimitives.h")}
TENSOR_MARK = "#define MSLEMU_TENSOR 1\n"


def kernel_flags(unit):
    """KERNEL_FLAGS, as C++20 for a tensor unit (matmul2d's descriptor is a class-type template argument)."""
    if unit.startswith(TENSOR_MARK):
        return ["-std=c++20" if f == "-std=c++17" else f for f in KERNEL_FLAGS]
    return KERNEL_FLAGS


def lower_file(clang, metal, args):
    """-> (translation unit text, source files it came from, host kernel names)"""
    pre = preprocess(clang, metal, args)
    try:
        lw = Lowering(pre, metal)
        lw.run()
        unit = '#include "mslemu/msl.h"\n' + lw.output() + "\n" + lw.registration()
        # A unit that includes the Metal 4 tensor headers gets the tensor shim (mslemu/tensor.h) and C++20.
        if any(os.path.abspath(m.group(2)) in TENSOR_HEADERS for m in MARKER_RE.finditer(pre)):
            unit = TENSOR_MARK + unit
    except LowerError as e:
        sys.stderr.write(f"{e}\n")
        sys.exit(1)
    sources = sorted({os.path.abspath(m.group(2)) for m in MARKER_RE.finditer(pre)
                      if not m.group(2).startswith("<") and os.path.exists(m.group(2))})
    return unit, sources, [h["name"] for h in lw.hosts]


def write_if_changed(path, text):
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(path, "w") as f:
        f.write(text)


def dep_escape(p):
    return p.replace(" ", "\\ ")


def read_depfile(path):
    with open(path) as f:
        text = f.read().replace("\\\n", " ")
    deps = text.split(":", 1)[1] if ":" in text else ""
    return [d.replace("\x00", " ") for d in deps.replace("\\ ", "\x00").split()]


def write_depfile(path, target, deps):
    with open(path, "w") as f:
        f.write(dep_escape(target) + ": " + " \\\n  ".join(dep_escape(d) for d in deps) + "\n")


def compile_unit(clang, cpp, obj, flags, depfile, extra_deps):
    cmd = [clang, *flags, "-I", INCLUDE, f"-O{os.environ.get('MSLEMU_OPT', '2')}", "-c", cpp, "-o", obj]
    if depfile:
        cmd += ["-MD", "-MF", depfile + ".clang"]
    r = subprocess.run(cmd)
    if r.returncode:
        sys.exit(r.returncode)
    if depfile:
        deps = read_depfile(depfile + ".clang")
        os.remove(depfile + ".clang")
        write_depfile(depfile, obj, [os.path.abspath(d) for d in deps] + extra_deps + [os.path.abspath(__file__)])


def builtins_library(clang):
    # __truncsfbf2 (float -> bfloat) and friends are in compiler-rt's builtins, not in Debian 12's libgcc.
    r = subprocess.run([clang, "--rtlib=compiler-rt", "-print-libgcc-file-name"], capture_output=True, text=True)
    path = r.stdout.strip()
    return [path] if r.returncode == 0 and os.path.exists(path) else []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["check", "lower", "compile", "runtime", "link"])
    ap.add_argument("inputs", nargs="*")
    ap.add_argument("-o", dest="out")
    ap.add_argument("-I", dest="include", action="append", default=[])
    ap.add_argument("-D", dest="define", action="append", default=[])
    ap.add_argument("--metal-version", type=int, default=310)
    ap.add_argument("--depfile")
    ap.add_argument("--clang")
    args = ap.parse_intermixed_args()
    clang = find_clang(args.clang)

    if args.mode in ("check", "lower", "compile"):
        if len(args.inputs) != 1:
            ap.error("expected one .metal file")
        metal = args.inputs[0]
        unit, sources, hosts = lower_file(clang, metal, args)
        if args.mode == "check":
            with tempfile.NamedTemporaryFile("w", suffix=".cpp", prefix="mslemu_check_") as f:
                f.write(unit)
                f.flush()
                r = subprocess.run([clang, *kernel_flags(unit), "-I", INCLUDE, "-fsyntax-only", f.name])
            if r.returncode == 0:
                print(f"{metal}: OK ({len(hosts)} kernels: {', '.join(hosts)})")
            sys.exit(r.returncode)
        if not args.out:
            ap.error("-o is required")
        if args.mode == "lower":
            write_if_changed(args.out, unit)
            return
        cpp = os.path.splitext(args.out)[0] + ".cpp"
        write_if_changed(cpp, unit)
        compile_unit(clang, cpp, args.out, kernel_flags(unit), args.depfile, sources)
    elif args.mode == "runtime":
        compile_unit(clang, RUNTIME, args.out, COMMON_FLAGS + ["-Wall", "-Wextra"], args.depfile, [])
    elif args.mode == "link":
        cmd = [clang, "-shared", "-o", args.out, *args.inputs, "-lboost_context", "-lpthread",
               *builtins_library(clang), "-Wl,--exclude-libs,ALL", "-Wl,-z,defs"]
        r = subprocess.run(cmd)
        sys.exit(r.returncode)


if __name__ == "__main__":
    main()
