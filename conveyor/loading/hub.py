"""Hugging Face Hub names -> a local path: `resolve_model("ORG/NAME[:QUANT]")`, as `vllm serve` and `llama-server -hf`.

huggingface_hub does the HTTP, the cache (HF_HOME / HF_HUB_CACHE, shared with other tools), HF_TOKEN,
HF_ENDPOINT, HF_HUB_OFFLINE and the progress bars; this module picks the files and words the errors.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import httpx2  # huggingface_hub's transport: its connection errors mean "use the cache"
from huggingface_hub import HfApi, constants, get_cached_repo_tree, get_token, snapshot_download
from huggingface_hub.errors import (CachedRepoTreeNotFoundError, GatedRepoError, HfHubHTTPError,
                                    LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                    RevisionNotFoundError)
from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

from conveyor.loading.checkpoint import LoadError
from conveyor.loading.gguf_split import part_names, whole_name

DownloadReport = Callable[[int, int], None]  # (bytes written, bytes in all) of a download under way

# What load_hf_dir reads: config, weights, tokenizer (json / sentencepiece .model / vocab .txt), chat template.
HF_DIR_SUFFIXES = (".json", ".safetensors", ".jinja", ".model", ".txt")
# llama-server's default when -hf names no quantization and the repo has several.
DEFAULT_QUANT = "Q4_K_M"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class HubSpec:
    repo_id: str  # ORG/NAME
    quant: str | None = None  # the :QUANT of ORG/NAME:QUANT (a GGUF file whose name contains it)
    filename: str | None = None  # --hf-file: this file of the repo
    revision: str | None = None  # --revision: branch, tag or commit (None = the default branch)

    @property
    def name(self) -> str:
        return self.repo_id + (f":{self.quant}" if self.quant else "") + (f"@{self.revision}" if self.revision else "")


def parse_hub_spec(text: str, filename: str | None = None, revision: str | None = None) -> HubSpec | None:
    """'ORG/NAME' or 'ORG/NAME:QUANT' -> HubSpec; None when the text is not shaped like a repo id."""
    repo_id, _, quant = text.partition(":")
    if not _REPO_ID.fullmatch(repo_id):
        return None
    return HubSpec(repo_id, quant or None, filename, revision)


def resolve_model(model: str | None, hf_file: str | None = None, revision: str | None = None,
                  on_download: DownloadReport | None = None) -> str | None:
    """A local path as is (None = the default model); a Hub name -> its cached directory or GGUF file
    (on_download(bytes, total) as the files are written: /health's progress while a server waits)."""
    if model is None or os.path.exists(os.path.expanduser(model)):
        if hf_file or revision:
            raise LoadError(f"--hf-file and --revision apply to Hugging Face Hub names, not to {model or 'the default model'}")
        return model
    spec = parse_hub_spec(model, hf_file, revision)
    if spec is None:
        return model  # load_checkpoint reports the missing path
    try:
        return _resolve(spec, on_download)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise LoadError(f"{spec.name}: no space left on the device of the Hugging Face cache "
                            f"({constants.HF_HUB_CACHE}); free some or point HF_HOME to a larger disk") from None
        raise


def _resolve(spec: HubSpec, on_download: DownloadReport | None) -> str:
    files = _list_files(spec)
    gguf = _pick_gguf(spec, files)
    wanted = part_names(gguf) if gguf else [f for f in files if "/" not in f and f.endswith(HF_DIR_SUFFIXES)]
    folder = _download(spec, wanted, on_download)
    return os.path.join(folder, gguf) if gguf else folder


def _list_files(spec: HubSpec) -> list[str]:
    """The repo's files: from the Hub, or offline (or unreachable) from the listing the cache kept."""
    try:
        if not constants.is_offline_mode():
            return HfApi().list_repo_files(spec.repo_id, revision=spec.revision)
    except (OfflineModeIsEnabled, httpx2.TransportError):
        pass
    except HfHubHTTPError as exc:
        raise _http_error(spec, exc) from None
    try:
        return [f.path for f in get_cached_repo_tree(spec.repo_id, revision=spec.revision)]
    except CachedRepoTreeNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else f"{constants.ENDPOINT} cannot be reached"
        raise LoadError(f"{spec.name}: {why} and the model is not in the Hugging Face cache "
                        f"({constants.HF_HUB_CACHE}); download it once online") from None


def _pick_gguf(spec: HubSpec, files: list[str]) -> str | None:
    """The GGUF file to load, or None for a Hugging Face directory (config.json + *.safetensors)."""
    if spec.filename is not None:
        if spec.filename not in files:
            raise LoadError(f"{spec.name} has no file {spec.filename}; files: {_few(files)}")
        if not spec.filename.endswith(".gguf"):
            raise LoadError(f"--hf-file names a GGUF file; for a safetensors repo pass only --model {spec.repo_id}")
        return _first_part(spec, spec.filename, files)
    top = [f for f in files if "/" not in f]
    if spec.quant is None and "config.json" in top and any(f.endswith(".safetensors") for f in top):
        return None
    # mmproj files are vision projectors, never the language model (llama-server skips them too).
    ggufs = [f for f in files if f.endswith(".gguf") and "mmproj" not in os.path.basename(f).lower()]
    if not ggufs:
        raise LoadError(f"{spec.name}: no usable model files (config.json + *.safetensors, or *.gguf); "
                        f"files: {_few(files)}")
    candidates = _matching(ggufs, spec.quant) if spec.quant else ggufs
    if spec.quant is None and len(candidates) > 1:
        candidates = _matching(ggufs, DEFAULT_QUANT) or candidates
    if len({whole_name(f) for f in candidates}) == 1:  # one file, or the parts of one split file
        return _first_part(spec, candidates[0], files)
    what = f"no GGUF file matches :{spec.quant}" if not candidates else "several GGUF files match"
    raise LoadError(f"{spec.name}: {what}; pick one with ORG/NAME:QUANT or --hf-file: {_few(candidates or ggufs)}")


def _matching(ggufs: list[str], quant: str) -> list[str]:
    return [f for f in ggufs if quant.lower() in os.path.basename(f).lower()]


def _first_part(spec: HubSpec, filename: str, files: list[str]) -> str:
    """A split GGUF is named by its first part (loading/gguf_loader.py finds the rest beside it)."""
    parts = part_names(filename)
    missing = [p for p in parts if p not in files]
    if missing:
        raise LoadError(f"{spec.name}: {filename} is one part of a split GGUF whose other parts are not in the repo: "
                        f"{_few(missing)}")
    return parts[0]


def _download(spec: HubSpec, wanted: list[str], on_download: DownloadReport | None = None) -> str:
    """The snapshot folder holding `wanted` (downloaded, or found in the cache offline)."""
    # NOTE: snapshot_download also for one GGUF (not hf_hub_download): it records the repo's listing in the
    # cache, which is what lets _list_files pick the same file offline.
    bars = _reporting_bar(on_download) if on_download is not None else None
    try:
        return snapshot_download(spec.repo_id, revision=spec.revision, allow_patterns=wanted, tqdm_class=bars)
    except LocalEntryNotFoundError:
        raise LoadError(f"{spec.name}: not (completely) in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                        f"{constants.ENDPOINT} cannot be reached (or HF_HUB_OFFLINE is set); download it once online") from None
    except HfHubHTTPError as exc:
        raise _http_error(spec, exc) from None


def _reporting_bar(report: DownloadReport) -> type:
    """huggingface_hub's bars (shown on a terminal as before) that also report the snapshot's bytes written:
    its "huggingface_hub.snapshot_download" bar sums every file's."""

    class ReportingBar(hf_tqdm):
        def __init__(self, *args, **kwargs) -> None:
            self._reports = kwargs.get("name") == "huggingface_hub.snapshot_download"
            self._done = 0
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1):
            if self._reports and n:
                self._done += int(n)
                report(self._done, int(self.total or 0))
            return super().update(n)

    return ReportingBar


def _http_error(spec: HubSpec, exc: HfHubHTTPError) -> LoadError:
    """One line saying what to do, from huggingface_hub's error for a refused request."""
    status = exc.response.status_code if exc.response is not None else None
    where = constants.ENDPOINT
    if isinstance(exc, GatedRepoError):
        return LoadError(f"{spec.name} is gated on {where}: accept its terms on the model page and set HF_TOKEN")
    if isinstance(exc, RevisionNotFoundError):
        return LoadError(f"{spec.name}: no revision {spec.revision!r} in the repo on {where}")
    if status in (401, 403) and get_token() is None:
        return LoadError(f"{spec.name}: {where} refused access ({status}): the repo is private or gated, or does "
                         "not exist; set HF_TOKEN to a token that can read it")
    if status in (401, 403):
        return LoadError(f"{spec.name}: {where} refused access ({status}) with the token set; check that HF_TOKEN "
                         "can read this repo")
    if isinstance(exc, RepositoryNotFoundError) or status == 404:
        return LoadError(f"{spec.name}: no such model repo on {where} (and not a local path)")
    return LoadError(f"{spec.name}: {where} answered {status}: {str(exc).splitlines()[0]}")


def _few(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(sorted(names)[:limit]) + more if names else "none"


# -- the cache: `conveyor pull`, `conveyor ls`, `conveyor rm` -------------------------------------------------
@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    size_bytes: int
    files: tuple[str, ...]  # every file of every cached revision (GGUFs first named by ls)


def cached_models() -> list[CachedModel]:
    """The model repos in the Hugging Face cache (the one other tools share), largest first."""
    from huggingface_hub import scan_cache_dir

    if not os.path.isdir(constants.HF_HUB_CACHE):
        return []
    repos = [r for r in scan_cache_dir(constants.HF_HUB_CACHE).repos if r.repo_type == "model"]
    return sorted((CachedModel(r.repo_id, r.size_on_disk,
                               tuple(sorted({f.file_name for rev in r.revisions for f in rev.files})))
                   for r in repos), key=lambda m: -m.size_bytes)


def remove_cached(repo_id: str) -> int:
    """Delete every cached revision of `repo_id` (ORG/NAME, a :QUANT suffix ignored); the bytes freed."""
    from huggingface_hub import scan_cache_dir

    repo_id = repo_id.partition(":")[0]
    cache = scan_cache_dir(constants.HF_HUB_CACHE) if os.path.isdir(constants.HF_HUB_CACHE) else None
    repo = next((r for r in cache.repos if r.repo_id == repo_id and r.repo_type == "model"), None) if cache else None
    if repo is None:
        raise LoadError(f"{repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}); `conveyor ls` lists it")
    strategy = cache.delete_revisions(*(rev.commit_hash for rev in repo.revisions))
    strategy.execute()
    return strategy.expected_freed_size
