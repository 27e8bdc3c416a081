"""Builds one PEP 427 wheel from a manifest written by tools/bazel/wheel.bzl.

    wheel_builder.py --manifest MANIFEST.json --out DIST-VERSION-py3-none-any.whl

The manifest names the target's first-party closure (import path + source file), the import
paths its first-party wheel dependencies already provide, the packages this wheel may own, the
namespace levels no wheel owns, and the metadata. The builder decides the payload (and refuses a
closure that would drag in a file this wheel must not own), then writes the wheel reproducibly:
fixed timestamps, sorted entries, fixed permissions, only relative archive paths.
"""
from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import re
import sys
import zipfile
from dataclasses import dataclass, field

# Every entry gets the zip format's earliest timestamp and these permissions, whatever the
# sources' mtimes and the umask were: two builds of the same sources give the same bytes.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
FILE_MODE = 0o100644
GENERATOR = "sparse_mla tools/bazel/wheel_builder.py"


class WheelContentError(ValueError):
    """The closure or metadata cannot make a correct wheel; the message says what to change."""


@dataclass
class Manifest:
    distribution: str
    version: str
    summary: str
    files: dict  # import path (sparse_mla/...) -> source path
    packages: list  # import-path prefixes this wheel owns, e.g. "sparse_mla/ops/common"
    namespaces: list  # namespace levels, e.g. "sparse_mla/ops": their __init__.py is never shipped
    provided: dict = field(default_factory=dict)  # import path -> wheel dependency providing it
    requires: list = field(default_factory=list)
    extras: dict = field(default_factory=dict)
    entry_points: dict = field(default_factory=dict)
    requires_python: str = ""

    @classmethod
    def load(cls, path: str) -> "Manifest":
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        files = {}
        for entry in raw.pop("files"):
            if entry["path"] in files and files[entry["path"]] != entry["src"]:
                raise WheelContentError(f"two sources for {entry['path']}")
            files[entry["path"]] = entry["src"]
        return cls(files=files, **raw)


def normalize(distribution: str) -> str:
    """The distribution name as wheel file and .dist-info names spell it (PEP 427 / 503)."""
    return re.sub(r"[-_.]+", "_", distribution).lower()


def wheel_filename(distribution: str, version: str) -> str:
    return f"{normalize(distribution)}-{version}-py3-none-any.whl"


def _owner(path: str, packages) -> bool:
    return any(path.startswith(p.rstrip("/") + "/") for p in packages)


