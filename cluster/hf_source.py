"""hf://org/repo[@revision] through huggingface_hub.

The revision (default "main") is resolved to a commit sha first and the
snapshot is taken at that sha, so the files fetched and fingerprint() agree
even while someone pushes to the branch. Only top-level adapter_config.json
and *.safetensors are downloaded (allow_patterns).
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (EntryNotFoundError, HFValidationError, LocalEntryNotFoundError,
                                    RepositoryNotFoundError, RevisionNotFoundError)

from cluster.errors import AdapterNotFoundError, BadAdapterSourceError, SourceUnavailableError
from cluster.sources import ACCEPTED_FORMS, ADAPTER_CONFIG, AdapterSource, SourceSettings, check_components

try:  # the HTTP client under huggingface_hub: httpx2 (2.x), httpx (1.x), requests (0.x, whose errors are OSErrors)
    from httpx2 import HTTPError as _ClientHTTPError
except ImportError:
    try:
        from httpx import HTTPError as _ClientHTTPError
    except ImportError:
        _ClientHTTPError = OSError

logger = logging.getLogger(__name__)

_REPO = re.compile(r"[A-Za-z0-9][\w.\-]{0,95}/[\w.\-]{1,96}")
_REVISION = re.compile(r"[\w.\-/]{1,255}")
ALLOW_PATTERNS = [ADAPTER_CONFIG, "*.safetensors"]
IGNORE_PATTERNS = ["*/*"]  # fnmatch's * crosses '/': keep files of the repo's top level only


class HFSource(AdapterSource):
    """An adapter repo on the Hugging Face Hub (or a Hub-compatible endpoint), at a revision."""

    def __init__(self, repo_id: str, revision: str | None, settings: SourceSettings) -> None:
        super().__init__(f"hf://{repo_id}@{revision}" if revision else f"hf://{repo_id}", settings)
        self.repo_id, self.revision = repo_id, revision

    @classmethod
    def parse(cls, uri: str, settings: SourceSettings) -> "HFSource":
        repo_id, at, revision = uri[len("hf://"):].partition("@")
        check_components(uri, repo_id.split("/") + revision.split("/"))
        if (not _REPO.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git")
                or repo_id.split("/")[1] == "."):
            raise BadAdapterSourceError(
                f"malformed Hub URI {uri!r}: expected hf://org/repo[@revision]; accepted forms: {ACCEPTED_FORMS}")
        if at and (not _REVISION.fullmatch(revision) or {"", "."} & set(revision.split("/"))
                   or revision.endswith(".lock")):
            raise BadAdapterSourceError(f"malformed revision {revision!r} in {uri!r}: a branch, tag or commit sha")
        return cls(repo_id, revision or None, settings)

    def describe(self) -> str:
        at = f" at {self.settings.hf_endpoint}" if self.settings.hf_endpoint else ""
        return f"{self.uri}{at}"

    def _api(self) -> HfApi:
        return HfApi(endpoint=self.settings.hf_endpoint, token=self.settings.hf_token)

    def _translate(self, exc: Exception) -> Exception:
        # LocalEntryNotFoundError first: it subclasses EntryNotFoundError but means "the Hub was unreachable".
        if isinstance(exc, LocalEntryNotFoundError):
            return SourceUnavailableError(f"{self.describe()} is unreachable: {exc}")
        if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return AdapterNotFoundError(
                f"{self.describe()}: {first} (a private or gated repo also looks missing without a token "
                "that may read it)")
        if isinstance(exc, HFValidationError):
            return BadAdapterSourceError(f"{self.uri}: {exc}")
        return SourceUnavailableError(f"{self.describe()} failed: {exc}")

    def resolve(self) -> tuple[str, dict[str, int | None]]:
        """(commit sha, {adapter file: size}) at the pinned revision; AdapterNotFoundError without a config."""
        try:
            info = self._api().model_info(self.repo_id, revision=self.revision, files_metadata=True,
                                          timeout=self.settings.timeout_s)
        except (OSError, _ClientHTTPError, HFValidationError) as exc:
            raise self._translate(exc) from exc
        if not info.sha:
            raise SourceUnavailableError(f"{self.describe()}: the Hub answered without a commit sha")
        files = {s.rfilename: s.size for s in info.siblings or []
                 if "/" not in s.rfilename and (s.rfilename == ADAPTER_CONFIG or s.rfilename.endswith(".safetensors"))}
        if ADAPTER_CONFIG not in files:
            raise AdapterNotFoundError(f"{self.describe()} (commit {info.sha}) holds no {ADAPTER_CONFIG}")
        return info.sha, files

    def fingerprint(self) -> str:
        return "hf:" + self.resolve()[0]

    def _download(self, staging: Path) -> None:
        sha, files = self.resolve()
        logger.info("%s: commit %s, fetching %s", self.describe(), sha,
                    ", ".join(f"{name} ({'?' if size is None else size} bytes)" for name, size in files.items()))
        # A private cache: the files are wanted in staging only, and the user's HF cache stays untouched.
        with tempfile.TemporaryDirectory(prefix="lorafleet-hf-") as cache:
            try:
                snapshot_download(self.repo_id, revision=sha, local_dir=staging, cache_dir=cache,
                                  allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
                                  endpoint=self.settings.hf_endpoint, token=self.settings.hf_token,
                                  etag_timeout=self.settings.timeout_s)
            except (OSError, _ClientHTTPError, HFValidationError) as exc:
                raise self._translate(exc) from exc
        shutil.rmtree(staging / ".cache", ignore_errors=True)  # huggingface_hub's local_dir bookkeeping
        for name in sorted(p.name for p in staging.iterdir()):
            size = (staging / name).stat().st_size
            logger.info("%s: %s %d/%s bytes", self.describe(), name, size, files.get(name, "?"))
