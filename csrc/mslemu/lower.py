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

and rejects what Apple's Metal compiler rejects but clang with the shim would accept (RULES below: each error
names its rule and the section of the Metal Shading Language Specification that states it).
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
# Every attribute a compute .metal file may spell (§5: MSL's own, and the C++ standard attributes it keeps).
KNOWN_ATTRIBUTES = set(BINDINGS) | set(UNSUPPORTED_PARAMS) | {
    "kernel", "host_name", "function_constant", "max_total_threads_per_threadgroup", "visible", "stitchable",
    "id", "grid_origin", "grid_size", "quadgroups_per_threadgroup", "dispatch_quadgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup", "user_annotation", "maybe_unused", "likely", "unlikely", "nodiscard",
    "fallthrough", "noreturn", "deprecated"}

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


# The Metal Shading Language rules this checker enforces beyond C++, with the specification section
# (MSL 3.2 numbering; tensors and Metal Performance Primitives are MSL 4.0) that states each.
RULES = {
    "double": "MSL has no double (§2.1 Scalar Data Types)",
    "tg-initializer": "threadgroup variables cannot be initialised (§4.4 threadgroup Address Space)",
    "by-value-param": "kernel arguments are buffers, textures, samplers or attributed built-ins "
                      "(§5.2.1 Locating Buffer, Texture, and Sampler Arguments)",
    "address-space": "a pointer or reference argument of a kernel needs an address space: device, constant, "
                     "threadgroup, ... (§4 Address Spaces)",
    "float-atomic": "atomic_float exists in device memory only; Apple's compiler rejects threadgroup and thread "
                    "float atomics (§2.6 Atomic Data Types, §6.15 Atomic Functions)",
    "grid-width": "the grid-position attributes of one kernel (thread_position_in_grid, threads_per_grid, "
                  "thread_position_in_threadgroup, threads_per_threadgroup, threadgroup_position_in_grid, "
                  "threadgroups_per_grid, dispatch_threads_per_threadgroup) share one component count "
                  "(§5.2.3.6 Kernel Function Input Attributes)",
    "recursion": "no recursive calls in kernel code (§1.5.4 Restrictions)",
    "function-pointer": "no function pointers or virtual calls: they need [[visible]] functions linked through "
                        "MTLLinkedFunctions, which these kernels do not use (§1.5.4 Restrictions, §5.1.4 Visible "
                        "Functions)",
    "tg-memory": f"at most {MAX_TG_MEMORY} bytes of threadgroup memory per threadgroup, static plus "
                 "setThreadgroupMemoryLength (§4.4 threadgroup Address Space; Metal feature set tables)",
    "max-threads": f"at most {MAX_THREADS} threads per threadgroup (§5.1.3 Kernel Functions, "
                   "max_total_threads_per_threadgroup; Metal feature set tables)",
    "version": "types and functions exist only from the MSL version that introduced them (§1.3 New in Metal, "
               "§2.1 bfloat: MSL 3.1; MSL 4.0 tensor types and Metal Performance Primitives)",
    "attribute": "an attribute must be one MSL defines, spelled as the specification spells it (§5 Function "
                 "and Variable Declarations)",
}

# Identifiers whose first MSL version is above what every Apple GPU compiles (__METAL_VERSION__ values).
# (name, next token or None) -> version; `tensor` counts only as the template `tensor<...>`.
VERSION_FLOORS = {
    **{(t, None): 230 for t in ("simdgroup_float8x8", "simdgroup_half8x8", "make_filled_simdgroup_matrix",
                                "simdgroup_multiply_accumulate", "simdgroup_matrix")},
    ("atomic_float", None): 300,
    **{(t, None): 310 for t in ("bfloat", "bfloat2", "bfloat3", "bfloat4", "simdgroup_bfloat8x8")},
    ("atomic_thread_fence", None): 320,
    **{(t, None): 400 for t in ("tensor_inline", "tensor_handle", "dextents", "extents", "matmul2d",
                                "matmul2d_descriptor", "execution_simdgroup", "execution_simdgroups",
                                "execution_thread", "cooperative_tensor")},
    ("tensor", "<"): 400,
    ("mpp", "::"): 400,
}

ADDRESS_SPACES = ("device", "constant", "threadgroup", "threadgroup_imageblock", "ray_data", "object_data")
GRID_ATTRIBUTES = ("thread_position_in_grid", "threads_per_grid", "thread_position_in_threadgroup",
                   "threads_per_threadgroup", "threadgroup_position_in_grid", "threadgroups_per_grid",
                   "dispatch_threads_per_threadgroup")
