"""How readable the trainer script is: figures of rc_train.py before -> after, printed side by side with targets.

Static figures (stdlib only): lines; words (whitespace-separated tokens of the text); prose share (words of comments,
found by `tokenize`, and of every expression-statement string, found by `ast`: module/class/function docstrings
and the strings under dataclass fields, quotes included, over all words); lines over 100 characters; the longest
functions (ast, `end_lineno - lineno + 1` from the `def` line, decorators excluded; methods and nested functions
included, as Class.name / outer.name); the longest top-level statement outside any def/class (the `__main__`
block); the most positional arguments in one call (a `*starred` one counts 1); the rc_train names other files use
(every .py of the tree but rc_train.py: `rc_train.X`, `from rc_train import X`, getattr/setattr(rc_train, "X")).

The step trace runs the real trainer (this interpreter, OMP_NUM_THREADS=1, cwd = the measured tree) on the task
`add` for 4 steps (so that the traced step queues a batch, as in a longer run) with a profiler (sys.setprofile in the
main thread, threading.setprofile in the threads it starts) on from the 2nd call of the marker to the 3rd: the whole
2nd step. The marker, `rc_rollout:Rollouts.take` (each step first takes its rollout batch), is wrapped as its module
is imported. It counts `call` events of functions defined in the tree's files (not .venv, not site-packages);
generator resumptions count as calls, comprehensions and genexprs are not functions here. Only the trainer process
is traced, not the rollout worker process (the CPU default --max-staleness 1 starts one).

    python -m benchmarks.page_figures [--before REV_OR_PATH] [--after PATH] [--no-trace] [--json FILE]
"""

import argparse
import ast
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_FLAGS = "--task add --num-steps 4 --eval-every 0 --no-eval-before --no-save-final --run-name page_trace"
TRACER = r"""
import functools, importlib.abc, importlib.machinery, json, os, runpy, sys, threading
root, marker, out = sys.argv[1:4]
(mod_name, qual), calls, state = marker.split(":"), {}, {"n": 0, "on": False}
def prof(frame, event, arg):
    if event == "call" and state["on"]:
        calls[frame.f_code] = calls.get(frame.f_code, 0) + 1
def dump():
    rows = [[os.path.relpath(c.co_filename, root), c.co_qualname, c.co_firstlineno, n] for c, n in calls.items()
            if not c.co_filename.startswith("<") and "site-packages" not in c.co_filename]
    json.dump([r for r in rows if not r[0].startswith(".")], open(out, "w"))
def patch(module):
    owner, (*parts, last) = module, qual.split(".")
    for part in parts:
        owner = getattr(owner, part)
    inner = getattr(owner, last)
    @functools.wraps(inner)
    def marked(*args, **kwargs):
        state["n"] += 1
        if state["n"] in (2, 3):
            state["on"] = state["n"] == 2
            sys.setprofile(prof if state["on"] else None)
            if not state["on"]:
                dump()
        return inner(*args, **kwargs)
    setattr(owner, last, marked)
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == mod_name:
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module
            spec.loader.exec_module = lambda module: (run(module), patch(module))
            return spec
sys.meta_path.insert(0, Hook())
threading.setprofile(prof)
sys.path[0], sys.argv = root, [os.path.join(root, "rc_train.py"), *sys.argv[4:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def text_figures(src: str) -> dict:
    """Lines, words, prose words (comments and expression-statement strings) and lines over 100 characters."""
    lines = src.splitlines()
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    prose = sum(len(t.string.split()) for t in tokens if t.type == tokenize.COMMENT)
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            prose += len(ast.get_source_segment(src, node.value).split())
    n, words, long = len(lines), len(src.split()), sum(len(line) > 100 for line in lines)
    shares = dict(prose_share=prose / max(words, 1), long_share=long / max(n, 1))
    return dict(lines=n, words=words, prose_words=prose, long_lines=long, **shares)


def function_lengths(src: str) -> list[tuple[str, int]]:
    """Every function's qualified name and lines (def line to last line, decorators excluded), longest first."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name + "."
                if not isinstance(child, ast.ClassDef):
                    found.append((prefix + child.name, child.end_lineno - child.lineno + 1))
            visit(child, name)

    visit(ast.parse(src), "")
    return sorted(found, key=lambda f: -f[1])


