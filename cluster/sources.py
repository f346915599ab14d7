"""Adapter sources: where an adapter's files come from (s3://, hf://, a local directory).

`parse_adapter_uri` turns a lora_path into an AdapterSource, refusing a bad
one (BadAdapterSourceError, HTTP 400) before any I/O; `source.fetch(dest)`
downloads only adapter_config.json and *.safetensors into dest and maps every
failure to a typed error: AdapterNotFoundError (nothing there, HTTP 404) or
SourceUnavailableError (unreachable, 5xx, timeout; HTTP 503). Validating the
files is lora_core's job. Pure Python: no ray here, so sources test alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote

from cluster.errors import AdapterNotFoundError, BadAdapterSourceError, SourceUnavailableError

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ACCEPTED_FORMS = ("s3://bucket/prefix, hf://org/repo or hf://org/repo@revision, "
                  "an absolute local directory /path/to/adapter or file:///path/to/adapter")
_CHUNK = 1 << 20
# The roots themselves are the operator's to know (the deployment's sources.allowed_local_roots), not a caller's.
OUTSIDE_ROOTS = "outside the directories this server loads adapters from (its allowed_local_roots)"


def is_adapter_file(name: str) -> bool:
    """The only files a fetch takes: the PEFT config and safetensors weights (never pickles)."""
    return name == ADAPTER_CONFIG or name.endswith(".safetensors")


@dataclass
class SourceSettings:
    """How sources reach their origins. None means "the library's default" everywhere.

    s3_endpoint_url: None = AWS; region and credentials always come from the
    standard AWS chain (env, ~/.aws, instance role). hf_token / hf_endpoint:
    None = huggingface_hub's own (HF_TOKEN, HF_ENDPOINT). timeout_s bounds
    each connect or read, so a dead origin fails in seconds, not minutes.
    """

    allowed_local_roots: Sequence[str | Path] = field(default_factory=list)
    s3_endpoint_url: str | None = None
    hf_token: str | None = None
    hf_endpoint: str | None = None
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        roots = [Path(r) for r in self.allowed_local_roots]
        relative = [str(r) for r in roots if not r.is_absolute()]
        if relative:
            raise ValueError(f"allowed_local_roots must be absolute paths, got {relative}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        self.allowed_local_roots = [Path(os.path.normpath(r)) for r in roots]


class AdapterSource(ABC):
    """One adapter's origin. `uri` is canonical: parsing it again gives an equal source."""

    def __init__(self, uri: str, settings: SourceSettings) -> None:
        self.uri = uri
        self.settings = settings

    def describe(self) -> str:
        """For logs: where the adapter comes from, never a credential."""
        return self.uri

    @abstractmethod
    def fingerprint(self) -> str:
        """Changes whenever the adapter's files at the origin change (ETags, commit sha, mtimes)."""

    @abstractmethod
    def _download(self, staging: Path) -> None:
        """Put adapter_config.json and the *.safetensors files, and nothing else, into staging."""

    def fetch(self, dest_dir: str | Path) -> Path:
        """Download the adapter into dest_dir (absent or empty) and return it.

        Files land in a scratch directory next to dest_dir that is renamed into
        place at the end, so dest_dir holds a whole adapter or nothing at all.
        """
        dest = Path(dest_dir)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise FileExistsError(f"fetch destination {dest} exists and is not an empty directory")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.fetch-", dir=dest.parent))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the adapter from other users of the node
        start = time.monotonic()
        logger.info("fetching adapter from %s", self.describe())
        try:
            self._download(staging)
            names = sorted(p.name for p in staging.iterdir())
            if ADAPTER_CONFIG not in names:
                raise AdapterNotFoundError(f"{self.describe()} holds no {ADAPTER_CONFIG}")
            stray = [n for n in names if not is_adapter_file(n)]
            if stray:
                raise RuntimeError(f"fetch from {self.describe()} left non-adapter files {stray}")
            size = sum((staging / n).stat().st_size for n in names)
            if dest.exists():
                dest.rmdir()
            os.rename(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info("fetched %s: %d files, %d bytes in %.2f s", self.describe(), len(names), size,
                    time.monotonic() - start)
        return dest

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash((type(self), self.uri))


class Progress:
    """Logs bytes done/total of one file: when it starts, at most every `every_s`, and when done."""

    def __init__(self, source: str, name: str, total: int | None, every_s: float = 2.0) -> None:
        self.source, self.name, self.total, self.every_s = source, name, total, every_s
        self.done = 0
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._log()

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last >= self.every_s:
                self._last = now
                self._log()

    def finish(self) -> None:
        self._log()

    def _log(self) -> None:
        total = "?" if self.total is None else self.total
        logger.info("%s: %s %d/%s bytes", self.source, self.name, self.done, total)


def copy_stream(src: BinaryIO, dst: Path, progress: Progress) -> None:
    """Copy src into dst in chunks, reporting to progress."""
    with open(dst, "wb") as out:
        while chunk := src.read(_CHUNK):
            out.write(chunk)
            progress.update(len(chunk))
    progress.finish()


def check_components(uri: str, parts: Iterable[str]) -> None:
    """Refuse '..' before anything is touched: no source may climb out of the place it names."""
    if any(p == ".." for p in parts):
        raise BadAdapterSourceError(f"adapter source {uri!r} contains a '..' path component; refused")


# ---- parsing -----------------------------------------------------------------------------------


def parse_adapter_uri(uri: str, settings: SourceSettings) -> AdapterSource:
    """The source a lora_path names; BadAdapterSourceError (HTTP 400) if it names none we accept.

    Local paths are checked against settings.allowed_local_roots here, after
    resolving symlinks; a path with a '..' component is refused before the
    filesystem is touched at all.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise BadAdapterSourceError(f"adapter source must be a non-empty string ({ACCEPTED_FORMS}), got {uri!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in uri):
        raise BadAdapterSourceError(f"adapter source {uri!r} contains control characters")
    # boto3 and huggingface_hub load only when a source of theirs is used.
    if uri.startswith("s3://"):
        from cluster.s3_source import S3Source
        return S3Source.parse(uri, settings)
    if uri.startswith("hf://"):
        from cluster.hf_source import HFSource
        return HFSource.parse(uri, settings)
    if uri.startswith("file://") or uri.startswith("/"):
        return LocalSource.parse(uri, settings)
    hint = " (a bare org/repo is ambiguous with a relative path: write hf://org/repo)" if "://" not in uri else ""
    raise BadAdapterSourceError(f"unsupported adapter source {uri!r}{hint}; accepted forms: {ACCEPTED_FORMS}")


# ---- local directories -------------------------------------------------------------------------


def _under(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


class LocalSource(AdapterSource):
    """A directory on this machine, under one of settings.allowed_local_roots (symlinks resolved)."""

    def __init__(self, path: Path, settings: SourceSettings) -> None:
        super().__init__(str(path), settings)
        self.path = path

    @classmethod
    def parse(cls, uri: str, settings: SourceSettings) -> "LocalSource":
        raw = uri
        if uri.startswith("file://"):
            rest = uri[len("file://"):]
            rest = rest[len("localhost"):] if rest.startswith("localhost/") else rest
            if not rest.startswith("/") or "?" in rest or "#" in rest:
                raise BadAdapterSourceError(
                    f"malformed file URI {uri!r}: write file:///absolute/path (no host, query or fragment)")
            raw = unquote(rest)
        check_components(uri, raw.split("/"))
        if "\0" in raw:
            raise BadAdapterSourceError(f"adapter source {uri!r} contains a NUL byte")
        path = Path(os.path.normpath(raw))
        roots = list(settings.allowed_local_roots)
        if not roots:
            raise BadAdapterSourceError(
                f"local adapter directories are disabled (no allowed_local_roots configured): {uri!r}")
        source = cls(path, settings)
        # The named path must lie under a root as written or as resolved, and so must its real location.
        real_roots = [Path(os.path.realpath(r)) for r in roots]
        if not _under(path, roots + real_roots):
            raise BadAdapterSourceError(f"{uri!r} is {OUTSIDE_ROOTS}")
        source.resolved()
        return source

    def resolved(self) -> Path:
        """The real directory, refused if a symlink anywhere on the way leads out of the allowed roots."""
        real = Path(os.path.realpath(self.path))
        roots = [Path(os.path.realpath(r)) for r in self.settings.allowed_local_roots]
        if not _under(real, roots):
            raise BadAdapterSourceError(f"{self.path} resolves (through a symlink) to a place {OUTSIDE_ROOTS}")
        return real

    def describe(self) -> str:
        return f"local directory {self.path}"

    def _files(self) -> list[Path]:
        real = self.resolved()  # again: a symlink may have changed since parse
        if not real.is_dir():
            raise AdapterNotFoundError(f"{self.describe()} does not exist or is not a directory")
        roots = [Path(os.path.realpath(r)) for r in self.settings.allowed_local_roots]
        files = []
        for entry in sorted(real.iterdir()):
            if not is_adapter_file(entry.name) or not entry.is_file():
                continue
            if not _under(Path(os.path.realpath(entry)), roots):
                raise BadAdapterSourceError(f"{self.path / entry.name} is a symlink to a place {OUTSIDE_ROOTS}")
            files.append(entry)
        if not any(f.name == ADAPTER_CONFIG for f in files):
            raise AdapterNotFoundError(f"{self.describe()} holds no {ADAPTER_CONFIG}")
        return files

    def fingerprint(self) -> str:
        try:
            stats = [(f.name, f.stat()) for f in self._files()]
        except OSError as exc:
            raise SourceUnavailableError(f"cannot read {self.describe()}: {exc}") from exc
        return ";".join(f"{name}:{st.st_size}:{st.st_mtime_ns}" for name, st in stats)

    def _download(self, staging: Path) -> None:
        # A copy, not a hardlink: writers that rewrite a file in place would change our copy under us.
        try:
            for f in self._files():
                with open(f, "rb") as src:
                    size = os.fstat(src.fileno()).st_size
                    copy_stream(src, staging / f.name, Progress(self.describe(), f.name, size))
        except OSError as exc:
            raise SourceUnavailableError(f"cannot read {self.describe()}: {exc}") from exc
