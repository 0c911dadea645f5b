#!/usr/bin/env python3
"""Checks that #include edges between modules point one way, down the layer order.

The order is not written here: it is read from the ```layers block of docs/architecture.md
(top line = highest layer), so the document and the check cannot drift apart. A module may
include modules on lower lines; modules on one line are peers and include neither each other
nor anything above them. Generated protobuf headers ("vocabpipe/v1/x.pb.h") belong to the
folder that holds x.proto. Headers outside the project (absl, gloo, system) are not checked.

Usage: check_layers.py SOURCE_DIR        exit 0 when every edge points down, 1 otherwise.
       check_layers.py --self-test       the check itself: a tiny tree with one edge up, one
                                         between peers and one down must give two errors.
"""
import os
import re
import sys

# Edges allowed against the order, each with its reason. Keep this list short: today it is
# empty (the worker executes plans from proto/plan and never calls the planner).
EXCEPTIONS = set()

SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")
CHECKED_ROOTS = ("proto", "worker", "coordinator", "client")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def read_layers(root):
    text = open(os.path.join(root, "docs", "architecture.md"), encoding="utf-8").read()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    if not block:
        sys.exit("docs/architecture.md has no ```layers block")
    layers = []
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            layers.append(line.split())
    # rank 0 = lowest layer
    rank = {}
    for i, line in enumerate(reversed(layers)):
        for module in line:
            rank[module] = i
    return rank


def module_of(path, rank):
    """The longest listed module that is a folder prefix of path, or None."""
    best = None
    for module in rank:
        if path.startswith(module + "/") and (best is None or len(module) > len(best)):
            best = module
    return best


def proto_folders(root):
    """vocabpipe/v1/<name> -> the project folder holding <name>.proto."""
    where = {}
    for base, _, files in os.walk(os.path.join(root, "proto")):
        for f in files:
            if f.endswith(".proto"):
                rel = os.path.relpath(base, root)
                where[f[: -len(".proto")]] = rel
    return where


def excepted(src_module, include):
    for who, what in EXCEPTIONS:
        if who.endswith("/*"):
            if not src_module.startswith(who[:-2]):
                continue
        elif who != src_module:
            continue
        if include == what:
            return True
    return False


def self_test():
    import tempfile
    with tempfile.TemporaryDirectory() as root:
        def write(rel, text):
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            open(os.path.join(root, rel), "w").write(text)
        write("docs/architecture.md", "```layers\nclient\nworker/a worker/b\nproto/x\n```\n")
        write("proto/x/x.h", '#include "client/c.h"\n')          # up: wrong
        write("worker/a/a.h", '#include "worker/b/b.h"\n')        # peer: wrong
        write("worker/b/b.h", '#include "proto/x/x.h"\n')         # down: fine
        write("client/c.h", '#include "worker/a/a.h"\n#include <vector>\n')  # down: fine
        errors = check(root)
    expected = ["proto/x/x.h:1: proto/x includes client/c.h (client, a higher layer)",
                "worker/a/a.h:1: worker/a includes worker/b/b.h (worker/b, a peer)"]
    if errors != expected:
        print("self-test failed:", errors)
        return 1
    print("self-test passed")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    errors = check(root)
    return 1 if errors else 0


def check(root):
    rank = read_layers(root)
    protos = proto_folders(root)
    errors, unplaced, edges = [], set(), 0
    for top in CHECKED_ROOTS:
        for base, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.relpath(os.path.join(base, f), root)
                src = module_of(path, rank)
                if src is None:
                    unplaced.add(os.path.dirname(path))
                    continue
                for n, line in enumerate(open(os.path.join(root, path), encoding="utf-8",
                                              errors="replace"), 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    inc = m.group(1)
                    target = inc
                    pb = re.match(r"vocabpipe/v1/(\w+?)\.(grpc\.)?pb\.h$", inc)
                    if pb and pb.group(1) in protos:
                        target = protos[pb.group(1)] + "/x"
                    dst = module_of(target, rank)
                    if dst is None or dst == src:
                        continue
                    edges += 1
                    if rank[dst] < rank[src] or excepted(src, inc):
                        continue
                    how = "a peer" if rank[dst] == rank[src] else "a higher layer"
                    errors.append(f"{path}:{n}: {src} includes {inc} ({dst}, {how})")
    for folder in sorted(unplaced):
        print(f"note: {folder} is in no layer of docs/architecture.md; not checked")
    for e in errors:
        print(e)
    print(f"{edges} cross-module includes checked against {len(rank)} modules; "
          f"{len(errors)} point the wrong way")
    return errors


if __name__ == "__main__":
    sys.exit(main())
