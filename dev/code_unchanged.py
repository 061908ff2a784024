"""Whether two trees' Python modules hold the same code once docstrings and comments are set aside (a developer
check for edits meant to touch only documentation):

    python dev/code_unchanged.py OLD_DIR NEW_DIR [PATH ...]    # PATHs relative to both (default: every *.py)

Each module is parsed; every docstring (the first string statement of a module, class or function) is dropped and
the ASTs are compared with ``ast.dump``. Exit 0 when every module matches, 1 with the differing modules named."""
import ast
import pathlib
import sys


def _code(path: pathlib.Path) -> str:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__)
        return 2
    old, new = pathlib.Path(args[0]), pathlib.Path(args[1])
    paths = args[2:] or sorted(str(p.relative_to(new)) for p in new.rglob("*.py"))
    bad = []
    for rel in paths:
        a, b = old / rel, new / rel
        if not a.exists() or not b.exists():
            bad.append(f"{rel}: only in {'the new' if b.exists() else 'the old'} tree")
        elif _code(a) != _code(b):
            bad.append(f"{rel}: the code differs")
    for line in bad:
        print(line)
    print(f"{len(paths) - len(bad)} of {len(paths)} modules hold the same code")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
