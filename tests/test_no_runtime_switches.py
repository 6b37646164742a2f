"""Nothing in the package switches parallel state at run time.

The role and group of a compiled graph are fixed when it is compiled; there is no
"dcp enabled" flag to flip around draft calls.  This scans the package source for the
ways such a switch could exist: ``global``/``nonlocal`` rebinding, assignments into
another module's attributes (``torch._dynamo.config.x = ...``), module-level mutable
state other than the prepare-time registries, and writes to those registries from
anywhere but prepare time.
"""

import ast
from pathlib import Path

import dcp_compile

PACKAGE = Path(dcp_compile.__file__).parent
# The prepare-time registries (one record per KV cache buffer, one name per causal-mask
# table prepare checked), read only at compile time.
ALLOWED_MODULE_STATE = {("records.py", "_records"), ("records.py", "_tables"), ("records.py", "_paged")}


def sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def test_no_global_or_nonlocal_rebinding():
    found = [
        f"{name}:{node.lineno}"
        for name, tree in sources()
        for node in ast.walk(tree)
        if isinstance(node, (ast.Global, ast.Nonlocal))
    ]
    assert found == []


def test_no_assignment_into_other_modules():
    found = []
    for name, tree in sources():
        imported = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                root = target
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in imported:
                    found.append(f"{name}:{node.lineno}")
    assert found == []


def test_module_level_mutable_state_is_only_the_prepare_time_registries():
    mutable_calls = {"dict", "list", "set", "WeakIdKeyDictionary", "WeakKeyDictionary", "defaultdict", "OrderedDict"}
    found = set()
    for name, tree in sources():
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                value = node.value
                is_mutable = isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
                    isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) in mutable_calls
                )
                if is_mutable:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    found.update((name, t.id) for t in targets if isinstance(t, ast.Name) and not t.id.startswith("__"))
    assert found == ALLOWED_MODULE_STATE


REGISTRY_WRITERS = ("register", "register_table", "register_paged")
# dcp_compile/hf/cache.py's DCPStaticCache is prepare for caches HF keeps outside modules: it
# registers them once, when it allocates them.
PREPARE_TIME = {
    ("runtime/prepare.py", "_place_caches"), ("runtime/prepare.py", "_shard_mask_tables"), ("hf/cache.py", "DCPStaticCache.__init__"),
    ("runtime/prepare.py", "_place_paged"),
}


def calls_in_scope(tree, scope=""):
    """``(enclosing def/class path, call)`` for every call in ``tree``; a function
    defined inside another (a hook, a closure) is a scope of its own."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from calls_in_scope(child, f"{scope}.{child.name}" if scope else child.name)
            continue
        if isinstance(child, ast.Call):
            yield scope, child
        yield from calls_in_scope(child, scope)


def test_the_registries_are_written_only_at_prepare_time():
    callers = set()
    for name, tree in sources():
        # register(...), caches.register(...) and any alias the module imports them as
        aliases = {
            a.asname for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            for a in n.names if a.name in REGISTRY_WRITERS and a.asname
        }
        for scope, call in calls_in_scope(tree):
            func = call.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called in REGISTRY_WRITERS or called in aliases:
                callers.add((name, scope))
    assert callers == PREPARE_TIME
