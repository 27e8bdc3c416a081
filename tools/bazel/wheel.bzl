"""Per-target wheels (PEP 427) built with Bazel alone (rules_python cannot be fetched offline).

One stanza next to a product `py_library`:

    load("//tools/bazel:wheel.bzl", "sparse_mla_wheel")

    sparse_mla_wheel(
        name = "wheel",
        lib = ":flashmla_decode",
        summary = "FlashMLA-semantics sparse decode / prefill ops",
        deps = ["//ops/common:wheel"],        # wheels of first-party dependencies
        requires = ["torch", "triton"],       # keys of PINS in tools/bazel/versions.bzl
        extras = {"flashmla": ["sgl-flash-mla"]},
        entry_points = {"vllm.general_plugins": ["sparse_mla = sparse_mla.integration.vllm:register"]},
    )

The wheel ships the library's first-party closure minus what `deps` already ship, minus the
namespace levels' `__init__.py` (versions.bzl NAMESPACE_PACKAGES); whatever is left must lie
under this package (or `packages`), else the build fails naming the stray files. It requires
each wheel of `deps` at exactly VERSION, and `requires` / `extras` from PINS. The distribution
name defaults to `sparse-mla-<package>` with a leading `ops/` dropped and `/`, `_` as `-`
(`ops/flashmla_decode` -> `sparse-mla-flashmla-decode`, `backends/v4` ->
`sparse-mla-backends-v4`).

`sparse_mla_wheel_set` gathers wheels (and every wheel they require) into one directory for
`pip install --no-index --find-links`.
"""

load(":versions.bzl", "NAMESPACE_PACKAGES", "PINS", "PYTHON_REQUIRES", "VERSION")

WheelInfo = provider(
    doc = "A first-party wheel and what installing it (with its requirements) provides.",
    fields = {
        "distribution": "distribution name, e.g. sparse-mla-common",
        "wheel": "File: the .whl",
        "provided": "depset of (import path, distribution) pairs this wheel and the wheels it requires ship",
        "wheels": "depset of File: this wheel and every first-party wheel it requires",
        "manifests": "depset of File: the builder manifests of those wheels",
    },
)

def _normalize(distribution):
    out = distribution.lower()
    for c in ["-", "."]:
        out = out.replace(c, "_")
    return out

def _import_path(f):
    # Main workspace: ops/common/x.py; vendored as @sparse_mla: ../sparse_mla/ops/common/x.py.
    path = f.short_path
    if path.startswith("../"):
        path = path.split("/", 2)[2]
    return "sparse_mla/" + path

def _wheel_impl(ctx):
    repo = ctx.label.workspace_name
    closure = depset(transitive = [
        ctx.attr.lib[PyInfo].transitive_sources,
        ctx.attr.lib[DefaultInfo].default_runfiles.files,
    ]).to_list()

    provided = {}
    for dep in ctx.attr.deps:
        for path, dist in dep[WheelInfo].provided.to_list():
            provided[path] = dist

    files = []
    inputs = []
    for f in closure:
        if f.owner == None or f.owner.workspace_name != repo:
            fail("%s: %s comes from another repository; third-party code is a requirement " %
                 (ctx.label, f.short_path) + "(requires = [...]), never a file of the wheel")
        files.append(struct(path = _import_path(f), src = f.path))
        inputs.append(f)

    packages = ["sparse_mla/" + p if p else "sparse_mla" for p in ctx.attr.packages]
    requires = ["%s==%s" % (dep[WheelInfo].distribution, VERSION) for dep in ctx.attr.deps]
    requires += ctx.attr.requires
    manifest = ctx.actions.declare_file(ctx.label.name + ".manifest.json")
    ctx.actions.write(manifest, struct(
        distribution = ctx.attr.distribution,
        version = VERSION,
        summary = ctx.attr.summary,
        requires_python = PYTHON_REQUIRES,
        requires = requires,
        extras = ctx.attr.extras,
        entry_points = ctx.attr.entry_points,
        packages = packages,
        namespaces = NAMESPACE_PACKAGES,
        provided = provided,
        files = files,
    ).to_json())

    whl = ctx.actions.declare_file("%s-%s-py3-none-any.whl" % (_normalize(ctx.attr.distribution), VERSION))
    ctx.actions.run(
        executable = ctx.executable._builder,
        arguments = ["--manifest", manifest.path, "--out", whl.path],
        inputs = inputs + [manifest],
        outputs = [whl],
        mnemonic = "SparseMlaWheel",
        # The builder's stub finds `python` on PATH, as py_test stubs do under `bazel test`.
        use_default_shell_env = True,
        progress_message = "Building wheel %s" % whl.short_path,
    )

    # What installing this wheel provides: its files, not the namespace levels it leaves out.
    namespace_inits = [ns + "/__init__.py" for ns in NAMESPACE_PACKAGES]
    own = [
        (f.path, ctx.attr.distribution)
        for f in files
        if f.path not in provided and f.path not in namespace_inits
    ]
    return [
        DefaultInfo(files = depset([whl]), runfiles = ctx.runfiles(files = [whl])),
        OutputGroupInfo(manifest = depset([manifest])),
        WheelInfo(
            distribution = ctx.attr.distribution,
            wheel = whl,
            provided = depset(own, transitive = [d[WheelInfo].provided for d in ctx.attr.deps]),
            wheels = depset([whl], transitive = [d[WheelInfo].wheels for d in ctx.attr.deps]),
            manifests = depset([manifest], transitive = [d[WheelInfo].manifests for d in ctx.attr.deps]),
        ),
    ]

