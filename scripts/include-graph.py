#!/usr/bin/env python3
"""The import arrows of common/: which file includes which project header,
and which file calls (or otherwise uses) a function or object another file
defines.

  scripts/include-graph.py [BUILD]     (BUILD: the build tree, default build)

Sections printed:
  includes    FILE -> HEADER for every #include "..." of common/ (also
              common/cpu/, common/cuda/), resolved the way the compiler
              does: the including file's folder first, then the -I folders
              of the Makefile in their order. Headers found outside
              common/ are marked "(outside common/)".
  calls       FILE -> FILE (symbols) for the objects of common/*.c and
              common/cpu/*.c in BUILD/obj (nm: a symbol one object leaves
              undefined and another defines); absent objects are named.
  leaving     the arrows of both kinds that leave common/.
  circles     the files that reach each other through call and include
              arrows together (strongly connected components of more than
              one file), each with the arrows inside it.

The output is sorted and has no timestamps, so two runs diff cleanly.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("BUILD", "build")
INC_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def makefile_include_dirs():
    """The -I folders of INCLUDES in the Makefile, in order, plus those the
    CUDA rules add; BUILD/gen stays symbolic."""
    dirs = []
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    for var in ("INCLUDES", "NVCC_FLAGS", "CUDA_CFLAGS"):
        m = re.search(r"^%s\s*:?=((?:.*\\\n)*.*)$" % var, text, re.M)
        if not m:
            continue
        for d in re.findall(r"-I(\S+)", m.group(1)):
            d = d.replace("$(BUILD)", BUILD)
            if d.startswith("$(") or d.startswith("/"):
                continue
            if d not in dirs:
                dirs.append(d)
    return dirs


def sources():
    out = []
    for sub in ("common", "common/cpu", "common/cuda"):
        p = os.path.join(ROOT, sub)
        if not os.path.isdir(p):
            continue
        for n in sorted(os.listdir(p)):
            if n.endswith((".c", ".h", ".cu")):
                out.append(sub + "/" + n)
    return out


def resolve(including, name, dirs):
    for d in [os.path.dirname(including)] + dirs:
        cand = os.path.normpath(os.path.join(d, name))
        if os.path.isfile(os.path.join(ROOT, cand)):
            return cand
    return None


def include_arrows(files, dirs):
    """Also follows the headers outside common/ that common/ reaches, so
    what such a header pulls in is shown too."""
    arrows, todo, seen = [], list(files), set(files)
    while todo:
        f = todo.pop(0)
        with open(os.path.join(ROOT, f), errors="replace") as fh:
            for line in fh:
                m = INC_RE.match(line)
                if not m:
                    continue
                target = resolve(f, m.group(1), dirs)
                if target is None:
                    target = "?" + m.group(1)
                elif target.startswith(BUILD + "/"):
                    target = "(generated) " + target
                elif target not in seen:
                    seen.add(target)
                    todo.append(target)
                arrows.append((f, target))
    return sorted(set(arrows))


def nm_symbols(obj):
    """(defined, undefined) global symbol names of one object."""
    res = subprocess.run(["nm", "-g", obj], capture_output=True, text=True)
    if res.returncode != 0:
        return None
    defined, undefined = set(), set()
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRCVWGS" and parts[1] != "U":
            defined.add(parts[2])
    return defined, undefined


def call_arrows(files):
    objs, missing = {}, []
    for f in files:
        if not f.endswith(".c") or f.startswith("common/cuda/"):
            continue
        o = os.path.join(ROOT, BUILD, "obj", f[:-2] + ".o")
        syms = nm_symbols(o) if os.path.isfile(o) else None
        if syms is None:
            missing.append(f)
        else:
            objs[f] = syms
    owner = {}
    for f, (defined, _) in objs.items():
        for s in defined:
            owner.setdefault(s, f)
    arrows = {}
    for f, (_, undefined) in objs.items():
        for s in undefined:
            g = owner.get(s)
            if g and g != f:
                arrows.setdefault((f, g), set()).add(s)
    return arrows, missing


def circles(edges):
    """Strongly connected components (Tarjan, iterative) of more than one
    node."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return sorted(comps)


# The parts of common/ for the summary by part, first match wins; the rest
# of common/ is "core". Headers outside common/ count by their folder.
PARTS = [
    ("cpu", lambda f: f.startswith("common/cpu/")),
    ("cuda", lambda f: f.startswith("common/cuda/")),
    ("autodiff", lambda f: re.match(r"common/autodiff(_rules)?\.[ch]$", f)),
    ("ops", lambda f: re.match(r"common/(op|op_check|op_cost|ops_\w+)\.c$|common/ops_plan\.h$", f)),
    ("graph", lambda f: re.match(r"common/(graph|op_record)\.[ch]$", f)),
    ("wire", lambda f: re.match(r"common/(frame|wire_req)\.[ch]$", f)),
    ("core", lambda f: f.startswith("common/")),
]


def part(f):
    for name, test in PARTS:
        if test(f):
            return name
    return os.path.dirname(f) + "/"


def inside(path):
    return path.startswith(("common/", "?"))


def main():
    dirs = makefile_include_dirs()
    files = sources()
    inc = include_arrows(files, dirs)
    calls, missing = call_arrows(files)

    print("# import arrows of common/ (scripts/include-graph.py)")
    print("# -I order: " + " ".join(dirs))
    print()
    print("## includes (file -> project header)")
    for a, b in inc:
        mark = "" if inside(b) else "  (outside common/)"
        print("%s -> %s%s" % (a, b, mark))
    print()
    print("## calls (file -> file that defines what it uses; from nm of %s/obj)" % BUILD)
    if missing:
        print("# objects not found, left out: " + " ".join(missing))
    for (a, b) in sorted(calls):
        print("%s -> %s (%s)" % (a, b, " ".join(sorted(calls[(a, b)]))))
    print()
    print("## leaving common/")
    out = [(a, b) for a, b in inc if a.startswith("common/") and not inside(b)]
    for a, b in out:
        print("include %s -> %s" % (a, b))
    if not out:
        print("(none)")
    print()
    edges = set(calls) | {(a, b) for a, b in inc if not b.startswith(("?", "("))}
    print("## by part (%s; calls and includes together)"
          % ", ".join("%s" % n for n, _ in PARTS))
    pedges = {}
    for a, b in edges:
        pa, pb = part(a), part(b)
        if pa != pb:
            pedges.setdefault((pa, pb), []).append("%s -> %s" % (a, b))
    for (a, b) in sorted(pedges):
        ex = sorted(pedges[(a, b)])
        print("%s -> %s (%d: %s%s)" % (a, b, len(ex), ", ".join(ex[:3]),
                                      ", ..." if len(ex) > 3 else ""))
    pcomps = circles(set(pedges))
    for comp in pcomps:
        print("circle of parts: " + " ".join(comp))
    if not pcomps:
        print("no circle between parts")
    print()
    print("## circles (files that reach each other by calls or includes)")
    comps = circles(edges)
    for comp in comps:
        members = set(comp)
        print("circle of %d files: %s" % (len(comp), " ".join(comp)))
        for a, b in sorted(edges):
            if a in members and b in members:
                kind = "calls" if (a, b) in calls else "includes"
                print("  %s %s %s" % (a, kind, b))
    if not comps:
        print("(none)")


if __name__ == "__main__":
    main()