# Pairs whose types must be identical, not only of one width (§5.2.3.6).
GRID_TYPE_PAIRS = (("thread_position_in_grid", "threads_per_grid"),
                   ("thread_position_in_threadgroup", "threads_per_threadgroup"))
GRID_TYPE_RE = re.compile(r"(?:u?(?:int|short)|uint|ushort)([234]?)$")
# Words before '(' that are not calls.
NOT_CALLS = {"if", "for", "while", "switch", "return", "sizeof", "alignof", "decltype", "static_assert",
             "static_cast", "reinterpret_cast", "const_cast", "as_type", "operator", "template", "typename",
             "constexpr", "catch", "noexcept", "alignas", "defined"}


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


def function_name(head):
    """The name a function definition's head declares: the identifier before its first top-level '('."""
    depth = 0
    for i, h in enumerate(head):
        if h == "(" and depth == 0:
            return head[i - 1] if i and IDENT_RE.match(head[i - 1]) and head[i - 1] != "operator" else None
        if h in "([<":
            depth += 1
        elif h in ")]>":
            depth -= 1
    return None


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
    def __init__(self, src, fname, metal_version=310):
        self.metal_version = metal_version
        self.functions = {}  # name -> token index of each function body's '{' (overloads share a name)
        self.calls = {}      # caller name -> {callee name: token index of the first call}
        self.name_uses = []  # (token index, name): identifiers in code not called; function pointers if functions
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

    def rule_error(self, k, rule, msg):
        self.error(k, f"{msg} [MSL rule '{rule}': {RULES[rule]}]")

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
        self.check_tokens()
        k, n = 0, len(self.sig)
        while k < n:
            x = self.t(k)
            kind = self.tok(k).kind
            if kind == "num":
                new = float_literal(x)
                if new != x:
                    self.set(k, new)
            elif x == "double":
                self.rule_error(k, "double", "'double' is not supported in MSL (use float)")
            elif x == "{":
                self.open_scope(k)
            elif x == "}":
                if self.scopes:
                    self.scopes.pop()
            elif self.in_code():
                if x in ("threadgroup", "const", "volatile") and self.at_statement_start(k):
                    k = self.threadgroup_decl(k)
                    continue
                if kind == "id":
                    self.record_use(k)
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
        self.check_function_pointers()
        self.check_recursion()

    # ---- MSL rules over the token stream ----
    def check_tokens(self):
        """Attribute spellings, version floors, virtual calls and function-pointer declarators."""
        for k in range(len(self.sig)):
            x, kind = self.t(k), self.tok(k).kind
            if x == "[" == self.t(k + 1) and self.t(k - 1) != "[":
                for name, _ in self.parse_attrs(k)[0]:
                    if name not in KNOWN_ATTRIBUTES and not name.startswith("clang::"):
                        self.rule_error(k, "attribute", f"unknown attribute [[{name}]]")
            elif kind == "id":
                floor = VERSION_FLOORS.get((x, None)) or VERSION_FLOORS.get((x, self.t(k + 1)))
                if floor and floor > self.metal_version:
                    self.rule_error(k, "version", f"'{x}' needs MSL {floor // 100}.{floor % 100 // 10}; this file "
                                                  f"is compiled as MSL {self.metal_version // 100}."
                                                  f"{self.metal_version % 100 // 10}")
                if x == "virtual":
                    self.rule_error(k, "function-pointer", "virtual functions are not supported in MSL")
            elif x == "(" and self.t(k + 1) in ("*", "&"):
                # `(*name)(` / `(*)(` / `(&name)(`: a declarator of a function pointer or reference.
                j = k + 2 + (self.tok(k + 2).kind == "id")
                if self.t(j) == ")" and self.t(j + 1) == "(":
                    self.rule_error(k, "function-pointer", "a function pointer or reference is not supported in MSL")

    def current_function(self):
        s = self.function_scope()
        return s[2] if s else None

    def record_use(self, k):
        """An identifier in a function body: a call (an edge of the call graph) or a plain use."""
        x, prev, nxt = self.t(k), self.t(k - 1), self.t(k + 1)
        if x in NOT_CALLS or prev in (".", "->"):
            return
        if nxt == "(" or nxt == "<":
            self.calls.setdefault(self.current_function(), {}).setdefault(x, k)
        elif nxt != "::" and prev != "::":
            self.name_uses.append((k, x))

    def check_function_pointers(self):
        for k, x in self.name_uses:
            if x in self.functions:
                self.rule_error(k, "function-pointer", f"'{x}' names a function without calling it (a function "
                                                       f"pointer; pass a functor type as a template argument instead)")

    def check_recursion(self):
        graph = {f: [c for c in callees if c in self.functions] for f, callees in self.calls.items()
                 if f in self.functions}
        state = {}

        def visit(f, path):
            state[f] = "open"
            for c in graph.get(f, []):
                if state.get(c) == "open":
                    cycle = path[path.index(c):] + [c]
                    self.rule_error(self.calls[f][c], "recursion",
                                    f"recursive call {' -> '.join(cycle)} (overloads count as one function)")
                if c not in state:
                    visit(c, path + [c])
            state[f] = "done"

        for f in graph:
            if f not in state:
                visit(f, [f])

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
            name = function_name(head)
            if name:
                self.functions.setdefault(name, k)
            self.scopes.append(("code", [], name))  # a function body: collects its threadgroup declarations
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
        texts = [t for _, t in decls[0]]
        if "atomic_float" in texts or any(a == "atomic" and b == "<" and c == "float"
                                          for a, b, c in zip(texts, texts[1:], texts[2:])):
            self.rule_error(k, "float-atomic", "a threadgroup atomic_float")
        if {"*", "&"} & set(top_level(texts)):
            return e + 1  # a pointer or reference to threadgroup memory is ordinary C++
        for d in decls:
            if {"=", "{"} & set(top_level(t for _, t in d)):
                self.rule_error(k, "tg-initializer", "a threadgroup variable cannot have an initializer in MSL")
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
                f"the {MAX_TG_MEMORY}-byte limit [MSL rule 'tg-memory': {RULES['tg-memory']}]\"); "
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
                    self.rule_error(k, "max-threads", f"max_total_threads_per_threadgroup({max_threads}) exceeds "
                                                      f"the limit of {MAX_THREADS} threads per threadgroup")
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
        params, grid = [], []
        for part in split_top([(i, self.t(i)) for i in range(p + 1, close)]):
            idx = [i for i, _ in part]
            bind, rest, attr = None, [], None
            i = 0
            while i < len(idx):
                q = idx[i]
                if self.t(q) == "[" == self.t(q + 1):
                    attrs, end = self.parse_attrs(q)
                    for a, args in attrs:
                        if a in BINDINGS:
                            bind = (BINDINGS[a], self.text(args) if args else "0")
                            attr = a
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
            if ("*" in rest or "&" in rest) and not set(ADDRESS_SPACES) & set(rest):
                self.rule_error(k, "address-space", f"kernel '{name}': parameter '{' '.join(rest)}' is a pointer or "
                                                    f"reference without an address space")
            if bind is None:
                if "*" in rest or "&" in rest:
                    bind = ("auto", None)  # MSL numbers unattributed buffers by position
                else:
                    self.rule_error(k, "by-value-param", f"kernel '{name}': parameter '{' '.join(rest)}' is passed by "
                                                         f"value without an attribute; use a [[buffer(n)]] reference "
                                                         f"(e.g. constant Args& args [[buffer(0)]])")
            if attr in GRID_ATTRIBUTES:
                grid.append((attr, [t for t in rest[:-1] if t not in ("const", "volatile")]))
            params.append(bind)
        self.check_grid_widths(k, name, grid)
        return params

    def check_grid_widths(self, k, name, grid):
        """grid: [(attribute, type tokens)] of one kernel's grid-position parameters."""
        def width(ty):
            if ty[:1] == ["vec"] and len(ty) == 6:  # vec < uint , 3 >
                return int(ty[4])
            m = GRID_TYPE_RE.match(ty[-1]) if ty else None
            if not m:
                self.rule_error(k, "grid-width", f"kernel '{name}': '{' '.join(ty)}' is not a scalar or vector "
                                                 f"integer type for a grid-position attribute")
            return int(m.group(1) or 1)
        shown = ", ".join(f"{' '.join(ty)} [[{a}]]" for a, ty in grid)
        if len({width(ty) for _, ty in grid}) > 1:
            self.rule_error(k, "grid-width", f"kernel '{name}' mixes component counts: {shown}")
        types = dict((a, ty) for a, ty in grid)
        for a, b in GRID_TYPE_PAIRS:
            if a in types and b in types and types[a] != types[b]:
                self.rule_error(k, "grid-width", f"kernel '{name}': [[{a}]] and [[{b}]] need one type: {shown}")

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
        lw = Lowering(pre, metal, args.metal_version)
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