_wheel = rule(
    implementation = _wheel_impl,
    attrs = {
        "lib": attr.label(mandatory = True, providers = [PyInfo]),
        "deps": attr.label_list(providers = [WheelInfo]),
        "distribution": attr.string(mandatory = True),
        "summary": attr.string(mandatory = True),
        "requires": attr.string_list(),
        "extras": attr.string_list_dict(),
        "entry_points": attr.string_list_dict(),
        "packages": attr.string_list(mandatory = True),
        "_builder": attr.label(
            default = Label("//tools/bazel:wheel_builder"),
            executable = True,
            cfg = "exec",
        ),
    },
)

def _pin(key, where):
    if key not in PINS:
        fail("%s: %r is not a key of PINS in tools/bazel/versions.bzl (the one place for " % (where, key) +
             "third-party requirement ranges); add it there")
    return PINS[key]

def default_distribution(package):
    """`ops/flashmla_decode` -> `sparse-mla-flashmla-decode`; `backends/x` -> `sparse-mla-backends-x`."""
    if package.startswith("ops/"):
        package = package[len("ops/"):]
    return "sparse-mla-" + package.replace("/", "-").replace("_", "-")

def sparse_mla_wheel(name, lib, summary, deps = [], requires = [], extras = {}, entry_points = {},
                     distribution = None, packages = None, **kwargs):
    """A wheel of `lib`'s own first-party closure (see this file's docstring)."""
    package = native.package_name()
    where = "//%s:%s" % (package, name)
    _wheel(
        name = name,
        lib = lib,
        deps = deps,
        summary = summary,
        distribution = distribution or default_distribution(package),
        requires = [_pin(key, where) for key in requires],
        extras = {extra: [_pin(key, where) for key in keys] for extra, keys in extras.items()},
        entry_points = entry_points,
        packages = packages if packages != None else [package],
        **kwargs
    )

def _wheel_set_impl(ctx):
    wheels = depset(transitive = [w[WheelInfo].wheels for w in ctx.attr.wheels]).to_list()
    outs = {}
    for whl in wheels:
        if whl.basename in outs:
            fail("two wheels named %s" % whl.basename)
        out = ctx.actions.declare_file("%s/%s" % (ctx.label.name, whl.basename))
        # A copy, not a symlink into the output base: the directory can be tarred or copied.
        ctx.actions.run_shell(
            command = 'cp "$1" "$2"',
            arguments = [whl.path, out.path],
            inputs = [whl],
            outputs = [out],
            mnemonic = "SparseMlaWheelCopy",
        )
        outs[whl.basename] = out
    files = [outs[k] for k in sorted(outs)]
    manifests = depset(transitive = [w[WheelInfo].manifests for w in ctx.attr.wheels])
    return [
        DefaultInfo(files = depset(files), runfiles = ctx.runfiles(files = files)),
        OutputGroupInfo(manifests = manifests),
    ]

sparse_mla_wheel_set = rule(
    implementation = _wheel_set_impl,
    doc = "Every wheel in `wheels` and every wheel they require, in bazel-bin/<package>/<name>/.",
    attrs = {"wheels": attr.label_list(providers = [WheelInfo])},
)
