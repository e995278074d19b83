#!/usr/bin/env python3
"""Import graph of loxi-user's library modules, from `crate::` and `super::` paths.

Usage: scripts/import-graph.py [SRC_DIR]   (default: loxi-user/src)

Reads every non-test `.rs` file under SRC_DIR (test-only modules, i.e. `#[cfg(test)] mod x;`
files and the inline `#[cfg(test)] mod ... {}` tail of a file, are skipped), resolves each
`crate::a::b::...` path (in `use` lines, grouped `use crate::{...}` included, and inline) and
each `super::...` path to the longest module that exists, and prints:

  1. back-edges: an import from a module to a top-level module of a HIGHER layer (LAYERS
     below; the docs/architecture.md table), with the importing file and path;
  2. cycles between top-level modules (strongly connected components);
  3. cycles between files inside one top-level module.

Exit status is 0; the output is the report (the closing note of issue 10 quotes it).
"""
import os
import re
import sys
from collections import defaultdict

# Layer of each top-level module: a module may import only its own layer or lower ones.
LAYERS = {
    "request": 0, "rules": 0, "certs": 0, "metrics": 0, "listen": 0,
    "routing": 1, "kv": 1, "pd": 1, "health": 1, "netlink": 1, "l4": 1, "telemetry": 1,
    "proxy": 2, "api": 2, "cli": 2,
    "app": 3, "config": 3, "bin": 3,
}

PATH_RE = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
GROUP_RE = re.compile(r"\buse\s+(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{", re.S)


def module_of(rel):
    parts = rel[:-3].split("/")
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


def test_only_children(text):
    """Names of `mod x;` declared right after a #[cfg(test)] attribute."""
    return set(re.findall(r"#\[cfg\((?:test|any\(test[^)]*\))\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+(\w+)\s*;", text))


def strip_tests(text):
    m = re.search(r"#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+\w+\s*\{", text)
    text = text[: m.start()] if m else text
    # drop comments (doc links mention paths that are not imports)
    return re.sub(r"//[^\n]*", "", text)


def group_items(text, start):
    """Top-level comma-separated items of the brace group opening at text[start-1]."""
    depth, cur, out, i = 1, "", [], start
    while i < len(text) and depth:
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                break
        if c == "," and depth == 1:
            out.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    out.append(cur)
    return [re.sub(r"\s+", "", x) for x in out if x.strip()]


def load(src):
    files, skip = {}, set()
    for root, _, names in os.walk(src):
        for n in names:
            if n.endswith(".rs"):
                rel = os.path.relpath(os.path.join(root, n), src)
                files[rel] = open(os.path.join(root, n), encoding="utf-8").read()
    for rel, text in files.items():
        mod = module_of(rel)
        for child in test_only_children(text):
            skip.add(mod + (child,))
    mods = {module_of(r): r for r in files}
    keep = {}
    for rel, text in files.items():
        mod = module_of(rel)
        name = os.path.basename(rel)
        if (any(mod[: len(s)] == s for s in skip) or rel.startswith("bin/")
                or name.endswith("_tests.rs") or name in ("tests.rs", "testutil.rs", "test_util.rs")):
            continue
        keep[rel] = strip_tests(text)
    return keep, set(mods)


def resolve(mod, is_mod_rs, kind, segs, mods):
    if kind == "crate":
        base = ()
    else:
        base = mod[:-1]
        # `super` in a/b.rs (module a::b) is a; in a/mod.rs (module a) it is the crate root
        while segs and segs[0] == "super":
            base, segs = base[:-1], segs[1:]
    full = base + tuple(segs)
    for n in range(len(full), 0, -1):
        if full[:n] in mods:
            return full[:n]
    return None


def edges(files, mods):
    out = []
    for rel, text in files.items():
        mod = module_of(rel)
        is_mod_rs = rel.endswith("mod.rs") or rel == "lib.rs"
        paths = []
        for m in GROUP_RE.finditer(text):
            prefix = [s for s in m.group(2).split("::") if s]
            for item in group_items(text, m.end()):
                item = item.split("{")[0]
                segs = prefix + [s for s in item.split("::") if s and s not in ("self", "*")]
                paths.append((m.group(1), segs))
        for m in PATH_RE.finditer(text):
            paths.append((m.group(1), [s for s in m.group(2).split("::") if s]))
        for kind, segs in paths:
            tgt = resolve(mod, is_mod_rs, kind, segs, mods)
            if tgt and tgt[:1] != mod[:1] or (tgt and tgt != mod and tgt[:1] == mod[:1]):
                out.append((rel, mod, tgt, kind + "::" + "::".join(segs)))
    return out


def sccs(nodes, adj):
    index, low, stack, on, res, i = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = i[0]
        i[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                res.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return res


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "loxi-user/src"
    files, mods = load(src)
    es = edges(files, mods)
    print(f"# import graph of {src}: {len(files)} non-test files, {len(es)} crate/super paths")
    print("\n## back-edges (lower layer imports a higher one)")
    back = defaultdict(set)
    for rel, mod, tgt, path in es:
        a, b = mod[0] if mod else "lib", tgt[0]
        if a != b and LAYERS.get(a, 9) < LAYERS.get(b, 9):
            back[(a, b)].add((rel, path))
    n = 0
    for (a, b), sites in sorted(back.items()):
        print(f"{a} (layer {LAYERS.get(a)}) -> {b} (layer {LAYERS.get(b)}): {len(sites)} paths")
        for rel, path in sorted(sites):
            print(f"    {rel}: {path}")
        n += len(sites)
    print(f"total: {len(back)} module pairs, {n} paths")
    top = defaultdict(set)
    sub = defaultdict(set)
    for rel, mod, tgt, _ in es:
        if not mod:
            continue
        if mod[0] != tgt[0]:
            top[mod[0]].add(tgt[0])
        elif mod != tgt:
            sub[mod].add(tgt)
    print("\n## cycles between top-level modules")
    cyc = sccs(set(top) | {t for v in top.values() for t in v}, top)
    for c in cyc:
        print("  " + " <-> ".join(c))
    print(f"total: {len(cyc)}")
    print("\n## cycles between files inside one top-level module")
    subn = set(sub) | {t for v in sub.values() for t in v}
    # a parent module (mod.rs) re-exporting its children is not a cycle worth reporting
    adj = {v: {w for w in ws if not (len(w) < len(v) and v[: len(w)] == w)} for v, ws in sub.items()}
    cyc2 = sccs(subn, adj)
    for c in cyc2:
        print("  " + " <-> ".join("::".join(m) for m in c))
    print(f"total: {len(cyc2)}")


if __name__ == "__main__":
    main()