def _has_code(source: bytes) -> bool:
    """True unless the module is empty, comments, or a docstring alone."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return bool(body)


def plan_payload(m: Manifest, read=lambda p: open(p, "rb").read()) -> dict:
    """Import path -> source path of the files this wheel ships.

    The closure minus what first-party wheel dependencies provide, minus the namespace levels'
    ``__init__.py`` (which must hold no code: installed, they do not exist). Anything else must
    lie under one of the wheel's packages: a test helper, a tool or another family's module in
    the closure is an error (the fix is a wheel dependency, or a library that does not pull it).
    """
    if not m.packages:
        raise WheelContentError(f"{m.distribution}: no packages to own")
    for p in m.packages:
        if p.rstrip("/") in m.namespaces or not p.startswith("sparse_mla/"):
            raise WheelContentError(f"{m.distribution}: cannot own package {p!r} "
                                    "(a namespace level, or outside sparse_mla/)")
    namespace_inits = {f"{n}/__init__.py" for n in m.namespaces}
    payload, stray = {}, []
    for path, src in sorted(m.files.items()):
        if path.startswith("/") or ".." in path.split("/"):
            raise WheelContentError(f"{m.distribution}: archive path {path!r} is not relative")
        if path in m.provided:
            continue
        if path in namespace_inits:
            if _has_code(read(src)):
                raise WheelContentError(
                    f"{src}: {path.rsplit('/', 1)[0]} is a namespace package in the wheels "
                    "(tools/bazel/versions.bzl NAMESPACE_PACKAGES); its __init__.py must hold "
                    "no code (a docstring at most), or installed wheels would behave differently")
            continue
        if _owner(path, m.packages):
            payload[path] = src
        else:
            stray.append(path)
    if stray:
        raise WheelContentError(
            f"{m.distribution} (owns {', '.join(m.packages)}): its closure also holds "
            f"{', '.join(stray)}, which no wheel dependency provides. Add the wheel of the target "
            "that owns them to `deps`, or drop the dependency that pulls them in (tests/ and "
            "tools/ never belong in a product wheel).")
    if not payload:
        raise WheelContentError(f"{m.distribution}: nothing to ship under {m.packages}")
    return payload


def metadata_text(m: Manifest) -> str:
    if not m.summary or "\n" in m.summary:
        raise WheelContentError(f"{m.distribution}: the summary must be one non-empty line")
    lines = ["Metadata-Version: 2.1", f"Name: {m.distribution}", f"Version: {m.version}",
             f"Summary: {m.summary}"]
    if m.requires_python:
        lines.append(f"Requires-Python: {m.requires_python}")
    lines += [f"Requires-Dist: {r}" for r in m.requires]
    for extra in sorted(m.extras):
        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", extra):
            raise WheelContentError(f"extra name {extra!r}: lower-case letters, digits, '-'")
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in m.extras[extra]]
    return "\n".join(lines) + "\n"


def wheel_text() -> str:
    return (f"Wheel-Version: 1.0\nGenerator: {GENERATOR}\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n")


_ENTRY = re.compile(r"\s*([\w.-]+)\s*=\s*([\w.]+)(:[\w.]+)?\s*$")


def entry_points_text(entry_points: dict) -> str:
    """entry_points.txt (INI, sorted): {"vllm.general_plugins": ["name = module:attr"]}."""
    out = []
    for group in sorted(entry_points):
        if not re.fullmatch(r"[\w.-]+", group):
            raise WheelContentError(f"entry point group {group!r}")
        lines = []
        for spec in entry_points[group]:
            match = _ENTRY.match(spec)
            if not match:
                raise WheelContentError(
                    f"entry point {spec!r} in [{group}]: expected 'name = module:attr'")
            lines.append(f"{match.group(1)} = {match.group(2)}{match.group(3) or ''}")
        names = [line.split(" = ")[0] for line in lines]
        if len(set(names)) != len(names):
            raise WheelContentError(f"entry point group [{group}] repeats a name: {names}")
        out.append(f"[{group}]\n" + "\n".join(sorted(lines)) + "\n")
    return "\n".join(out)


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def build(m: Manifest, out: str, read=lambda p: open(p, "rb").read()) -> list:
    """Writes the wheel; returns its archive paths in order."""
    payload = plan_payload(m, read)
    dist_info = f"{normalize(m.distribution)}-{m.version}.dist-info"
    entries = [(path, read(src)) for path, src in sorted(payload.items())]
    meta = [("METADATA", metadata_text(m)), ("WHEEL", wheel_text())]
    if m.entry_points:
        meta.append(("entry_points.txt", entry_points_text(m.entry_points)))
    entries += [(f"{dist_info}/{name}", text.encode("utf-8")) for name, text in meta]
    record = "".join(f"{path},{record_hash(data)},{len(data)}\n" for path, data in entries)
    entries.append((f"{dist_info}/RECORD", (record + f"{dist_info}/RECORD,,\n").encode()))
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path, data in entries:
            info = zipfile.ZipInfo(path, date_time=ZIP_EPOCH)
            info.create_system = 3  # Unix, so external_attr carries the permissions
            info.external_attr = FILE_MODE << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data, compresslevel=9)
    return [path for path, _ in entries]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        m = Manifest.load(args.manifest)
        expected = wheel_filename(m.distribution, m.version)
        if not args.out.endswith("/" + expected) and args.out != expected:
            raise WheelContentError(f"output {args.out} should be named {expected}")
        build(m, args.out)
    except WheelContentError as e:
        print(f"wheel_builder: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