def longest_outside_functions(src: str) -> tuple[str, int]:
    """The longest top-level statement that is not a def, class or import: (its first line, shortened; lines)."""
    skip = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)
    best = ("", 0)
    for node in ast.parse(src).body:
        n = node.end_lineno - node.lineno + 1
        if not isinstance(node, skip) and n > best[1]:
            best = (src.splitlines()[node.lineno - 1].strip()[:32], n)
    return best


def positional_calls(src: str) -> tuple[int, int, str, int]:
    """The most positional arguments in one call: (count, line, callee, number of calls with more than 6)."""
    calls = [node for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Call)]
    top = max(calls, key=lambda c: (len(c.args), -c.lineno), default=None)
    if top is None:
        return 0, 0, "", 0
    return len(top.args), top.lineno, ast.unparse(top.func)[:40], sum(len(c.args) > 6 for c in calls)


def used_names(src: str, module: str = "rc_train") -> set[str]:
    """The names of `module` that `src` uses: module.X, from module import X, getattr/setattr(module, "X")."""
    tree, aliases, names = ast.parse(src), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == module}
        elif isinstance(node, ast.ImportFrom) and node.module == module and not node.level:
            names |= {a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            names.add(node.attr)
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[0], ast.Name):
            name, key = node.args[0].id, node.args[1]
            if name in aliases and isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
    return names


def defined_names(src: str) -> set[str]:
    """The module-level names `src` binds (defs, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def importers(root: str) -> tuple[set[str], list[str]]:
    """rc_train names used by the tree's other .py files (hidden folders skipped), and those files."""
    names, files = set(), []
    for folder, dirs, found in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(found):
            path = os.path.join(folder, name)
            if not name.endswith(".py") or os.path.relpath(path, root) == "rc_train.py":
                continue
            try:
                used = used_names(open(path, encoding="utf-8").read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # a file mid-edit: skipped
            names |= used
            files += [os.path.relpath(path, root)] if used else []
    return names, files


def trace_step(root: str, marker: str, timeout: float) -> dict:
    """Project calls in the trainer's 2nd step: {files: {file: calls}, functions, calls, seconds} or {error}."""
    with tempfile.TemporaryDirectory(prefix="page_trace_") as tmp:
        out, start = os.path.join(tmp, "calls.json"), time.time()
        cmd = [sys.executable, "-c", TRACER, root, marker, out, *TRAIN_FLAGS.split(), "--output-dir", tmp]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no end within {timeout:.0f} s"}
        if not os.path.exists(out):
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"error": f"exit {done.returncode}, no step traced: " + " | ".join(tail)}
        rows = json.load(open(out))
    rows = [r for r in rows if not r[1].split(".")[-1].startswith("<") or r[1].endswith("<lambda>")]
    files = {}
    for rel, _, _, n in rows:
        files[rel] = files.get(rel, 0) + n
    functions = {f"{rel}:{qual.replace('<locals>.', '')}:{line}": n for rel, qual, line, n in sorted(rows)}
    fig = dict(files=dict(sorted(files.items(), key=lambda kv: -kv[1])), functions=len(rows), calls=sum(files.values()))
    return {**fig, "function_calls": functions, "seconds": round(time.time() - start, 1)}


def measure(root: str, trace: bool, marker: str = "rc_rollout:Rollouts.take", timeout: float = 900) -> dict:
    """Every figure of root/rc_train.py."""
    src = open(os.path.join(root, "rc_train.py"), encoding="utf-8").read()
    functions, (names, files) = function_lengths(src), importers(root)
    fig = dict(root=root, **text_figures(src), functions=functions[:5], imported_names=sorted(names))
    fig.update(functions_over_60=sum(n > 60 for _, n in functions), outside_functions=longest_outside_functions(src))
    fig.update(positional=positional_calls(src), importing_files=files, undefined=sorted(names - defined_names(src)))
    return {**fig, "trace": trace_step(root, marker, timeout) if trace else None}


