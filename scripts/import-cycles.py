#!/usr/bin/env python3
"""Lists import circles between the modules of each crate, and fails on any
that the allow-list does not name.

A module is one source file (`foo.rs`, `foo/mod.rs`). Module `a` imports
module `b` when `a`'s code, outside its tests, names an item of `b` by a
path: a `use` line or a path in code, through `crate::`, `super::`,
`self::` or a child module's name. Names re-exported by `use` are followed
to the module that defines them. A module naming an item of one of its
ancestors (`use super::Error` in a folder's file) is not counted: the
folder's `mod.rs` is its front, and every folder would otherwise be a
circle. A strongly connected set of two or more modules is a circle.

Usage: scripts/import-cycles.py [--allow FILE] [CRATE_DIR ...]
  (by default every crate under crates/). The allow-list holds known
  circles, each `crate: module module ...`, going on over indented lines
  (`#` starts a comment); a circle passes when all its modules are in one
  entry, so a known circle may shrink but not grow. Exit status 1 on any
  other circle.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def strip(text):
    """The code with comments removed and string and char literals emptied,
    so that a path inside either is not an import."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        out.append("\n")
                    i += 1
        elif (m := re.compile(r'b?r(#*)"').match(text, i)) and (
            i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
        ):
            end = text.find('"' + m.group(1), m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and (m := re.compile(r"'(\\.[^']*|[^\\'])'").match(text, i)):
            out.append("' '")
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def without_tests(code):
    """The code without `#[cfg(test)]` items (test modules, test-only
    imports and functions), and the names of test-only child modules."""
    test_children = set()
    out, i = [], 0
    attr = re.compile(r"#\[cfg\(test\)\]")
    while (m := attr.search(code, i)) is not None:
        out.append(code[i : m.start()])
        j = m.end()
        decl = re.compile(r"\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")
        if d := decl.match(code, j):
            test_children.add(d.group(1))
            i = d.end()
            continue
        # Skip one item: up to its `;` or its balanced `{ ... }`.
        k, depth = j, 0
        while k < len(code):
            if code[k] == "{":
                depth += 1
            elif code[k] == "}":
                depth -= 1
                if depth == 0:
                    k += 1
                    break
            elif code[k] == ";" and depth == 0:
                k += 1
                break
            k += 1
        out.append("\n" * code.count("\n", m.start(), k))
        i = k
    out.append(code[i:])
    return "".join(out), test_children


def use_paths(tree):
    """The paths of one `use` tree, `a::{b, c::d as e}`, as (segments, alias)."""
    tree = re.sub(r"\s+as\s+", "@", tree)
    tree = re.sub(r"\s+", "", tree)
    results = []

    def walk(prefix, text):
        parts, depth, start = [], 0, 0
        for k, ch in enumerate(text):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(text[start:k])
                start = k + 1
        parts.append(text[start:])
        for part in filter(None, parts):
            brace = part.find("{")
            if brace >= 0:
                head = [s for s in part[:brace].split("::") if s]
                walk(prefix + head, part[brace + 1 : -1])
                continue
            path, _, alias = part.partition("@")
            segs = prefix + [s for s in path.split("::") if s]
            if segs and segs[-1] == "self":
                segs = segs[:-1]
            if segs and segs[-1] not in ("crate", "super", "self"):
                results.append((segs, alias or segs[-1]))

    walk([], tree)
    return results


class Module:
    def __init__(self, path, file):
        self.path = path  # tuple of names from the crate root
        self.file = file
        self.children = {}  # name -> tuple path
        self.uses = {}  # imported name -> absolute path (list)
        self.globs = []  # absolute module paths glob-imported
        self.refs = []  # (absolute path list, line)
        self.test_only = False


def load_crate(root_file):
    """Every module of the crate whose root is `root_file`."""
    modules = {}

    def load(path, file, test_only):
        m = Module(path, file)
        m.test_only = test_only
        modules[path] = m
        raw = strip(file.read_text(encoding="utf-8"))
        m.code, test_children = without_tests(raw)
        here = file.parent if file.name in ("mod.rs", "lib.rs", "main.rs") else file.with_suffix("")
        decl = re.compile(r"(?m)^[ \t]*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")
        for d in decl.finditer(raw):
            name = d.group(1)
            child = here / f"{name}.rs"
            if not child.exists():
                child = here / name / "mod.rs"
            if child.exists():
                m.children[name] = path + (name,)
                load(path + (name,), child, test_only or name in test_children)

    load((), root_file, False)
    return modules


def absolute(mod, segs, modules):
    """`segs` as a path from the crate root, or None for another crate."""
    if not segs:
        return None
    head, base = segs[0], list(mod.path)
    if head == "crate":
        return segs[1:]
    if head in ("super", "self"):
        k = 0
        while k < len(segs) and segs[k] in ("super", "self"):
            if segs[k] == "super":
                base = base[:-1]
            k += 1
        return base + segs[k:]
    if head in mod.children:
        return base + segs
    if head in mod.uses:
        return mod.uses[head] + segs[1:]
    return None


def scan(modules):
    ident_path = re.compile(r"(?<![\w:])((?:crate|super|self|[a-z_][a-z0-9_]*)(?:::[A-Za-z_]\w*)+)")
    use_stmt = re.compile(r"(?s)\buse\s+([^;]+);")
    for mod in modules.values():
        code = mod.code
        for u in use_stmt.finditer(code):
            line = code.count("\n", 0, u.start()) + 1
            for segs, alias in use_paths(u.group(1)):
                path = absolute(mod, segs, modules)
                if path is None:
                    continue
                if segs[-1] == "*":
                    mod.globs.append(path[:-1])
                    mod.refs.append((path[:-1], line))
                else:
                    if alias and alias != "_":
                        mod.uses[alias] = path
                    mod.refs.append((path, line))
        body = use_stmt.sub(lambda u: "\n" * u.group(0).count("\n"), code)
        for p in ident_path.finditer(body):
            segs = p.group(1).split("::")
            if segs[0] not in ("crate", "super", "self") and segs[0] not in mod.children:
                continue
            path = absolute(mod, segs, modules)
            if path is not None:
                mod.refs.append((path, body.count("\n", 0, p.start()) + 1))


def resolve(path, modules, depth=0):
    """The module that defines what `path` names, following re-exports."""
    path = tuple(path)
    k = len(path)
    while k > 0 and path[:k] not in modules:
        k -= 1
    owner = modules.get(path[:k])
    if owner is None:
        return None
    rest = path[k:]
    if rest and depth < 16:
        if rest[0] in owner.uses:
            target = resolve(list(owner.uses[rest[0]]) + list(rest[1:]), modules, depth + 1)
            if target is not None:
                return target
        defines = re.compile(
            r"\b(?:fn|struct|enum|trait|type|const|static|union|mod|macro_rules!)\s+" + re.escape(rest[0]) + r"\b"
        )
        if not defines.search(owner.code):
            for glob in owner.globs:
                target = resolve(list(glob) + list(rest), modules, depth + 1)
                if target is not None and target != tuple(glob):
                    return target
    return path[:k]


def cycles(modules):
    """The import graph's strongly connected sets of two or more modules,
    each with the imports that close it."""
    edges = {p: {} for p in modules if not modules[p].test_only}
    for p, mod in modules.items():
        if mod.test_only:
            continue
        for ref, line in mod.refs:
            target = resolve(ref, modules)
            if target is None or target == p or modules[target].test_only:
                continue
            if p[: len(target)] == target:  # an ancestor: the folder's front
                continue
            edges[p].setdefault(target, line)
    # Tarjan's algorithm, iterative.
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(edges[nxt])))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    scc.append(w)
                    if w == node:
                        break
                if len(scc) > 1:
                    members = set(scc)
                    closing = sorted(
                        (a, b, edges[a][b]) for a in members for b in edges[a] if b in members
                    )
                    out.append((sorted(members), closing))
    return out


