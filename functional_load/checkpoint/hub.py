"""Hugging Face Hub repo ids and cache folders: the local directory a ``model`` argument names.

:func:`resolve_model` is the only place that touches the Hub or its cache:

* a path that exists is a path, exactly as before; a Hugging Face cache repo folder
  (``.../models--org--name``) is the snapshot its ``refs/<revision>`` names (``main`` by default);
* a string shaped ``org/name`` that is no existing path is a Hub repo id. With ``HF_HUB_OFFLINE``
  set it is the snapshot in the local cache (``HF_HUB_CACHE``) and nothing else; otherwise
  ``huggingface_hub`` downloads into that cache only what the load reads: ``config.json``,
  ``params.json``, the safetensors index and a pre-sharded save's manifest when the repo has them,
  and the weight files of the one format the load picks, as vLLM 0.32 picks it from the repo's
  files (``"auto"``: Mistral's format when any ``consolidated*.safetensors`` is there, else
  safetensors before ``.bin`` before ``.pt``; only the shards the index names). Cached files are
  not downloaded again, and when the Hub cannot be reached the cached snapshot is used.

Every failure is a :class:`~functional_load.errors.LoadError` that says how to get the model,
never a ``huggingface_hub`` exception. ``huggingface_hub`` is imported only for a repo id.
"""

from __future__ import annotations

import difflib
import glob
import os
import re
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TypeVar

from ..errors import ConfigError, LoadError, MissingFileError, SecurityError
from ..model.config import CONFIG
from .discover import HF_INDEX, MISTRAL_INDEX, PATTERNS, TRAINING_FILE_SUFFIXES, _read_weight_map, natural_sort_key
from .sharded import MANIFEST, read_manifest

_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_ID = re.compile(f"{_PART}/{_PART}")
CACHE_PREFIX = "models--"
PARAMS = "params.json"
METADATA = (CONFIG, PARAMS, HF_INDEX, MISTRAL_INDEX, MANIFEST)  # small files fetched first, when the repo has them
_TRUE = ("1", "ON", "YES", "TRUE")

T = TypeVar("T")


def is_repo_id(model: object) -> bool:
    """Whether ``model`` is a Hub repo id: a string ``org/name`` (letters, digits, ``-_.``, no
    ``--`` or ``..``) that is not an existing path."""
    return (
        isinstance(model, str) and REPO_ID.fullmatch(model) is not None and "--" not in model and ".." not in model
        and not os.path.lexists(model)
    )


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now, else huggingface_hub's setting."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if value is not None:
        return value.strip().upper() in _TRUE
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> str:
    """The Hub cache: ``HF_HUB_CACHE`` as set now, else ``$HF_HOME/hub``, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_model(
    model: str | os.PathLike[str], *, revision: str | None = None, load_format: str = "auto", allow_pickle: bool = False,
    weights: bool = True,
) -> str | os.PathLike[str]:
    """The local path ``model`` stands for: ``model`` itself when it is a path (an existing one, or
    anything that is no repo id), the snapshot of a cache repo folder, or the snapshot of a Hub
    repo id with what a load with ``load_format`` reads (``weights=False``: the config, index and
    manifest only, plus Mistral-format weights, whose presence decides how the directory reads)."""
    path = Path(model)
    if path.is_dir() and path.name.startswith(CACHE_PREFIX) and (path / "snapshots").is_dir():
        repo_id = path.name[len(CACHE_PREFIX):].replace("--", "/")
        return _snapshot(repo_id, revision, str(path.parent), True, str(path), load_format, allow_pickle, weights)
    if not is_repo_id(model):
        if revision is not None and os.path.lexists(path):
            raise ConfigError(
                f"revision={revision!r} picks a revision of a Hugging Face Hub repo, but {str(model)!r} is a local path "
                f"(neither a repo id org/name nor a cache folder models--org--name); drop revision, or pass the repo id"
            )
        return model
    repo_id = str(model)  # a repo id is a string (is_repo_id)
    try:
        return _snapshot(repo_id, revision, cache_dir(), offline(), None, load_format, allow_pickle, weights)
    except MissingFileError as exc:
        better = _mistyped_path(repo_id, exc)
        if better is None:
            raise
        raise better from exc


def _mistyped_path(model: str, exc: MissingFileError) -> MissingFileError | None:
    """When ``org`` of ``org/name`` is a local directory, the likelier mistake is a mistyped path."""
    folder = Path(model).parent
    if not folder.is_dir():
        return None
    close = difflib.get_close_matches(Path(model).name, sorted(p.name for p in folder.iterdir() if p.is_dir()), n=3)
    hint = f"; did you mean {' or '.join(str(folder / c) for c in close)}?" if close else ""
    return MissingFileError(
        f"{model}: no such directory ({folder}/ is a local directory here, so this looks like a mistyped path){hint} "
        f"As a Hugging Face Hub repo id it was not found either: {exc}"
    )


def files_to_fetch(names: Iterable[str], load_format: str, folder: Path, allow_pickle: bool = False, where: str = "") -> tuple[str, ...]:
    """The weight files of a repo (its file ``names``) that a load with ``load_format`` reads, as
    vLLM's loader picks them: ``"auto"`` is Mistral's format when any top-level
    ``consolidated*.safetensors`` exists, else ``"hf"``; the first of the format's patterns that
    matches wins (safetensors, then ``.bin``, then ``.pt``); the index in ``folder``, when there,
    keeps the shards it names; trainer pickles, files in subfolders and Mistral's copy of HF
    weights are left out. A pre-sharded save (its manifest in ``folder``) reads its rank files.
    Pickles without ``allow_pickle`` are a :class:`SecurityError` (nothing is downloaded)."""
    top = {name for name in names if "/" not in name and not name.startswith(".")}
    if MANIFEST in top:
        manifest = read_manifest(folder)
        return tuple(sorted(manifest["files"] if manifest else (), key=natural_sort_key))
    fmt = load_format.lower() if isinstance(load_format, str) else ""
    if fmt == "auto":
        fmt = "mistral" if any(fnmatchcase(name, "consolidated*.safetensors") for name in top) else "hf"
    for pattern in PATTERNS.get(fmt, ()):  # an unknown format fetches no weights; the load reports it
        files = [name for name in top if fnmatchcase(name, pattern) and not name.endswith(TRAINING_FILE_SUFFIXES)]
        if fmt != "mistral" and any(not name.startswith("consolidated") for name in files):
            files = [name for name in files if not name.startswith("consolidated")]  # Mistral's copy of the same weights
        if files:
            break
    else:
        return ()
    files.sort(key=natural_sort_key)
    if not pattern.endswith(".safetensors"):
        if not allow_pickle:
            raise SecurityError(
                f"{where or folder}: the weights are pickle files ({', '.join(files[:3])}), which can run code when "
                f"unpickled; nothing was downloaded. Use a revision with safetensors weights, or pass allow_pickle=True "
                f"(CLI: --allow-pickle) to load them with torch.load(weights_only=True)"
            )
        return tuple(files)
    index = folder / (MISTRAL_INDEX if fmt == "mistral" else HF_INDEX)
    if index.is_file():
        named = set(_read_weight_map(index).values())
        files = [name for name in files if name in named]
    return tuple(files)


def _snapshot(
    repo_id: str, revision: str | None, cache: str, local_only: bool, folder_path: str | None, load_format: str,
    allow_pickle: bool, weights: bool,
) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` in ``cache``, with what the load reads
    downloaded unless ``local_only``."""
    import huggingface_hub as hub

    def call(fn: Callable[[], T]) -> T:
        return _hub_call(fn, repo_id, revision, cache, local_only, folder_path)

    folder = Path(call(lambda: hub.snapshot_download(
        repo_id, revision=revision, cache_dir=cache, local_files_only=local_only, allow_patterns=list(METADATA),
    )))
    if local_only:  # the cache holds what it holds; discovery checks the snapshot as any directory
        return folder
    try:  # one request, no retries: the snapshot may have come from the cache because the Hub is unreachable
        names = [sibling.rfilename for sibling in hub.HfApi().model_info(repo_id, revision=folder.name).siblings or ()]
    except Exception:  # then the cached snapshot is what there is
        return folder
    if not weights and not any(fnmatchcase(name, "consolidated*.safetensors") for name in names if "/" not in name):
        return folder
    files = files_to_fetch(names, load_format, folder, allow_pickle, f"{repo_id} (revision {revision or 'main'})")
    if files:
        call(lambda: hub.snapshot_download(
            repo_id, revision=folder.name, cache_dir=cache, allow_patterns=[glob.escape(name) for name in files],
        ))
    return folder