def rows(fig: dict) -> list[tuple[str, str, str, bool | None]]:
    """(figure, value, target, met) for one tree's figures."""
    top, share = (fig["functions"] + [("", 0)] * 5)[:5], f"{fig['long_lines']} ({fig['long_share']:.1%})"
    out = [
        ("lines", str(fig["lines"]), "<= 700", fig["lines"] <= 700),
        ("words", f"{fig['words']:,}", "<= 4,000", fig["words"] <= 4000),
        ("prose share (docstrings, comments)", f"{fig['prose_share']:.1%}", "<= 35 %", fig["prose_share"] <= 0.35),
        ("lines over 100 chars", share, "<= 10 %", fig["long_share"] <= 0.10),
        ("functions over 60 lines", str(fig["functions_over_60"]), "0", fig["functions_over_60"] == 0),
    ]
    out += [(f"longest function #{i + 1}", f"{n} {name}" if n else "-", "", None) for i, (name, n) in enumerate(top)]
    label, n = fig["outside_functions"]
    out.append(("longest top-level code outside defs", f"{n} ({label})", "", None))
    most, line, callee, over = fig["positional"]
    out += [
        ("most positional args in a call", f"{most} (line {line}, {callee})", "<= 6", most <= 6),
        ("calls with > 6 positional args", str(over), "", None),
        ("rc_train names used elsewhere", str(len(fig["imported_names"])), "", None),
        ("files using rc_train", str(len(fig["importing_files"])), "", None),
    ]
    trace = fig["trace"]
    if trace and "error" not in trace:
        out += [
            ("step trace: project files entered", str(len(trace["files"])), "", None),
            ("step trace: project functions called", str(trace["functions"]), "", None),
            ("step trace: project calls", f"{trace['calls']:,}", "", None),
        ]
        out += [(f"  calls into {rel}", f"{n:,}", "", None) for rel, n in trace["files"].items()]
    elif trace:
        out.append(("step trace", "failed (below)", "", None))
    return out


def table(before: dict, after: dict) -> str:
    """figure | before | after | target | verdict (before -> after), then the name lists and any trace error."""
    b, a = {r[0]: r for r in rows(before)}, {r[0]: r for r in rows(after)}
    names = list(b) + [k for k in a if k not in b]
    word = {True: "met", False: "not met", None: ""}
    lines = [("figure", "before", "after", "target", "verdict")]
    for k in names:
        rb, ra = b.get(k, (k, "-", "", None)), a.get(k, (k, "-", "", None))
        verdict = f"{word[rb[3]]} -> {word[ra[3]]}" if (rb[3] is not None or ra[3] is not None) else ""
        lines.append((k, rb[1], ra[1], rb[2] or ra[2], verdict))
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "-" * len(text[0]))
    for side, fig in (("before", before), ("after", after)):
        text.append(f"\n{side}: {fig['root']}\n  rc_train names used elsewhere: {', '.join(fig['imported_names'])}")
        text.append(f"  by: {', '.join(fig['importing_files'])}")
        text.append(f"  of those names, not bound in its rc_train.py: {', '.join(fig['undefined']) or 'none'}")
        if fig["trace"]:
            text.append(f"  step trace: {fig['trace'].get('error') or str(fig['trace']['seconds']) + ' s'}")
    return "\n".join(text)


def main(argv=None) -> int:
    """CLI: measure the before and after trees, print the table, optionally write the figures as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="ec88ed7", help="a git revision (checked out in a temporary worktree) or a path")
    p.add_argument("--after", default=ROOT, help="a path (default: this working tree)")
    p.add_argument("--no-trace", action="store_true", help="skip the step trace (two trainer runs)")
    p.add_argument("--marker", default="rc_rollout:Rollouts.take", help="module:qualname called at each step's start")
    p.add_argument("--timeout", type=float, default=900, help="seconds per trainer run")
    p.add_argument("--json", help="write the figures here")
    opts, start = p.parse_args(argv), time.time()
    worktree = None
    if not os.path.isdir(opts.before):
        worktree = tempfile.mkdtemp(prefix="page_before_")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", worktree, opts.before], check=True)
    try:
        before = measure(os.path.abspath(worktree or opts.before), not opts.no_trace, opts.marker, opts.timeout)
        after = measure(os.path.abspath(opts.after), not opts.no_trace, opts.marker, opts.timeout)
    finally:
        if worktree:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", worktree], check=False)
    print(table(before, after))
    print(f"\n{time.time() - start:.0f} s in all")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(before=before, after=after), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