def name(path):
    return "::".join(path) or "crate"


def main(argv):
    allow_file, dirs = None, []
    args = iter(argv)
    for a in args:
        if a == "--allow":
            allow_file = Path(next(args))
        else:
            dirs.append(Path(a))
    if not dirs:
        dirs = sorted(p.parent for p in (ROOT / "crates").glob("*/Cargo.toml"))
    allowed = []
    if allow_file:
        for raw in allow_file.read_text(encoding="utf-8").splitlines():
            line = raw.split("#", 1)[0]
            if not line.strip():
                continue
            if line[0].isspace() and allowed:  # the entry above goes on
                allowed[-1][1].update(line.split())
                continue
            krate, _, mods = line.partition(":")
            allowed.append((krate.strip(), set(mods.split())))
    failed, used = 0, set()
    for d in dirs:
        for root in ("src/lib.rs", "src/main.rs"):
            if not (d / root).exists():
                continue
            krate = d.name
            modules = load_crate(d / root)
            scan(modules)
            for members, closing in cycles(modules):
                names = {name(m) for m in members}
                known = [i for i, (k, mods) in enumerate(allowed) if k == krate and names <= mods]
                used.update(known)
                verdict = "known (allow-listed)" if known else "NEW"
                failed += not known
                print(f"{krate} ({root}): circle of {len(members)} modules, {verdict}")
                if known:
                    continue
                for a, b, line in closing:
                    src = modules[a].file.relative_to(d)
                    print(f"    {name(a)} -> {name(b)}    ({src}:{line})")
    for i, (krate, mods) in enumerate(allowed):
        if i not in used:
            print(f"note: the allow-list's circle in {krate} ({len(mods)} modules) is gone; remove its line")
    if failed:
        print(f"{failed} import circle(s) not on the allow-list: make the imports point one way")
        return 1
    print("no import circles beyond the allow-list" if allowed else "no import circles")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