def _hub_call(fn: Callable[[], T], repo_id: str, revision: str | None, cache: str, local_only: bool, folder_path: str | None) -> T:
    """``fn()``, with huggingface_hub's exceptions turned into a ``LoadError`` that says what to do."""
    from huggingface_hub import errors

    at = f"revision {revision!r}" if revision else "its main revision"
    command = f"{repo_id}{f' --revision {revision}' if revision else ''}"
    download = f"`hf download {command}` (`huggingface-cli download {command}` before huggingface_hub 1.0)"
    try:
        return fn()
    except LoadError:
        raise
    except errors.GatedRepoError as exc:
        raise MissingFileError(
            f"{repo_id} is a gated repo on the Hugging Face Hub: accept its terms on https://huggingface.co/{repo_id}, then "
            f"log in (`hf auth login`, or set HF_TOKEN)"
        ) from exc
    except errors.RepositoryNotFoundError as exc:
        raise MissingFileError(
            f"{repo_id}: no local directory of that name, and no such repo on the Hugging Face Hub (a private repo needs "
            f"a login: `hf auth login`, or set HF_TOKEN)"
        ) from exc
    except errors.RevisionNotFoundError as exc:
        raise MissingFileError(f"{repo_id}: {at} does not exist on the Hugging Face Hub; pass a branch, tag or commit hash") from exc
    except errors.LocalEntryNotFoundError as exc:
        if folder_path is not None:
            refs = sorted(p.name for p in (Path(folder_path) / "refs").glob("*")) if (Path(folder_path) / "refs").is_dir() else []
            raise MissingFileError(
                f"{folder_path}: this Hugging Face cache folder has no complete snapshot for {at} (refs: {refs}); pass "
                f"revision= one of its refs or snapshot hashes, or download it with {download}"
            ) from exc
        if local_only:
            raise MissingFileError(
                f"{repo_id}: not a local directory, and not in the Hugging Face cache {cache} at {at}, and downloads are "
                f"off (HF_HUB_OFFLINE=1). Download it first with {download}, or set HF_HUB_OFFLINE=0 to let the load "
                f"download the files it reads"
            ) from exc
        raise MissingFileError(
            f"{repo_id}: not in the Hugging Face cache {cache} at {at}, and it could not be downloaded "
            f"({_first_line(exc)}); check the network (or HF_ENDPOINT), or download it with {download}"
        ) from exc
    except Exception as exc:  # HTTP errors and connection failures, of huggingface_hub and its HTTP library
        raise MissingFileError(
            f"{repo_id}: the Hugging Face Hub could not be reached or refused the request ({type(exc).__name__}: "
            f"{_first_line(exc)}); check the network, or set HF_HUB_OFFLINE=1 to use the cache {cache} only"
        ) from exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
